"""Sampling on ``infermesh up`` (each service its own process, exporting over OTLP/HTTP to a real receiver): a ratio
of 0 leaves every trace out, yet a request that failed and a slow one still arrive (shared/trace_sampling.py)."""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest

from shared.ports import free_port
from tests.e2e.mesh_process import UpProcess
from tests.otlp_receiver import OtlpReceiver
from tests.utils import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
SLOW_MS = 400
KEPT_BY = "infermesh.sampling.kept_by"


def workers(up: UpProcess) -> list:
    return [p for p in up.descendants() if "services.worker" in p.cmdline()]


def ready_workers(port: int, key: str) -> int:
    try:
        answer = httpx.get(f"http://127.0.0.1:{port}/ready", headers={"Authorization": f"Bearer {key}"},
                           timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return 0
    return answer.get("workers", 0) if answer.get("status") == "ready" else 0


async def test_a_zero_ratio_still_keeps_the_failed_and_the_slow_request(nats_url, tiny_model, tmp_path):
    port = free_port()
    with OtlpReceiver() as otlp:
        up = UpProcess(["--engine", "sim", "--workers", "1", "--sim-ttft-ms", "5", "--sim-itl-ms", "10",
                        "--model", "tiny", "--model-path", str(tiny_model), "--nats-url", nats_url,
                        "--namespace", f"t{uuid.uuid4().hex[:8]}", "--http-port", str(port),
                        "--edge-replicas", "1", "--router-replicas", "1", "--admission-replicas", "1",
                        "--billing-port", str(free_port()), "--metrics-port-base", "-1", "--state-dir", str(tmp_path)],
                       env={"OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100",
                            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0",
                            "INFERMESH_TRACES_SLOW_MS": str(SLOW_MS)})
        up.start(timeout_s=90)
        try:
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=up.key, max_retries=0)
            fast = await client.completions.with_raw_response.create(model="tiny", prompt=[5, 6, 7], max_tokens=2)
            failed = await client.completions.with_raw_response.create(  # its worker is killed mid-stream
                model="tiny", prompt=[5, 6, 9], max_tokens=200, stream=True, extra_body={"ignore_eos": True},
                extra_headers={"X-Infermesh-Max-Migrations": "0"})
            killed: set[int] = set()
            with pytest.raises(openai.APIError):
                async for chunk in failed.parse():
                    if chunk.choices and chunk.choices[0].text and not killed:
                        for process in workers(up):
                            killed.add(process.pid)
                            process.kill()
            await eventually(lambda: {p.pid for p in workers(up)} - killed, 60)  # up's supervisor restarts it
            await eventually(lambda: ready_workers(port, up.key) == 1, 60)
            slow = await client.completions.with_raw_response.create(  # 60 tokens at 10 ms: past SLOW_MS
                model="tiny", prompt=[5, 6, 8], max_tokens=60, extra_body={"ignore_eos": True})
            ids = {name: r.headers["traceparent"].split("-")[1]
                   for name, r in (("fast", fast), ("failed", failed), ("slow", slow))}
            assert all(int(r.headers["traceparent"][-2:], 16) & 1 == 0 for r in (fast, slow))  # none sampled

            def names(which: str) -> set[str]:
                return {s.name for s in otlp.of_trace(ids[which])}

            await eventually(lambda: {"text_completion tiny", "attempt", "generate"} <= names("slow"), 20)
            await eventually(lambda: any(s.status == 2 for s in otlp.of_trace(ids["failed"])), 20)
            slow_spans = otlp.of_trace(ids["slow"])
            assert {s.attributes[KEPT_BY] for s in slow_spans} == {"slow"}
            assert "router.route" not in names("slow")  # the router's part was quick: left out there
            assert {s.attributes[KEPT_BY] for s in otlp.of_trace(ids["failed"])} == {"error"}
            assert names("fast") == set()  # decided before the later ones were exported: dropped everywhere
        finally:
            assert up.stop() == 0
