"""``infermesh batch`` run as a user runs it (a process, a key in its environment) against a sim mesh with a batch
service: submit --wait ends ``completed`` and prints the batch id, results writes the output and error files,
list, status and cancel answer from the edge; a refused call is one line on stderr and exit code 1.

The ledger is SQLite only (test_batch_api.py covers both ledgers)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from types import SimpleNamespace

import pytest

from infermesh.batch_cli import Progress, endpoint_of, progress_line, with_model
from tests.e2e.test_batch_api import chat_line, client_of, jsonl

pytestmark = [pytest.mark.e2e]
CLI_TIMEOUT_S = 90.0


async def infermesh(*argv: str, base_url: str, key: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``python -m infermesh.cli ARGV`` with the key in its environment."""
    env = {**os.environ, "INFERMESH_BASE_URL": base_url, "INFERMESH_API_KEY": key}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "infermesh.cli", *argv, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), CLI_TIMEOUT_S)
    return proc.returncode or 0, out.decode(), err.decode()


def lines_without_model(count: int) -> list[dict]:
    lines = [chat_line(f"req-{i}", f"question {i}") for i in range(count)]
    for line in lines:
        del line["body"]["model"]
    return lines


@pytest.mark.parametrize("ledger_url", ["sqlite"], indirect=True)
async def test_submit_wait_ends_completed_and_results_writes_the_lines(batch_mesh, ledger_url, tmp_path):
    key = (await client_of(batch_mesh, ledger_url, "kappa")).api_key
    run = {"base_url": batch_mesh.base_url, "key": key}
    bad = {**chat_line("bad", "x"), "body": {**chat_line("bad", "x")["body"], "max_tokens": -1}}
    source = tmp_path / "in.jsonl"
    source.write_bytes(jsonl([*lines_without_model(4), bad]))

    code, out, err = await infermesh("batch", "submit", str(source), "--model", "tiny", "--wait",
                                     "--poll-s", "0.1", "--metadata", "run=cli", **run)
    assert code == 0, err
    batch_id = out.strip()
    assert batch_id.startswith("batch_")
    final = err.strip().splitlines()[-1]
    assert final.startswith(f"{batch_id} completed: 4/5 done, 1 failed; output file-") and "errors file-" in final

    output = tmp_path / "out.jsonl"
    code, _, err = await infermesh("batch", "results", batch_id, "-o", str(output), **run)
    assert code == 0, err
    written = [json.loads(line) for line in output.read_text().splitlines()]
    assert sorted(o["custom_id"] for o in written) == [f"req-{i}" for i in range(4)]
    assert all(o["response"]["status_code"] == 200 and o["response"]["body"]["model"] == "tiny" for o in written)
    code, out, _ = await infermesh("batch", "results", batch_id, "--errors", **run)
    assert code == 0 and [json.loads(line)["custom_id"] for line in out.splitlines()] == ["bad"]

    code, out, _ = await infermesh("batch", "list", **run)
    assert code == 0 and out.split("\t")[:2] == [batch_id, "completed"]
    code, out, _ = await infermesh("batch", "status", batch_id, **run)
    status = json.loads(out)
    assert code == 0 and status["status"] == "completed" and status["metadata"] == {"run": "cli"}
    code, _, err = await infermesh("batch", "cancel", batch_id, **run)
    assert code == 1 and err.strip() == ("infermesh batch cancel: 409: Cannot cancel a batch with status "
                                         "'completed'.")


@pytest.mark.parametrize("ledger_url", ["sqlite"], indirect=True)
async def test_a_refused_file_or_key_is_one_line_and_exit_code_1(batch_mesh, ledger_url, tmp_path):
    key = (await client_of(batch_mesh, ledger_url, "kappa")).api_key
    run = {"base_url": batch_mesh.base_url, "key": key}
    source = tmp_path / "bad.jsonl"
    source.write_bytes(jsonl(lines_without_model(1)) + b"not json\n")
    code, out, err = await infermesh("batch", "submit", str(source), "--model", "tiny", "--wait", "--poll-s", "0.1",
                                     **run)
    assert code == 1 and out.strip().startswith("batch_")
    assert f"{out.strip()} failed; output -, errors -" in err and "invalid_json_line (line 2)" in err

    code, _, err = await infermesh("batch", "status", "batch_nope", **run)
    assert code == 1 and err.strip() == "infermesh batch status: 404: No batch found with id 'batch_nope'."
    code, _, err = await infermesh("batch", "list", base_url=batch_mesh.base_url, key="")
    assert code == 1 and "no API key" in err
    code, _, err = await infermesh("batch", "results", "batch_nope", base_url=batch_mesh.base_url, key="im-wrong")
    assert code == 1 and err.startswith("infermesh batch results: 401")


def test_model_fills_only_the_lines_that_lack_one():
    data = jsonl([{"custom_id": "a", "body": {}}, {"custom_id": "b", "body": {"model": "other"}}]) + b"not json\n"
    filled = with_model(data, "tiny").splitlines()
    assert [json.loads(line)["body"].get("model") for line in filled[:2]] == ["tiny", "other"]
    assert filled[2] == b"not json"
    assert endpoint_of(b"\n" + jsonl([{"url": "/v1/completions"}])) == "/v1/completions"
    assert endpoint_of(b"not json\n") == "/v1/chat/completions"


@pytest.mark.parametrize("counts, usage, eta_s, line", [
    (SimpleNamespace(total=10, completed=3, failed=1), None, 12.4, "b in_progress: 3/10 done, 1 failed, ETA 12s"),
    (SimpleNamespace(total=10, completed=3, failed=1), SimpleNamespace(total_tokens=420), None,
     "b in_progress: 3/10 done, 1 failed, 420 tokens"),
    (SimpleNamespace(total=0, completed=0, failed=0), None, None, "b in_progress"),
])
def test_the_progress_line_shows_what_is_known(counts, usage, eta_s, line):
    batch = SimpleNamespace(id="b", status="in_progress", request_counts=counts, usage=usage)
    assert progress_line(batch, eta_s) == line


def test_the_eta_is_the_rate_seen_so_far():
    progress = Progress()
    assert progress.eta_s(2, 10, now=100.0) is None  # the first read: no rate yet
    assert progress.eta_s(2, 10, now=101.0) is None  # nothing ended since
    assert progress.eta_s(4, 10, now=102.0) == 6.0  # 2 lines in 2 s, 6 to go
