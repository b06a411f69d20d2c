"""A locked bus: each service role does its own work and nothing else; forgeries are refused.

Each test starts nats-server with ``infermesh up``'s generated config (one user per role, provisioned by admin)
for a namespace of its own. A legitimate flow runs the services' own bus code (registry, KV watches, CAS puts,
the usage stream); a forgery is refused: the server logs the violation and the message never lands.
"""

from __future__ import annotations

import asyncio
import ssl
import time

import nats
import pytest
import pytest_asyncio
from nats.errors import NoRespondersError
from nats.js.api import StreamConfig

from infermesh.bus_roles import Role
from services.admission.store import LeaseStore
from services.edge.keys import KeyDirectory, hash_key
from services.metering.db import create_engine, migrate
from services.metering.responses import ResponsesServer
from services.metering.sync import BusViews
from services.router.session_store import SessionStore
from shared import schema
from shared.breakers import BreakerView
from shared.bus import Bus, BusError
from shared.bus_limits import MAX_PAYLOAD_BYTES
from shared.kv_cas import ensure_bucket, get_last
from shared.kv_keys import live_keys
from shared.nats_auth import NatsCredentials
from shared.registry import WorkerDirectory, WorkerRegistration
from shared.responses_schema import ResponsesApiReply, ResponsesApiRequest
from shared.schema import ApiKeyRecord, BreakerRecord, SessionBinding, TeamSpend, UsageEvent, WorkerInfo
from shared.usage import UsagePublisher, ensure_usage_stream
from tests.locked_nats import LockedNats, make_tls
from tests.utils import eventually

pytestmark = [pytest.mark.integration]
REFUSED_S = 0.3  # a refused JetStream publish gets no ack: it times out


@pytest_asyncio.fixture
async def locked(tmp_path, namespace):
    server = LockedNats(tmp_path / "nats", namespace).start()
    buses: list[Bus] = []
    server.opened = buses  # type: ignore[attr-defined]
    try:
        await server.provision()
        yield server
    finally:
        for bus in buses:
            await bus.close()
        server.stop()


async def connect(locked: LockedNats, role: Role) -> Bus:
    bus = await locked.bus(role)
    locked.opened.append(bus)  # type: ignore[attr-defined]
    return bus


async def connect_all(locked: LockedNats, *roles: Role) -> list[Bus]:
    return [await connect(locked, role) for role in roles]


def worker_info(worker_id: str) -> WorkerInfo:
    return WorkerInfo(worker_id, "both", "tiny", "sim", 16, 1024, 2048, "tiny", heartbeat_ttl_s=5.0,
                      started_at=time.time(), ts=time.time())


def usage(request_id: str) -> UsageEvent:
    return UsageEvent(request_id, 0, "research", "", "tiny", "finished", "length", 5, 0, 3, 1.0, 2.0, "sim-0")


async def refused_put(locked: LockedNats, bus: Bus, subject: str, data: bytes = b"forged",
                      ledger: bool = False) -> None:
    """A JetStream publish (on the bus's ledger connection if ``ledger``) that must be refused: no ack comes, and
    the server logs the violation."""
    with pytest.raises(nats.errors.TimeoutError):
        await (bus.ledger_js if ledger else bus.js).publish(subject, data, timeout=REFUSED_S)
    await locked.wait_for_violation(f'Subject "{subject}"')


async def refused_subscription(locked: LockedNats, bus: Bus, subject: str) -> None:
    await bus.nc.subscribe(subject)
    await locked.wait_for_violation(f'Subscription Violation - Subject "{subject}"')


# ---------------------------------------------------------------- who may connect


async def test_a_connection_without_credentials_or_with_a_wrong_password_is_refused(locked):
    with pytest.raises(BusError, match="refused"):
        await Bus.connect(locked.url, locked.namespace, "anonymous", NatsCredentials())
    with pytest.raises(BusError, match="refused"):
        await Bus.connect(locked.url, locked.namespace, "guesser", NatsCredentials("admin", "not-the-password"))
    with pytest.raises(nats.errors.Error):  # a plain client, no retries: the server closes it
        await nats.connect(locked.url, allow_reconnect=False, max_reconnect_attempts=0)
    await locked.wait_for_violation('authentication error - User "admin"')
    edge = await connect(locked, Role.EDGE)
    assert edge.nc.is_connected  # the right password is let in
    assert edge.nc.max_payload == MAX_PAYLOAD_BYTES  # up's server carries a long prompt (shared/bus_limits.py)


