"""The cluster test's hosts (loadtests/lib/netns_hosts.py) and its balancer (loadtests/lib/tcp_balancer.py): each host
has its own loopback and is reached over the bridge only; the balancer skips a target that refuses."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from loadtests.lib.netns_hosts import NetnsHosts, netns_available
from loadtests.lib.tcp_balancer import TcpBalancer
from shared.ports import free_port

pytestmark = pytest.mark.integration

ECHO = """
import socket, sys
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind((sys.argv[1], int(sys.argv[2])))
server.listen()
print("listening", flush=True)
while True:
    conn, _ = server.accept()
    conn.sendall(sys.argv[3].encode())
    conn.close()
"""


def _on(hosts: NetnsHosts, host: int, code: str, *args: str) -> subprocess.Popen[str]:
    child = subprocess.Popen([*hosts.prefix(host), sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                             text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "listening"
    return child


def _dial(hosts: NetnsHosts, host: int, address: str, port: int) -> str:
    code = ("import socket, sys\ntry:\n    print(socket.create_connection((sys.argv[1], int(sys.argv[2])), 2)"
            ".recv(64).decode())\nexcept OSError as exc:\n    print(type(exc).__name__)")
    return subprocess.run([*hosts.prefix(host), sys.executable, "-c", code, address, str(port)],
                          capture_output=True, text=True, timeout=20).stdout.strip()


@pytest.mark.skipif(bool(netns_available()), reason="needs root and iproute2's ip netns (netns_available says why)")
def test_hosts_have_their_own_loopback_and_reach_each_other_over_the_bridge():
    port = free_port()
    with NetnsHosts(2) as hosts:
        servers = [_on(hosts, 1, ECHO, hosts.address(1), str(port), "host-1"),
                   _on(hosts, 1, ECHO, "127.0.0.1", str(port), "host-1-loopback")]
        try:
            assert _dial(hosts, 0, hosts.address(1), port) == "host-1"  # over the bridge
            assert _dial(hosts, 0, "127.0.0.1", port) == "ConnectionRefusedError"  # host 0's loopback is its own
            assert _dial(hosts, 1, "127.0.0.1", port) == "host-1-loopback"
        finally:
            for server in servers:
                server.kill()
                server.wait()
    assert hosts.netns(0) not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


async def test_the_balancer_takes_turns_and_skips_a_target_that_refuses():
    async def serve(name: bytes) -> tuple[asyncio.base_events.Server, int]:
        async def answer(_reader, writer):
            writer.write(name)
            await writer.drain()
            writer.close()
        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        return server, server.sockets[0].getsockname()[1]

    (a, port_a), (b, port_b) = await serve(b"a"), await serve(b"b")
    balancer = TcpBalancer("127.0.0.1", [("127.0.0.1", port_a), ("127.0.0.1", port_b)])
    await balancer.start()

    async def ask() -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", balancer.port)
        try:
            return await asyncio.wait_for(reader.read(), 5)
        finally:
            writer.close()

    try:
        assert sorted([await ask(), await ask()]) == [b"a", b"b"]
        a.close()
        await a.wait_closed()  # target a now refuses: every connection goes to b
        assert [await ask() for _ in range(3)] == [b"b", b"b", b"b"]
        b.close()
        await b.wait_closed()
        assert await ask() == b""  # nobody accepts: the connection is closed, not left hanging
    finally:
        balancer.close()
