"""Batch jobs over the bus with ``infermesh.batch_client`` on a sim mesh (issue 17): a submission published twice
is one job, followed to ``completed`` without polling, its results one per line; a refused submission is a failed
job saying why; on a locked bus a team's own user submits and follows its jobs, cannot forge results or events, and
reaches no other team's jobs; a team given a user while the bus runs submits at once.

The ledger is SQLite only: these tests are about the bus (test_batch_api.py covers both ledgers)."""

from __future__ import annotations

import asyncio

import msgspec
import nats
import pytest

from infermesh.batch_client import BatchClient, content_submit_id, jsonl
from infermesh.bus_roles import Role
from infermesh.local import LocalMesh
from infermesh.team_bus_users import add_team_user, reload_team_users
from shared.batch_schema import BatchLineResult, job_id_for
from shared.bus import BusError
from tests.e2e.test_batch_api import chat_line, client_of
from tests.e2e.test_metering_mesh import KEY
from tests.locked_nats import LockedNats
from tests.utils import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.parametrize("ledger_url", ["sqlite"], indirect=True)]
FOLLOW_S = 60.0
REFUSED_S = 0.3  # a refused JetStream publish gets no ack: it times out


async def followed(client: BatchClient, job_id: str) -> list:
    async with asyncio.timeout(FOLLOW_S):
        return [record async for record in client.follow(job_id)]


async def results_by_custom_id(client: BatchClient, job_id: str) -> dict[str, BatchLineResult]:
    return {r.custom_id: r async for r in client.results(job_id)}


async def test_a_submission_published_twice_is_one_job_followed_to_completed(batch_mesh, nats_url, namespace,
                                                                             ledger_url):
    lines = [chat_line(f"req-{i}", f"question {i}") for i in range(4)]
    client = await BatchClient.connect(nats_url, namespace, "kappa")
    try:
        assert await client.status(job_id_for("kappa", "nightly-1")) is None
        job_id = await client.submit(lines, submit_id="nightly-1", metadata={"run": "nightly"})
        assert await client.submit(lines, submit_id="nightly-1") == job_id == job_id_for("kappa", "nightly-1")

        records = await followed(client, job_id)
        done = records[-1]
        assert done.status == "completed" and done.source == "bus" and done.metadata == {"run": "nightly"}
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (4, 4, 0)
        assert await client.status(job_id) == done
        assert [r.status for r in await followed(client, job_id)] == ["completed"]  # ended: its last record, once

        results = await results_by_custom_id(client, job_id)
        assert sorted(results) == [line["custom_id"] for line in lines]
        for result in results.values():
            body = msgspec.json.decode(result.body)
            assert result.ok and body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 4

        http = await client_of(batch_mesh, ledger_url, "kappa")  # the same job, over /v1/batches
        assert [b.id for b in (await http.batches.list()).data] == [job_id]
        output = (await http.files.content(done.output_file_id)).read()
        assert sorted(msgspec.json.decode(o)["custom_id"] for o in output.splitlines()) == sorted(results)
    finally:
        await client.close()


async def test_the_default_submit_id_makes_the_same_file_the_same_job(batch_mesh, nats_url, namespace):
    lines = [chat_line("only", "hello")]
    async with await BatchClient.connect(nats_url, namespace, "kappa") as client:
        job_id = await client.submit(lines)
        assert await client.submit(jsonl(lines)) == job_id
        assert job_id == job_id_for("kappa", content_submit_id("/v1/chat/completions", "24h", jsonl(lines)))
        assert await client.submit(lines, endpoint="/v1/completions") != job_id  # another endpoint: another job
        assert (await followed(client, job_id))[-1].status == "completed"


