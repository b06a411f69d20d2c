"""``infermesh up`` supervises its processes: a SIGKILLed worker, then an edge, then nats-server come back
and the mesh serves again; SIGTERM stops everything with no restart and no orphan."""

from __future__ import annotations

import json
import re
import signal
import urllib.request

import openai
import psutil
import pytest

from infermesh.bus_auth import admin_credentials
from shared.bus import Bus
from shared.ports import free_port
from shared.registry import workers_bucket
from shared.schema import WorkerInfo, decode
from tests.e2e.mesh_process import UpProcess
from tests.utils import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
MESSAGES = [{"role": "user", "content": "still there after a crash?"}]


def one_child(up: UpProcess, *needles: str) -> psutil.Process:
    """The mesh's one process whose command line holds every needle."""
    (found,) = [p for p in up.descendants() if all(n in " ".join(p.cmdline()) for n in needles)]
    return found


def edge_processes(up: UpProcess) -> list[psutil.Process]:
    return sorted((p for p in up.descendants() if "-m services.edge " in " ".join(p.cmdline()) + " "),
                  key=lambda p: p.pid)


def said(up: UpProcess, pattern: str) -> bool:
    return any(re.search(pattern, line) for line in up.lines)


def health(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


async def registered_at(bus: Bus, worker_id: str) -> float:
    """The registry entry's ``started_at`` (0 when there is none): a restarted worker writes a newer one."""
    try:
        entry = await (await workers_bucket(bus)).get(worker_id)
    except Exception:  # justified: no entry yet (KeyNotFound / deleted marker) reads as "not registered"
        return 0.0
    return decode(entry.value, WorkerInfo).started_at if entry.value else 0.0


async def chat_ok(client: openai.AsyncOpenAI, n: int) -> None:
    for _ in range(n):
        reply = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 4


async def test_up_restarts_a_killed_worker_edge_and_nats_and_sigterm_stops_every_child(tiny_model, tmp_path,
                                                                                   monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))  # the locked bus's secrets and the ledger
    port, namespace = free_port(), "sup"
    up = UpProcess(["--engine", "sim", "--workers", "2", "--model", "tiny", "--model-path", str(tiny_model),
                    "--namespace", namespace, "--http-port", str(port), "--billing-port", str(free_port()),
                    "--state-dir", str(tmp_path / "state")])  # its own (locked) nats-server, supervised too
    up.start(timeout_s=90)
    bus = None
    try:
        (nats_url,) = {m.group(1) for line in up.lines if (m := re.search(r"JetStream on (nats://\S+)", line))}
        bus = await Bus.connect(nats_url, namespace, "probe", admin_credentials())
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=up.key, max_retries=0, timeout=20)
        await chat_ok(client, 2)

        worker = one_child(up, "services.worker", "sim-1")
        first_registration = await registered_at(bus, "sim-1")
        assert first_registration > 0
        worker.send_signal(signal.SIGKILL)
        await chat_ok(client, 3)  # the mesh keeps serving on sim-0 meanwhile
        await eventually(lambda: said(up, r"worker-1 died \(killed by SIGKILL\) .* restart #1 in 0\.5 s"), 10)
        await eventually(lambda: said(up, r"worker-1 restarted \(pid \d+\)"), 10)
        await eventually(lambda: _newer(bus, "sim-1", first_registration), 30)  # back in the registry
        assert one_child(up, "services.worker", "sim-1").pid != worker.pid

        edges = edge_processes(up)
        assert len(edges) == 2  # two edges share the port (SO_REUSEPORT)
        edges[0].send_signal(signal.SIGKILL)
        # the other edge serves meanwhile: a connection the dead one held fails, the SDK's retry lands on the other
        await chat_ok(client.with_options(max_retries=2), 3)
        await eventually(lambda: said(up, r"edge-\d died \(killed by SIGKILL\) .* restart #1 in 0\.5 s"), 10)
        await eventually(lambda: said(up, r"edge-\d restarted \(pid \d+\)") and health(port), 30)
        await eventually(lambda: len(edge_processes(up)) == 2, 30)
        assert edges[0].pid not in {p.pid for p in edge_processes(up)}
        await eventually(lambda: _ready_with(port, 2, up.key), 30)
        await chat_ok(client, 4)
        assert not said(up, r"nats died|router-\d died|worker-0 died")  # the others were never touched

        one_child(up, "nats-server").send_signal(signal.SIGKILL)  # the bus itself: every service reconnects
        await eventually(lambda: said(up, r"nats restarted \(pid \d+\)"), 10)
        await eventually(lambda: _serves(client), 30)
        await chat_ok(client, 3)
    finally:
        if bus is not None:
            await bus.close()
        mesh = up.descendants()
        assert up.stop() == 0  # SIGTERM; fails if any process of the mesh outlives it
    assert mesh and not any(p.is_running() for p in mesh)
    stopping = "".join(up.lines).split("infermesh: stopping")[-1]
    assert " died " not in stopping and "restarted" not in stopping  # the stop restarts nothing


async def _newer(bus: Bus, worker_id: str, than: float) -> bool:
    return await registered_at(bus, worker_id) > than


async def _serves(client: openai.AsyncOpenAI) -> bool:
    try:
        await chat_ok(client, 1)
        return True
    except openai.APIError:
        return False


def _ready_with(port: int, workers: int, key: str) -> bool:
    """The edge is ready with ``workers`` (its /ready counts them only for a key's holder)."""
    try:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/ready", headers={"Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(request, timeout=1) as response:
            return json.loads(response.read()).get("workers", 0) >= workers
    except OSError:
        return False
