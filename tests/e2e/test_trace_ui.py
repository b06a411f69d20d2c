"""``infermesh up --trace-ui``: Phoenix starts with the mesh, every service exports to it, and one request's
whole trace is there, in its REST API and on its page in Chromium (where the billing dashboard links it).

Phoenix is installed once into its own virtualenv (``./scripts/test`` does it before the tests)."""

from __future__ import annotations

import asyncio
import os
import uuid

import openai
import pytest

from loadtests.trace_ui import CHROMEDRIVER, CHROMIUM, TREE, browser, open_trace, tree, wait_for_spans
from shared.ports import free_port
from tests.e2e.mesh_process import UpProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


async def test_up_with_trace_ui_shows_a_requests_whole_trace_in_phoenix(nats_url, tiny_model, tmp_path):
    # justified skip: the browser is a system package that ./scripts/test installs with apt-get; only a machine where
    # that install is impossible (no root, no apt) lands here, and the trace tree itself is still checked without a
    # browser by tests/e2e/test_observability.py against a real OTLP receiver
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.skip("needs Debian's chromium and chromium-driver (./scripts/test installs them)")
    http_port, ui_port = free_port(), free_port()
    up = UpProcess(["--engine", "sim", "--pd", "1:1", "--model", "tiny", "--model-path", str(tiny_model),
                    "--nats-url", nats_url, "--namespace", f"t{uuid.uuid4().hex[:8]}", "--http-port", str(http_port),
                    "--billing-port", str(free_port()), "--metrics-port-base", "-1", "--router-replicas", "1",
                    "--admission-replicas", "1", "--trace-ui", "--trace-ui-port", str(ui_port),
                    "--state-dir", str(tmp_path)], env={"OTEL_BSP_SCHEDULE_DELAY": "100"})
    up.start(timeout_s=300)
    try:
        ui_url = f"http://127.0.0.1:{ui_port}"
        assert any(line.strip().startswith(f"traces   : {ui_url}") for line in up.lines), "".join(up.lines)
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key=up.key, max_retries=0)
        raw = await client.completions.with_raw_response.create(model="tiny", prompt=list(range(5, 200)),
                                                                max_tokens=8)
        trace_id = raw.headers["traceparent"].split("-")[1]
        spans = await asyncio.to_thread(wait_for_spans, ui_url, trace_id, {"text_completion tiny", *TREE})
        parents = {s["name"]: s["parent"] for s in tree(spans)}
        assert parents["text_completion tiny"] == ""  # the edge's span is the root; every hop hangs below it
        assert (parents["admission.decide"], parents["router.route"], parents["kv.transfer"]) == (
            "admission.acquire", "attempt", "decode")
        assert {s["trace_id"] for s in spans} == {trace_id}

        def page() -> str:
            driver = browser()
            try:
                return open_trace(driver, ui_url, trace_id, {"router.route", "kv.transfer", "engine.decode"})
            finally:
                driver.quit()

        assert "text_completion tiny" in await asyncio.to_thread(page)
        metering = [p.cmdline() for p in up.descendants() if "services.metering" in p.cmdline()]
        assert metering and f"{ui_url}/redirects/traces/{{trace_id}}" in metering[0]  # the dashboard's links
    finally:
        assert up.stop() == 0
