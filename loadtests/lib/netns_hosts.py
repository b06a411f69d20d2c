"""Separate hosts on one machine: a network namespace per host, each joined by a veth pair to a bridge in the root
namespace (root and iproute2's ``ip netns``). What runs in a host has its own loopback, ports and address, and
reaches the other hosts and the root namespace (at ``gateway``) only over the bridge, as over a LAN::

      root namespace: bridge im<tag>b  10.<a>.<b>.1 (gateway) -- the load generator, Postgres' forwarder
        |-- veth -- host 0: netns im<tag>h0, 10.<a>.<b>.10
        |-- veth -- host 1: netns im<tag>h1, 10.<a>.<b>.11
        '-- veth -- host 2: netns im<tag>h2, 10.<a>.<b>.12

    with NetnsHosts(3) as hosts:
        subprocess.Popen([*hosts.prefix(0), "nats-server", "-a", hosts.address(0)])
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess


def netns_available() -> str:
    """"" when this process can make hosts, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's ip not found"
    probe = f"improbe{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


class NetnsHosts:
    def __init__(self, count: int) -> None:
        assert 1 <= count <= 200
        self.count = count
        self.tag = secrets.token_hex(3)  # interface names stay within Linux's 15 characters
        a, b = 16 + secrets.randbelow(16), secrets.randbelow(256)  # 172.16-31.x.0/24: a subnet of its own
        self._subnet = f"172.{a}.{b}"
        self._made: list[list[str]] = []  # undo commands, newest last

    @property
    def gateway(self) -> str:
        """The root namespace's address on the bridge: what a host dials to reach the machine's own services."""
        return f"{self._subnet}.1"

    def address(self, host: int) -> str:
        return f"{self._subnet}.{10 + host}"

    def netns(self, host: int) -> str:
        return f"im{self.tag}h{host}"

    def prefix(self, host: int) -> list[str]:
        """Put before a command to run it on ``host`` (``ip netns exec`` execs it: the pid is the command's)."""
        return ["ip", "netns", "exec", self.netns(host)]

    def __enter__(self) -> "NetnsHosts":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        bridge = f"im{self.tag}b"
        try:
            self._ip(["link", "add", bridge, "type", "bridge"], ["link", "del", bridge])
            self._ip(["addr", "add", f"{self.gateway}/24", "dev", bridge])
            self._ip(["link", "set", bridge, "up"])
            for host in range(self.count):
                netns, outer, inner = self.netns(host), f"im{self.tag}v{host}", f"im{self.tag}p{host}"
                self._ip(["netns", "add", netns], ["netns", "del", netns])
                # deleted by hand: a namespace a socket still refers to (TIME_WAIT) outlives its ``netns del``
                self._ip(["link", "add", outer, "type", "veth", "peer", "name", inner], ["link", "del", outer])
                self._ip(["link", "set", inner, "netns", netns])
                self._ip(["link", "set", outer, "master", bridge, "up"])
                self._ip(["-n", netns, "addr", "add", f"{self.address(host)}/24", "dev", inner])
                self._ip(["-n", netns, "link", "set", inner, "up"])
                self._ip(["-n", netns, "link", "set", "lo", "up"])
                self._ip(["-n", netns, "route", "add", "default", "via", self.gateway])
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Delete what ``start`` made (a namespace's veth goes with it, the bridge last)."""
        while self._made:
            subprocess.run(["ip", *self._made.pop()], capture_output=True)

    def _ip(self, args: list[str], undo: list[str] | None = None) -> None:
        done = subprocess.run(["ip", *args], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
        if undo:
            self._made.append(undo)
