"""A team user on the locked bus makes no JetStream consumer (issue 38, point 5): nats-server does not check a push
consumer's ``deliver_subject``, so a consumer a team made on its own results could deliver them onto any STORE
stream subject, again and again, filling the shared batch streams up to their caps. Now a team publishes its
submission (with its ack) and nothing else in STORE; it reads its jobs by asking the batch service over MESH,
``<ns>.batch.team.<team>.<read>``, its own team's subjects only (infermesh/bus_roles.py ``team_permissions``).

On the code before, a team user made consumers filtered on its own jobs: the consumer probes below were granted
(one delivering its results back into the results stream, one onto another team's submissions), and the
``batch.team`` subjects did not exist.
"""

from __future__ import annotations

import uuid

import nats
import pytest
import pytest_asyncio
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from infermesh.bus_roles import Role
from shared import schema
from shared.batch_schema import BatchTeamReply, BatchTeamRequest
from shared.bus import Bus
from tests.locked_nats import OBSERVER, LockedNats
from tests.utils import eventually

pytestmark = [pytest.mark.integration]
REFUSED_S = 1.0  # a request the server refuses gets no answer


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


async def connect(locked: LockedNats, who: Role | str) -> Bus:
    credentials = locked.credentials(who) if isinstance(who, Role) else locked.team_credentials(who)
    bus = await Bus.connect(locked.url, locked.namespace, f"{who}-test", credentials)
    locked.opened.append(bus)  # type: ignore[attr-defined]
    return bus


async def stream_messages(locked: LockedNats, stream: str) -> int:
    nc = await nats.connect(locked.url, **OBSERVER.connect_options(locked.url))
    try:
        return (await nc.jetstream().stream_info(stream)).state.messages
    finally:
        await nc.close()


async def made(team: Bus, stream: str, config: ConsumerConfig) -> bool:
    """Whether the server made the consumer (a refused create gets no answer)."""
    try:
        await team.js.add_consumer(stream, config, timeout=REFUSED_S)
    except (nats.errors.TimeoutError, nats.js.errors.APIError):
        return False
    return True


def consumers(s, stream: str, own: str, target: str) -> list[ConsumerConfig]:
    """Every shape of consumer a team might ask for on its own jobs: pull, push delivering anywhere, durable."""
    name = f"c-{uuid.uuid4().hex[:8]}"
    return [ConsumerConfig(name=name, filter_subject=own, ack_policy=AckPolicy.EXPLICIT),
            ConsumerConfig(name=name, durable_name=name, filter_subject=own, ack_policy=AckPolicy.EXPLICIT),
            ConsumerConfig(name=name, filter_subject=own, deliver_subject=target, deliver_policy=DeliverPolicy.ALL),
            ConsumerConfig(filter_subject=own, deliver_subject=target)]  # unnamed: the legacy create


async def test_a_team_user_makes_no_consumer_on_any_stream(locked):
    team, batch = await connect(locked, "research"), await connect(locked, Role.BATCH)
    s = team.subjects
    results, events = s.batch_results("research", "batch_1"), s.batch_events("research", "batch_1")
    await batch.js.publish(results, b'{"job_id": "batch_1", "line_index": 0, "custom_id": "a"}')
    await batch.js.publish(events, b'{"status": "completed"}')
    before = await stream_messages(locked, s.batch_results_stream)
    replay = s.batch_results("research", "replayed")  # its results delivered back into the results stream
    for stream, own, target in ((s.batch_results_stream, results, replay),
                                (s.batch_events_stream, events, s.batch_submit("victim")),
                                (s.batch_submit_stream, s.batch_submit("research"), replay)):
        for config in consumers(s, stream, own, target):
            assert not await made(team, stream, config), f"{config} on {stream}"
    assert await stream_messages(locked, s.batch_results_stream) == before
    assert await stream_messages(locked, s.batch_submit_stream) == 0
    await locked.wait_for_violation("$JS.API.CONSUMER.CREATE")


async def test_a_team_user_submits_its_own_jobs_and_asks_only_its_own_teams_reads(locked):
    team, batch = await connect(locked, "research"), await connect(locked, Role.BATCH)
    s = team.subjects
    ack = await team.js.publish(s.batch_submit("research"), b"{}", stream=s.batch_submit_stream)
    assert ack.seq == 1  # its submission, acknowledged

    async def answer(request: BatchTeamRequest, raw) -> None:  # the batch service's part (team_reads.py)
        await batch.respond(raw, BatchTeamReply(revision=f"{raw.subject.split('.')[-2]}:{request.job_id}"))

    await batch.subscribe(s.batch_team_all, BatchTeamRequest, answer)
    await batch.nc.flush()
    reply = await team.request(s.batch_team("research", "status"), BatchTeamRequest(job_id="batch_1"), BatchTeamReply)
    assert reply.revision == "research:batch_1"

    theirs = s.batch_team("victim", "status")  # another team's job: the server refuses the request
    with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
        await team.nc.request(theirs, schema.encode(BatchTeamRequest(job_id="batch_1")), timeout=REFUSED_S)
    await locked.wait_for_violation(f'Subject "{theirs}"')
    for forged in (s.batch_submit("victim"), f"$JS.API.STREAM.INFO.{s.batch_results_stream}",
                   f"$JS.API.DIRECT.GET.{s.batch_events_stream}.{s.batch_events('research', 'batch_1')}"):
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await team.store.request(forged, b"", timeout=REFUSED_S)
        await locked.wait_for_violation(f'Subject "{forged}"')


