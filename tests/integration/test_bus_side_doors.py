"""The locked bus has no side door: a JetStream push consumer cannot deliver where its maker may not publish.

nats-server does not check a consumer's ``deliver_subject`` against its maker's publish permissions, so on one
account a worker delivered bytes it wrote into its own KV bucket onto ``<ns>.worker.<id>.generate`` (review
finding 5, reproduced on nats-server 2.15.1). Now core traffic is in the MESH account, which has no JetStream,
and JetStream in STORE, where nothing but private inboxes and the streams themselves listen
(``infermesh/bus_roles.py``). Each probe below makes the consumer as the attacker would and checks it delivers
to no one a service reads: nobody listens in its account (``push_bound`` false), and the service's own
subscription then hears the real sender's message first. On one account (the code before) the work, batch line
and keys_changed probes failed: the service's subscription was interest for the consumer, which delivered the
forged bytes to it; the two marked guard held there too. The usage streams are alone in a third account, LEDGER,
where none of these roles makes a consumer: on two accounts a delivery onto ``<ns>.usage`` or ``<ns>.usage_dlq``
was stored there, taking the room of usage metering had not read yet.
"""

from __future__ import annotations

import uuid

import nats
import pytest
import pytest_asyncio
from nats.js.api import ConsumerConfig, DeliverPolicy

from infermesh.bus_roles import Role
from services.edge.batch_lines import QUEUE
from shared import schema
from shared.bus import Bus
from shared.schema import UsageEvent
from shared.subjects import Subjects
from shared.usage import ensure_usage_stream
from tests.locked_nats import LEDGER_OBSERVER, OBSERVER, LockedNats

pytestmark = [pytest.mark.integration]
REFUSED_S = 2.0  # a consumer create the server refuses gets no answer
FORGED = b"forged by a consumer's deliver_subject"


@pytest_asyncio.fixture
async def locked(tmp_path, namespace):
    server = LockedNats(tmp_path / "nats", namespace).start(teams=("research", "victim"), observer=True)
    opened: list = []
    server.opened = opened  # type: ignore[attr-defined]
    try:
        await server.provision()
        yield server
    finally:
        for client in opened:
            await client.close()
        server.stop()


async def bus(locked: LockedNats, role: Role) -> Bus:
    connected = await locked.bus(role)
    locked.opened.append(connected)  # type: ignore[attr-defined]
    return connected


async def team_bus(locked: LockedNats, team: str) -> Bus:
    connected = await Bus.connect(locked.url, locked.namespace, f"team-{team}", locked.team_credentials(team))
    locked.opened.append(connected)  # type: ignore[attr-defined]
    return connected


async def observer(locked: LockedNats, ledger: bool = False):
    """The test's observer in STORE (or in LEDGER, the usage streams'): reads stream and consumer info."""
    who = LEDGER_OBSERVER if ledger else OBSERVER
    nc = await nats.connect(locked.url, **who.connect_options(locked.url))
    locked.opened.append(nc)  # type: ignore[attr-defined]
    return nc.jetstream()


async def side_door(attacker: Bus, stream: str, target: str, filter_subject: str | None = None,
                    deliver_group: str | None = None) -> str:
    """The probe: a push consumer on ``stream`` delivering to ``target`` (to one of ``deliver_group``, a queue
    group's name). Its name, or "" if it was refused."""
    config = ConsumerConfig(name=f"side-door-{uuid.uuid4().hex[:8]}", deliver_subject=target,
                            deliver_policy=DeliverPolicy.ALL, filter_subject=filter_subject,
                            deliver_group=deliver_group)
    try:
        return (await attacker.js.add_consumer(stream, config, timeout=REFUSED_S)).name
    except (nats.errors.TimeoutError, nats.js.errors.APIError):
        return ""


async def assert_lands_nowhere(locked: LockedNats, stream: str, consumer: str, listener, sender: Bus,
                               target: str) -> None:
    """The consumer (if made) has no one to deliver to, and the service listening on ``target`` hears the real
    sender's message, not the forged one."""
    if consumer:
        info = await (await observer(locked)).consumer_info(stream, consumer)
        assert not info.push_bound, f"someone where {consumer} delivers listens on {target}"
    await sender.nc.publish(target, b"real")
    assert (await listener.next_msg(timeout=5)).data == b"real"


async def forged_worker_record(worker: Bus) -> str:
    """A worker writes bytes of its choosing into its own bucket (it may): the stream the probes consume."""
    s = worker.subjects
    await worker.js.publish(f"$KV.{s.workers_bucket}.w-forger", FORGED)
    return f"KV_{s.workers_bucket}"


async def test_a_worker_cannot_deliver_work_to_another_worker(locked):
    worker, victim, edge = await bus(locked, Role.WORKER), await bus(locked, Role.WORKER), await bus(locked, Role.EDGE)
    target = worker.subjects.worker_generate("w-victim")
    listener = await victim.nc.subscribe(target)
    await victim.nc.flush()
    stream = await forged_worker_record(worker)
    consumer = await side_door(worker, stream, target)
    await assert_lands_nowhere(locked, stream, consumer, listener, edge, target)


async def test_a_worker_cannot_inject_into_an_edges_token_stream(locked):
    """Guard (on one account too the probe found no way in: a push consumer counts no wildcard subscription such
    as the edge's ``stream.<edge>.*`` as interest; here nobody in STORE listens there at all)."""
    worker, edge, honest = await bus(locked, Role.WORKER), await bus(locked, Role.EDGE), await bus(locked, Role.WORKER)
    target = edge.subjects.stream("e1", "r-of-another-tenant")
    listener = await edge.nc.subscribe(edge.subjects.stream_prefix("e1") + ".*")
    await edge.nc.flush()
    stream = await forged_worker_record(worker)
    consumer = await side_door(worker, stream, target)
    await assert_lands_nowhere(locked, stream, consumer, listener, honest, target)


