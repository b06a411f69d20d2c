"""A team's batch jobs over the bus: submit a JSONL file, follow the job to its end, read its results.

    from infermesh.batch_client import BatchClient
    from infermesh.team_bus_users import team_credentials

    client = await BatchClient.connect("nats://127.0.0.1:4222", "im", "research", team_credentials("research"))
    job_id = await client.submit([{"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions",
                                   "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}}])
    async for job in client.follow(job_id):        # the job record after each change, until it ends
        print(job.status, job.request_counts)
    async for result in client.results(job_id):    # one BatchLineResult per line
        print(result.custom_id, result.status_code, result.body)
    await client.close()

What it talks to (``services/batch``; on a locked bus the team's own user, ``team-<team>``, may do exactly this
for its own team and nothing for another: ``infermesh teams bus-user TEAM`` makes it, ``team_credentials(TEAM)``
reads it back; ``infermesh/bus_roles.py`` says how):

| call        | bus                                                                                        |
|-------------|--------------------------------------------------------------------------------------------|
| ``submit``  | a JetStream publish of a BatchSubmit on ``<ns>.batch.submit.<team>``, ``Nats-Msg-Id`` set   |
| ``status``  | a direct get of the last message of ``<ns>.batch.events.<team>.<job>`` (one kept per job)  |
| ``follow``  | a named ordered consumer on that subject, delivering its last message first: no polling    |
| ``results`` | a named ordered consumer on ``<ns>.batch.results.<team>.<job>``, until none is pending     |

Invariants: a submission's job id is ``job_id_for(team, submit_id)``, known before the service has seen it;
the same ``submit_id`` makes one job however often it is published (the service keeps one job per team and
submit id for good, not only within the stream's one-day deduplication window), so the default submit id, a
hash of the endpoint, completion window and lines, makes re-submitting the same file the same job (pass a
``submit_id`` of your own to run it again). A submission the service refuses (not JSON, a bad endpoint, an
invalid line) still ends as a ``failed`` job under that id, the reason in ``errors``: ``follow`` always ends.
Lines go inline, so a file must fit one NATS message (``max_payload``, 1 MiB by default); a bigger one goes
through ``/v1/files`` and ``/v1/batches``.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import AsyncIterator

import msgspec
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from shared.batch_schema import (
    MAX_SUBMIT_ID,
    TERMINAL_STATUSES,
    BatchJobRecord,
    BatchLineResult,
    BatchSubmit,
    job_id_for,
)
from shared.bus import Bus
from shared.nats_auth import NatsCredentials
from shared.telemetry import traced

READ_TIMEOUT_S = 10.0  # a message the stream says it holds comes at once; this long means the bus is gone


def jsonl(lines: list[dict]) -> bytes:
    """An OpenAI batch input file: one JSON object a line."""
    return b"".join(json.dumps(line, separators=(",", ":")).encode() + b"\n" for line in lines)


def content_submit_id(endpoint: str, completion_window: str, lines: bytes) -> str:
    """The default submit id: the same file for the same endpoint is the same job."""
    digest = hashlib.sha256(f"{endpoint}\0{completion_window}\0".encode() + lines).hexdigest()
    return f"sha256-{digest}"


class BatchClient:
    """One team's connection to the batch service's streams: it submits jobs and reads what they became."""

    def __init__(self, bus: Bus, team: str) -> None:
        self.bus, self.team = bus, team
        bus.subjects.batch_submit(team)  # the team must be one subject token: fail here, not at submit

    @classmethod
    async def connect(cls, nats_url: str, namespace: str, team: str,
                      credentials: NatsCredentials | None = None) -> "BatchClient":
        """Connect as ``credentials`` (default: the ``INFERMESH_NATS_*`` env vars; on a locked bus the team's own
        user, ``infermesh.team_bus_users.team_credentials(team)``)."""
        return cls(await Bus.connect(nats_url, namespace, f"batch-client-{team}", credentials), team)

    async def close(self) -> None:
        await self.bus.close()

    async def __aenter__(self) -> "BatchClient":
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------ in
    async def submit(self, lines: bytes | list[dict], endpoint: str = "/v1/chat/completions",
                     submit_id: str | None = None, metadata: dict[str, str] | None = None,
                     completion_window: str = "24h") -> str:
        """Publish a job (the JSONL bytes of a batch input file, or its lines as dicts); returns its job id.

        Returns once JetStream has the submission, not once the service made the job: ``follow`` the id."""
        data = lines if isinstance(lines, bytes) else jsonl(lines)
        submit_id = submit_id or content_submit_id(endpoint, completion_window, data)
        if len(submit_id) > MAX_SUBMIT_ID:
            raise ValueError(f"submit_id is longer than {MAX_SUBMIT_ID} characters")
        message = msgspec.json.encode(BatchSubmit(endpoint=endpoint, lines=data, completion_window=completion_window,
                                                  metadata=metadata))
        if len(message) > self.bus.nc.max_payload:
            raise ValueError(f"the submission is {len(message)} bytes, over the bus's {self.bus.nc.max_payload}: "
                             "upload the file with /v1/files and create the batch with /v1/batches")
        s = self.bus.subjects
        await self.bus.js.publish(s.batch_submit(self.team), message, stream=s.batch_submit_stream,
                                  headers=traced({"Nats-Msg-Id": submit_id}))
        return job_id_for(self.team, submit_id)

    # ------------------------------------------------------------ out
    async def status(self, job_id: str) -> BatchJobRecord | None:
        """The job as the service last reported it; None before the service has made it (or an unknown id)."""
        s = self.bus.subjects
        try:  # a direct get names the subject in its API subject: a team user may ask it for its own jobs only
            msg = await self.bus.js.get_last_msg(s.batch_events_stream, s.batch_events(self.team, job_id),
                                                 direct=True)
        except NotFoundError:
            return None
        return msgspec.json.decode(msg.data or b"", type=BatchJobRecord)

    async def follow(self, job_id: str) -> AsyncIterator[BatchJobRecord]:
        """The job's record now (once it exists) and after each change, ending with its terminal one.

        Waits as long as the job takes: bound it with ``asyncio.timeout`` if you must."""
        s = self.bus.subjects
        sub = await self.bus.js.subscribe(s.batch_events(self.team, job_id), ordered_consumer=True,
                                          deliver_policy=DeliverPolicy.LAST, stream=s.batch_events_stream,
                                          config=_named())
        try:
            while True:
                msg = await sub.next_msg(timeout=None)
                record = msgspec.json.decode(msg.data, type=BatchJobRecord)
                yield record
                if record.status in TERMINAL_STATUSES:
                    return
        finally:
            await sub.unsubscribe()

    async def results(self, job_id: str) -> AsyncIterator[BatchLineResult]:
        """Each line's result the stream holds now, once per line, in the order lines ended.

        Complete once the job has ended (the service publishes every line's result before the terminal record);
        while it runs, the lines ended so far."""
        job = await self.status(job_id)
        if job is None or not job.request_counts.completed + job.request_counts.failed:
            return  # no line ended yet (a line's result is published before it is counted)
        s = self.bus.subjects
        sub = await self.bus.js.subscribe(s.batch_results(self.team, job_id), ordered_consumer=True,
                                          deliver_policy=DeliverPolicy.ALL, stream=s.batch_results_stream,
                                          config=_named())
        seen: set[int] = set()
        try:
            while True:
                msg = await sub.next_msg(timeout=READ_TIMEOUT_S)
                result = msgspec.json.decode(msg.data, type=BatchLineResult)
                if result.line_index not in seen:  # a line that ended twice (a rerun after a crash): its first
                    seen.add(result.line_index)
                    yield result
                if msg.metadata.num_pending == 0:  # the last the stream holds for this job now
                    return
        finally:
            await sub.unsubscribe()


def _named() -> ConsumerConfig:
    """A consumer with a name: its create request then carries its filter subject in the API subject
    (``CONSUMER.CREATE.<stream>.<name>.<filter>``), which is what a team user's permissions check."""
    return ConsumerConfig(name=f"batch-client-{uuid.uuid4().hex[:16]}")
