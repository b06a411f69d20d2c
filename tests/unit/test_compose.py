"""docker-compose.yml, checked without a Docker engine (none runs here): against the Compose specification's JSON
schema, and against the code — every service ``infermesh up`` starts is in it, every command is a module the
image holds, every INFERMESH_ variable it sets is one the service reads, and Prometheus scrapes every service."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.resources
import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from infermesh.up import MeshOptions, start_processes

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
OTEL_VARS = {"OTEL_EXPORTER_OTLP_ENDPOINT"}  # OpenTelemetry's own, read by its SDK (shared/telemetry.py)


def _infermesh_services() -> dict[str, dict]:
    return {name: spec for name, spec in COMPOSE["services"].items() if spec.get("image") == "infermesh:latest"}


def _module(spec: dict) -> str:
    command = spec["command"]
    assert command[:2] == ["python", "-m"], command
    return command[2]


class _Recorder:
    """Where ``start_processes`` starts its services: the modules it would run (nothing is started)."""

    def __init__(self) -> None:
        self.modules: set[str] = set()
        self.metrics_ports: dict[str, int] = {}
        self.bus_credentials: dict = {}

    def python_service(self, name: str, module: str, args: list[str], env: dict[str, str]) -> None:
        self.modules.add(module)


def test_the_file_follows_the_compose_specification():
    schema = json.loads(importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
                        .joinpath("compose-spec.json").read_text())
    jsonschema.Draft202012Validator(schema).validate(COMPOSE)


def test_the_schema_check_catches_a_wrong_file():
    schema = json.loads(importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
                        .joinpath("compose-spec.json").read_text())
    wrong = {**COMPOSE, "services": {**COMPOSE["services"], "edge": {**COMPOSE["services"]["edge"], "port": [1]}}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(schema).validate(wrong)


def test_every_service_infermesh_up_starts_is_in_it(tmp_path):
    recorder = _Recorder()
    start_processes(recorder, MeshOptions(engine="sim", nats_url="nats://nats:4222", metrics_port_base=-1),  # type: ignore[arg-type]
                    "/models/x", tmp_path)
    assert recorder.modules == {_module(spec) for spec in _infermesh_services().values()}


def test_every_command_is_a_module_the_image_holds():
    copied = set(re.findall(r"^COPY (\S+) \1$", (ROOT / "Dockerfile").read_text(), re.M))
    for name, spec in _infermesh_services().items():
        module = _module(spec)
        assert module.split(".")[0] in copied, f"{name}: the Dockerfile does not COPY {module.split('.')[0]}"
        assert (ROOT / module.replace(".", "/") / "__main__.py").exists(), f"{name}: no {module}/__main__.py"


def _config_class(module: str) -> type:
    config = importlib.import_module(f"{module}.config")
    return next(v for k, v in vars(config).items() if k.endswith("Config") and dataclasses.is_dataclass(v)
                and v.__module__ == config.__name__)


@pytest.mark.parametrize("name", sorted(_infermesh_services()))
def test_every_variable_it_sets_is_one_the_service_reads(name):
    spec = _infermesh_services()[name]
    fields = {f"INFERMESH_{f.name.upper()}" for f in dataclasses.fields(_config_class(_module(spec)))}
    unknown = {var for var in spec["environment"] if var not in fields and var not in OTEL_VARS}
    assert not unknown, f"{name} sets {sorted(unknown)}, which {_module(spec)} does not read"


def test_prometheus_scrapes_every_service_on_its_metrics_port():
    scrape = yaml.safe_load((ROOT / "deploy" / "prometheus" / "compose.yml").read_text())
    targets = {t for config in scrape["scrape_configs"] for static in config["static_configs"]
               for t in static["targets"]}
    expected = set()
    for name, spec in _infermesh_services().items():
        env = spec["environment"]
        port = env["INFERMESH_BILLING_PORT"] if "INFERMESH_BILLING_PORT" in env else env["INFERMESH_METRICS_PORT"]
        expected.add(f"{name}:{port}")
    assert targets == expected
    grafana = COMPOSE["services"]["grafana"]["volumes"]
    for volume in grafana + COMPOSE["services"]["prometheus"]["volumes"]:
        assert (ROOT / volume.split(":")[0]).exists(), volume
