"""docker-compose.yml, checked without a Docker engine (none runs here): against the Compose specification's JSON
schema, and against the code — every service ``infermesh up`` starts is in it, every command is a module the
image holds, every INFERMESH_ variable it sets is one the service reads, and Prometheus scrapes every service."""

from __future__ import annotations

import importlib
import importlib.resources
import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from infermesh.deploy_secrets import SERVICES, env_of, init
from shared.nats_auth import ENV as NATS_ENV
from shared.replication import ENV as REPLICAS_ENV
from tests.deploy_checks import modules_up_starts, variables_read

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
OTEL_VARS = {"OTEL_EXPORTER_OTLP_ENDPOINT"}  # OpenTelemetry's own, read by its SDK (shared/telemetry.py)
NATS_VARS = set(NATS_ENV.values())  # the bus credentials, read by shared/nats_auth.py
SHARED_VARS = {REPLICAS_ENV}  # read by shared/ for every service (shared/replication.py)


ONE_SHOTS = ("secrets", "provision")  # deploy_secrets init / provision: they run once, before the services
LAUNCHER = ["python", "-m", "infermesh.deploy_secrets", "run", "/run/infermesh", "--"]


def _infermesh_services() -> dict[str, dict]:
    """The services of the mesh (the image's long-running ones)."""
    return {name: spec for name, spec in COMPOSE["services"].items()
            if spec.get("image") == "infermesh:latest" and name not in ONE_SHOTS}


def _module(spec: dict) -> str:
    """The service's module: the command after the launcher that hands it its secrets."""
    command = spec["command"]
    assert command[:len(LAUNCHER)] == LAUNCHER, command
    service = command[len(LAUNCHER):]
    assert service[:2] == ["python", "-m"], command
    return service[2]


def _secrets_subpath(spec: dict) -> str | None:
    mounts = [v for v in spec.get("volumes", []) if isinstance(v, dict) and v.get("source") == "secrets"]
    assert len(mounts) <= 1 and all(m["read_only"] for m in mounts), mounts
    return mounts[0]["volume"]["subpath"] if mounts else None



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
    assert modules_up_starts(tmp_path) == {_module(spec) for spec in _infermesh_services().values()}


def test_every_command_is_a_module_the_image_holds():
    copied = set(re.findall(r"^COPY (\S+) \1$", (ROOT / "Dockerfile").read_text(), re.M))
    modules = {name: _module(spec) for name, spec in _infermesh_services().items()}
    modules |= {name: COMPOSE["services"][name]["command"][2] for name in ONE_SHOTS}
    modules["launcher"] = LAUNCHER[2]
    for name, module in modules.items():
        assert module.split(".")[0] in copied, f"{name}: the Dockerfile does not COPY {module.split('.')[0]}"
        path = ROOT / module.replace(".", "/")
        assert (path / "__main__.py").exists() or path.with_suffix(".py").exists(), f"{name}: no module {module}"




@pytest.mark.parametrize("name", sorted(_infermesh_services()))
def test_every_variable_it_sets_is_one_the_service_reads(name, tmp_path):
    """Its environment, and what its folder of the secrets volume adds (``deploy_secrets init``, run here)."""
    spec = _infermesh_services()[name]
    fields = variables_read(_module(spec))
    init(tmp_path)
    given = env_of(tmp_path / _secrets_subpath(spec))
    assert given["INFERMESH_NATS_USER"] == SERVICES[name].value  # its own role on the bus
    unknown = {var for var in [*spec["environment"], *given]
               if var not in fields and var not in OTEL_VARS | NATS_VARS | SHARED_VARS}
    assert not unknown, f"{name} sets {sorted(unknown)}, which {_module(spec)} does not read"


def test_each_container_mounts_only_its_own_secrets():
    for name, spec in COMPOSE["services"].items():
        subpath = _secrets_subpath(spec) if name != "secrets" else None
        expected = {"nats": "nats", "postgres": "postgres"}.get(name, name if name in SERVICES else None)
        assert subpath == expected, f"{name} mounts the secrets' {subpath!r}"


def test_no_secret_is_in_the_file_and_the_ledger_is_not_published():
    text = (ROOT / "docker-compose.yml").read_text()
    assert "dev-key" not in text and "PASSWORD:" not in text and "postgresql://" not in text
    assert "ports" not in COMPOSE["services"]["postgres"]
    assert COMPOSE["services"]["postgres"]["environment"]["POSTGRES_PASSWORD_FILE"].startswith("/run/secrets/")
    assert all(port.startswith("127.0.0.1:") for port in COMPOSE["services"]["nats"]["ports"])


def test_every_service_starts_after_what_it_needs_and_has_a_health_check():
    services = COMPOSE["services"]
    for name in [*_infermesh_services(), "nats", "postgres"]:
        assert services[name]["healthcheck"]["test"][0] == "CMD", name
    for name, spec in _infermesh_services().items():
        assert spec["depends_on"]["provision"] == {"condition": "service_completed_successfully"}, name
    assert services["provision"]["depends_on"] == {"nats": {"condition": "service_healthy"}}
    for name in ("nats", "postgres"):
        assert services[name]["depends_on"] == {"secrets": {"condition": "service_completed_successfully"}}
    assert services["edge"]["depends_on"]["admission"] == {"condition": "service_healthy"}
    assert services["metering"]["depends_on"]["postgres"] == {"condition": "service_healthy"}
    assert services["batch"]["depends_on"]["metering"] == {"condition": "service_healthy"}
    for name, spec in _infermesh_services().items():  # each checks a port the service serves
        port = spec["environment"].get("INFERMESH_BILLING_PORT") or spec["environment"]["INFERMESH_METRICS_PORT"]
        assert f"127.0.0.1:{port}/" in spec["healthcheck"]["test"][-1], name


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
