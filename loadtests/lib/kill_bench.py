"""Sim workers as processes one can SIGKILL, the streams clients see of them, and the ledger rows they leave:
what the kill benchmarks (migration, deployments) share."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
from sqlalchemy import select

from infermesh.processes import nats_server_binary
from loadtests.lib.migration_report import Seen
from shared.ports import free_port, wait_for_port

MODEL = "tiny"


def start_nats(store: Path) -> tuple[subprocess.Popen, str]:
    """A nats-server with JetStream on a free port (as tests/conftest.py starts one)."""
    port = free_port()
    proc = subprocess.Popen([nats_server_binary(), "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(store)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if not wait_for_port(port, 10):
        proc.kill()
        raise RuntimeError("nats-server did not start")
    return proc, f"nats://127.0.0.1:{port}"


class Fleet:
    """Sim workers as their own processes (heartbeat every 0.5 s), so one can be SIGKILLed and replaced."""

    def __init__(self, nats_url: str, namespace: str, model_path: Path, itl_ms: float, ttl_s: float,
                 logs: Path, prefix: str = "sim") -> None:
        self.env = {**os.environ, "INFERMESH_NATS_URL": nats_url, "INFERMESH_NAMESPACE": namespace}
        self.model_path, self.itl_ms, self.ttl_s, self.logs = model_path, itl_ms, ttl_s, logs
        self.prefix = prefix
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self) -> str:
        worker_id = f"{self.prefix}-{len(self.procs)}"  # a new id each time: a replacement is a new worker
        with open(self.logs / f"{worker_id}.log", "w") as log:
            self.procs[worker_id] = subprocess.Popen(
                [sys.executable, "-m", "services.worker", "--worker-id", worker_id, "--engine", "sim", "--model",
                 MODEL, "--model-path", str(self.model_path), "--heartbeat-s", "0.5", "--heartbeat-ttl-s",
                 str(self.ttl_s), "--sim-itl-ms", str(self.itl_ms)], env=self.env, stdout=log,
                stderr=subprocess.STDOUT)
        return worker_id

    def kill(self, worker_id: str) -> None:
        self.procs[worker_id].send_signal(signal.SIGKILL)
        self.procs[worker_id].wait(10)

    def alive(self) -> set[str]:
        return {w for w, p in self.procs.items() if p.poll() is None}

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


async def stream_one(client: openai.AsyncOpenAI, body: dict, seen: Seen, headers: dict, hang_s: float) -> None:
    """Stream one completion into ``seen``; past ``hang_s`` it is hung, whatever it was waiting for."""
    async def consume() -> None:
        raw = await client.completions.with_raw_response.create(
            **body, stream=True, stream_options={"include_usage": True}, extra_headers=headers)
        seen.deployment = raw.headers.get("x-infermesh-deployment", "")
        async for chunk in raw.parse():
            seen.request_id = seen.request_id or chunk.id.removeprefix("cmpl-")
            if chunk.choices:
                choice = chunk.choices[0]
                if choice.text:
                    seen.text += choice.text
                    seen.chunk_times.append(time.monotonic())
                seen.finish_reason = choice.finish_reason or seen.finish_reason
            if chunk.usage is not None:
                seen.usage = {"prompt_tokens": chunk.usage.prompt_tokens,
                              "completion_tokens": chunk.usage.completion_tokens}

    try:
        await asyncio.wait_for(consume(), hang_s)
    except asyncio.TimeoutError:
        seen.hung, seen.error = True, "hung"
    except openai.APIError as exc:
        seen.error = getattr(exc, "code", None) or type(exc).__name__
        seen.error_message = str(exc)[:300]
    finally:
        seen.ended = time.monotonic()


async def ledger_rows(database_url: str, expected: int, settle_s: float, limit_s: float = 60.0) -> dict:
    """request id -> its usage rows, once there are ``expected`` rows and the count has not moved for ``settle_s``
    (a doubled row would come after)."""
    from services.metering.db import create_engine
    from services.metering.models import Usage

    engine = create_engine(database_url)
    columns = ("request_id", "attempt", "status", "finish_reason", "prompt_tokens", "completion_tokens",
               "migrations", "migration_prefill_tokens", "worker_id")
    try:
        start, last, stable_since = time.monotonic(), -1, time.monotonic()
        while time.monotonic() - start < limit_s:
            async with engine.connect() as conn:
                rows = (await conn.execute(select(Usage))).all()
            if len(rows) != last:
                last, stable_since = len(rows), time.monotonic()
            elif len(rows) >= expected and time.monotonic() - stable_since >= settle_s:
                break
            await asyncio.sleep(0.2)
    finally:
        await engine.dispose()
    by_request: dict[str, list[dict]] = {}
    for row in rows:
        by_request.setdefault(row.request_id, []).append({c: getattr(row, c) for c in columns})
    return by_request
