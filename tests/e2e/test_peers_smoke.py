"""The peers benchmark (loadtests/peers.py), tiny: the tiny model at one stream, a few requests, one round, behind
vLLM's own server and infermesh (and LiteLLM's proxy when its virtualenv is already there: the benchmark would
install it, which is no test's job). Every request answered with the tokens asked, every figure sane, every
comparison with vLLM's server taken, and the report and its picture written."""

from __future__ import annotations

import json
import math

import pytest

from loadtests import peers
from loadtests.lib.peers_stacks import LITELLM_VENV, litellm_installed

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]
REQUESTS, MAX_TOKENS = 4, 12


STACKS = ["vllm", "infermesh"] + (["litellm"] if litellm_installed() else [])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("peers")
    report = peers.main(["--models", "tiny", "--stacks", ",".join(STACKS), "--concurrency", "1", "--rounds", "1",
                         "--requests", str(REQUESTS), "--max-tokens", str(MAX_TOKENS), "--max-model-len", "1024",
                         "--out", str(out)])
    (entry,) = report["results"]["tiny"]
    return report, entry, out


def _check_phase(stack: str, phase: dict) -> None:
    assert phase["requests"] == REQUESTS and phase["failed"] == 0, stack
    assert phase["output_tokens"] == REQUESTS * MAX_TOKENS, stack
    assert phase["ttft"]["n"] == REQUESTS and 0 < phase["ttft"]["p50_ms"] < 5_000, stack
    assert phase["itl"]["n"] > 0 and 0 < phase["itl"]["p50_ms"] < 1_000, stack
    assert phase["output_tok_s"] > 0 and phase["cpu_ms_per_request_total"] > 0, stack
    assert 0 < phase["engine_cpu_ms_per_request"] <= phase["cpu_ms_per_request_total"], stack


def test_a_tiny_peers_run_measures_vllm_and_infermesh_on_the_same_engine(run):
    report, entry, out = run
    assert report["failed"] is None
    (one,) = entry["rounds"]
    assert set(one) == set(STACKS)
    for stack in ("vllm", "infermesh"):
        _check_phase(stack, one[stack])
    # the same prompts, rendered by the same template, in every stack
    assert len({phase["prompt_tokens"] for phase in one.values()}) == 1
    mesh_processes = set(one["infermesh"]["cpu_ms_per_request"])
    assert {"nats", "admission-0", "breaker", "metering", "worker-0", "edge-0"} <= mesh_processes
    vs = entry["vs_vllm"]["infermesh"]
    assert 0 < vs["tok_s_ratio"] < 10 and math.isfinite(vs["added_ttft_p50_ms"])
    assert report["goals"]["tiny@1"]["throughput_ratio"] == vs["tok_s_ratio"]
    written = json.loads((out / "peers.json").read_text())
    assert written["command"].startswith("python -m loadtests.peers")
    assert (out / "peers.png").stat().st_size > 0 and "| 1 | infermesh |" in (out / "peers.md").read_text()


def test_the_litellm_proxy_in_front_of_vllms_server_is_measured_too(request):
    if "litellm" not in STACKS:  # justified: installing LiteLLM (~a minute, from PyPI) is the benchmark's job, not a
        # test's; the vLLM and infermesh stacks are still measured above, and this machine's CI has the venv
        pytest.skip(f"no LiteLLM virtualenv at {LITELLM_VENV}: `python -m loadtests.peers` installs it on first use")
    report, entry, _out = request.getfixturevalue("run")
    _check_phase("litellm", entry["rounds"][0]["litellm"])
    assert set(entry["rounds"][0]["litellm"]["cpu_ms_per_request"]) == {"litellm", "vllm-server"}
    assert 0 < entry["vs_vllm"]["litellm"]["tok_s_ratio"] < 10
    assert report["goals"]["tiny@1"]["added_ttft_met"] is not None and report["litellm_version"]
