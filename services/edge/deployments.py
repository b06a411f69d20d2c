"""The deployments an edge serves from (shared/deployments.py): one ``Link`` each, the local one first.

A link is one deployment as this edge reaches it, over the edge's one NATS connection (the deployments
share a supercluster, each in its own namespace: docs/deployments.md): its worker registry, a receiver
for its token streams, its admission, the edge's registration in its edges bucket (so its workers know
this edge lives) and a biller of its workers' orphan reports. Usage always goes to the local deployment's
stream: one ledger, whichever deployment served the request.

Which deployment takes a request: the local one, else the others in priority order, each behind a breaker
per (deployment, model) that one "unavailable" answer opens (no live worker of the model in its registry,
no capacity, an unreachable router or admission); a single deployment has no breaker to open. A lease is
asked for in two passes (``EdgeMesh.acquire``): first who has room now, in that order (a full pool spills
the request to the next deployment); when none has, the first again, queueing there up to the wait.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from services.edge.admission import AdmissionClient
from services.edge.config import EdgeConfig
from services.edge.orphans import OrphanBiller
from shared import errors
from shared.bus import Bus, StreamReceiver
from shared.deployments import Deployment, DeploymentBreakers, Deployments, Ticket, Unavailable
from shared.edges import edge_registration
from shared.liveness import Registration
from shared.registry import WorkerDirectory
from shared.schema import SERVING_ROLES, RouteDecision, RouteRequest
from shared.subjects import Subjects
from shared.usage import UsagePublisher

log = logging.getLogger("infermesh.edge")

# how a deployment's "no" reads to its breaker; any other error is the request's own (400, 429, 404 ...)
UNAVAILABLE = {"no_capacity": Unavailable.NO_CAPACITY, "model_not_found": Unavailable.NO_LIVE_WORKER,
               "router_unavailable": Unavailable.UNREACHABLE, "admission_unavailable": Unavailable.UNREACHABLE,
               "all_breakers_open": Unavailable.ALL_BREAKERS_OPEN}


def deployments_of(config: EdgeConfig) -> Deployments:
    """``--deployments name=namespace,...`` (priority order) with ``--deployment`` naming the local one; without
    a list, one deployment on the edge's own namespace."""
    if not config.deployments:
        return Deployments(Deployment(config.deployment or "local", config.namespace))
    deployments = Deployments.parse(config.deployments, config.deployment)
    if deployments.local.namespace != config.namespace:
        raise ValueError(f"--deployments gives {deployments.local.name!r} namespace "
                         f"{deployments.local.namespace!r}, but the edge runs in {config.namespace!r}")
    return deployments


def bus_in(home: Bus, namespace: str) -> Bus:
    """The edge's connection, speaking another deployment's namespace (its reconnect listeners are shared)."""
    bus = Bus(home.nc, Subjects(namespace))
    bus.on_reconnected = home.on_reconnected
    bus.refusals = home.refusals

    async def connect_again(name: str) -> Bus:  # a liveness thread's own connection, in this namespace too
        again = await home.connect_again(name)
        again.subjects = Subjects(namespace)
        return again

    bus._reconnect = connect_again
    return bus


@dataclass(slots=True)
class Link:
    deployment: Deployment
    bus: Bus
    directory: WorkerDirectory
    receiver: StreamReceiver
    admission: AdmissionClient | None
    orphans: OrphanBiller | None
    registration: Registration | None = None

    @property
    def name(self) -> str:
        return self.deployment.name

    @classmethod
    def build(cls, deployment: Deployment, bus: Bus, edge_id: str, config: EdgeConfig, secret: bytes,
              usage: UsagePublisher) -> "Link":
        return cls(deployment, bus, WorkerDirectory(bus), StreamReceiver(bus, edge_id),
                   AdmissionClient(bus, edge_id) if config.admission else None,
                   OrphanBiller(bus, secret, usage, deployment=deployment.name) if secret else None)

    def serves(self, model: str) -> bool:
        return any(w.role in SERVING_ROLES for w in self.directory.live(model))

    async def start_streams(self) -> None:
        await self.receiver.start()
        if self.admission is not None:
            await self.admission.start()
        await self.directory.start()

    async def start_liveness(self, edge_id: str, config: EdgeConfig, usage_pending: Callable[[], int]) -> None:
        """Beat in this deployment's edges bucket, saying how much usage this edge has not yet got into the
        stream (its workers keep reports of its ended requests until that is none)."""
        if self.orphans is not None:
            await self.orphans.start()
        self.registration = await edge_registration(self.bus, edge_id, config.edge_heartbeat_s, config.edge_ttl_s,
                                                    usage_pending=usage_pending)

    async def stop(self) -> None:
        """The edges key goes last: the deployment's workers abort what this edge still ran once it is gone."""
        if self.orphans is not None:
            await self.orphans.stop()
        await self.receiver.stop()
        if self.admission is not None:
            await self.admission.stop()
        await self.directory.stop()
        if self.registration is not None:
            await self.registration.stop()


