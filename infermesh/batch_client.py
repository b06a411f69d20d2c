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

| call        | bus                                                                                         |
|-------------|---------------------------------------------------------------------------------------------|
| ``submit``  | a JetStream publish of a BatchSubmit on ``<ns>.batch.submit.<team>``, ``Nats-Msg-Id`` set    |
| ``status``  | a request on ``<ns>.batch.team.<team>.status``: the job as the service's ledger holds it      |
| ``follow``  | requests on ``<ns>.batch.team.<team>.follow``, each a long poll: the job once it changed     |
|             | from the revision the client has, or as it is after ``FOLLOW_WAIT_S``: no polling            |
| ``results`` | requests on ``<ns>.batch.team.<team>.results``, a page of results after a stream sequence,  |
|             | until a page is not full                                                                    |

A team makes no JetStream consumer and calls no JetStream API (a consumer could deliver anywhere in the streams'
account): its reads are core request/reply, answered by the batch service (services/batch/team_reads.py), which
takes the team from the subject. While no service answers (a new leader taking over) or it says to wait (429:
the team's follows at once), the client asks again: ``follow`` for as long as the job takes, ``status`` and
``results`` for ``READ_TIMEOUT_S``, then BusError.

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

import asyncio
import hashlib
import json
from dataclasses import replace
from typing import AsyncIterator

import msgspec

from infermesh.bus_roles import store_user, team_user
from shared.batch_schema import (
    MAX_SUBMIT_ID,
    TERMINAL_STATUSES,
    BatchJobRecord,
    BatchLineResult,
    BatchSubmit,
    BatchTeamRead,
    BatchTeamReply,
    BatchTeamRequest,
    job_id_for,
)
from shared.bus import Bus, BusError, NoResponder
from shared.nats_auth import NatsCredentials
from shared.telemetry import traced

READ_TIMEOUT_S = 10.0  # no answer to a status or results read for this long means the bus or the service is gone
FOLLOW_WAIT_S = 20.0  # a follow's long poll: answered at the job's change, or after this long as it is
ASK_AGAIN_S = 0.5  # no batch service answered (a leader being elected): asked again after this
RESULTS_PAGE = 256  # results asked for at once (the service may send fewer)


class BatchReadError(BusError):
    """The batch service refused a read (a job id that is no job id: 400; its own error: 500)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


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
        user, ``infermesh.team_bus_users.team_credentials(team)``: ``team-<team>`` for its reads, and its
        ``team-<team>@store``, same password, for its submissions, added here if not given)."""
        if credentials is not None and credentials.user == team_user(team) and not credentials.store_user:
            credentials = replace(credentials, store_user=store_user(credentials.user))
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
        """The job as the service last saved it; None before the service has made it (or an unknown id)."""
        return (await self._ask("status", BatchTeamRequest(job_id=job_id), READ_TIMEOUT_S)).job

    async def follow(self, job_id: str) -> AsyncIterator[BatchJobRecord]:
        """The job's record now (once it exists) and after each change, ending with its terminal one.

        Waits as long as the job takes: bound it with ``asyncio.timeout`` if you must."""
        revision = ""
        while True:
            reply = await self._ask("follow", BatchTeamRequest(job_id=job_id, revision=revision,
                                                               wait_s=FOLLOW_WAIT_S), None)
            if reply.job is None or reply.revision == revision:  # the wait ended with no change: ask again
                continue
            revision = reply.revision
            yield reply.job
            if reply.job.status in TERMINAL_STATUSES:
                return

    async def results(self, job_id: str) -> AsyncIterator[BatchLineResult]:
        """Each line's result the stream holds now, once per line, in the order lines ended.

        Complete once the job has ended (the service publishes every line's result before the terminal record);
        while it runs, the lines ended so far."""
        after, seen = 0, set()
        while True:
            page = await self._ask("results", BatchTeamRequest(job_id=job_id, after=after, limit=RESULTS_PAGE),
                                   READ_TIMEOUT_S)
            for result in page.results:
                if result.line_index not in seen:  # a line that ended twice (a rerun after a crash): its first
                    seen.add(result.line_index)
                    yield result
            if not page.more:
                return
            after = page.last

    async def _ask(self, read: BatchTeamRead, request: BatchTeamRequest, patience_s: float | None) -> BatchTeamReply:
        """The batch service's answer, asked again while none comes or it says to wait, for ``patience_s`` (None:
        for good); a refusal raises BatchReadError."""
        loop = asyncio.get_running_loop()
        give_up = None if patience_s is None else loop.time() + patience_s
        subject = self.bus.subjects.batch_team(self.team, read)
        while True:
            pause = ASK_AGAIN_S
            try:
                reply = await self.bus.request(subject, request, BatchTeamReply,
                                               timeout=request.wait_s + READ_TIMEOUT_S)
            except NoResponder:
                pass
            except BusError:  # no answer in time: the leader went away while it waited
                pause = 0.0
            else:
                if reply.error_status == 429:
                    pause = reply.retry_after_s
                elif reply.error_status:
                    raise BatchReadError(reply.error_status, reply.error_message)
                else:
                    return reply
            if give_up is not None and loop.time() + pause > give_up:
                raise BusError(f"the batch service did not answer {read} of {request.job_id} in {patience_s}s")
            await asyncio.sleep(pause)
