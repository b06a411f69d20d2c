"""Client side of the fault matrix: streamed and plain chat requests in closed loops, each outcome recorded.

An outcome is what the client saw: the request id (from the response id), whether usage reached it and
with which token counts, how many content chunks arrived before an error, the error's kind, and whether
the request hung (no answer within ``hang_s``: the platform promises that never happens).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

MESSAGES = [{"role": "user", "content": "tell me a long story about a fault-tolerant mesh"}]


@dataclass(slots=True)
class Outcome:
    started: float
    stream: bool
    request_id: str = ""
    usage: dict | None = None  # what the client was told it used (and is billed for)
    chunks: int = 0  # content chunks before the end or the error
    error: str = ""  # "" = finished; else a kind: http_503, connect, sse_error, read, ...
    hung: bool = False
    ended: float = 0.0


@dataclass(slots=True)
class Load:
    base_url: str
    key: str
    model: str
    max_tokens: int = 40
    hang_s: float = 30.0
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self, concurrency: int) -> None:
        limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
        async with httpx.AsyncClient(base_url=self.base_url, limits=limits, timeout=httpx.Timeout(self.hang_s)) as c:
            await asyncio.gather(*(self._loop(c, i % 2 == 0) for i in range(concurrency)))

    def stop(self) -> None:
        self._stop.set()

    async def _loop(self, client: httpx.AsyncClient, stream: bool) -> None:
        while not self._stop.is_set():
            outcome = Outcome(time.monotonic(), stream)
            self.outcomes.append(outcome)
            try:
                await asyncio.wait_for(self._one(client, outcome), self.hang_s)
            except asyncio.TimeoutError:
                outcome.hung, outcome.error = True, "hung"
            except httpx.ConnectError:
                outcome.error = "connect"
            except (httpx.ReadError, httpx.RemoteProtocolError):
                outcome.error = "connection_lost"
            except httpx.TimeoutException:
                outcome.hung, outcome.error = True, "hung"
            outcome.ended = time.monotonic()
            if outcome.error in ("connect", "connection_lost") or outcome.error.startswith("http_5"):
                await asyncio.sleep(0.05)  # an edge being restarted: do not spin

    def _body(self, stream: bool) -> dict:
        body = {"model": self.model, "messages": MESSAGES, "max_tokens": self.max_tokens, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    async def _one(self, client: httpx.AsyncClient, outcome: Outcome) -> None:
        headers = {"Authorization": f"Bearer {self.key}"}
        if not outcome.stream:
            response = await client.post("/chat/completions", json=self._body(False), headers=headers)
            if response.status_code != 200:
                outcome.error = _http_error(response.status_code, response.content)
                return
            data = response.json()
            outcome.request_id = data["id"].partition("-")[2]
            outcome.usage = data.get("usage")
            outcome.chunks = 1
            return
        async with client.stream("POST", "/chat/completions", json=self._body(True), headers=headers) as response:
            if response.status_code != 200:
                outcome.error = _http_error(response.status_code, await response.aread())
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    outcome.error = "sse_error"
                    return
                outcome.request_id = outcome.request_id or event["id"].partition("-")[2]
                if event.get("usage"):
                    outcome.usage = event["usage"]
                if event.get("choices") and event["choices"][0]["delta"].get("content"):
                    outcome.chunks += 1
            if outcome.usage is None:
                outcome.error = "no_usage"


def _http_error(status: int, body: bytes) -> str:
    """``http_<status>``, and the error's code when the body is the API's error object (``http_503:no_capacity``)."""
    try:
        code = json.loads(body)["error"].get("code")
    except Exception:
        code = None
    return f"http_{status}:{code}" if code else f"http_{status}"


async def first_success_after(base_url: str, key: str, model: str, since: float, limit_s: float) -> float | None:
    """Seconds from ``since`` until a fresh plain request succeeds (None: not within ``limit_s``)."""
    body = {"model": model, "messages": MESSAGES, "max_tokens": 2}
    async with httpx.AsyncClient(base_url=base_url, timeout=5) as client:
        while time.monotonic() - since < limit_s:
            try:
                response = await client.post("/chat/completions", json=body,
                                             headers={"Authorization": f"Bearer {key}"})
                if response.status_code == 200:
                    return time.monotonic() - since
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
    return None
