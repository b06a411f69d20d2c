"""Run ``infermesh up`` as a subprocess for tests and read its banner."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import psutil

from shared.ports import free_port


@dataclass
class UpProcess:
    argv: list[str]
    key: str = "e2e-key"
    lines: list[str] = field(default_factory=list)
    popen: subprocess.Popen[str] | None = None
    env: dict[str, str] = field(default_factory=dict)  # set for the mesh's processes, over this one's

    def start(self, timeout_s: float) -> None:
        env = {**os.environ, "INFERMESH_DEV_KEY": self.key, **self.env}
        self.popen = subprocess.Popen([sys.executable, "-m", "infermesh.cli", "up", *self.argv], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any("base URL" in line for line in self.lines):
                return
            if self.popen.poll() is not None:
                break
            time.sleep(0.1)
        self.stop()
        raise AssertionError("infermesh up did not become ready:\n" + "".join(self.lines[-40:]))

    def _read(self) -> None:
        assert self.popen and self.popen.stdout
        for line in self.popen.stdout:
            self.lines.append(line)

    def descendants(self) -> list[psutil.Process]:
        assert self.popen
        try:
            return psutil.Process(self.popen.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def stop(self, timeout_s: float = 60) -> int:
        """SIGTERM; returns the exit code. Fails if any process of the mesh outlives it."""
        assert self.popen
        children = self.descendants()
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        code = self.popen.wait(timeout_s)
        _gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"orphans left behind: {[p.pid for p in alive]}"
        return code


@contextmanager
def tiny_vllm_mesh(workers: list[str], nats_url: str, tiny_model: Path, state_dir: Path,
                   prefix: str = "v", env: dict[str, str] | None = None) -> Iterator[dict[str, Any]]:
    """``infermesh up --engine vllm`` with ``workers`` (e.g. ``--workers 2`` or ``--pd 1:1``) on the tiny model,
    in a namespace of its own (``env`` set for its processes); yields its base URL, key and namespace and checks
    it stops cleanly."""
    namespace = f"{prefix}{uuid.uuid4().hex[:8]}"
    port = free_port()
    up = UpProcess([*workers, "--engine", "vllm", "--model", "tiny", "--model-path", str(tiny_model),
                    "--nats-url", nats_url, "--namespace", namespace, "--http-port", str(port),
                    "--max-model-len", "1024", "--state-dir", str(state_dir)], env=env or {})
    up.start(timeout_s=300)
    yield {"base_url": f"http://127.0.0.1:{port}/v1", "key": up.key, "namespace": namespace, "up": up}
    assert up.stop() == 0