async def test_credentials_come_from_the_environment_when_none_are_given(locked, monkeypatch):
    for var, value in locked.credentials(Role.WORKER).env().items():
        monkeypatch.setenv(var, value)
    bus = await Bus.connect(locked.url, locked.namespace, "from-env")
    try:
        assert bus.nc.is_connected
        await bus.nc.subscribe(bus.subjects.worker_generate("w-1"))  # a worker's subscription: allowed
        await bus.nc.flush()
        assert locked.violations() == []
    finally:
        await bus.close()


# ---------------------------------------------------------------- usage, keys, budgets


async def test_edges_publish_usage_and_metering_consumes_it_but_no_other_role_can_publish_usage(locked):
    edge, metering = await connect_all(locked, Role.EDGE, Role.METERING)
    await ensure_usage_stream(edge)  # as every edge does on start (a no-op: provisioned)
    await ensure_usage_stream(metering)
    assert await UsagePublisher(edge).publish(usage("r-1")) == 1
    s = metering.subjects
    sub = await metering.ledger_js.pull_subscribe(s.usage, durable="metering", stream=s.usage_stream)
    (msg,) = await sub.fetch(1, timeout=2)
    assert schema.decode(msg.data, UsageEvent).request_id == "r-1"
    await msg.ack()
    assert locked.violations() == []
    for role in (Role.WORKER, Role.ROUTER, Role.ADMISSION, Role.METERING, Role.ADMIN):
        forger = metering if role is Role.METERING else await connect(locked, role)
        await refused_put(locked, forger, s.usage, schema.encode(usage(f"forged-by-{role}")), ledger=True)
    assert (await metering.ledger_js.stream_info(s.usage_stream)).state.messages == 1


async def test_only_metering_writes_api_keys_and_budgets_and_edges_and_admission_follow_them(locked):
    metering = await connect(locked, Role.METERING)
    s = metering.subjects
    views = BusViews(await ensure_bucket(metering, s.api_keys_bucket), await ensure_bucket(metering, s.billing_bucket))
    await views.load_published()
    edge = await connect(locked, Role.EDGE)
    keys = KeyDirectory(edge, {})
    await keys.start()
    try:
        await views.sync_keys({hash_key("im-research-key"): ApiKeyRecord("im-resea", "research")})
        await eventually(lambda: keys.caller("im-research-key") is not None, 5)
        admission = await connect(locked, Role.ADMISSION)
        billing = await (await ensure_bucket(admission, s.billing_bucket)).watchall()
        await views.billing_kv.put("spend.research", schema.encode(TeamSpend("research", "2026-12", 10, 0, 0)))
        entry = await billing.updates(timeout=2)
        while entry is None:  # the watcher's "history read" marker
            entry = await billing.updates(timeout=2)
        assert entry.key == "spend.research"
        await billing.stop()
        assert locked.violations() == []
        for role in (Role.EDGE, Role.ADMISSION, Role.WORKER, Role.ROUTER, Role.ADMIN):
            forger = edge if role is Role.EDGE else await connect(locked, role)
            await refused_put(locked, forger, f"$KV.{s.api_keys_bucket}.{hash_key(f'minted-by-{role}')}",
                              schema.encode(ApiKeyRecord("im-mint", "research", True)))
            await refused_put(locked, forger, f"$KV.{s.billing_bucket}.spend.research",
                              schema.encode(TeamSpend("research", "2026-12", -1, 0, 0)))  # budgets off
        assert await live_keys(views.keys_kv) == [hash_key("im-research-key")]  # (nats-py's keys() can list none)
        assert schema.decode((await views.billing_kv.get("spend.research")).value, TeamSpend).budget_nano == 10
    finally:
        await keys.stop()


