"""deploy/k8s, checked without a cluster: both overlays (laptop, gpu-fleet) rendered by kustomize (`kubectl
kustomize`), every object valid against Kubernetes' own schema (kubernetes-validate, K8S_VERSION, strict), and
against the code as docker-compose is: every service `infermesh up` starts runs, every command is a module its
image holds and every flag one the service parses, every variable one it reads, probes on its /ready and /health,
resources, a disruption budget, NATS's copies following its servers, and the NATS config valid for nats-server
with the users `infermesh.deploy_secrets k8s` makes."""

from __future__ import annotations

import re
import shutil
import subprocess
from functools import cache
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from infermesh.deploy_secrets import k8s_secrets
from infermesh.processes import nats_server_binary
from shared.bus_limits import MAX_PAYLOAD_BYTES
from shared.config import load_config
from shared.nats_auth import ENV as NATS_ENV
from shared.replication import ENV as REPLICAS_ENV, replicas_for_cluster
from tests.deploy_checks import config_class, modules_up_starts, variables_read

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
K8S_VERSION = "1.32.0"
OVERLAYS = ("laptop", "gpu-fleet")
IMAGES = {"infermesh:latest": ROOT / "Dockerfile", "infermesh-gpu:latest": K8S / "Dockerfile.gpu"}
READ_ELSEWHERE = {*NATS_ENV.values(), REPLICAS_ENV, "OTEL_EXPORTER_OTLP_ENDPOINT"}
EXTERNAL_SECRETS = {"infermesh-ledger"}  # the operator's: the ledger's URL (Postgres is not deployed here)


