"""Failures of our code inside an engine step, contained to the one request they concern (and when
budget-aware closing took over a request, for the worker's counts).

Our hooks (the budget-closing logits processor, its grammar matcher) run inside vLLM's engine step, in
the engine-core process. An exception there would kill the engine, and with it every request in
flight. So each hook catches everything per request and *reports* instead of raising: one datagram
on a UNIX socket the worker's engine binds (``FaultListener``; its path reaches the engine process
in the environment variable ``SOCKET_ENV``). The worker then aborts that request and fails its stream
with a clear error; the engine serves the others on.

    listener = FaultListener(on_fault, on_closing)  # worker side: on_fault(HookFault), on_closing(request_id)
    env = {SOCKET_ENV: listener.start()}      # before the engine starts
    report(request_id, "close", exc)          # engine side: never raises
    report_closing(request_id)                # closing forced its first token for the request

Fault injection (tests only): with ``INJECT_ENV=1`` in the engine's environment, a hook raises at
stage S for a request whose grammar spec contains ``infermesh-fault:S`` (``injected``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass
from typing import Callable, Literal

log = logging.getLogger("infermesh.worker.hooks")

SOCKET_ENV = "INFERMESH_HOOK_FAULTS"
INJECT_ENV = "INFERMESH_HOOK_FAULT_INJECTION"
Stage = Literal["build", "sync", "close", "mask", "update"]  # where a hook failed
STAGES: tuple[str, ...] = ("build", "sync", "close", "mask", "update")
MAX_DATAGRAM = 4096


@dataclass(frozen=True, slots=True)
class HookFault:
    request_id: str
    stage: str
    error: str  # "<ExceptionType>: <message>"

    def message(self) -> str:
        return f"budget-aware closing failed for this request ({self.stage}: {self.error}); the engine serves on"


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:1024]


def report(request_id: str, stage: str, exc: BaseException) -> None:
    """Tell the worker that ``request_id`` must fail (logged either way; never raises)."""
    log.error("hook %s failed for request %s: %s", stage, request_id or "?", describe(exc), exc_info=exc)
    path = os.environ.get(SOCKET_ENV)
    if not path or not request_id:
        return
    _send(path, {"request_id": request_id, "stage": stage, "error": describe(exc)})


def report_closing(request_id: str) -> None:
    """Budget-aware closing took over ``request_id`` (counted by the worker; never raises)."""
    path = os.environ.get(SOCKET_ENV)
    if path and request_id:
        _send(path, {"request_id": request_id, "closing": True})


def _send(path: str, value: dict[str, object]) -> None:
    data = json.dumps(value).encode()[:MAX_DATAGRAM]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.sendto(data, path)
    except OSError as err:
        log.error("cannot report to the worker (%s): %s", value.get("request_id"), err)


def injection_enabled() -> bool:
    return os.environ.get(INJECT_ENV) == "1"


def injected(enabled: bool, stage: str, spec: str) -> None:
    """Raise at ``stage`` when injection is enabled and the request's spec asks for it."""
    if enabled and f"infermesh-fault:{stage}" in spec:
        raise RuntimeError(f"fault injected at {stage}")


def parse(data: bytes) -> HookFault | str | None:
    """A HookFault, the request id of a closing report, or None (unreadable)."""
    try:
        value = json.loads(data)
        if value.get("closing") is True:
            return str(value["request_id"])
        return HookFault(str(value["request_id"]), str(value["stage"]), str(value["error"]))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


class FaultListener:
    """The worker's end: a datagram socket in a private temporary folder, read on the event loop."""

    def __init__(self, on_fault: Callable[[HookFault], None],
                 on_closing: Callable[[str], None] = lambda _request_id: None) -> None:
        self.on_fault = on_fault
        self.on_closing = on_closing
        self._folder = ""
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> str:
        """Bind and start reading; returns the socket's path (for ``SOCKET_ENV``)."""
        self._folder = tempfile.mkdtemp(prefix="infermesh-hooks-")
        path = os.path.join(self._folder, "faults")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(path)
        sock.setblocking(False)
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(sock.fileno(), self._read)
        return path

    def _read(self) -> None:
        assert self._sock is not None
        while True:
            try:
                data = self._sock.recv(MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("hook fault socket: %s", exc)
                return
            event = parse(data)
            if event is None:
                log.warning("hook fault socket: an unreadable datagram (%d bytes) dropped", len(data))
                continue
            try:
                if isinstance(event, str):
                    self.on_closing(event)
                else:
                    self.on_fault(event)
            except Exception:
                log.exception("handling the hook report %r failed", event)

    def close(self) -> None:
        if self._sock is not None:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        if self._folder:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = ""