async def test_the_admin_tells_metering_keys_changed_and_only_the_admin_may(locked):
    metering, admin = await connect_all(locked, Role.METERING, Role.ADMIN)
    heard: list[str] = []

    async def on_changed(msg) -> None:
        heard.append(msg.data.decode())

    await metering.nc.subscribe(metering.subjects.keys_changed, cb=on_changed)
    await metering.nc.flush()

    async def admin_tells(word: str) -> None:  # core NATS is at most once (metering's periodic sync covers a lost
        async def told() -> bool:  # one): the admin may, shown by one that arrives (a CI run once heard none in 2 s)
            if word not in heard:
                await admin.nc.publish(admin.subjects.keys_changed, word.encode())
                await admin.nc.flush()
            return word in heard
        await eventually(told, 10, interval_s=0.2)

    await admin_tells("admin")
    edge = await connect(locked, Role.EDGE)
    await edge.nc.publish(edge.subjects.keys_changed, b"edge")
    await locked.wait_for_violation(f'Publish Violation - Subject "{edge.subjects.keys_changed}"')
    await admin_tells("after")  # metering still hears the admin
    assert set(heard) == {"admin", "after"}  # the server refused the edge's: it never reached metering


# ---------------------------------------------------------------- the registry, leases, breakers, sessions


async def test_only_workers_write_the_registry_that_edges_routers_admission_and_breakers_follow(locked):
    worker = await connect(locked, Role.WORKER)
    registration = WorkerRegistration(worker, lambda: worker_info("sim-0"), heartbeat_s=0.2, ttl_s=2)
    directories = [WorkerDirectory(await connect(locked, role))
                   for role in (Role.EDGE, Role.ROUTER, Role.ADMISSION, Role.BREAKER)]
    try:
        for directory in directories:
            await directory.start()
        await registration.start()
        await eventually(lambda: all("sim-0" in d.workers for d in directories), 5)
        await asyncio.sleep(0.5)  # a few heartbeats, from the liveness thread's own connection
        assert locked.violations() == []
        s = worker.subjects
        for role in (Role.EDGE, Role.ROUTER, Role.ADMISSION, Role.BREAKER, Role.METERING, Role.ADMIN):
            await refused_put(locked, await connect(locked, role), f"$KV.{s.workers_bucket}.fake-{role}",
                              schema.encode(worker_info(f"fake-{role}")))
        assert set(directories[0].workers) == {"sim-0"}
    finally:
        await registration.stop()
        for directory in directories:
            await directory.stop()


async def request_answered(bus, subject: str, payload: bytes):
    """The reply, asking again on "no responders" for up to 5 s (a fresh-clone run once got it right after the
    responder's subscribe and flush, on a loaded machine); a refused request still fails at once."""
    deadline = time.monotonic() + 5
    while True:
        try:
            return await bus.nc.request(subject, payload, timeout=2)
        except NoRespondersError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def test_leases_and_lease_replies_are_admissions_alone(locked):
    admission, edge, worker = await connect_all(locked, Role.ADMISSION, Role.EDGE, Role.WORKER)
    s = admission.subjects

    async def grant(msg) -> None:
        await msg.respond(b"granted")

    await admission.nc.subscribe(s.admission_acquire, cb=grant)
    await admission.nc.flush()
    assert (await request_answered(edge, s.admission_acquire, b"lease?")).data == b"granted"
    leases = await ensure_bucket(admission, s.leases_bucket)
    await admission.js.publish(f"$KV.{s.leases_bucket}.l-1", b"lease", timeout=2)
    # how far the ledger must get before a lapsed lease's budget hold clears (services/admission/store.py)
    assert await LeaseStore(admission, leases).usage_last_seq() is not None
    assert locked.violations() == []
    await refused_put(locked, worker, f"$KV.{s.leases_bucket}.l-forged")
    await refused_put(locked, edge, f"$KV.{s.leases_bucket}.leader")
    await refused_subscription(locked, worker, s.admission_acquire)  # cannot answer as admission
    await worker.nc.publish("_INBOX.edge.guessed", b"granted")  # nor into an edge's inbox
    await locked.wait_for_violation('Publish Violation - Subject "_INBOX.edge.guessed"')
    await worker.nc.publish(s.admission_release, b"release someone's lease")
    await locked.wait_for_violation(f'Publish Violation - Subject "{s.admission_release}"')