async def test_a_submission_that_is_not_json_is_a_failed_job_saying_why(batch_mesh, nats_url, namespace):
    async with await BatchClient.connect(nats_url, namespace, "kappa") as client:
        s = client.bus.subjects
        await client.bus.js.publish(s.batch_submit("kappa"), b"{not json", stream=s.batch_submit_stream,
                                    headers={"Nats-Msg-Id": "garbage-1"})
        failed = (await followed(client, job_id_for("kappa", "garbage-1")))[-1]
        assert failed.status == "failed" and failed.failed_at and failed.request_counts.total == 0
        (error,) = failed.errors
        assert error.code == "invalid_submission" and "the submission is not JSON" in error.message

        bad_lines = await client.submit(b'{"custom_id": "a"}\nnot json either\n')  # JSON, but its lines are not
        failed = (await followed(client, bad_lines))[-1]
        assert failed.status == "failed" and 2 in {e.line for e in failed.errors}
        assert "invalid_json_line" in {e.code for e in failed.errors}
        assert [r async for r in client.results(bad_lines)] == []


# ---------------------------------------------------------------- a locked bus


@pytest.fixture
async def locked_mesh(tmp_path, namespace, tiny_model, ledger_url):
    locked = LockedNats(tmp_path / "nats", namespace).start(teams=("kappa", "lambda"))
    mesh = LocalMesh(locked.url, namespace, dev_key=KEY,
                     credentials={role.value: locked.credentials(role) for role in Role})
    try:
        await locked.provision()
        await mesh.start_router()
        await mesh.start_admission()
        await mesh.start_metering(database_url=ledger_url, sync_s=0.2)
        await mesh.start_worker(worker_id="sim-0", engine="sim", model="tiny", model_path=str(tiny_model),
                                max_model_len=2048, block_size=16, num_kv_blocks=4096, sim_ttft_ms=2, sim_itl_ms=2)
        edge = await mesh.start_edge()
        await eventually(edge.mesh.is_ready, 20)
        batch = await mesh.start_batch(database_url=ledger_url, tick_s=0.05, retry_s=0.1)
        await eventually(lambda: batch.leadership.is_leader, 10)
        yield locked
    finally:
        await mesh.stop()
        locked.stop()


async def refused(locked: LockedNats, connection, subject: str, payload: bytes = b"forged") -> None:
    """A publish or request the server refuses: nothing answers, and it logs the violation. ``connection``: a
    team client's ``bus.store`` (STORE: the streams) or ``bus.nc`` (MESH: its reads)."""
    with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
        await connection.request(subject, payload, timeout=REFUSED_S)
    await locked.wait_for_violation(f'Subject "{subject}"')


async def stored(locked: LockedNats, stream: str, subject: str) -> int:
    """How many messages the stream holds on ``subject`` (asked as the batch role, which reads both streams)."""
    batch = await locked.bus(Role.BATCH)
    try:
        info = await batch.js.stream_info(stream, subjects_filter=subject)
        return (info.state.subjects or {}).get(subject, 0)
    finally:
        await batch.close()


async def test_on_a_locked_bus_a_team_user_runs_its_own_jobs_and_reaches_no_other_teams(locked_mesh, namespace):
    locked = locked_mesh
    lines = [chat_line(f"req-{i}", f"question {i}") for i in range(3)]
    kappa = await BatchClient.connect(locked.url, namespace, "kappa", locked.team_credentials("kappa"))
    lam = await BatchClient.connect(locked.url, namespace, "lambda", locked.team_credentials("lambda"))
    try:
        job_id = await kappa.submit(lines, submit_id="locked-1")
        done = (await followed(kappa, job_id))[-1]
        assert done.status == "completed" and done.request_counts.completed == 3 and done.team == "kappa"
        assert await kappa.status(job_id) == done
        assert sorted(await results_by_custom_id(kappa, job_id)) == ["req-0", "req-1", "req-2"]
        theirs = await lam.submit(lines[:1], submit_id="locked-2")
        assert (await followed(lam, theirs))[-1].request_counts.completed == 1
        assert locked.violations() == []

        s, store = kappa.bus.subjects, kappa.bus.store
        for forged in (s.batch_submit("lambda"), s.batch_results("kappa", "batch_forged"),
                       s.batch_events("kappa", "batch_forged")):  # billing another team; writing what only batch may
            await refused(locked, store, forged)
        assert await stored(locked, s.batch_submit_stream, s.batch_submit("lambda")) == 1  # lambda's own only
        assert await stored(locked, s.batch_results_stream, s.batch_results("kappa", "batch_forged")) == 0
        # reading another team's job: asking for it, its status in the stream, a consumer on its results, the
        # stream's subject list; and any consumer at all, even on its own results (it could deliver anywhere)
        await refused(locked, kappa.bus.nc, s.batch_team("lambda", "status"), b"")
        await refused(locked, store, f"$JS.API.DIRECT.GET.{s.batch_events_stream}.{s.batch_events('lambda', theirs)}",
                      b"")
        spy = f"$JS.API.CONSUMER.CREATE.{s.batch_results_stream}.spy.{s.batch_results('lambda', theirs)}"
        await refused(locked, store, spy, b'{"stream_name": "x", "config": {"name": "spy"}}')
        own = f"$JS.API.CONSUMER.CREATE.{s.batch_results_stream}.own.{s.batch_results('kappa', job_id)}"
        await refused(locked, store, own, b'{"stream_name": "x", "config": {"name": "own"}}')
        await refused(locked, store, f"$JS.API.STREAM.INFO.{s.batch_results_stream}", b'{"subjects_filter": ">"}')
        # the mesh ran the jobs as its roles, each team as its own user: those were the only refusals
        assert len(locked.violations()) == 8
    finally:
        await kappa.close()
        await lam.close()


