"""infermesh/deploy_secrets.py on a real nats-server: what docker-compose's `secrets`, `provision` and each
service's `run` do, without Docker. The generated server config locks the bus (anonymous refused, each service
connects as its role); provisioning as admin makes the buckets; `run` hands a service its own secrets and no
other's; a second `init` keeps every secret, and the API key is printed only when it is made."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import uuid

import pytest

from infermesh.deploy_secrets import SERVICES, env_of, init
from infermesh.processes import nats_server_binary
from shared.bus import Bus, BusError
from shared.nats_auth import NatsCredentials
from shared.ports import free_port, wait_for_port


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_init_makes_each_secret_once_and_each_service_gets_only_its_own(tmp_path):
    folder = tmp_path / "secrets"
    key = init(folder, api_key="")
    assert key and len(key) >= 32
    before = {p.relative_to(folder): p.read_text() for p in folder.rglob("*") if p.is_file()}
    assert init(folder) is None  # the second start: nothing new, nothing printed
    assert {p.relative_to(folder): p.read_text() for p in folder.rglob("*") if p.is_file()} == before

    edge, metering, router = (env_of(folder / name) for name in ("edge", "metering", "router"))
    assert edge["INFERMESH_DEV_KEY"] == key and edge["INFERMESH_NATS_USER"] == "edge"
    assert set(router) == {"INFERMESH_NATS_USER", "INFERMESH_NATS_STORE_USER", "INFERMESH_NATS_PASSWORD"}  # no key
    assert router["INFERMESH_NATS_STORE_USER"] == "router@store"  # its user in the STORE account
    assert metering["INFERMESH_NATS_LEDGER_USER"] == "metering@ledger"  # and in LEDGER: the usage streams
    password = (folder / "postgres" / "password").read_text()
    assert metering["INFERMESH_DATABASE_URL"] == f"postgresql://postgres:{password}@postgres:5432/infermesh"
    assert "INFERMESH_DATABASE_URL" not in edge
    assert len({env_of(folder / name)["INFERMESH_NATS_PASSWORD"] for name in SERVICES}) == len(SERVICES)
    for path in folder.rglob("*"):
        if path.is_file():
            assert _mode(path) == (0o644 if path.parent.name == "postgres" else 0o600), path


def test_a_given_api_key_is_the_one_used(tmp_path):
    assert init(tmp_path, api_key="sk-team-default-given") == "sk-team-default-given"
    assert env_of(tmp_path / "edge")["INFERMESH_DEV_KEY"] == "sk-team-default-given"


async def test_the_generated_config_locks_the_bus_and_provision_and_run_use_it(tmp_path):
    port, namespace = free_port(), f"cs{uuid.uuid4().hex[:6]}"
    folder = tmp_path / "secrets"
    monitor = free_port()
    init(folder, namespace, nats_listen=f"127.0.0.1:{port}", store_dir=str(tmp_path / "store"), monitor_port=monitor)
    assert json.loads((folder / "nats" / "nats.json").read_text())["http_port"] == monitor
    server = subprocess.Popen([nats_server_binary(), "-c", str(folder / "nats" / "nats.json")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"nats://127.0.0.1:{port}"
    try:
        assert wait_for_port(port, 10) and wait_for_port(monitor, 10)  # the monitor: compose's health check
        with pytest.raises(BusError):
            await Bus.connect(url, namespace, "anonymous", NatsCredentials())
        env = {**os.environ, "INFERMESH_NATS_URL": url, "INFERMESH_NAMESPACE": namespace}
        done = subprocess.run([sys.executable, "-m", "infermesh.deploy_secrets", "provision",
                               str(folder / "provision")], env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        edge = await Bus.connect(url, namespace, "edge", NatsCredentials.from_env(env_of(folder / "edge")))
        try:
            await edge.js.key_value(edge.subjects.api_keys_bucket)  # provisioned: the edge reads it
            await edge.ledger_js.stream_info(edge.subjects.usage_stream)  # in LEDGER, through its ledger user
        finally:
            await edge.close()
        shown = subprocess.run([sys.executable, "-m", "infermesh.deploy_secrets", "run", str(folder / "breaker"),
                                "--", sys.executable, "-c",
                                "import os; print(os.environ['INFERMESH_NATS_USER'],"
                                " os.environ.get('INFERMESH_DEV_KEY', '-'))"],
                               env=env, capture_output=True, text=True, timeout=30)
        assert shown.stdout.split() == ["breaker", "-"], shown.stderr
    finally:
        server.terminate()
        server.wait(10)