async def test_breakers_and_routers_write_breaker_records_that_edges_only_read(locked):
    breaker, router, edge = await connect_all(locked, Role.BREAKER, Role.ROUTER, Role.EDGE)
    views = [BreakerView(bus) for bus in (breaker, router, edge)]
    try:
        for view in views:
            await view.start()
        revision = await views[0].put(BreakerRecord("sim-0", "half_open", time.time(), "errors", 1), 0)
        await eventually(lambda: "sim-0" in views[1].records and "sim-0" in views[2].records, 5)
        assert await views[1].take_probe("sim-0", "req-1")  # a router takes the probe permit by CAS
        assert (await views[0].read("sim-0"))[1] > revision
        assert locked.violations() == []
        await refused_put(locked, edge, f"$KV.{edge.subjects.breakers_bucket}.sim-0",
                          schema.encode(BreakerRecord("sim-0", "closed", time.time())))
    finally:
        for view in views:
            await view.stop()


async def test_routers_bind_sessions_and_no_other_role_can(locked):
    router, edge = await connect_all(locked, Role.ROUTER, Role.EDGE)
    store = SessionStore(router, idle_ttl_s=60)
    await store.start()
    await store.put(SessionBinding("agent-1", "sim-0", time.time()), 0)
    assert (await store.get("agent-1"))[0].worker_id == "sim-0"
    assert locked.violations() == []
    from services.router.session_store import session_key

    await refused_put(locked, edge, f"$KV.{edge.subjects.sessions_bucket}.{session_key('agent-1')}")
    data, _ = await get_last(router, router.subjects.sessions_bucket, session_key("agent-1"))
    assert schema.decode(data, SessionBinding).worker_id == "sim-0"


# ---------------------------------------------------------------- workers and token streams


async def test_only_edges_send_work_to_workers_and_only_edges_read_token_streams(locked):
    edge, worker = await connect_all(locked, Role.EDGE, Role.WORKER)
    s = edge.subjects
    got: list[bytes] = []

    async def on_generate(msg) -> None:
        got.append(msg.data)
        await worker.nc.publish(msg.reply, b"token")

    await worker.nc.subscribe(s.worker_generate("sim-0"), cb=on_generate)
    tokens = await edge.nc.subscribe(s.stream_prefix("e1") + ".*")
    await edge.nc.flush()
    await worker.nc.flush()
    await edge.nc.publish(s.worker_generate("sim-0"), b"prompt", reply=s.stream("e1", "r1"))
    assert (await tokens.next_msg(timeout=2)).data == b"token"
    assert locked.violations() == []
    for role in (Role.ROUTER, Role.ADMISSION, Role.BREAKER, Role.METERING, Role.WORKER, Role.ADMIN):
        caller = worker if role is Role.WORKER else await connect(locked, role)
        await caller.nc.publish(s.worker_generate("sim-0"), b"free prompt", reply=s.stream("e1", "r2"))
        await caller.nc.publish(s.worker_abort("sim-0"), b"abort")
        await locked.wait_for_violation(f'"MESH/user:{role}" - Publish Violation - '
                                        f'Subject "{s.worker_generate("sim-0")}"')
        await refused_subscription(locked, caller, s.stream_prefix("e1") + ".*")
        await refused_subscription(locked, caller, "_INBOX.>")
    await edge.nc.flush()
    assert got == [b"prompt"]


async def test_no_role_can_delete_purge_or_redefine_a_stream(locked):
    worker, edge, admin = await connect_all(locked, Role.WORKER, Role.EDGE, Role.ADMIN)
    s = worker.subjects
    for bus in (worker, edge, admin):
        for verb in ("DELETE", "PURGE", "UPDATE"):
            subject = f"$JS.API.STREAM.{verb}.KV_{s.workers_bucket}"
            with pytest.raises(nats.errors.TimeoutError):
                await bus.store.request(subject, b"{}", timeout=REFUSED_S)  # JetStream: the STORE account
            await locked.wait_for_violation(f'Subject "{subject}"')
    # the edge may re-create the usage stream (a no-op), never redefine it to capture token streams
    with pytest.raises(nats.js.errors.BadRequestError):
        await edge.ledger_js.add_stream(StreamConfig(name=s.usage_stream,
                                                     subjects=[s.usage, f"{s.namespace}.stream.>"]))
    assert (await edge.ledger_js.stream_info(s.usage_stream)).config.subjects == [s.usage]


# ---------------------------------------------------------------- TLS