@pytest.mark.parametrize("role", [Role.ROUTER, Role.BREAKER, Role.ADMISSION])
async def test_router_breaker_and_admission_cannot_inject_batch_lines(locked, role):
    worker, attacker = await bus(locked, Role.WORKER), await bus(locked, role)
    edge, batch = await bus(locked, Role.EDGE), await bus(locked, Role.BATCH)
    target = edge.subjects.batch_line
    listener = await edge.nc.subscribe(target, queue=QUEUE)  # as the edges serve batch lines
    await edge.nc.flush()
    stream = await forged_worker_record(worker)  # every one of them reads the workers bucket
    consumer = await side_door(attacker, stream, target, deliver_group=QUEUE)
    await assert_lands_nowhere(locked, stream, consumer, listener, batch, target)


async def test_a_team_user_cannot_tell_metering_keys_changed_nor_submit_as_another_team(locked):
    team, batch, metering, admin = (await team_bus(locked, "research"), await bus(locked, Role.BATCH),
                                    await bus(locked, Role.METERING), await bus(locked, Role.ADMIN))
    s = team.subjects
    await batch.js.publish(s.batch_events("research", "job-1"), b'{"status": "completed"}')
    listener = await metering.nc.subscribe(s.keys_changed)
    await metering.nc.flush()
    own = s.batch_events("research", "job-1")  # the only filter a team user may consume
    consumer = await side_door(team, s.batch_events_stream, s.keys_changed, own)
    await assert_lands_nowhere(locked, s.batch_events_stream, consumer, listener, admin, s.keys_changed)
    # onto another team's submissions: the submit stream (a wildcard) never stores a delivery under a subject
    # it does not capture, so the batch service's consumer has nothing to read
    await side_door(team, s.batch_events_stream, s.batch_submit("victim"), own)
    await batch.nc.flush()
    info = await (await observer(locked)).stream_info(s.batch_submit_stream)
    assert info.state.messages == 0


async def usage_counts(locked: LockedNats) -> tuple[int, int]:
    """How many messages the usage stream and its dead-letter stream hold (as the test's observer sees them)."""
    js, s = await observer(locked, ledger=True), Subjects(locked.namespace)
    return tuple([(await js.stream_info(name)).state.messages  # type: ignore[return-value]
                  for name in (s.usage_stream, s.usage_dead_letter_stream)])


@pytest.mark.parametrize("attacker", [Role.WORKER, Role.ROUTER, Role.BREAKER, Role.ADMISSION, "team"])
async def test_no_role_nor_team_can_deliver_into_the_usage_streams(locked, attacker):
    """On two accounts (the code before) the usage streams were in STORE beside every stream a role may read:
    a consumer delivering onto ``<ns>.usage`` or ``<ns>.usage_dlq`` had each delivery stored there, taking the
    room of unread usage (a flood evicted it). Now they are in LEDGER, where these roles make no consumer, and
    nothing in STORE captures those subjects: the consumer has no one to deliver to, and nothing is stored."""
    worker, batch = await bus(locked, Role.WORKER), await bus(locked, Role.BATCH)
    s = worker.subjects
    if attacker == "team":
        prober, own = await team_bus(locked, "research"), s.batch_events("research", "job-1")
        await batch.js.publish(own, b'{"status": "completed"}')
        stream = s.batch_events_stream
    else:
        prober, own = (worker if attacker is Role.WORKER else await bus(locked, attacker)), None
        stream = await forged_worker_record(worker)  # every one of them reads the workers bucket
    before = await usage_counts(locked)
    for target in (s.usage, s.usage_dead_letters):
        consumer = await side_door(prober, stream, target, own)
        if consumer:
            info = await (await observer(locked)).consumer_info(stream, consumer)
            assert not info.push_bound, f"{consumer} delivers into a usage stream ({target})"
    assert await usage_counts(locked) == before


async def test_metering_reads_only_the_real_usage_after_deliveries_onto_usage_and_the_jetstream_api(locked):
    """Guard: a delivery onto the JetStream API is no call (held on one account too); a delivery onto
    ``<ns>.usage`` is not stored (on two accounts it was, under its original subject, which metering's consumer,
    filtered on ``<ns>.usage``, never read)."""
    worker, edge = await bus(locked, Role.WORKER), await bus(locked, Role.EDGE)
    metering = await bus(locked, Role.METERING)
    s = edge.subjects
    await ensure_usage_stream(edge)
    stream = await forged_worker_record(worker)
    for target in (s.usage, f"$JS.API.STREAM.PURGE.{s.usage_stream}"):
        await side_door(worker, stream, target)
    real = UsageEvent("r-real", 0, "research", "", "tiny", "finished", "length", 5, 0, 3, 1.0, 2.0, "sim-0")
    await edge.ledger_js.publish(s.usage, schema.encode(real))
    sub = await metering.ledger_js.pull_subscribe(s.usage, durable="metering", stream=s.usage_stream)
    (msg,) = await sub.fetch(1, timeout=5)
    assert schema.decode(msg.data, UsageEvent).request_id == "r-real"
    assert msg.metadata.num_pending == 0 and msg.metadata.sequence.stream == 1  # nothing stored before it
    assert await usage_counts(locked) == (1, 0)
