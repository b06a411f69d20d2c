"""The harnesses' recorded requests as fixtures (tests/fixtures/agents/<harness>/NN.json), secrets removed.

A fixture keeps what the harness sent (method, path with its query, headers, the JSON body) and what the edge
made of it (status, streamed or not, and whether the answer was a tool call), so a fast test can replay it
against the edge. Removed: credentials (authorization, x-api-key...) and transport headers (host, length);
scratch paths are normalized (the run's root becomes ``/work``: ``/work/<harness>/repo`` and ``.../home``).
Installation and device ids are zeroed (made per scratch home, but they name an installation, not a run).
Session ids stay: they identify a trajectory, not a person."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tests.agents.proxy import Exchange

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "agents"
NORMALIZED_ROOT = "/work"
DROPPED_HEADERS = {"authorization", "x-api-key", "api-key", "openai-api-key", "cookie", "proxy-authorization",
                   "host", "content-length", "connection", "accept-encoding", "transfer-encoding"}
TOOL_MARKS = (b'"tool_use"', b'"function_call"', b'"tool_calls"')
ZERO_UUID = "00000000-0000-0000-0000-000000000000"
# Claude Code's metadata.user_id is a JSON string inside the body: {"device_id": "<hex>", ...}
_DEVICE_ID = re.compile(r'(\\"device_id\\":\s*\\")[0-9a-f]+')
# Codex's installation id: client_metadata's x-codex-installation-id, and inside its turn metadata
_INSTALLATION_ID = re.compile(r'installation[_-]id\\*"\s*:\s*\\*"([0-9a-f-]{36})')


def zero_ids(text: str) -> str:
    """``text`` with Claude Code's device id and Codex's installation id zeroed."""
    text = _DEVICE_ID.sub(lambda m: m[1] + "0" * 64, text)
    for installation in set(_INSTALLATION_ID.findall(text)):
        text = text.replace(installation, ZERO_UUID)
    return text


def answered_with(exchange: Exchange) -> str:
    """``tool_call`` when the edge's answer called a tool, else ``text``."""
    return "tool_call" if any(mark in exchange.response for mark in TOOL_MARKS) else "text"


def sanitize(exchange: Exchange, root: Path, harness: str, version: str) -> dict[str, Any]:
    def normal(text: str) -> str:
        return text.replace(str(root), NORMALIZED_ROOT)

    headers = {name: zero_ids(normal(value)) for name, value in sorted(exchange.headers.items())
               if name not in DROPPED_HEADERS}
    body = json.loads(zero_ids(normal(exchange.body.decode()))) if exchange.body else None
    return {"harness": harness, "version": version, "method": exchange.method, "path": exchange.path,
            "headers": headers, "body": body, "status": exchange.status,
            "streamed": exchange.content_type.startswith("text/event-stream"), "answer": answered_with(exchange)}


def write_fixtures(harness: str, version: str, exchanges: list[Exchange], root: Path,
                   folder: Path = FIXTURES) -> list[Path]:
    """Replace ``folder/<harness>`` with one file per exchange, in the order they were sent."""
    out = folder / harness
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.json"):
        old.unlink()
    paths = []
    for i, exchange in enumerate(exchanges):
        path = out / f"{i:02d}.json"
        path.write_text(json.dumps(sanitize(exchange, root, harness, version), indent=1, ensure_ascii=False) + "\n")
        paths.append(path)
    return paths


def load_fixtures(folder: Path = FIXTURES) -> list[dict[str, Any]]:
    return [json.loads(path.read_text()) for path in sorted(folder.glob("*/*.json"))]