async def test_a_team_given_a_bus_user_while_the_bus_runs_submits_at_once(locked_mesh, namespace):
    """``infermesh teams bus-user`` on a running up: the user is written into the server's config, which reloads
    it on SIGHUP; no restart, no service touched."""
    locked = locked_mesh
    add_team_user(locked.secrets_dir, "mu")
    assert reload_team_users(locked.secrets_dir)

    async def logs_in() -> bool:
        try:
            await (await BatchClient.connect(locked.url, namespace, "mu", locked.team_credentials("mu"))).close()
        except BusError:
            return False
        return True

    await eventually(logs_in, 10, 0.1)
    client = await BatchClient.connect(locked.url, namespace, "mu", locked.team_credentials("mu"))
    try:
        job_id = await client.submit([chat_line("only", "question")], submit_id="reloaded")
        done = (await followed(client, job_id))[-1]
        assert done.status == "completed" and done.team == "mu"
        assert [v for v in locked.violations() if "authentication" not in v] == []
    finally:
        await client.close()


async def test_a_job_is_one_root_span_and_each_line_a_trace_of_its_own_linked_to_it(span_exporter, batch_mesh,
                                                                                    nats_url, namespace):
    lines = [chat_line(f"traced-{i}", f"question {i}") for i in range(3)]
    async with await BatchClient.connect(nats_url, namespace, "kappa") as client:
        job_id = await client.submit(lines, submit_id="traced-1")
        assert (await followed(client, job_id))[-1].status == "completed"

    def of_job(name: str) -> list:
        return [s for s in span_exporter.get_finished_spans()
                if s.name == name and s.attributes.get("infermesh.batch_id") == job_id]

    await eventually(lambda: of_job("batch.job"), 5)
    [job] = of_job("batch.job")
    assert job.parent is None and f"{job.context.trace_id:032x}" == job_id.removeprefix("batch_")
    assert job.attributes["infermesh.batch.status"] == "completed" and job.attributes["infermesh.batch.completed"] == 3
    runs = of_job("batch.line")
    assert sorted(s.attributes["infermesh.batch.custom_id"] for s in runs) == [line["custom_id"] for line in lines]
    spans = span_exporter.get_finished_spans()
    for run in runs:  # a trace of its own, linked to the job's span, above the edge's request span
        assert run.parent is None and run.context.trace_id != job.context.trace_id
        assert [(link.context.trace_id, link.context.span_id) for link in run.links] == [
            (job.context.trace_id, job.context.span_id)]
        [request] = [s for s in spans if s.parent is not None and s.parent.span_id == run.context.span_id]
        assert request.name == "chat tiny" and request.context.trace_id == run.context.trace_id
        assert request.attributes["infermesh.request_id"] == run.attributes["infermesh.request_id"]
        assert run.attributes["http.response.status_code"] == 200
        assert job.start_time <= run.start_time and run.end_time <= job.end_time
