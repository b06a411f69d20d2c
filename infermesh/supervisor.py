"""``infermesh up``'s supervisor: the restart policy (``restart_policy.py``) wired to child processes.

Every child of the group is watched once the mesh is up; one that dies (any exit code or signal) gets a log
line saying which process, how it ended, its restart count and the delay, and is started again with the
argv and environment it first had, appending to the same log file. The others are never touched: the mesh
keeps serving on whatever is alive. ``run`` returns when ``stop`` is set, after which nothing is restarted,
so ``ProcessGroup.stop`` then stops everything once.

The supervisor runs in the thread that started the children: PR_SET_PDEATHSIG fires when the parent
*thread* ends, so a child started from a short-lived thread would be killed when that thread ends.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from infermesh.processes import Child, ProcessGroup
from infermesh.restart_policy import Phase, Restart, RestartPolicy
from shared.nats_auth import NatsCredentials

POLL_S = 0.2  # how soon a death is seen


def describe_exit(exit_code: int) -> str:
    """``exit code 3`` or ``killed by SIGKILL`` (subprocess's returncode: a negative one is the signal)."""
    if exit_code >= 0:
        return f"exit code {exit_code}"
    try:
        return f"killed by {signal.Signals(-exit_code).name}"
    except ValueError:
        return f"killed by signal {-exit_code}"


def exit_message(restart: Restart) -> str:
    """The log line for one death: which process, how it ended, its restart count, the delay."""
    line = (f"{restart.name} died ({describe_exit(restart.exit_code)}) after {restart.uptime_s:.1f} s up; "
            f"restart #{restart.restarts} in {restart.delay_s:g} s")
    if restart.crash_looping:
        line += (f"; crash-looping ({restart.streak} quick exits in a row): retrying every {restart.delay_s:g} s"
                 " until it stays up")
    return line


@dataclass
class SupervisedGroup(ProcessGroup):
    """A ProcessGroup that remembers how it started each child, so that it can start it again."""

    specs: dict[str, tuple[list[str], dict[str, str] | None, NatsCredentials | None]] = field(default_factory=dict)

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None,
              credentials: NatsCredentials | None = None) -> Child:
        self.specs[name] = (list(argv), env, credentials)
        return super().spawn(name, argv, env, credentials)

    def respawn(self, name: str) -> Child:
        """Start ``name`` again as it first was, in its old place in ``children`` (the stop order holds).
        What the dead child left in its process group (vLLM's engine core) is killed first."""
        index = next(i for i, child in enumerate(self.children) if child.name == name)
        try:
            os.killpg(self.children[index].popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        argv, env, credentials = self.specs[name]
        child = super().spawn(name, argv, env, credentials)  # appended last; its credentials in a new pipe
        self.children[index] = self.children.pop()
        return child


class Supervisor:
    """Restarts what dies in ``group`` when ``policy`` says so; ``say`` gets the log lines."""

    def __init__(self, group: SupervisedGroup, say: Callable[[str], None], policy: RestartPolicy | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.group = group
        self.say = say
        self.policy = policy or RestartPolicy()
        self.clock = clock
        now = clock()
        for child in group.children:
            self.policy.started(child.name, now)

    def poll(self) -> None:
        """One round: note the deaths, then start whatever is due."""
        now = self.clock()
        for child in list(self.group.children):
            if self.policy.phase(child.name) is Phase.RUNNING and not child.alive():
                self._died(child, now)
        for name in self.policy.due(self.clock()):
            self._restart(name)

    def run(self, stop: threading.Event) -> None:
        """Supervise until ``stop`` is set; from then on nothing is restarted."""
        while not stop.is_set():
            self.poll()
            next_due = self.policy.next_due()
            stop.wait(POLL_S if next_due is None else max(0.0, min(POLL_S, next_due - self.clock())))
        self.policy.stop()

    def _died(self, child: Child, now: float) -> None:
        restart = self.policy.exited(child.name, child.popen.returncode, now)
        if restart is None:
            return
        self.say(exit_message(restart))
        backoff = self.policy.backoff
        newly_looping = restart.crash_looping and (restart.streak == 1
                                                   or backoff.delay_s(restart.streak - 1) < backoff.max_s)
        if restart.streak == 1 or newly_looping:  # not every 30 s of a crash loop
            self.say(f"  last lines of {child.log_path}:\n{child.tail()}")

    def _restart(self, name: str) -> None:
        self._mark_log(name)
        try:
            child = self.group.respawn(name)
        except OSError as exc:  # the binary went away, out of processes, ...: an exit like any other, retried
            now = self.clock()
            self.policy.started(name, now)
            restart = self.policy.exited(name, 127, now)
            self.say(f"{name} could not be started again ({exc})" + (f"; {exit_message(restart)}" if restart else ""))
            return
        self.policy.started(name, self.clock())
        self.say(f"{name} restarted (pid {child.popen.pid})")

    def _mark_log(self, name: str) -> None:
        path = self.group.log_dir / f"{name}.log"
        try:
            with open(path, "a") as log:
                log.write(f"\n--- infermesh up: restarting {name} ---\n")
        except OSError:
            pass
