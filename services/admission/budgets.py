"""Team budgets at admission: a request is admitted only while its team's month is not spent.

Pure. What a team has committed this month is

    spent in the ledger (TeamSpend from metering)
  + what finished requests cost that the ledger has not counted yet (released, usage seq > through_seq)
  + the worst case of every request still running (prompt x input price + max_tokens x output price)

A request is admitted while that is below the budget, and then reserves its own worst case, so
requests running at once can never take a team past its budget by more than one request.
When a lease ends, its reservation becomes the request's actual cost, held until metering's
``through_seq`` passes the usage message's sequence (then the ledger has it). A lease that ends
without a usage message (failed before any token) just gives its reservation back.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

from shared.schema import PriceSheet, TeamSpend

UNPOSTED_TTL_S = 300.0  # drop an unposted cost after this long anyway (its usage message was lost)


def month_of(now: float) -> str:
    return dt.datetime.fromtimestamp(now, dt.timezone.utc).strftime("%Y-%m")


@dataclass(slots=True)
class _Team:
    spend: TeamSpend | None = None
    reserved: dict[str, int] = field(default_factory=dict)  # lease id -> worst-case nano-USD
    unposted: list[tuple[int, int, float]] = field(default_factory=list)  # (usage seq, nano-USD, released at)


@dataclass(frozen=True, slots=True)
class OverBudget:
    message: str


class Budgets:
    def __init__(self) -> None:
        self.prices = PriceSheet({})
        self._teams: dict[str, _Team] = {}
        self._lease_team: dict[str, str] = {}

    # ------------------------------------------------------------ what metering says
    def on_prices(self, sheet: PriceSheet) -> None:
        self.prices = sheet

    def on_spend(self, spend: TeamSpend) -> None:
        team = self._team(spend.team)
        team.spend = spend
        team.unposted = [item for item in team.unposted if item[0] > spend.through_seq]

    # ------------------------------------------------------------ requests
    def worst_case_nano(self, model: str, prompt_tokens: int, max_tokens: int) -> int:
        return self.prices.cost_nano(model, prompt_tokens, 0, max_tokens)

    def committed_nano(self, team_name: str, now: float) -> int:
        team = self._teams.get(team_name)
        if team is None:
            return 0
        spent = team.spend.spent_nano if team.spend and team.spend.month == month_of(now) else 0
        return spent + sum(cost for _, cost, _ in team.unposted) + sum(team.reserved.values())

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
        self.hold(lease_id, team_name, worst)
        return worst

    def hold(self, lease_id: str, team_name: str, nano: int) -> None:
        """Reserve ``nano`` for a lease (also how a new leader restores the leases it inherits)."""
        self._team(team_name).reserved[lease_id] = nano
        self._lease_team[lease_id] = team_name

    def release(self, lease_id: str, model: str, usage_seq: int, prompt: int, cached: int, completion: int,
                now: float) -> None:
        team_name = self._lease_team.pop(lease_id, None)
        if team_name is None:
            return
        team = self._teams[team_name]
        team.reserved.pop(lease_id, None)
        through = team.spend.through_seq if team.spend else 0
        if usage_seq > through:
            team.unposted.append((usage_seq, self.prices.cost_nano(model, prompt, cached, completion), now))

    def drop(self, lease_id: str) -> None:
        """The lease lapsed or was never granted: its reservation goes (its usage, if any, comes from metering)."""
        team_name = self._lease_team.pop(lease_id, None)
        if team_name is not None:
            self._teams[team_name].reserved.pop(lease_id, None)

    def reserved_nano(self, lease_id: str) -> int:
        team_name = self._lease_team.get(lease_id)
        return self._teams[team_name].reserved.get(lease_id, 0) if team_name else 0

    def clear_leases(self) -> None:
        """No longer the leader: the next one restores the reservations from the leases bucket."""
        for team in self._teams.values():
            team.reserved.clear()
        self._lease_team.clear()

    def expire(self, now: float) -> None:
        for team in self._teams.values():
            if team.unposted and team.unposted[0][2] < now - UNPOSTED_TTL_S:
                team.unposted = [item for item in team.unposted if item[2] >= now - UNPOSTED_TTL_S]

    def _team(self, name: str) -> _Team:
        team = self._teams.get(name)
        if team is None:
            team = self._teams[name] = _Team()
        return team