async def test_tls_clients_that_trust_the_ca_connect_and_others_are_refused(tmp_path, namespace):
    tls = make_tls(tmp_path / "tls")
    server = LockedNats(tmp_path / "nats", namespace, tls=tls).start()
    try:
        assert server.url.startswith("tls://")
        await server.provision()  # admin over TLS
        worker = await server.bus(Role.WORKER)
        registration = WorkerRegistration(worker, lambda: worker_info("sim-tls"), heartbeat_s=0.2, ttl_s=2)
        await registration.start()
        edge = await server.bus(Role.EDGE)
        directory = WorkerDirectory(edge)
        await directory.start()
        await eventually(lambda: "sim-tls" in directory.workers, 5)
        await directory.stop()
        await registration.stop()
        for bus in (worker, edge):
            await bus.close()
        untrusting = NatsCredentials("edge", server.secrets[Role.EDGE])  # the system's CAs only
        with pytest.raises(BusError, match="(?i)certificate"):
            await Bus.connect(server.url, namespace, "untrusting", untrusting)
        plain = server.url.replace("tls://", "nats://")
        with pytest.raises(ssl.SSLError):  # nats-py upgrades to TLS with the system's CAs: the handshake fails
            await nats.connect(plain, user="edge", password=server.secrets[Role.EDGE], allow_reconnect=False,
                               max_reconnect_attempts=0, connect_timeout=2)
    finally:
        server.stop()


async def test_up_starts_nats_locked_over_tls_and_reuses_the_secrets_next_time(tmp_path, namespace):
    from infermesh.bus_auth import start_locked_nats
    from infermesh.processes import ProcessGroup

    tls = make_tls(tmp_path / "tls")
    seen: list[dict] = []
    for start in range(2):
        group = ProcessGroup(tmp_path / f"logs-{start}")
        try:
            url = await asyncio.to_thread(start_locked_nats, group, tmp_path / f"state-{start}", namespace, tls,
                                          tmp_path / "data")
            assert url.startswith("tls://")
            seen.append({role: c.password for role, c in group.bus_credentials.items()})
            bus = await Bus.connect(url, namespace, "edge-probe", group.bus_credentials["edge"])
            try:  # provisioned before any service: the edge finds the bucket it only reads
                await (await bus.js.key_value(bus.subjects.api_keys_bucket)).watchall()
            finally:
                await bus.close()
            assert "Violation" not in (group.log_dir / "nats.log").read_text()
        finally:
            await asyncio.to_thread(group.stop)
    assert seen[0] == seen[1] and set(seen[0]) == {role.value for role in Role}


async def test_a_reply_subject_cannot_borrow_a_responders_rights(locked):
    """NATS lets a responder publish to the reply subject of a message it received whatever its permissions
    say. A worker that pinged an edge with ``reply=$KV.<ns>_api_keys.<key>`` had the edge's liveness thread
    overwrite that record with its pong (and a load request could aim a worker's answer at the leader key):
    responders answer inboxes only, and a worker streams only to a stream subject or an inbox."""
    from shared.edges import edge_registration

    edge, worker, metering = await connect_all(locked, Role.EDGE, Role.WORKER, Role.METERING)
    s = edge.subjects
    registration = await edge_registration(edge, "e-pong", heartbeat_s=0.2, ttl_s=2)
    await ensure_bucket(metering, s.api_keys_bucket)
    try:
        await worker.nc.publish(s.edge_ping("e-pong"), b"", reply=f"$KV.{s.api_keys_bucket}.forged")
        assert (await worker.nc.request(s.edge_ping("e-pong"), b"", timeout=2)).data  # an inbox is answered
        data, _ = await get_last(metering, s.api_keys_bucket, "forged")
        assert data is None
    finally:
        await registration.stop()


async def test_edges_ask_metering_for_stored_responses_and_no_other_role_can(locked, tmp_path):
    metering, edge, worker = await connect_all(locked, Role.METERING, Role.EDGE, Role.WORKER)
    url = f"sqlite:///{tmp_path}/ledger.db"
    await migrate(url)
    engine = create_engine(url)
    server = ResponsesServer(metering, engine, 86_400, 3_600)
    await server.start()
    try:
        raw = await request_answered(edge, edge.subjects.responses_api("get"), schema.encode(ResponsesApiRequest(
            team="research", response_id="resp_x")))
        assert schema.decode(raw.data, ResponsesApiReply).error_status == 404  # answered through the locked bus
        subject = worker.subjects.responses_api("get")
        await worker.nc.publish(subject, b"forged")
        await locked.wait_for_violation(f'Publish Violation - Subject "{subject}"')
    finally:
        await server.stop()
        await engine.dispose()
