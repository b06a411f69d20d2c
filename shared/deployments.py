"""Deployments an edge may send a request to, local first, and a breaker per deployment and model. Pure: no I/O.

    deployments = Deployments.from_env(os.environ)     # INFERMESH_DEPLOYMENT=east
                                                       # INFERMESH_DEPLOYMENTS="east=nsA,west=nsB,south=nsC"
    deployments.local, deployments.others              # Deployment(east, nsA); (west, nsB), (south, nsC)
    breakers = DeploymentBreakers(deployments)
    for deployment in breakers.order(model, now):      # priority order; a deployment whose breaker is open skipped
        ticket = breakers.admit(deployment.name, model, now)   # None: its one half-open probe is out already
        ... ask deployment.subjects.route / admission; then exactly one of:
        breakers.unavailable(ticket, Unavailable.NO_CAPACITY, now)   # and try the next deployment
        breakers.served(ticket, now)

A deployment is a mesh in one place (workers, routers, admission) with its own namespace on one NATS
supercluster (``docs/deployments.md``): reaching it is using ``Subjects(namespace)``, nothing else.

One breaker per (deployment, model), on any monotonic clock:

    | from      | event                                                   | to        | reason             |
    |-----------|---------------------------------------------------------|-----------|--------------------|
    | CLOSED    | unavailable(no_capacity | no_live_worker |              | OPEN      | the Unavailable    |
    |           |             all_breakers_open | unreachable)            |           |                    |
    | OPEN      | tick, cooldown_s after it opened                        | HALF_OPEN | cooldown           |
    | HALF_OPEN | admit: the first request takes the period's one probe   | HALF_OPEN | (no transition)    |
    | HALF_OPEN | the probe is served                                     | CLOSED    | probe_succeeded    |
    | HALF_OPEN | the probe finds it unavailable                          | OPEN      | probe_failed       |
    | HALF_OPEN | the probe's outcome is not in probe_timeout_s later     | OPEN      | probe_timeout      |

One report opens it: a deployment that says it has no capacity or no live worker of the model has judged
its own state (from its leases, registry and worker breakers), it is not one noisy request. Outcomes of
tickets admitted under an earlier state (a request sent before the breaker opened, a probe of an earlier
half-open period) change nothing. An open breaker is never asked, so when every deployment's is open
``order`` is empty and the edge answers no capacity itself.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Mapping

from shared.schema import MAX_DEPLOYMENT
from shared.subjects import DEFAULT_NAMESPACE, Subjects

DEPLOYMENT_ENV = "INFERMESH_DEPLOYMENT"
DEPLOYMENTS_ENV = "INFERMESH_DEPLOYMENTS"
NAMESPACE_ENV = "INFERMESH_NAMESPACE"
SINGLE = "local"  # the deployment's name when none is configured (one mesh, no others)


class DeploymentsError(ValueError):
    """The deployment list in the configuration cannot be used."""


@dataclass(frozen=True, slots=True)
class Deployment:
    """One mesh in one place, reached through its namespace's subjects and buckets."""

    name: str
    namespace: str

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.namespace)


