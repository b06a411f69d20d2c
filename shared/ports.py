"""Ports on this host: pick a free one, wait for one to listen.

Services need these too (a vLLM worker picks its NIXL side-channel port), so
they live here and not in the ``infermesh`` CLI package: services and shared/
never import ``infermesh`` (``tests/unit/test_layering.py``).
"""

from __future__ import annotations

import socket
import time


def free_port() -> int:
    """A TCP port nothing on 127.0.0.1 holds right now (the caller races anyone else to bind it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout_s: float, host: str = "127.0.0.1") -> bool:
    """True once something listens on ``host:port``; False after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex((host, port)) == 0:
                return True
        time.sleep(0.05)
    return False
