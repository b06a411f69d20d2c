"""``infermesh up``'s plan: which worker processes with which roles and flags, for --pd and the sim fleet."""

from __future__ import annotations

import pytest

from infermesh.up import MeshOptions, parse_pd, worker_processes


@pytest.mark.parametrize("text, pools", [("1:1", (1, 1)), ("2:6", (2, 6))])
def test_pd_parses(text, pools):
    assert parse_pd(text) == pools


@pytest.mark.parametrize("text", ["1", "0:1", "1:0", "a:b", "1:1:1", ":2", "-1:2"])
def test_bad_pd_is_refused(text):
    with pytest.raises(SystemExit, match="--pd wants PREFILL:DECODE"):
        parse_pd(text)


def test_vllm_pd_runs_a_prefill_and_a_decode_worker():
    options = MeshOptions(engine="vllm", pd="1:1")
    options.check()
    assert [(p.name, p.worker_id, p.role) for p in worker_processes(options)] == [
        ("worker-prefill-0", "prefill-0", "prefill"), ("worker-decode-0", "decode-0", "decode")]
    assert options.total_workers == 2


def test_vllm_pd_beyond_two_engines_is_refused():
    with pytest.raises(SystemExit, match="at most two vLLM CPU engines"):
        MeshOptions(engine="vllm", pd="1:2").check()


def test_sim_pd_is_the_sim_fleet_pools():
    options = MeshOptions(engine="sim", pd="2:3")
    options.check()
    roles = [p.role for p in worker_processes(options)]
    assert roles.count("prefill") == 2 and roles.count("decode") == 3 and options.total_workers == 5


def test_worker_flags_carry_role_connector_and_pool_budget(tmp_path):
    from infermesh.up import start_processes

    class Recorder:
        def __init__(self) -> None:
            self.services: dict[str, list[str]] = {}
            self.metrics_ports: dict[str, int] = {}

        def python_service(self, name, module, args, env) -> None:
            self.services[name] = args

    group = Recorder()
    options = MeshOptions(engine="vllm", pd="1:1", nats_url="nats://127.0.0.1:1", prefill_token_budget=4096,
                          decode_token_budget=256)
    start_processes(group, options, "/models/tiny", tmp_path)  # type: ignore[arg-type]
    prefill, decode = group.services["worker-prefill-0"], group.services["worker-decode-0"]
    for args, role, core, budget in ((prefill, "prefill", "0", "4096"), (decode, "decode", "1", "256")):
        flags = dict(zip(args[::2], args[1::2], strict=True))
        assert flags["--role"] == role and flags["--kv-connector"] == "nixl" and flags["--cpu-core"] == core
        assert flags["--max-num-batched-tokens"] == budget and float(flags["--heartbeat-ttl-s"]) >= 10
    # every service its own metrics port, from the base up, and the banner's list is that one
    ports = {name: int(args[args.index("--metrics-port") + 1]) for name, args in group.services.items()}
    assert sorted(ports.values()) == list(range(9464, 9464 + len(ports))) and ports == group.metrics_ports
    assert {"router-0", "breaker", "admission-0", "batch", "edge-0", "worker-prefill-0"} <= set(ports)
