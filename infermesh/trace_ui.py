"""``infermesh up --trace-ui``: Arize Phoenix, a trace UI on this machine, started with the mesh.

Phoenix (PyPI ``arize-phoenix``, about 850 MB with what it needs) is installed once into a virtualenv of its own,
``<data dir>/phoenix-venv`` (``~/.local/share/infermesh/phoenix-venv``; ``INFERMESH_PHOENIX_VENV`` names another),
never into the mesh's, whose pins (vLLM, OpenTelemetry) it would fight. ``up`` runs ``phoenix serve`` as one of
its supervised processes: the UI and OTLP/HTTP (``/v1/traces``) on ``--trace-ui-port`` (default 6006), OTLP/gRPC
on a free port, its store under STATE_DIR/phoenix, its usage telemetry off. Every service's exporter is pointed
at it (``OTEL_EXPORTER_OTLP_ENDPOINT``), and the billing dashboard links each usage row to
``/redirects/traces/<trace id>``, Phoenix's page for one trace.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from infermesh.private_files import data_dir
from infermesh.processes import ProcessGroup
from shared.ports import free_port

PHOENIX_REQUIREMENT = "arize-phoenix==20.26.1"
INSTALLED_MARKER = "infermesh-installed.txt"  # holds the requirement; written last, so a half install is redone


@dataclass(frozen=True, slots=True)
class TraceUi:
    url: str  # the UI
    otlp_endpoint: str  # what OTEL_EXPORTER_OTLP_ENDPOINT is set to (the exporter appends /v1/traces)

    @property
    def trace_url(self) -> str:
        """One trace's page, ``{trace_id}`` to fill (the billing dashboard's ``--trace-url``)."""
        return f"{self.url}/redirects/traces/{{trace_id}}"


def phoenix_venv() -> Path:
    return Path(os.environ.get("INFERMESH_PHOENIX_VENV") or data_dir() / "phoenix-venv")


def ensure_phoenix(say: Callable[[str], None], venv: Path | None = None) -> Path:
    """The ``phoenix`` command of ``venv`` (default ``phoenix_venv()``), installing it first when it is not
    there (one installer at a time: a second ``up`` waits for the first)."""
    venv = venv or phoenix_venv()
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        marker = venv / INSTALLED_MARKER
        if not (marker.exists() and marker.read_text().strip() == PHOENIX_REQUIREMENT):
            _install(venv, say)
            marker.write_text(PHOENIX_REQUIREMENT + "\n")
    return venv / "bin" / "phoenix"


def _install(venv: Path, say: Callable[[str], None]) -> None:
    shutil.rmtree(venv, ignore_errors=True)
    log = venv.parent / f"{venv.name}-install.log"
    say(f"installing {PHOENIX_REQUIREMENT} into {venv} (once; ~850 MB, a few minutes; log: {log})")
    with open(log, "w") as out:
        for argv in ([sys.executable, "-m", "venv", str(venv)],
                     [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", PHOENIX_REQUIREMENT]):
            if subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode:
                raise SystemExit(f"--trace-ui: installing Phoenix failed ({' '.join(argv)}); see {log}")


def phoenix_env(host: str, port: int, working_dir: Path) -> dict[str, str]:
    return {"PHOENIX_HOST": host, "PHOENIX_PORT": str(port), "PHOENIX_GRPC_PORT": str(free_port()),
            "PHOENIX_WORKING_DIR": str(working_dir), "PHOENIX_TELEMETRY_ENABLED": "false"}


def start_phoenix(group: ProcessGroup, phoenix: Path, host: str, port: int, state: Path,
                  timeout_s: float = 180.0) -> TraceUi:
    """Start ``phoenix serve`` in ``group`` and wait until it answers."""
    working_dir = state / "phoenix"
    working_dir.mkdir(parents=True, exist_ok=True)
    child = group.spawn("phoenix", [str(phoenix), "serve"], phoenix_env(host, port, working_dir))
    address = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    ui = TraceUi(f"http://{address}:{port}", f"http://{address}:{port}")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not child.alive():
            raise SystemExit(f"Phoenix exited ({child.popen.returncode}); last lines of {child.log_path}:\n"
                             + child.tail())
        if _answers(f"{ui.url}/healthz"):
            return ui
        time.sleep(0.25)
    raise SystemExit(f"Phoenix did not answer on {ui.url} within {timeout_s:.0f} s; see {child.log_path}")


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False
