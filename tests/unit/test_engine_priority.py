"""Engine processes yield the CPU: every thread of every process the engine started, and the threads they
start later; never a process that was there before (a test runner's nats-server)."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil

from services.worker.engines.priority import SpawnedProcesses

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


def _spawn() -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    return child


def _nice(process: subprocess.Popen) -> set[int]:
    return {os.getpriority(os.PRIO_PROCESS, t.id) for t in psutil.Process(process.pid).threads()}


def test_the_engines_processes_and_the_threads_they_start_later_run_at_the_lower_priority_and_no_other():
    own = os.getpriority(os.PRIO_PROCESS, 0)
    bystander = _spawn()  # started before the engine: nats-server under a test runner
    spawned = SpawnedProcesses()
    engine = _spawn()
    try:
        threads = psutil.Process(engine.pid).threads()
        assert len(threads) >= 2
        assert spawned.renice(7) >= len(threads)
        assert _nice(engine) == {7}
        engine.stdin.write("\n")
        engine.stdin.flush()
        late = int(engine.stdout.readline())
        assert os.getpriority(os.PRIO_PROCESS, late) == 7
        assert spawned.renice(7) == 0  # nothing left to change
        assert _nice(bystander) == {own}  # the runner's other children are untouched
        assert os.getpriority(os.PRIO_PROCESS, 0) == own  # and so is this process (the worker's event loop)
    finally:
        for child in (bystander, engine):
            child.kill()
            child.wait()


def test_every_thread_of_the_engines_processes_is_bound_to_its_core_and_no_other_process():
    core = max(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    bystander = _spawn()
    spawned = SpawnedProcesses()
    engine = _spawn()
    try:
        threads = psutil.Process(engine.pid).threads()
        assert spawned.pin(core) == (0 if before == {core} else len(threads))
        assert all(os.sched_getaffinity(t.id) == {core} for t in psutil.Process(engine.pid).threads())
        engine.stdin.write("\n")
        engine.stdin.flush()
        late = int(engine.stdout.readline())
        assert os.sched_getaffinity(late) == {core}  # a thread started later inherits it
        assert all(os.sched_getaffinity(t.id) == before for t in psutil.Process(bystander.pid).threads())
        assert os.sched_getaffinity(0) == before  # the worker's own threads float
    finally:
        for child in (bystander, engine):
            child.kill()
            child.wait()