@dataclass(frozen=True, slots=True)
class Deployments:
    """The local deployment, then the others in priority order (the order they were listed in)."""

    local: Deployment
    others: tuple[Deployment, ...] = ()

    def __post_init__(self) -> None:
        names = [d.name for d in self.in_order()]
        namespaces = [d.namespace for d in self.in_order()]
        assert len(set(names)) == len(names) and len(set(namespaces)) == len(namespaces), self

    def in_order(self) -> tuple[Deployment, ...]:
        return (self.local, *self.others)

    def get(self, name: str) -> Deployment:
        for deployment in self.in_order():
            if deployment.name == name:
                return deployment
        raise KeyError(f"no deployment {name!r}; known: {[d.name for d in self.in_order()]}")

    @classmethod
    def parse(cls, spec: str, local: str) -> "Deployments":
        """``spec`` is ``name=namespace`` entries, comma-separated, in priority order; ``local`` names one."""
        entries = [entry.strip() for entry in spec.split(",")]
        deployments: list[Deployment] = []
        for number, entry in enumerate(entries, 1):
            name, sep, namespace = (part.strip() for part in entry.partition("="))
            if not sep or not name or not namespace:
                raise DeploymentsError(f"{DEPLOYMENTS_ENV}: entry {number} {entry!r} is not name=namespace "
                                       f"(in {spec!r})")
            _check_name(name)
            try:
                Subjects(namespace)
            except ValueError as exc:
                raise DeploymentsError(f"{DEPLOYMENTS_ENV}: deployment {name!r}: {exc}") from exc
            for seen in deployments:
                if seen.name == name:
                    raise DeploymentsError(f"{DEPLOYMENTS_ENV}: deployment {name!r} is listed twice")
                if seen.namespace == namespace:
                    raise DeploymentsError(f"{DEPLOYMENTS_ENV}: {seen.name!r} and {name!r} share namespace "
                                           f"{namespace!r}: each deployment needs its own")
            deployments.append(Deployment(name, namespace))
        if not local:
            raise DeploymentsError(f"{DEPLOYMENTS_ENV} is set, so {DEPLOYMENT_ENV} must name the local deployment")
        mine = [d for d in deployments if d.name == local]
        if not mine:
            raise DeploymentsError(f"{DEPLOYMENT_ENV}={local!r} is not in {DEPLOYMENTS_ENV}={spec!r}")
        return cls(mine[0], tuple(d for d in deployments if d.name != local))

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "Deployments":
        """From ``INFERMESH_DEPLOYMENTS`` and ``INFERMESH_DEPLOYMENT``; without a list, one deployment (named
        ``INFERMESH_DEPLOYMENT``, default ``local``) on ``INFERMESH_NAMESPACE``. A list whose local namespace
        is not ``INFERMESH_NAMESPACE`` (when that is set) is an error: the services would be elsewhere."""
        spec, local = env.get(DEPLOYMENTS_ENV, "").strip(), env.get(DEPLOYMENT_ENV, "").strip()
        namespace = env.get(NAMESPACE_ENV, "").strip()
        if not spec:
            name = local or SINGLE
            _check_name(name)
            return cls(Deployment(name, namespace or DEFAULT_NAMESPACE))
        deployments = cls.parse(spec, local)
        if namespace and namespace != deployments.local.namespace:
            raise DeploymentsError(f"{DEPLOYMENTS_ENV} gives {local!r} namespace {deployments.local.namespace!r}, "
                                   f"but {NAMESPACE_ENV}={namespace!r}")
        return deployments


def _check_name(name: str) -> None:
    if not all(c.isalnum() or c in "-_" for c in name):
        raise DeploymentsError(f"deployment name {name!r}: letters, digits, '-' and '_' only")
    if len(name) > MAX_DEPLOYMENT:
        raise DeploymentsError(f"deployment name {name[:16]!r}...: at most {MAX_DEPLOYMENT} characters (the ledger's "
                               "column)")


# ---------------------------------------------------------------- the breaker
class Unavailable(str, Enum):
    """Why a deployment could not take a request."""

    NO_CAPACITY = "no_capacity"  # admission had no lease for the model's pool
    NO_LIVE_WORKER = "no_live_worker"  # no worker of the model in its registry
    ALL_BREAKERS_OPEN = "all_breakers_open"  # workers of the model, each one's breaker open
    UNREACHABLE = "unreachable"  # no responders or a timeout on its subjects (gone, hung or cut off)


