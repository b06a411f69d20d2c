"""docker-compose.yml run as compose would run it, without a Docker engine (none runs here): each service's own
command and environment as a process on this host, in the file's start order, its secrets folder where its
volume subpath would be mounted, its health check run against it. Differences, and only these: hostnames and
ports become this host's (each container would have its own), Postgres is this machine's (a fresh database),
no Jaeger, and the worker runs the sim engine on the tiny model instead of vLLM on Gemma (the image's model;
vLLM workers have e2e tests of their own). Then: the key printed at the first start answers a chat request
through admission, a well-known key is refused, and the request is billed in the ledger."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from infermesh.processes import ProcessGroup, nats_server_binary
from shared.ports import free_port, wait_for_port
from tests.ledger_db import fresh_database_or_skip
from tests.utils import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
MESH = ("admission", "breaker", "router", "metering", "batch", "worker", "edge")  # the image's long-running ones


def _start_order() -> list[str]:
    order: list[str] = []

    def visit(name: str) -> None:
        for dependency in SERVICES[name].get("depends_on", {}):
            visit(dependency)
        if name not in order:
            order.append(name)

    for name in MESH:
        visit(name)
    return order


def _secrets_dir(name: str, secrets: Path) -> tuple[str, Path] | None:
    for volume in SERVICES[name].get("volumes", []):
        if isinstance(volume, dict) and volume.get("source") == "secrets":
            return volume["target"], secrets / volume["volume"]["subpath"]
    return None


class Host:
    """Where compose's names and ports land on this host."""

    def __init__(self, tmp: Path, nats_port: int, database: str, tiny_model: Path) -> None:
        self.tmp, self.nats_url, self.database, self.tiny_model = tmp, f"nats://127.0.0.1:{nats_port}", database, \
            tiny_model
        self.ports: dict[tuple[str, str], int] = {}  # (service, port in the file) -> this host's

    def port(self, service: str, port: str) -> str:
        return str(self.ports.setdefault((service, port), free_port()))

    def argv(self, name: str) -> list[str]:
        argv = list(SERVICES[name]["command"])
        mount = _secrets_dir(name, self.tmp / "secrets")
        argv = [str(mount[1]) if mount and a == mount[0] else a for a in argv]
        argv = [sys.executable if a == "python" else a for a in argv]
        for flag in ("--http-port", "--billing-port"):
            if flag in argv:
                argv[argv.index(flag) + 1] = self.port(name, argv[argv.index(flag) + 1])
        if name == "worker":  # the sim engine on the tiny model, not vLLM on the image's Gemma
            argv[argv.index("--engine") + 1] = "sim"
            argv[argv.index("--model-path") + 1] = str(self.tiny_model)
        return argv

    def env(self, name: str) -> dict[str, str]:
        env = {k: str(v) for k, v in (SERVICES[name].get("environment") or {}).items()}
        env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)  # no Jaeger here
        env["INFERMESH_NATS_URL"] = self.nats_url
        for key in ("INFERMESH_METRICS_PORT", "INFERMESH_BILLING_PORT"):
            if key in env:
                env[key] = self.port(name, env[key])
        return env

    def healthy(self, name: str) -> bool:
        test = list(SERVICES[name]["healthcheck"]["test"][1:])
        test = [sys.executable if a == "python" else a for a in test]
        test[-1] = re.sub(r"127\.0\.0\.1:(\d+)", lambda m: f"127.0.0.1:{self.port(name, m.group(1))}", test[-1])
        return subprocess.run(test, capture_output=True, timeout=10).returncode == 0


async def test_the_compose_mesh_answers_its_printed_key_and_bills_it(tmp_path, tiny_model):
    url, drop = await fresh_database_or_skip("postgres")
    host = Host(tmp_path, free_port(), "127.0.0.1:5432/" + url.rsplit("/", 1)[1], tiny_model)
    group = ProcessGroup(tmp_path / "logs")
    try:
        init = [sys.executable if a == "python" else a for a in SERVICES["secrets"]["command"]]
        init[init.index("/secrets")] = str(tmp_path / "secrets")
        init += ["--nats-listen", host.nats_url.removeprefix("nats://"), "--store-dir", str(tmp_path / "store"),
                 "--database", host.database, "--monitor-port", host.port("nats", "8222")]
        made = subprocess.run(init, capture_output=True, text=True, timeout=60, check=True)
        key = made.stdout.rsplit(": ", 1)[1].strip()
        again = subprocess.run(init, capture_output=True, text=True, timeout=60, check=True)  # a second start
        assert key not in again.stdout  # printed once

        nats_config = str(tmp_path / "secrets" / "nats" / "nats.json")
        group.spawn("nats", [nats_server_binary(), "-c", nats_config])
        assert wait_for_port(int(host.nats_url.rsplit(":", 1)[1]), 15)
        provision = subprocess.run(host.argv("provision"), env={**os.environ, **host.env("provision")},
                                   capture_output=True, text=True, timeout=60)
        assert provision.returncode == 0, provision.stderr

        for name in _start_order():
            if name in MESH:
                group.spawn(name, host.argv(name), host.env(name))
        for name in MESH:
            await eventually(lambda name=name: asyncio.to_thread(host.healthy, name), 90, 0.5)  # its own check

        base = f"http://127.0.0.1:{host.port('edge', '8000')}/v1"
        body = {"model": "gemma-3-270m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            refused = await client.post("/chat/completions", json=body, headers={"Authorization": "Bearer dev-key"})
            assert refused.status_code == 401, refused.text
            answered = await client.post("/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        assert answered.status_code == 200, answered.text
        request_id = answered.json()["id"].partition("-")[2]

        from sqlalchemy import text
        from sqlalchemy.ext.asyncio import create_async_engine

        engine = create_async_engine(url)

        async def billed() -> bool:
            async with engine.connect() as conn:
                rows = (await conn.execute(text("SELECT completion_tokens FROM usage WHERE request_id = :r"),
                                           {"r": request_id})).all()
            return [tuple(r) for r in rows] == [(answered.json()["usage"]["completion_tokens"],)]

        try:
            await eventually(billed, 30, 0.5)
        finally:
            await engine.dispose()
    finally:
        group.stop()
        await drop()
