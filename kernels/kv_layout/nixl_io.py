"""Real NIXL plumbing for a planned KV transfer between two processes (UCX, host memory).

The *target* (the prefill side) runs in its own process: it allocates its KV region,
fills it with a known pattern (word ``i`` of the region holds ``i`` as uint32, so every
byte's origin can be checked), registers it with NIXL and hands its agent metadata and
base address to the parent over a pipe. The *reader* (the decode side, in the calling
process) registers its own region and READs planned descriptors from the target, as
vLLM's decode worker pulls KV from its prefill peer.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import uuid
from typing import Any

import numpy as np

from kernels.kv_layout.planner import TransferPlan


def _agent(name: str, telemetry: bool = False, progress_thread: bool = False) -> Any:
    """A UCX agent. Without a progress thread the caller's polls drive UCX: on a small host a busy
    progress thread per agent takes a core from the thread posting the transfer."""
    from nixl._api import nixl_agent, nixl_agent_config

    conf = nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"], capture_telemetry=telemetry)
    return nixl_agent(name, conf)


def _reg_rows(buf: np.ndarray) -> np.ndarray:
    return np.array([[buf.ctypes.data, buf.nbytes, 0]], dtype=np.uint64)


def pattern(nbytes: int) -> np.ndarray:
    """The target's content: uint32 word i holds i (``nbytes`` must be a multiple of 4, < 16 GiB)."""
    if nbytes % 4 or nbytes // 4 > 2**32:
        raise ValueError(f"region of {nbytes} B cannot hold the uint32 index pattern")
    return np.arange(nbytes // 4, dtype=np.uint32)


def _target_main(conn: Any, name: str, nbytes: int, progress_thread: bool) -> None:
    try:
        agent = _agent(name, progress_thread=progress_thread)
        buf = pattern(nbytes)
        reg = agent.register_memory(_reg_rows(buf), "DRAM")
        conn.send(("ready", agent.get_agent_metadata(), int(buf.ctypes.data)))
    except Exception as exc:  # report to the parent instead of leaving it waiting
        conn.send(("error", repr(exc), 0))
        return
    while not conn.poll(0.002):  # any message: stop; meanwhile answer UCX connection set-up
        agent.get_new_notifs()
    conn.recv()
    agent.deregister_memory(reg)
    conn.send(("stopped", b"", 0))


class NixlTarget:
    """The prefill side: a spawned process holding a registered, pattern-filled KV region."""

    def __init__(self, nbytes: int, name: str | None = None, start_timeout_s: float = 120.0,
                 progress_thread: bool = False) -> None:
        self.name = name or f"kv-prefill-{uuid.uuid4().hex[:8]}"
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_target_main, args=(child, self.name, nbytes, progress_thread), daemon=True)
        self._proc.start()
        if not self._conn.poll(start_timeout_s):
            self.close()
            raise TimeoutError(f"NIXL target did not start in {start_timeout_s} s")
        status, self.metadata, self.base = self._conn.recv()
        if status != "ready":
            self.close()
            raise RuntimeError(f"NIXL target failed: {self.metadata}")

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send("stop")
                self._conn.poll(30) and self._conn.recv()
            except (BrokenPipeError, EOFError, OSError):
                pass
            self._proc.join(30)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(10)

    def __enter__(self) -> NixlTarget:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NixlReader:
    """The decode side: a registered local region that READs planned descriptors from a target."""

    def __init__(self, nbytes: int, name: str | None = None, telemetry: bool = False,
                 progress_thread: bool = False) -> None:
        self.agent = _agent(name or f"kv-decode-{uuid.uuid4().hex[:8]}", telemetry, progress_thread)
        self.buf = np.zeros(nbytes, dtype=np.uint8)
        self._reg = self.agent.register_memory(_reg_rows(self.buf), "DRAM")
        self.remote: str | None = None
        self.remote_base = 0

    @property
    def base(self) -> int:
        return int(self.buf.ctypes.data)

    def connect(self, target: NixlTarget) -> str:
        self.remote = self.agent.add_remote_agent(target.metadata)
        self.remote_base = target.base
        return self.remote

    def prepare(self, plan: TransferPlan) -> Any:
        """A READ request for ``plan`` (src offsets on the target, dst offsets here); repostable."""
        if self.remote is None:
            raise RuntimeError("connect() to a target first")
        local = self.agent.get_xfer_descs(plan.descs(self.base, "dst").astype(np.uint64), "DRAM")
        remote = self.agent.get_xfer_descs(plan.descs(self.remote_base, "src").astype(np.uint64), "DRAM")
        handle = self.agent.initialize_xfer("READ", local, remote, self.remote)
        if not handle:
            raise RuntimeError("NIXL could not create the transfer request")
        return handle

    def run(self, handle: Any, timeout_s: float = 300.0) -> float:
        """Post ``handle`` and busy-poll it to completion; seconds from post to DONE."""
        t0 = time.perf_counter()
        state = self.agent.transfer(handle)
        while state == "PROC":
            if time.perf_counter() - t0 > timeout_s:
                raise TimeoutError(f"NIXL transfer still in progress after {timeout_s} s")
            state = self.agent.check_xfer_state(handle)
        if state != "DONE":
            raise RuntimeError(f"NIXL transfer ended in state {state}")
        return time.perf_counter() - t0

    def telemetry(self, handle: Any) -> dict[str, int]:
        """NIXL's own account of the last post (descriptor count after its merging, bytes, us)."""
        t = self.agent.get_xfer_telemetry(handle)
        return {"desc_count": int(t.descCount), "total_bytes": int(t.totalBytes),
                "post_us": int(t.postDuration), "xfer_us": int(t.xferDuration)}

    def close(self) -> None:
        if self.remote is not None:
            self.agent.remove_remote_agent(self.remote)
            self.remote = None
        if self._reg is not None:
            self.agent.deregister_memory(self._reg)
            self._reg = None

    def __enter__(self) -> NixlReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_landed(plan: TransferPlan, dst: np.ndarray, slab_bytes: int) -> int:
    """Bytes of ``plan`` checked in ``dst``: the first and last word of every (block, layer) slab must hold
    the target pattern of its source slab; raises AssertionError naming the first slab that does not."""
    counts = plan.lengths // slab_bytes
    within = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    d = np.repeat(plan.dst_offsets, counts) + within * slab_bytes
    s = np.repeat(plan.src_offsets, counts) + within * slab_bytes
    words = dst.view(np.uint32)
    got_first, got_last = words[d // 4], words[(d + slab_bytes) // 4 - 1]
    bad = np.flatnonzero((got_first != s // 4) | (got_last != (s + slab_bytes) // 4 - 1))
    if bad.size:
        i = int(bad[0])
        raise AssertionError(f"{bad.size} of {d.size} slabs did not land: dst offset {int(d[i])} holds word "
                             f"{int(got_first[i])}, want {int(s[i] // 4)}")
    return int(d.size) * slab_bytes