class Failover:
    """Which deployment takes a request (or its next attempt): tried in order, each behind its breaker."""

    def __init__(self, links: list[Link], breakers: DeploymentBreakers) -> None:
        self.links = links
        self.breakers = breakers
        self.stats = {"failovers": 0}

    def candidates(self, model: str, first: str = "") -> list[Link]:
        """The links to try for ``model``, ``first`` (a lease's deployment) before the rest."""
        if len(self.links) == 1:
            return self.links
        names = [d.name for d in self.breakers.order(model, time.monotonic())]
        links = [link for link in self.links if link.name in names]
        return sorted(links, key=lambda link: link.name != first) if first else links

    async def first_of(self, model: str, ask: Callable[[Link], Awaitable[object]], first: str = "",
                       spill: bool = False) -> tuple[Link, object]:
        """``ask(link)`` of each candidate until one answers: (that link, its answer). An answer that says the
        deployment is unavailable opens its breaker and goes on; with ``spill``, so does a full pool, which
        leaves its breaker be (a deployment that says it is full is up). None left: the first such error."""
        failure: errors.ApiError | None = None
        for link in self.candidates(model, first):
            ticket = self._admit(link, model)
            if ticket is False:
                continue
            try:
                answer = await ask(link)
            except errors.PoolFull as exc:
                if isinstance(ticket, Ticket):
                    self.breakers.served(ticket, time.monotonic())
                if not spill or len(self.links) == 1:
                    raise
                failure = failure or exc
                continue
            except errors.ApiError as exc:
                reason = UNAVAILABLE.get(exc.code or "")
                if reason is None or len(self.links) == 1:
                    raise
                self._unavailable(ticket, reason, link, model, exc)
                failure = failure or exc
                continue
            if ticket is not None:
                self.breakers.served(ticket, time.monotonic())
            if failure is not None:
                self.stats["failovers"] += 1
            return link, answer
        raise failure or errors.service_unavailable(f"No deployment can serve `{model}` right now; retry.",
                                                    "no_capacity", 2)

    async def route(self, request: RouteRequest, route: Callable[[Bus, RouteRequest], Awaitable[RouteDecision]],
                    first: str = "") -> tuple[Link, RouteDecision]:
        async def ask(link: Link) -> RouteDecision:
            if len(self.links) > 1 and not link.serves(request.model):  # its registry says no: no need to ask
                raise errors.service_unavailable(f"no live worker of {request.model!r} in {link.name}", "no_capacity")
            return await route(link.bus, request)

        link, decision = await self.first_of(request.model, ask, first)
        return link, decision  # type: ignore[return-value]

    def _admit(self, link: Link, model: str) -> Ticket | None | bool:
        """The breaker's ticket (None: a single deployment, no breaker); False: its breaker lets none through."""
        if len(self.links) == 1:
            return None
        ticket = self.breakers.admit(link.name, model, time.monotonic())
        return False if ticket is None else ticket

    def _unavailable(self, ticket: Ticket | None | bool, reason: Unavailable, link: Link, model: str,
                     exc: errors.ApiError) -> None:
        if isinstance(ticket, Ticket):
            self.breakers.unavailable(ticket, reason, time.monotonic())
        log.warning("deployment %s cannot take %s (%s: %s): trying the next", link.name, model, reason.value,
                    exc.message)
        for transition in self.breakers.drain_transitions():
            log.warning("deployment breaker %s", transition)
