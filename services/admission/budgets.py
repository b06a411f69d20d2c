"""Team budgets at admission (pure): a request is admitted only while its team's month is not spent,
and no cost stops counting before the ledger has it.

What a team has committed this month is

    spent in the ledger (TeamSpend.spent_nano from metering; complete through TeamSpend.through_seq)
  + holds: costs the ledger may not have yet, each counted until the ledger is complete through its sequence
  + reservations: the worst case of every request still running (prompt x input + max_tokens x output)

A request is admitted while that is below the budget, and then reserves its own worst case, so
requests running at once can never take a team past its budget by more than one request.

    how a lease ends               what it leaves                   cleared when
    -----------------------------  -------------------------------  ---------------------------------------
    release with usage seq u       a hold of the actual cost        the ledger is complete through u
    release without usage          nothing (it failed before any    -
                                   token: nothing is billed)
    lapse (its edge stopped        a hold of the worst case, bound  the ledger is complete through b: the
    renewing)                      b = the usage stream's last      dead edge's usage, if it sent any, is
                                   sequence at the lapse            in the spend, or none came
    a late release after a lapse   the hold, until max(b, u)        the ledger is complete through that

Invariants:
  * A hold is never dropped by age: only the ledger's progress clears it. Nothing bounds the holds but
    the ledger; they grow no faster than the usage stream's backlog (one per unledgered billed request,
    which the stream already keeps), and a budgeted team stops adding to them once they reach its budget.
  * "The ledger is complete through s" is the team's own ``through_seq >= s``, or the ledger floor
    ``>= s``: the highest ``through_seq`` any team's record carries, once seen for ``FLOOR_SETTLE_S``.
    Metering sums every team at one floor per sync and rewrites only the records that changed, so a
    record it did not rewrite still holds at that floor; the settle time covers the rest of that
    sync's writes. Without the floor, a hold of a team with no further usage (a lapse that billed
    nothing) would wait for the team's next record, which, at its budget, never comes.
  * Holds outlive the leader: every hold this core creates or clears is returned (``HoldChanges``), and
    the service writes it to the leases bucket before the lease record goes; a new leader loads them
    with ``restore_hold`` before it admits anyone.
  * A team without a budget keeps no holds (nor does a zero cost): it is never refused, so they would
    protect nothing, and when it gets a budget the ledger's spend is where that budget starts.
  * Known gap: a holder cut off from NATS (alive, not dead) whose lease lapsed and that publishes its usage
    only later, past b, is counted once the ledger has it, not before.
"""

from __future__ import annotations

import datetime as dt
import heapq
from collections import deque
from dataclasses import dataclass, field

from shared.schema import BudgetHold, PriceSheet, TeamSpend

FLOOR_SETTLE_S = 5.0  # a through_seq seen this long ago vouches for every team (a metering sync is shorter)


def month_of(now: float) -> str:
    return dt.datetime.fromtimestamp(now, dt.timezone.utc).strftime("%Y-%m")


@dataclass(slots=True)
class _Team:
    spend: TeamSpend | None = None
    reserved: dict[str, int] = field(default_factory=dict)  # lease id -> worst-case nano-USD
    holds: dict[str, BudgetHold] = field(default_factory=dict)  # hold id (its lease) -> the unledgered cost
    by_seq: list[tuple[int, str]] = field(default_factory=list)  # heap of (until_seq, hold id); stale entries skipped

    def has_budget(self) -> bool:
        return self.spend is not None and self.spend.budget_nano >= 0

    def add(self, hold: BudgetHold) -> None:
        self.holds[hold.hold_id] = hold
        heapq.heappush(self.by_seq, (hold.until_seq, hold.hold_id))

    def clear(self, through: int) -> list[str]:
        """Remove the holds the ledger is complete through: O(log n) per hold, whatever the team holds."""
        gone = []
        while self.by_seq and self.by_seq[0][0] <= through:
            seq, hold_id = heapq.heappop(self.by_seq)
            hold = self.holds.get(hold_id)
            if hold is not None and hold.until_seq == seq:  # else cleared already or moved to a later seq
                del self.holds[hold_id]
                gone.append(hold_id)
        return gone


