"""The picture of what an operator sees: one disaggregated request on ``infermesh up --trace-ui`` (sim engine,
GB200 step-time profile, a 400-token prompt), its trace opened in Phoenix in headless Chromium.

Writes ``OUT/trace.png`` (the screenshot) and ``OUT/trace.json`` (the command, the trace id, and the spans Phoenix
holds for it: name, parent, duration), after checking that Phoenix holds every span of the tree and its page
names them. Needs Debian's chromium and chromedriver (``./scripts/test`` installs them) and Phoenix
(``infermesh up --trace-ui`` installs it once).

    python -m loadtests.trace_ui --out docs/results/trace_ui
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from shared.ports import free_port

# the spans of one disaggregated request (tests/e2e/test_observability.py checks their links and attributes)
TREE = ("admission.acquire", "admission.decide", "attempt", "router.route", "prefill", "kv.transfer", "decode",
        "engine.queue", "engine.prefill", "engine.decode", "usage.publish")
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


def phoenix_spans(ui_url: str, trace_id: str) -> list[dict[str, Any]]:
    """The spans Phoenix's REST API holds for ``trace_id`` (OTLP JSON), in the default project."""
    url = f"{ui_url}/v1/projects/default/spans/otlpv1?trace_id={trace_id}&limit=1000"
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.loads(response.read())["data"]
    except OSError:
        return []


def wait_for_spans(ui_url: str, trace_id: str, names: set[str], timeout_s: float = 60.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while True:
        spans = phoenix_spans(ui_url, trace_id)
        if names <= {s["name"] for s in spans}:
            return spans
        if time.monotonic() > deadline:
            raise AssertionError(f"Phoenix holds {sorted(s['name'] for s in spans)}, not all of {sorted(names)}")
        time.sleep(0.5)


def browser(width: int = 1600, height: int = 1000):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={width},{height}"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def open_trace(driver, ui_url: str, trace_id: str, names: set[str], timeout_s: float = 60.0) -> str:
    """Open the trace's page (``/redirects/traces/<id>``, as the billing dashboard links it) and wait until it
    names every span in ``names``; returns the page's text."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(f"{ui_url}/redirects/traces/{trace_id}")
    WebDriverWait(driver, timeout_s).until(
        lambda d: trace_id in d.current_url and all(n in d.find_element(By.TAG_NAME, "body").text for n in names))
    return driver.find_element(By.TAG_NAME, "body").text


def tree(spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Phoenix's spans as (name, parent's name, duration), in start order."""
    by_id = {s["span_id"]: s["name"] for s in spans}
    return [{"name": s["name"], "parent": by_id.get(s.get("parent_span_id") or "", ""),
             "duration_ms": round((int(s["end_time_unix_nano"]) - int(s["start_time_unix_nano"])) / 1e6, 3)}
            for s in sorted(spans, key=lambda s: int(s["start_time_unix_nano"]))]


def _up(model_path: Path, state: Path, http_port: int, ui_port: int) -> tuple[subprocess.Popen[str], list[str]]:
    argv = [sys.executable, "-m", "infermesh.cli", "up", "--engine", "sim", "--pd", "1:1", "--sim-profile",
            "gb200-glm53", "--sim-clock-factor", "20", "--model", "tiny", "--model-path", str(model_path),
            "--http-port", str(http_port), "--billing-port", str(free_port()), "--metrics-port-base", "-1",
            "--trace-ui", "--trace-ui-port", str(ui_port), "--state-dir", str(state)]
    popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "100"})
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(popen.stdout or ()), daemon=True).start()
    deadline = time.monotonic() + 600
    while not any("base URL" in line for line in lines):
        if popen.poll() is not None or time.monotonic() > deadline:
            popen.terminate()
            raise RuntimeError("infermesh up did not become ready:\n" + "".join(lines[-40:]))
        time.sleep(0.2)
    return popen, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="loadtests/out/trace_ui", help="folder for trace.png and trace.json")
    args = parser.parse_args()
    import openai

    from infermesh.models import make_tiny_llama

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    state = Path(tempfile.mkdtemp(prefix="infermesh-trace-ui-"))
    http_port, ui_port = free_port(), free_port()
    popen, lines = _up(make_tiny_llama(state / "tiny"), state, http_port, ui_port)
    try:
        key = next(line.split(":", 1)[1].strip() for line in lines if line.strip().startswith("API key"))
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key=key, max_retries=0)
        raw = client.completions.with_raw_response.create(model="tiny", prompt=list(range(5, 405)), max_tokens=16,
                                                          extra_headers={"x-session-id": "agent-7"})
        trace_id = raw.headers["traceparent"].split("-")[1]
        ui_url = f"http://127.0.0.1:{ui_port}"
        spans = wait_for_spans(ui_url, trace_id, {"text_completion tiny", *TREE})
        driver = browser(height=1400)  # tall enough for the whole tree
        try:
            open_trace(driver, ui_url, trace_id, {"router.route", "kv.transfer", "decode"})
            time.sleep(1.0)  # let the tree's layout settle before the picture
            driver.save_screenshot(str(out / "trace.png"))
        finally:
            driver.quit()
        report = {"command": "python -m loadtests.trace_ui " + " ".join(sys.argv[1:]), "trace_id": trace_id,
                  "spans": tree(spans)}
        (out / "trace.json").write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {out / 'trace.png'} and {out / 'trace.json'} (trace {trace_id}, {len(spans)} spans)")
    finally:
        popen.terminate()
        popen.wait(60)


if __name__ == "__main__":
    main()
