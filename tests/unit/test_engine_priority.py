"""Engine processes yield the CPU: every thread of every child, and the threads they start later."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil

from services.worker.engines.priority import renice_children

CHILD = """
import sys, threading, time
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print("ready", flush=True)
sys.stdin.readline()  # start one more thread after the renice
late = threading.Thread(target=time.sleep, args=(60,), daemon=True)
late.start()
print(late.native_id, flush=True)
time.sleep(60)
"""


def test_every_thread_of_a_child_and_the_threads_it_starts_later_run_at_the_lower_priority():
    own = os.getpriority(os.PRIO_PROCESS, 0)
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        threads = psutil.Process(child.pid).threads()
        assert len(threads) >= 2
        assert renice_children(7) >= len(threads)
        assert {os.getpriority(os.PRIO_PROCESS, t.id) for t in threads} == {7}
        child.stdin.write("\n")
        child.stdin.flush()
        late = int(child.stdout.readline())
        assert os.getpriority(os.PRIO_PROCESS, late) == 7
        assert renice_children(7) == 0  # nothing left to change
        assert os.getpriority(os.PRIO_PROCESS, 0) == own  # this process (the worker's event loop) is untouched
    finally:
        child.kill()
        child.wait()
