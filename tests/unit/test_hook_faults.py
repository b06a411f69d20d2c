"""services/worker/engines/hook_faults.py: a hook's per-request failure reaches the worker over a real socket."""

from __future__ import annotations

import asyncio
import os

import pytest

from services.worker.engines import hook_faults
from services.worker.engines.hook_faults import SOCKET_ENV, FaultListener, HookFault


async def test_a_reported_fault_reaches_the_listener(monkeypatch: pytest.MonkeyPatch) -> None:
    got: asyncio.Queue[HookFault] = asyncio.Queue()
    closings: asyncio.Queue[str] = asyncio.Queue()
    listener = FaultListener(got.put_nowait, closings.put_nowait)
    path = listener.start()
    monkeypatch.setenv(SOCKET_ENV, path)
    try:
        hook_faults.report("req-1", "close", UnicodeDecodeError("utf-8", b"\xea", 0, 1, "unexpected end of data"))
        fault = await asyncio.wait_for(got.get(), 5)
        assert (fault.request_id, fault.stage) == ("req-1", "close")
        assert fault.error.startswith("UnicodeDecodeError") and "budget-aware closing failed" in fault.message()
        # garbage on the socket is dropped, the next fault still arrives
        import socket

        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.sendto(b"\xff not json", path)
        hook_faults.report("req-2", "build", RuntimeError("x" * 10_000))
        fault = await asyncio.wait_for(got.get(), 5)
        assert fault.request_id == "req-2" and len(fault.error) <= 1024
        hook_faults.report_closing("req-3")
        assert await asyncio.wait_for(closings.get(), 5) == "req-3"
    finally:
        listener.close()
    assert not os.path.exists(path)


def test_report_never_raises_without_a_listener(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SOCKET_ENV, "/nonexistent/infermesh/faults")
    hook_faults.report("req-1", "sync", ValueError("boom"))  # logged; no exception
    monkeypatch.delenv(SOCKET_ENV)
    hook_faults.report("req-1", "sync", ValueError("boom"))


@pytest.mark.parametrize("stage", hook_faults.STAGES)
def test_injection_only_when_enabled_and_asked(stage: str) -> None:
    hook_faults.injected(False, stage, f"... infermesh-fault:{stage} ...")
    hook_faults.injected(True, stage, "a spec without the marker")
    with pytest.raises(RuntimeError, match=stage):
        hook_faults.injected(True, stage, f"... infermesh-fault:{stage} ...")
