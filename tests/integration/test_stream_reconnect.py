"""A token stream open across a NATS restart: what the worker sent meanwhile may be lost, so the stream fails
within the receiver's reconnect grace instead of waiting out its deadline (60 s; 300 s before the first token)."""

from __future__ import annotations

import subprocess
import time

import pytest

from infermesh.processes import nats_server_binary
from shared.bus import Bus, StreamReceiver
from shared.ports import free_port
from shared.schema import StreamError
from tests.utils import eventually, wait_for_port

pytestmark = pytest.mark.integration


def _nats(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert wait_for_port(port, 10), "nats-server did not start"
    return proc


async def test_a_stream_open_across_a_nats_restart_fails_within_the_grace(namespace, monkeypatch):
    for name in ("INFERMESH_NATS_USER", "INFERMESH_NATS_PASSWORD", "INFERMESH_NATS_CREDS"):
        monkeypatch.delenv(name, raising=False)  # a server of its own, without credentials
    port = free_port()
    server = _nats(port)
    bus = await Bus.connect(f"nats://127.0.0.1:{port}", namespace, "edge-reconnect")
    receiver = StreamReceiver(bus, "e-rc", reconnect_grace_s=1.0)
    await receiver.start()
    quiet = receiver.open("r-quiet", "w-1", first_timeout_s=300, idle_timeout_s=60)
    try:
        server.kill()
        server.wait(10)
        server = _nats(port)
        await eventually(lambda: bus.nc.is_connected, 10)
        restarted_at = time.monotonic()
        end = await quiet.next()
        assert isinstance(end, StreamError) and end.code == "timeout" and "reconnected" in end.message
        assert time.monotonic() - restarted_at < 3
    finally:
        await receiver.stop()
        await bus.close()
        server.kill()
        server.wait(10)
