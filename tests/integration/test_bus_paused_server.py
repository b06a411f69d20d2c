"""A nats-server paused past a flush's timeout (SIGSTOP; a VM frozen) and resumed: the connection reads on.

nats-py cancels a timed-out flush's future but leaves it queued for its PONG; when the resumed server sends that
PONG, nats-py's ``set_result`` on the cancelled future raises InvalidStateError and its read loop ends without a
reconnect: the client still publishes but receives nothing (no message, no reply) until its ping timer notices,
minutes later. The fault matrix's ``jetstream-away`` (nats-server SIGSTOPped 300 s) left admission so, every
acquire unanswered. ``shared.bus`` takes such a PONG in its turn and drops it."""

from __future__ import annotations

import os
import signal
import subprocess

import nats
import pytest

from infermesh.processes import nats_server_binary
from shared.bus import Bus
from shared.ports import free_port, wait_for_port

pytestmark = pytest.mark.integration


async def test_a_flush_that_timed_out_while_the_server_was_paused_leaves_the_connection_reading():
    port = free_port()
    proc = subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        assert wait_for_port(port, 10), "nats-server did not start"
        url = f"nats://127.0.0.1:{port}"
        server, client = await Bus.connect(url, "paused", "responder"), await Bus.connect(url, "paused", "asker")

        async def answer(raw) -> None:  # noqa: ANN001
            await server.nc.publish(raw.reply, b"pong")

        await server.nc.subscribe("svc", cb=answer)
        await server.nc.flush()
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(nats.errors.TimeoutError):
                await server.nc.flush(timeout=0.2)  # its future cancelled, its PING still queued at the server
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        # the resumed server answers the queued PING before it delivers the request on the same connection
        assert (await client.nc.request("svc", b"ping", timeout=3)).data == b"pong"
        await server.close()
        await client.close()
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        proc.wait(10)