async def test_results_come_a_capped_page_at_a_time_each_line_once(nats_url, namespace):
    """A team's results read (services/batch/team_reads.py, on an open server): pages of at most
    ``results_page_max``, after the last one's sequence, until one is not full; a line that ended twice, once."""
    from infermesh.batch_client import BatchClient
    from services.batch.config import BatchConfig
    from services.batch.streams import ensure_batch_streams, publish_result
    from services.batch.team_reads import TeamReads
    from shared.batch_schema import BatchLineResult

    service = await Bus.connect(nats_url, namespace, "batch-test")
    reads = TeamReads(service, None, BatchConfig(results_page_max=2))  # type: ignore[arg-type]
    client = BatchClient(await Bus.connect(nats_url, namespace, "team-test"), "kappa")
    try:
        await ensure_batch_streams(service)
        for line in (0, 1, 2, 3, 4):
            result = BatchLineResult(job_id="batch_1", line_index=line, custom_id=f"c{line}")
            await publish_result(service, "kappa", result)
        await service.js.publish(service.subjects.batch_results("kappa", "batch_1"),  # line 1 again (a rerun)
                                 b'{"job_id": "batch_1", "line_index": 1, "custom_id": "again"}')
        await publish_result(service, "lambda", BatchLineResult(job_id="batch_1", line_index=9, custom_id="theirs"))
        await reads.start()
        pages: list[int] = []
        asked = client.bus.request

        async def counted(subject, request, reply_type, timeout):  # noqa: ANN001
            reply = await asked(subject, request, reply_type, timeout=timeout)
            pages.append(len(reply.results))
            return reply

        client.bus.request = counted  # type: ignore[method-assign]
        assert [r.custom_id async for r in client.results("batch_1")] == ["c0", "c1", "c2", "c3", "c4"]
        assert pages == [2, 2, 2, 0]  # the third page holds line 4 and the rerun of line 1; then none
        assert [r async for r in client.results("batch_2")] == []
    finally:
        await reads.stop()
        await client.close()
        await service.close()


async def test_a_team_flooding_its_reads_waits_on_its_own_share_and_never_delays_another_teams(
        nats_url, namespace, monkeypatch):
    """Status reads are answered each in its own task, at most ``max_reads_per_team`` of a team's at once: a team
    whose reads are slow (here: held) gets 429 past its share, and another team's read is answered meanwhile.
    Before, the one subscription answered reads in turn: the other team's waited behind the held ones."""
    import asyncio

    from services.batch import team_reads
    from services.batch.config import BatchConfig
    from services.batch.team_reads import TeamReads

    held = asyncio.Event()

    async def get_job(_engine, team, _job_id):  # noqa: ANN001 (the ledger read: held for the flooding team)
        if team == "flood":
            await held.wait()
        return None

    monkeypatch.setattr(team_reads.store, "get_job", get_job)
    service = await Bus.connect(nats_url, namespace, "batch-test")
    reads = TeamReads(service, None, BatchConfig(max_reads_per_team=2))  # type: ignore[arg-type]
    asker = await Bus.connect(nats_url, namespace, "teams-test")
    s = service.subjects
    try:
        await reads.start()
        async def answered() -> bool:  # its subscription is on the server before the flood asks
            try:
                await asker.request(s.batch_team("warm", "status"), BatchTeamRequest(job_id="b1"), BatchTeamReply,
                                    timeout=1)
            except Exception:
                return False
            return True

        await eventually(answered, 10)
        flood = [asyncio.ensure_future(asker.request(s.batch_team("flood", "status"), BatchTeamRequest(job_id="b1"),
                                                     BatchTeamReply, timeout=10)) for _ in range(2)]
        await asyncio.sleep(0)
        over = await asker.request(s.batch_team("flood", "status"), BatchTeamRequest(job_id="b1"), BatchTeamReply,
                                   timeout=5)
        assert over.error_status == 429 and over.retry_after_s > 0
        quiet = await asker.request(s.batch_team("quiet", "status"), BatchTeamRequest(job_id="b1"), BatchTeamReply,
                                    timeout=2)
        assert quiet.error_status == 0 and quiet.job is None
        held.set()
        assert [reply.error_status for reply in await asyncio.gather(*flood)] == [0, 0]
    finally:
        held.set()
        await reads.stop()
        await asker.close()
        await service.close()
