"""What the deploy checks (tests/unit/test_compose.py, test_k8s.py) compare a deploy file against: the services
``infermesh up`` starts and the configuration each service reads."""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path

from infermesh.up import MeshOptions, start_processes


class _Recorder:
    """Where ``start_processes`` starts its services: the modules it would run (nothing is started)."""

    def __init__(self) -> None:
        self.modules: set[str] = set()
        self.metrics_ports: dict[str, int] = {}
        self.bus_credentials: dict = {}

    def python_service(self, name: str, module: str, args: list[str], env: dict[str, str]) -> None:
        self.modules.add(module)


def modules_up_starts(state: Path) -> set[str]:
    """The service modules ``infermesh up --engine sim`` runs."""
    recorder = _Recorder()
    start_processes(recorder, MeshOptions(engine="sim", nats_url="nats://nats:4222", metrics_port_base=-1),  # type: ignore[arg-type]
                    "/models/x", state)
    return recorder.modules


def config_class(module: str) -> type:
    """The configuration dataclass a service module reads (``<module>.config``'s ``...Config``)."""
    config = importlib.import_module(f"{module}.config")
    return next(v for k, v in vars(config).items() if k.endswith("Config") and dataclasses.is_dataclass(v)
                and v.__module__ == config.__name__)


def variables_read(module: str) -> set[str]:
    """The ``INFERMESH_*`` variables a service module's configuration reads."""
    return {f"INFERMESH_{f.name.upper()}" for f in dataclasses.fields(config_class(module))}
