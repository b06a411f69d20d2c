"""``infermesh up`` with no ``--nats-url`` runs the whole sim mesh on a locked bus: each service as its role,
secrets made once in the data dir (0600), none on a command line, not one refusal, and strangers kept out."""

from __future__ import annotations

import asyncio
import json
import re
import stat
import time

import openai
import pytest

from infermesh import cli
from infermesh.batch_client import BatchClient
from infermesh.bus_auth import SECRETS_FILE, admin_credentials
from shared.bus import Bus, BusError
from shared.nats_auth import NatsCredentials
from shared.ports import free_port
from shared.schema import LoadRequest, LoadSnapshot
from tests.e2e.mesh_process import UpProcess
from tests.locked_nats import VIOLATION

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
MESSAGES = [{"role": "user", "content": "say something on a locked bus"}]
NATS_LINE = re.compile(r"NATS with JetStream on (nats://\S+)")


async def _probe(url: str, namespace: str) -> tuple[int, str]:
    """(requests the worker finished, as the admin sees it; how an anonymous connection fared)."""
    with pytest.raises(BusError, match="refused") as refused:
        await Bus.connect(url, namespace, "stranger", NatsCredentials())
    bus = await Bus.connect(url, namespace, "probe", admin_credentials())
    try:
        snapshot = await bus.request(bus.subjects.worker_load("sim-0"), LoadRequest(), LoadSnapshot)
    finally:
        await bus.close()
    return snapshot.num_finished_total, str(refused.value)


async def _bus_job(url: str, namespace: str, credentials: NatsCredentials):
    """Two lines submitted on the bus as the team's user, followed to their end."""
    lines = [{"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "tiny", "messages": MESSAGES, "max_tokens": 3}} for i in range(2)]
    async with await BatchClient.connect(url, namespace, "research", credentials) as client:
        job_id = await client.submit(lines)
        async with asyncio.timeout(60):
            return [job async for job in client.follow(job_id)][-1]


def _once_the_key_works(client: openai.OpenAI, timeout_s: float = 10.0):
    """The first reply to a new key: metering puts it in the keys bucket and the edges see it (401 until then)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5)
        except openai.AuthenticationError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def batch_round_trip(client: openai.OpenAI, timeout_s: float = 60.0, model: str = "tiny"):
    """Three lines through the Batch API; the batch once it ended (the batch service may still be taking the lead
    when the edge is ready: 503 until then)."""
    lines = b"".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": {"model": model, "messages": MESSAGES, "max_tokens": 3}}).encode() + b"\n"
                     for i in range(3))
    upload = client.files.create(file=("in.jsonl", lines), purpose="batch")
    deadline, batch = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            batch = batch or client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                                   completion_window="24h")
            batch = client.batches.retrieve(batch.id)
            if batch.status in ("completed", "failed", "cancelled", "expired"):
                return batch
        except (openai.InternalServerError, openai.APITimeoutError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"the batch did not end within {timeout_s:.0f} s: {batch}")


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_up_runs_the_sim_mesh_locked_and_the_admin_cli_mints_a_key_on_it(tiny_model, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))  # secrets and the SQLite ledger, for up and the CLI
    for var in NatsCredentials().env():
        monkeypatch.delenv(var, raising=False)
    namespace, port, state = "locked", free_port(), tmp_path / "state"
    up = UpProcess(["--engine", "sim", "--workers", "1", "--model", "tiny", "--model-path", str(tiny_model),
                    "--namespace", namespace, "--http-port", str(port), "--billing-port", str(free_port()),
                    "--state-dir", str(state)])
    up.start(timeout_s=120)
    try:
        (url,) = {m.group(1) for line in up.lines if (m := NATS_LINE.search(line))}
        secrets_file = tmp_path / "data" / "infermesh" / SECRETS_FILE
        secrets = json.loads(secrets_file.read_text())
        assert set(secrets) == {"edge", "router", "admission", "breaker", "metering", "worker", "batch", "admin"}
        assert _mode(secrets_file) == 0o600 and _mode(state / "nats" / "nats-server.json") == 0o600
        command_lines = " ".join(" ".join(p.cmdline()) for p in up.descendants())
        assert "services.edge" in command_lines and not any(s in command_lines for s in secrets.values())

        assert cli.main(["teams", "create", "research"]) == 0
        assert cli.main(["keys", "create", "--team", "research", "--nats-url", url, "--namespace", namespace]) == 0
        key = capsys.readouterr().out.strip().splitlines()[-1]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)
        reply = _once_the_key_works(client)
        assert reply.usage.completion_tokens == 5
        chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, stream=True))
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 5
        batch = batch_round_trip(client)  # the batch and edge roles: files, lines, results, events
        assert batch.status == "completed" and batch.request_counts.completed == 3
        output = [json.loads(line) for line in client.files.content(batch.output_file_id).read().splitlines()]
        assert sorted(o["custom_id"] for o in output) == ["c0", "c1", "c2"]
        assert cli.main(["teams", "bus-user", "research"]) == 0  # the team's own user, added to the running bus
        password = capsys.readouterr().out.strip().splitlines()[-1]
        job = asyncio.run(_bus_job(url, namespace, NatsCredentials("team-research", password)))
        assert job.status == "completed" and job.team == "research" and job.request_counts.completed == 2

        finished, refusal = asyncio.run(_probe(url, namespace))
        assert finished == 2 + 3 + 2 and "authorization violation" in refusal.lower()  # chats, HTTP and bus batch lines
    finally:
        assert up.stop() == 0
    logged = (state / "logs" / "nats.log").read_text()
    assert "authentication error" in logged  # the stranger
    assert [line for line in logged.splitlines() if VIOLATION.search(line) and "authentication" not in line] == []
