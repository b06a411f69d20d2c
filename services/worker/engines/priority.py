"""Engine processes yield the CPU to the mesh's control plane.

An engine's compute (vLLM's EngineCore, NIXL's busy-polling UCX threads) will use every cycle it is
given; NATS, the heartbeat and the services' event loops need a few milliseconds at a time but need
them now. On a 2-core machine two vLLM engines with NIXL starved nats-server until every JetStream
call timed out and a decoder "left the mesh" mid-stream. So engine processes run at a lower
priority (a higher nice value): they still get every idle cycle, the control plane runs first.

Linux keeps a nice value per thread, and a new thread inherits its creator's: every thread of each
child process is reniced, and threads those threads start later inherit the value.
"""

from __future__ import annotations

import logging
import os

import psutil

log = logging.getLogger(__name__)


def renice_children(nice: int) -> int:
    """Give every thread of this process's descendants at least ``nice``; returns how many threads changed."""
    changed = 0
    for child in psutil.Process().children(recursive=True):
        try:
            threads = child.threads()
        except psutil.Error:
            continue  # gone already
        for thread in threads:
            try:
                if os.getpriority(os.PRIO_PROCESS, thread.id) < nice:
                    os.setpriority(os.PRIO_PROCESS, thread.id, nice)
                    changed += 1
            except (ProcessLookupError, PermissionError):
                continue
    if changed:
        log.info("engine processes reniced to %d (%d threads)", nice, changed)
    return changed