class BreakerState(str, Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class DeploymentBreakerPolicy:
    cooldown_s: float = 2.0  # open this long before one probe may go
    probe_timeout_s: float = 10.0  # a probe unanswered this long failed (it was lost with its edge, say)

    def __post_init__(self) -> None:
        assert self.cooldown_s >= 0 and self.probe_timeout_s > 0, self


@dataclass(frozen=True, slots=True)
class Ticket:
    """Leave to send one request to a deployment; its outcome goes back with it."""

    deployment: str
    model: str
    period: int  # the breaker's period when admitted: a later period ignores the outcome
    probe: bool = False


@dataclass(frozen=True, slots=True)
class DeploymentTransition:
    deployment: str
    model: str
    old: BreakerState
    new: BreakerState
    reason: str  # an Unavailable value | cooldown | probe_succeeded | probe_failed | probe_timeout
    at: float


@dataclass(slots=True)
class DeploymentBreaker:
    """One deployment's breaker for one model."""

    deployment: str
    model: str
    policy: DeploymentBreakerPolicy = field(default_factory=DeploymentBreakerPolicy)
    state: BreakerState = BreakerState.CLOSED
    since: float = 0.0  # when the current state began
    period: int = 0  # bumped on every transition: tickets of an earlier period are stale
    probe_out_since: float | None = None  # when this half-open period's probe was admitted

    def admit(self, now: float) -> Ticket | None:
        """Leave for one request now; None while open, or half-open with the probe out."""
        self.tick(now)
        if self.state is BreakerState.CLOSED:
            return Ticket(self.deployment, self.model, self.period)
        if self.state is BreakerState.HALF_OPEN and self.probe_out_since is None:
            self.probe_out_since = now
            return Ticket(self.deployment, self.model, self.period, probe=True)
        return None

    def unavailable(self, ticket: Ticket, reason: Unavailable, now: float) -> DeploymentTransition | None:
        if ticket.period != self.period or self.state is BreakerState.OPEN:
            return None
        if self.state is BreakerState.HALF_OPEN:
            return self._move(now, BreakerState.OPEN, "probe_failed") if ticket.probe else None
        return self._move(now, BreakerState.OPEN, reason.value)

    def served(self, ticket: Ticket, now: float) -> DeploymentTransition | None:
        if ticket.period != self.period or self.state is not BreakerState.HALF_OPEN or not ticket.probe:
            return None
        return self._move(now, BreakerState.CLOSED, "probe_succeeded")

    def tick(self, now: float) -> DeploymentTransition | None:
        """Time passing: the cool-down ends, or the probe is overdue."""
        if self.state is BreakerState.OPEN and now - self.since >= self.policy.cooldown_s:
            return self._move(now, BreakerState.HALF_OPEN, "cooldown")
        if (self.state is BreakerState.HALF_OPEN and self.probe_out_since is not None
                and now - self.probe_out_since >= self.policy.probe_timeout_s):
            return self._move(now, BreakerState.OPEN, "probe_timeout")
        return None

    def _move(self, now: float, new: BreakerState, reason: str) -> DeploymentTransition:
        old, self.state, self.since = self.state, new, now
        self.period += 1
        self.probe_out_since = None
        return DeploymentTransition(self.deployment, self.model, old, new, reason, now)


class DeploymentBreakers:
    """Every deployment's breaker per model, made on first use; the order an edge tries deployments in."""

    def __init__(self, deployments: Deployments, policy: DeploymentBreakerPolicy | None = None) -> None:
        self.deployments = deployments
        self._policy = policy or DeploymentBreakerPolicy()
        self._breakers: dict[tuple[str, str], DeploymentBreaker] = {}
        self._transitions: deque[DeploymentTransition] = deque()

    def breaker(self, deployment: str, model: str) -> DeploymentBreaker:
        key = (self.deployments.get(deployment).name, model)
        if key not in self._breakers:
            self._breakers[key] = DeploymentBreaker(deployment, model, self._policy)
        return self._breakers[key]

    def state(self, deployment: str, model: str, now: float) -> BreakerState:
        self._note(self.breaker(deployment, model).tick(now))
        return self.breaker(deployment, model).state

    def order(self, model: str, now: float) -> list[Deployment]:
        """The deployments to try for ``model``, local first, then by priority; those whose breaker is open
        (or half-open with its probe out) left out."""
        return [d for d in self.deployments.in_order() if self._may_admit(self.breaker(d.name, model), now)]

    def admit(self, deployment: str, model: str, now: float) -> Ticket | None:
        """Leave for one request to ``deployment`` (the half-open probe, if it is the first since cool-down)."""
        breaker = self.breaker(deployment, model)
        self._note(breaker.tick(now))
        return breaker.admit(now)

    def unavailable(self, ticket: Ticket, reason: Unavailable, now: float) -> None:
        self._note(self.breaker(ticket.deployment, ticket.model).unavailable(ticket, reason, now))

    def served(self, ticket: Ticket, now: float) -> None:
        self._note(self.breaker(ticket.deployment, ticket.model).served(ticket, now))

    def drain_transitions(self) -> list[DeploymentTransition]:
        """Transitions since the last call, oldest first (to log, count and publish)."""
        drained = list(self._transitions)
        self._transitions.clear()
        return drained

    def _may_admit(self, breaker: DeploymentBreaker, now: float) -> bool:
        self._note(breaker.tick(now))
        return breaker.state is BreakerState.CLOSED or (
            breaker.state is BreakerState.HALF_OPEN and breaker.probe_out_since is None)

    def _note(self, transition: DeploymentTransition | None) -> None:
        if transition is not None:
            self._transitions.append(transition)
