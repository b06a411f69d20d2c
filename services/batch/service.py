"""Batch service: jobs from ``/v1/batches`` (through the edges) and from ``<ns>.batch.submit.<team>``, kept in the
ledger database, run line by line on idle capacity (runner.py), billed once per line at the batch price.

    edge --BatchApiRequest--> <ns>.batch.api.{create,retrieve,list,cancel} --> BatchApiReply
    team --BatchSubmit (JSON, Nats-Msg-Id)--> <ns>.batch.submit.<team> (JetStream) --> a job, once
    <ns>.batch.events.<team>.<job>   the job after each change (JSON BatchJobRecord; the stream keeps the last)
    <ns>.batch.results.<team>.<job>  one BatchLineResult (JSON) per line
    team --BatchTeamRequest--> <ns>.batch.team.<team>.{status,follow,results} --> BatchTeamReply (team_reads.py)

One replica at a time runs jobs and answers (leader election on the ``<ns>_batch`` bucket, as admission's);
another takes over within ``leader_ttl_s`` and resumes every unfinished job from the database and the results
stream, one job at a time in the background (each input streamed again, input.py): no line ends twice in the
output, none is billed twice (its request id is its own for good).

A team may have ``max_jobs_per_team`` unfinished jobs, of ``max_input_bytes_per_team`` input bytes in all; a job
past either is refused (429, ``batch_limit_exceeded`` / ``batch_bytes_limit_exceeded``, in the words of OpenAI's
enqueued limits; a bus submission refused so is a failed job saying why).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import msgspec
from nats.aio.msg import Msg

from services.admission.leader import Leadership
from services.batch import store, tracing
from services.batch.config import BatchConfig
from services.batch.input import JobInput, load_input
from services.batch.job import BatchJob
from services.batch.lines import too_large
from services.batch.runner import Runner
from services.batch.streams import ensure_batch_streams
from services.batch.submissions import SubmissionConsumer
from services.batch.team_reads import TeamReads
from services.metering.db import create_engine, database_url, wait_for_schema
from shared.batch_schema import (
    MAX_BATCH_FILE_BYTES,
    TERMINAL_STATUSES,
    BatchApiReply,
    BatchApiRequest,
    BatchJobRecord,
    BatchLineError,
    BatchSubmit,
    job_id_for,
)
from shared.bus import Bus
from shared.file_quota import QuotaExceeded
from shared.files import FileNotFound, FileStore, ensure_files_bucket
from shared.kv_cas import ensure_bucket
from shared.metrics import service_registry
from shared.tasks import cancel_and_wait
from shared.telemetry import traced

log = logging.getLogger("infermesh.batch")
WINDOW_S = {"24h": 24 * 3600}
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")


class ApiRefusal(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.reply = BatchApiReply(error_status=status, error_message=message, error_param=param, error_code=code)


class BatchService:
    def __init__(self, bus: Bus, config: BatchConfig) -> None:
        self.bus, self.config = bus, config
        self.replica_id = config.batch_id or f"b-{uuid.uuid4().hex[:8]}"
        self.engine = create_engine(database_url(config.database_url))
        self.files = FileStore(bus)
        self.runner = self._new_runner()
        self.submissions = SubmissionConsumer(bus, config, self._submitted, self._poisoned)
        self.team_reads = TeamReads(bus, self.engine, config)  # a team's reads of its jobs (team_reads.py)
        self.metrics = service_registry("infermesh_batch", self._stats, lambda: {
            "leader": float(self.leadership.is_leader), "jobs_running": len(self.runner.runs),
            "submissions_consumer_up": float(self.submissions.up),
            "lines_in_flight": sum(len(run.in_flight) for run in self.runner.runs.values())})
        self.leadership = Leadership(bus, bus.subjects.batch_bucket, self.replica_id, config.leader_ttl_s,
                                     self._elected, self._deposed, service="batch")
        self._subs: list = []
        self._resuming: asyncio.Task[None] | None = None
        self._admitting = asyncio.Lock()  # a team's caps are checked and its job created as one step

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        await wait_for_schema(self.config.database_url)  # metering migrates the ledger
        await ensure_batch_streams(self.bus)
        await ensure_bucket(self.bus, self.bus.subjects.batch_bucket)
        await ensure_files_bucket(self.bus)
        await self.leadership.start()

    async def stop(self) -> None:
        await self.leadership.stop()
        await self._deposed()
        await self.engine.dispose()

    async def _elected(self) -> None:
        log.info("batch %s runs the jobs", self.replica_id)
        for operation in ("create", "retrieve", "list", "cancel"):
            self._subs.append(await self.bus.subscribe(self.bus.subjects.batch_api(operation), BatchApiRequest,
                                                       self._api(operation)))
        await self.team_reads.start()
        await self.runner.start()
        unfinished = await store.unfinished_jobs(self.engine)
        self._resuming = asyncio.create_task(self._resume_all(unfinished), name="batch-resume")
        await self.submissions.start()

    async def _deposed(self) -> None:
        for sub in self._subs:
            await sub.unsubscribe()
        self._subs.clear()
        await self.team_reads.stop()
        await self.submissions.stop()
        await cancel_and_wait(self._resuming)
        await self.runner.stop()
        self.runner = self._new_runner()

    def _new_runner(self) -> Runner:
        return Runner(self.bus, self.files, self.config, self._save, lambda: self.leadership.still_leader())

    def _stats(self) -> dict[str, int]:
        return {**self.runner.stats, **self.submissions.stats}

    def healthy(self) -> bool:
        """/health: a leader whose submissions consumer is down (between a death and its restart) is not."""
        return not self.leadership.is_leader or self.submissions.up

    # ------------------------------------------------------------ state out
    async def _save(self, record: BatchJobRecord) -> BatchJobRecord:
        await store.save_job(self.engine, record)
        await self.bus.js.publish(self.bus.subjects.batch_events(record.team, record.id), msgspec.json.encode(record),
                                  stream=self.bus.subjects.batch_events_stream, headers=traced())
        self.team_reads.changed(record)
        return record

    # ------------------------------------------------------------ the API for edges
    def _api(self, operation: str):  # noqa: ANN202
        handler = {"create": self._create, "retrieve": self._retrieve, "list": self._list,
                   "cancel": self._cancel}[operation]

        async def answer(request: BatchApiRequest, raw: Msg) -> None:
            try:
                reply = await handler(request)
            except ApiRefusal as refusal:
                reply = refusal.reply
            except Exception:
                log.exception("batch %s failed", operation)
                reply = BatchApiReply(error_status=500, error_message="The batch service had an error.")
            await self.bus.respond(raw, reply)

        return answer

    async def _create(self, request: BatchApiRequest) -> BatchApiReply:
        record = await self._new_job(request.team, request.endpoint, request.completion_window,
                                     request.input_file_id, request.metadata, "http", None, request.key_prefix)
        return BatchApiReply(job=record)

    async def _retrieve(self, request: BatchApiRequest) -> BatchApiReply:
        return BatchApiReply(job=await self._job_of(request.team, request.job_id))

    async def _list(self, request: BatchApiRequest) -> BatchApiReply:
        jobs, has_more = await store.list_jobs(self.engine, request.team, request.after or None, request.limit)
        return BatchApiReply(jobs=jobs, has_more=has_more)

    async def _cancel(self, request: BatchApiRequest) -> BatchApiReply:
        record = await self._job_of(request.team, request.job_id)
        answer = self.runner.cancel(record.id, time.time()) if record.status not in TERMINAL_STATUSES else None
        if answer is None:  # ended: a cancelled one is answered as it is, any other cannot be cancelled
            if record.status in ("cancelled", "cancelling"):
                return BatchApiReply(job=record)
            raise ApiRefusal(409, f"Cannot cancel a batch with status '{record.status}'.", None,
                             "batch_not_cancellable")
        cancelled, refused = answer
        if refused:
            raise ApiRefusal(409, refused, None, "batch_not_cancellable")
        return BatchApiReply(job=cancelled)

    async def _job_of(self, team: str, job_id: str) -> BatchJobRecord:
        record = await store.get_job(self.engine, team, job_id) if job_id else None
        if record is None:
            raise ApiRefusal(404, f"No batch found with id '{job_id}'.", "batch_id", "not_found")
        return record

    # ------------------------------------------------------------ a new job
    async def _new_job(self, team: str, endpoint: str, window: str, input_file_id: str,
                       metadata: dict[str, str] | None, source: str, submit_id: str | None,
                       key_prefix: str = "") -> BatchJobRecord:
        if endpoint not in ENDPOINTS:
            raise ApiRefusal(400, f"endpoint must be one of {', '.join(ENDPOINTS)}.", "endpoint", "invalid_value")
        if window not in WINDOW_S:
            raise ApiRefusal(400, "completion_window must be '24h'.", "completion_window", "invalid_value")
        try:
            info = await self.files.get(team, input_file_id)
        except FileNotFound:
            raise ApiRefusal(404, f"No file found with id '{input_file_id}'.", "input_file_id", "not_found") from None
        if info.purpose != "batch":
            raise ApiRefusal(400, f"File {input_file_id} has purpose '{info.purpose}', not 'batch'.", "input_file_id",
                             "invalid_value")
        now = int(time.time())
        # over HTTP: time-ordered (jobs of one second list newest first, as OpenAI lists them), then random
        job_id = job_id_for(team, submit_id) if submit_id else f"batch_{time.time_ns():016x}{uuid.uuid4().hex[:16]}"
        record = BatchJobRecord(id=job_id, team=team, key_prefix=key_prefix, endpoint=endpoint,  # type: ignore[arg-type]
                                input_file_id=input_file_id,
                                completion_window=window, source=source, created_at=now,  # type: ignore[arg-type]
                                expires_at=now + (self.config.completion_window_s or WINDOW_S[window]),
                                metadata=metadata)
        async with self._admitting:
            existing = await store.get_job(self.engine, team, job_id) if submit_id else None
            if existing is not None:  # the same submission again: the job it made
                return existing
            await self._within_team_caps(team, info.bytes)
            record, created = await store.create_job(self.engine, record, submit_id)
        if not created:  # the same submission again: the job it made
            return record
        return await self._validate(BatchJob(record), info.bytes)

    async def _within_team_caps(self, team: str, input_bytes: int) -> None:
        """ApiRefusal (429) if one more job of ``input_bytes`` would pass the team's caps."""
        unfinished = await store.unfinished_jobs(self.engine, team)
        limit = self.config.max_jobs_per_team
        if len(unfinished) >= limit:
            raise ApiRefusal(429, f"Enqueued batch limit reached for team {team}. Limit: {limit:,} unfinished "
                             "batches. Please try again once some in_progress batches have been completed.", None,
                             "batch_limit_exceeded")
        used, limit = 0, self.config.max_input_bytes_per_team
        for record in unfinished:
            try:
                used += (await self.files.get(team, record.input_file_id)).bytes
            except FileNotFound:  # deleted: the job fails when it is read again; it holds no bytes
                continue
        if used + input_bytes > limit:
            raise ApiRefusal(429, f"Enqueued input limit reached for team {team}. Limit: {limit:,} bytes of input "
                             f"in unfinished batches ({used:,} enqueued, this file {input_bytes:,}). Please try "
                             "again once some in_progress batches have been completed.", "input_file_id",
                             "batch_bytes_limit_exceeded")

    async def _read_input(self, record: BatchJobRecord, num_bytes: int) -> JobInput | list[BatchLineError]:
        """The job's input streamed off the event loop (input.py), or why it is refused."""
        if num_bytes > MAX_BATCH_FILE_BYTES:  # known from its size: nothing is read
            return too_large(num_bytes)
        try:
            return await load_input(self.files.chunks(record.team, record.input_file_id), record.endpoint,
                                    self.config.spool_dir)
        except FileNotFound:
            return [BatchLineError("file_not_found", "the input file is gone", "input_file_id")]

    async def _validate(self, job: BatchJob, num_bytes: int) -> BatchJobRecord:
        loaded = await self._read_input(job.record, num_bytes)
        now = time.time()
        if isinstance(loaded, list):
            job.invalid(loaded, now)
            saved = await self._save(job.record)
            tracing.record_job(saved, now)
            return saved
        job.validated(loaded.model, len(loaded), now)
        await self.runner.add(job, loaded)
        return job.record

    async def _resume_all(self, records: list[BatchJobRecord]) -> None:
        """A new leader's unfinished jobs, one at a time in the background (the API answers meanwhile)."""
        for record in records:
            try:
                await self._resume(record)
            except Exception:  # the others are still resumed; this one again at the next election
                log.exception("batch %s of %s could not be resumed", record.id, record.team)

    async def _resume(self, record: BatchJobRecord) -> None:
        try:
            num_bytes = (await self.files.get(record.team, record.input_file_id)).bytes
        except FileNotFound:
            num_bytes = 0  # _read_input says the file is gone
        if record.status == "validating":
            await self._validate(BatchJob(record), num_bytes)
            return
        loaded = await self._read_input(record, num_bytes)
        if isinstance(loaded, list):  # its input is gone (or changed): it cannot go on
            log.error("batch %s of %s cannot be resumed: %s", record.id, record.team, loaded[0].message)
            return
        await self.runner.add(BatchJob(record), loaded)
        log.info("batch %s of %s resumed (%s)", record.id, record.team, record.request_counts)

    # ------------------------------------------------------------ the bus way in (submissions.py consumes)
    async def _submitted(self, msg: Msg) -> None:
        """A submission's job made, or its refusal recorded; any other error raises (the consumer retries it)."""
        team, submit_id = msg.subject.rsplit(".", 1)[-1], _submit_id(msg)
        try:
            submit = msgspec.json.decode(msg.data, type=BatchSubmit)
            input_file_id = submit.input_file_id
            if submit.lines:
                input_file_id = (await self.files.put(team, "batch", f"{submit_id}.jsonl", submit.lines)).id
            await self._new_job(team, submit.endpoint, submit.completion_window, input_file_id, submit.metadata,
                                "bus", submit_id)
        except ApiRefusal as refusal:
            await self._refused(team, submit_id, refusal.reply.error_message)
        except QuotaExceeded as exc:  # its lines would be a file past the team's storage quota: at once, not retried
            await self._refused(team, submit_id, f"the team's file storage quota is exceeded ({exc}): delete files "
                                "it no longer needs (DELETE /v1/files/{file_id}) and submit again")
        except msgspec.ValidationError as exc:
            await self._refused(team, submit_id, f"the submission is not a BatchSubmit: {exc}")
        except msgspec.DecodeError as exc:
            await self._refused(team, submit_id, f"the submission is not JSON: {exc}")

    async def _poisoned(self, msg: Msg, message: str) -> None:
        await self._refused(msg.subject.rsplit(".", 1)[-1], _submit_id(msg), message)

    async def _refused(self, team: str, submit_id: str, message: str) -> None:
        """A submission that cannot make a job: a failed job under its id says why (the client follows it)."""
        now = int(time.time())
        record = BatchJobRecord(id=job_id_for(team, submit_id), team=team, endpoint="/v1/chat/completions",
                                input_file_id="", source="bus", created_at=now, expires_at=now, status="failed",
                                failed_at=now, errors=[BatchLineError("invalid_submission", message)])
        record, created = await store.create_job(self.engine, record, submit_id)
        if created:
            await self._save(record)
        log.warning("batch submission %s of %s refused: %s", submit_id, team, message)


def _submit_id(msg: Msg) -> str:
    return (msg.headers or {}).get("Nats-Msg-Id") or f"seq-{msg.metadata.sequence.stream}"