@cache
def rendered(overlay: str) -> tuple[dict, ...]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl (with kustomize) is needed to render deploy/k8s: ./scripts/test checks for it"
    out = subprocess.run([kubectl, "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True,
                         check=True).stdout
    return tuple(doc for doc in yaml.safe_load_all(out) if doc)


def objects(overlay: str, kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in rendered(overlay) if o["kind"] == kind}


def containers(overlay: str) -> list[tuple[str, dict]]:
    out = []
    for kind in ("Deployment", "StatefulSet", "Job"):
        for name, o in objects(overlay, kind).items():
            out += [(name, c) for c in o["spec"]["template"]["spec"]["containers"]]
    return out


def infermesh_containers(overlay: str) -> list[tuple[str, dict]]:
    return [(n, c) for n, c in containers(overlay) if c["image"] in IMAGES]


def _module(command: list[str]) -> tuple[str, list[str]]:
    assert command[:2] == ["python", "-m"], command
    return command[2], command[3:]




@cache
def secrets() -> dict[str, dict[str, str]]:
    import tempfile

    manifests, _key = k8s_secrets(Path(tempfile.mkdtemp()))
    return {doc["metadata"]["name"]: doc["stringData"] for doc in yaml.safe_load_all(manifests)}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_is_valid_kubernetes(overlay):
    for o in rendered(overlay):
        kubernetes_validate.validate(o, K8S_VERSION, strict=True)


def test_the_schema_check_catches_a_wrong_object():
    deployment = dict(objects("laptop", "Deployment")["infermesh-edge"])
    wrong = {**deployment, "spec": {**deployment["spec"], "replica": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong, K8S_VERSION, strict=True)



@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_service_infermesh_up_starts_runs(overlay, tmp_path):
    running = {_module(c["command"])[0] for _, c in infermesh_containers(overlay) if c["name"] != "provision"}
    assert running == modules_up_starts(tmp_path)


def test_the_gpu_fleet_runs_prefill_and_decode_pools_on_gpus():
    pools = {n: d for n, d in objects("gpu-fleet", "Deployment").items() if n in ("infermesh-prefill",
                                                                                  "infermesh-decode")}
    assert len(pools) == 2
    for name, deployment in pools.items():
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        _, args = _module(container["command"])
        config = load_config(config_class("services.worker"), argv=args, env={})
        assert (config.engine, config.role, config.kv_connector) == ("vllm", name.split("-")[1], "nixl")
        assert config.kv_buffer_device == "cuda" and config.kv_cache_dtype == "nvfp4" and not config.enforce_eager
        assert container["resources"]["limits"]["nvidia.com/gpu"] == config.data_parallel_size
        assert container["image"] == "infermesh-gpu:latest"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_command_is_a_module_its_image_holds_and_every_flag_one_it_parses(overlay):
    for name, container in infermesh_containers(overlay):
        module, args = _module(container["command"])
        dockerfile = IMAGES[container["image"]].read_text()
        copied = set(re.findall(r"^COPY (\S+) \1$", dockerfile, re.M))
        assert module.split(".")[0] in copied, f"{name}: {IMAGES[container['image']].name} lacks {module}"
        path = ROOT / module.replace(".", "/")
        assert (path / "__main__.py").exists() or path.with_suffix(".py").exists(), name
        if module.startswith("services."):
            load_config(config_class(module), argv=args, env={})  # an unknown flag exits


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_variable_is_one_the_service_reads(overlay):
    config_maps = objects(overlay, "ConfigMap")
    for name, container in infermesh_containers(overlay):
        module, _ = _module(container["command"])
        given: set[str] = {e["name"] for e in container.get("env", []) if e["name"] != "POD_IP"}
        for source in container.get("envFrom", []):
            if "configMapRef" in source:
                given |= set(config_maps[source["configMapRef"]["name"]]["data"])
            else:
                given |= set(secrets()[source["secretRef"]["name"]])
        if not module.startswith("services."):
            continue
        fields = variables_read(module)
        unknown = given - fields - READ_ELSEWHERE
        assert not unknown, f"{name} is given {sorted(unknown)}, which {module} does not read"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_secret_it_names_is_made_or_the_operators(overlay):
    made = set(secrets()) | EXTERNAL_SECRETS
    for name, container in containers(overlay):
        refs = {s["secretRef"]["name"] for s in container.get("envFrom", []) if "secretRef" in s}
        refs |= {e["valueFrom"]["secretKeyRef"]["name"] for e in container.get("env", [])
                 if "secretKeyRef" in e.get("valueFrom", {})}
        assert refs <= made, f"{name} needs {sorted(refs - made)}"
    for kind in ("Deployment", "StatefulSet", "Job"):
        for name, o in objects(overlay, kind).items():
            for volume in o["spec"]["template"]["spec"].get("volumes", []):
                if "secret" in volume:
                    assert volume["secret"]["secretName"] in made, name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_service_has_probes_resources_and_a_disruption_budget(overlay):
    budgets = objects(overlay, "PodDisruptionBudget")
    for kind in ("Deployment", "StatefulSet"):
        for name, o in objects(overlay, kind).items():
            (container,) = o["spec"]["template"]["spec"]["containers"]
            ports = {p["name"] for p in container["ports"]}
            for probe in ("readinessProbe", "livenessProbe"):
                check = container[probe].get("httpGet") or container[probe]["tcpSocket"]
                assert check["port"] in ports or check["port"] in {p["containerPort"] for p in container["ports"]}
            if container["image"] in IMAGES:
                assert container["readinessProbe"]["httpGet"]["path"] in ("/ready", "/health"), name
            assert container["resources"]["requests"]["cpu"] and container["resources"]["limits"]["memory"], name
            budget = budgets[name]
            assert budget["spec"]["selector"]["matchLabels"] == o["spec"]["selector"]["matchLabels"], name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_streams_have_as_many_copies_as_the_nats_cluster_allows(overlay):
    servers = objects(overlay, "StatefulSet")["nats"]["spec"]["replicas"]
    copies = int(objects(overlay, "ConfigMap")["infermesh"]["data"][REPLICAS_ENV])
    assert copies == replicas_for_cluster(servers)
    conf = objects(overlay, "ConfigMap")["nats-config"]["data"]["nats.conf"]
    routes = re.findall(r"nats://(nats-\d+)\.nats-headless:6222", conf)
    assert routes == [f"nats-{i}" for i in range(servers)] if servers > 1 else not routes
    assert re.search(r"^\s*max_payload: (\d+)MB", conf, re.M).group(1) == str(MAX_PAYLOAD_BYTES >> 20)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_nats_config_with_its_users_is_one_nats_server_accepts(overlay, tmp_path):
    (tmp_path / "auth").mkdir()
    (tmp_path / "auth" / "auth.conf").write_text(secrets()["infermesh-nats-auth"]["auth.conf"])
    conf = objects(overlay, "ConfigMap")["nats-config"]["data"]["nats.conf"]
    (tmp_path / "nats.conf").write_text(conf.replace("/data", str(tmp_path / "store")))
    done = subprocess.run([nats_server_binary(), "-c", str(tmp_path / "nats.conf"), "-t"], capture_output=True,
                          text=True, env={"POD_NAME": "nats-0"}, timeout=30)
    assert done.returncode == 0 and "is valid" in done.stdout + done.stderr, done.stderr