@dataclass(frozen=True, slots=True)
class HoldChanges:
    """What the service must write to the leases bucket: holds to put, ids of holds to delete."""

    put: tuple[BudgetHold, ...] = ()
    gone: tuple[str, ...] = ()


NO_CHANGE = HoldChanges()


@dataclass(frozen=True, slots=True)
class OverBudget:
    message: str


class Budgets:
    def __init__(self) -> None:
        self.prices = PriceSheet({})
        self._teams: dict[str, _Team] = {}
        self._lease_team: dict[str, str] = {}  # lease id -> team, while it reserves
        self._hold_team: dict[str, str] = {}  # hold id -> team
        self._floor = 0  # the settled ledger floor
        self._floor_seen: deque[tuple[int, float]] = deque()  # (through_seq, seen at), rising, not yet settled

    # ------------------------------------------------------------ what metering says
    def on_prices(self, sheet: PriceSheet) -> None:
        self.prices = sheet

    def on_spend(self, spend: TeamSpend, now: float) -> HoldChanges:
        """A team's record: the holds it passes are cleared (and any the settled floor now passes)."""
        team = self._team(spend.team)
        team.spend = spend
        if spend.through_seq > (self._floor_seen[-1][0] if self._floor_seen else self._floor):
            self._floor_seen.append((spend.through_seq, now))
        own, floor = self._clear(team, self._ledgered_through(team)), self.settle(now)
        return HoldChanges(gone=own.gone + floor.gone) if own.gone or floor.gone else NO_CHANGE

    def settle(self, now: float) -> HoldChanges:
        """Advance the ledger floor to what has been seen for FLOOR_SETTLE_S; clear the holds it passes."""
        floor = self._floor
        while self._floor_seen and self._floor_seen[0][1] <= now - FLOOR_SETTLE_S:
            floor = max(floor, self._floor_seen.popleft()[0])
        if floor == self._floor:
            return NO_CHANGE
        self._floor = floor
        gone = [hold_id for team in self._teams.values() for hold_id in self._clear(team, floor).gone]
        return HoldChanges(gone=tuple(gone))

    # ------------------------------------------------------------ requests
    def worst_case_nano(self, model: str, prompt_tokens: int, max_tokens: int) -> int:
        return self.prices.cost_nano(model, prompt_tokens, 0, max_tokens)

    def committed_nano(self, team_name: str, now: float) -> int:
        team = self._teams.get(team_name)
        if team is None:
            return 0
        spent = team.spend.spent_nano if team.spend and team.spend.month == month_of(now) else 0
        return spent + sum(hold.nano for hold in team.holds.values()) + sum(team.reserved.values())

    def budget_nano(self, team_name: str) -> int:
        team = self._teams.get(team_name)
        return team.spend.budget_nano if team and team.spend else -1

    def admit(self, lease_id: str, team_name: str, model: str, prompt_tokens: int, max_tokens: int,
              now: float) -> OverBudget | int:
        """The reservation (nano-USD) taken for this request, or OverBudget."""
        budget = self.budget_nano(team_name)
        worst = self.worst_case_nano(model, prompt_tokens, max_tokens)
        if budget >= 0:
            committed = self.committed_nano(team_name, now)
            if committed >= budget:
                return OverBudget(f"team {team_name!r} has used its budget for {month_of(now)} "
                                  f"(${budget / 1e9:.2f}); ask for a higher budget or wait for next month")
        self.restore_reservation(lease_id, team_name, worst)
        return worst

    def restore_reservation(self, lease_id: str, team_name: str, nano: int) -> None:
        """Reserve ``nano`` for a lease (also how a new leader restores the leases it inherits)."""
        self._team(team_name).reserved[lease_id] = nano
        self._lease_team[lease_id] = team_name

    def restore_hold(self, hold: BudgetHold) -> HoldChanges:
        """A hold read back from the leases bucket by a new leader (gone at once if the ledger passed it)."""
        team = self._team(hold.team)
        if hold.until_seq <= self._ledgered_through(team):
            return HoldChanges(gone=(hold.hold_id,))
        team.add(hold)
        self._hold_team[hold.hold_id] = hold.team
        return NO_CHANGE

    def release(self, lease_id: str, model: str, usage_seq: int, prompt: int, cached: int,
                completion: int) -> HoldChanges:
        """The lease ended: with usage the ledger lacks, its actual cost is held; without usage, nothing is."""
        team_name = self._lease_team.pop(lease_id, None)
        if team_name is None:
            return self._late_release(lease_id, usage_seq)
        self._teams[team_name].reserved.pop(lease_id, None)
        if usage_seq <= 0:
            return NO_CHANGE
        return self._hold(team_name, lease_id, self.prices.cost_nano(model, prompt, cached, completion), usage_seq)

    def lapse(self, lease_id: str, last_usage_seq: int) -> HoldChanges:
        """The lease's holder stopped renewing: its worst case is held until the ledger is complete through
        ``last_usage_seq`` (the usage stream's last sequence now, which any usage the holder sent is under)."""
        team_name = self._lease_team.pop(lease_id, None)
        if team_name is None:
            return NO_CHANGE
        nano = self._teams[team_name].reserved.pop(lease_id, 0)
        return self._hold(team_name, lease_id, nano, last_usage_seq)

    def drop(self, lease_id: str) -> None:
        """The lease was never granted (rejected, timed out or bumped while queued): its reservation goes."""
        team_name = self._lease_team.pop(lease_id, None)
        if team_name is not None:
            self._teams[team_name].reserved.pop(lease_id, None)

    def reserved_nano(self, lease_id: str) -> int:
        team_name = self._lease_team.get(lease_id)
        return self._teams[team_name].reserved.get(lease_id, 0) if team_name else 0

    def held_nano(self, team_name: str) -> int:
        team = self._teams.get(team_name)
        return sum(hold.nano for hold in team.holds.values()) if team else 0

    def forget_leader_state(self) -> None:
        """No longer the leader: the next one restores reservations and holds from the leases bucket."""
        for team in self._teams.values():
            team.reserved.clear()
            team.holds.clear()
            team.by_seq.clear()
        self._lease_team.clear()
        self._hold_team.clear()

    # ------------------------------------------------------------ inside
    def _team(self, name: str) -> _Team:
        team = self._teams.get(name)
        if team is None:
            team = self._teams[name] = _Team()
        return team

    def _ledgered_through(self, team: _Team) -> int:
        return max(team.spend.through_seq if team.spend else 0, self._floor)

    def _hold(self, team_name: str, hold_id: str, nano: int, until_seq: int) -> HoldChanges:
        team = self._teams[team_name]
        if nano <= 0 or not team.has_budget() or until_seq <= self._ledgered_through(team):
            return NO_CHANGE
        hold = BudgetHold(hold_id, team_name, nano, until_seq)
        team.add(hold)
        self._hold_team[hold_id] = team_name
        return HoldChanges(put=(hold,))

    def _late_release(self, lease_id: str, usage_seq: int) -> HoldChanges:
        """A release for a lease that already lapsed: its worst-case hold also waits for this usage."""
        team_name = self._hold_team.get(lease_id)
        if team_name is None:
            return NO_CHANGE
        hold = self._teams[team_name].holds[lease_id]
        if usage_seq <= hold.until_seq:
            return NO_CHANGE
        return self._hold(team_name, lease_id, hold.nano, usage_seq)

    def _clear(self, team: _Team, through: int) -> HoldChanges:
        gone = tuple(team.clear(through))
        for hold_id in gone:
            self._hold_team.pop(hold_id, None)
        return HoldChanges(gone=gone) if gone else NO_CHANGE
