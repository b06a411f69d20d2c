"""When ``infermesh up`` restarts a process that died, pure: exit events and a clock in, restart times out.

    RUNNING --exited(code, now)--> BACKOFF    restart due at now + delay
    BACKOFF --due(now) lists it, the supervisor starts it, started(now)--> RUNNING
    any     --stop()--> STOPPED               nothing is ever due again; exits are ignored (Ctrl-C, SIGTERM)

    delay      initial_s * factor ** (streak - 1), capped at max_s
    streak     exits in a row of runs shorter than stable_s; a run of at least stable_s resets it to 0
               before its own exit counts, so a crash after a long healthy run waits initial_s again
    crash loop the delay has reached max_s: retried every max_s for as long as it keeps failing, never given up
    restarts   every restart of that process since ``up`` began (never reset)

Processes are independent: one crash-looping never delays or stops another. Times are seconds on any
monotonic clock; the policy never reads one itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Phase(str, Enum):
    RUNNING = "running"
    BACKOFF = "backoff"  # dead, its restart scheduled
    STOPPED = "stopped"  # the mesh is stopping: never restarted


@dataclass(frozen=True, slots=True)
class Backoff:
    initial_s: float = 0.5
    factor: float = 2.0
    max_s: float = 30.0
    stable_s: float = 30.0  # a run this long counts as healthy: the next exit starts the backoff over

    def __post_init__(self) -> None:
        assert 0 < self.initial_s <= self.max_s and self.factor >= 1 and self.stable_s > 0

    def delay_s(self, streak: int) -> float:
        """The wait before the restart that follows the ``streak``-th quick exit in a row (streak >= 1)."""
        return min(self.max_s, self.initial_s * self.factor ** (streak - 1))


@dataclass(frozen=True, slots=True, kw_only=True)
class Restart:
    """The decision on one exit: start ``name`` again at ``at``, ``delay_s`` after it was seen dead."""

    name: str
    exit_code: int  # as subprocess reports it: < 0 is the signal that ended it
    uptime_s: float
    delay_s: float
    at: float
    restarts: int  # of this process, this one included
    streak: int  # quick exits in a row, this one included
    crash_looping: bool  # delay_s is the cap: it will be retried every max_s until a run lasts stable_s


@dataclass(slots=True)
class _Track:
    phase: Phase
    started_at: float
    streak: int = 0
    restarts: int = 0
    restart_at: float = 0.0


class RestartPolicy:
    """Per named process: whether it runs, waits for a restart, or is stopped, and when its restart is due."""

    def __init__(self, backoff: Backoff | None = None) -> None:
        self.backoff = backoff or Backoff()
        self._tracks: dict[str, _Track] = {}
        self._stopped = False

    # ------------------------------------------------------------ inputs
    def started(self, name: str, now: float) -> None:
        """``name`` is running from ``now`` on (its first start, or the restart ``due`` asked for)."""
        track = self._tracks.get(name)
        if track is None:
            self._tracks[name] = _Track(Phase.STOPPED if self._stopped else Phase.RUNNING, now)
            return
        if track.phase is Phase.BACKOFF:
            track.restarts += 1
        if track.phase is not Phase.STOPPED:
            track.phase, track.started_at = Phase.RUNNING, now

    def exited(self, name: str, exit_code: int, now: float) -> Restart | None:
        """``name`` was seen dead at ``now``: when to start it again; None when the mesh is stopping."""
        track = self._tracks[name]
        if track.phase is not Phase.RUNNING:
            return None  # stopping, or already scheduled
        uptime_s = now - track.started_at
        if uptime_s >= self.backoff.stable_s:
            track.streak = 0
        track.streak += 1
        delay_s = self.backoff.delay_s(track.streak)
        track.phase, track.restart_at = Phase.BACKOFF, now + delay_s
        return Restart(name=name, exit_code=exit_code, uptime_s=uptime_s, delay_s=delay_s, at=track.restart_at,
                       restarts=track.restarts + 1, streak=track.streak, crash_looping=delay_s >= self.backoff.max_s)

    def stop(self) -> None:
        """The mesh is stopping: from now on nothing is restarted."""
        self._stopped = True
        for track in self._tracks.values():
            track.phase = Phase.STOPPED

    # ------------------------------------------------------------ outputs
    def phase(self, name: str) -> Phase | None:
        track = self._tracks.get(name)
        return track.phase if track else None

    def due(self, now: float) -> list[str]:
        """The processes whose restart time has come, earliest first; the caller starts each and calls started()."""
        ready = [(t.restart_at, name) for name, t in self._tracks.items()
                 if t.phase is Phase.BACKOFF and t.restart_at <= now]
        return [name for _, name in sorted(ready)]

    def next_due(self) -> float | None:
        """The earliest scheduled restart, or None when nothing waits for one."""
        return min((t.restart_at for t in self._tracks.values() if t.phase is Phase.BACKOFF), default=None)
