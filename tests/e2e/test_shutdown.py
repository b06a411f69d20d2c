"""Service processes stop on SIGTERM within a bound, even when NATS has gone away first."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from infermesh.processes import nats_server_binary
from shared.ports import free_port
from tests.utils import wait_for_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.mark.parametrize("module, args", [
    ("services.router", []),
    ("services.worker", ["--engine", "sim", "--worker-id", "w-stop"]),
])
def test_service_exits_on_sigterm_after_nats_died(tmp_path, tiny_model, module, args):
    port = free_port()
    nats = subprocess.Popen([nats_server_binary(), "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert wait_for_port(port, 10)
    env = {**os.environ, "INFERMESH_NATS_URL": f"nats://127.0.0.1:{port}", "INFERMESH_NAMESPACE": "stop"}
    service = subprocess.Popen([sys.executable, "-m", module, *args, "--model-path", str(tiny_model)]
                               if module == "services.worker" else [sys.executable, "-m", module, *args],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        ready_word = "serving" if module == "services.worker" else "ready"
        for line in service.stdout:  # type: ignore[union-attr]
            if ready_word in line or time.monotonic() > deadline:
                break
        # as when a supervisor dies: NATS and the service get SIGTERM together
        nats.send_signal(signal.SIGTERM)
        service.send_signal(signal.SIGTERM)
        assert service.wait(25) is not None
    finally:
        if service.poll() is None:
            service.kill()
        nats.kill()
