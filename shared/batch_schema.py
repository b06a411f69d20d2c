"""Batch jobs and files on the wire and in the ledger: the one definition every service uses (issue 17).

The shapes follow OpenAI's Batch and Files APIs (``/v1/batches``, ``/v1/files``): a job's ``status`` moves

    validating -> failed                  a line of the input is invalid (``errors`` names the lines)
    validating -> in_progress -> finalizing -> completed
    in_progress -> cancelling -> cancelled        (finished lines kept, billed; the rest are errors)
    in_progress | finalizing -> expired           (its completion window passed: partial output)

and ``request_counts`` counts its lines (``total``, ``completed``, ``failed``) as they end. Times are unix seconds
(OpenAI's integers); ``None`` until the event happened. The pure state machine is ``services/batch/job.py``.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Literal

from msgspec import Meta, Struct

BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                      "cancelled"]
TERMINAL_STATUSES: frozenset[str] = frozenset({"failed", "completed", "expired", "cancelled"})
BatchEndpoint = Literal["/v1/chat/completions", "/v1/completions"]
CompletionWindow = Literal["24h"]
FilePurpose = Literal["batch", "batch_output"]  # what a team uploads; what the batch service writes
BatchSource = Literal["http", "bus"]  # how the job came in: /v1/batches, or <ns>.batch.submit.<team>

MAX_BATCH_LINES = 50_000  # OpenAI's limits per input file
MAX_BATCH_FILE_BYTES = 200 * 1024 * 1024
MAX_BATCH_ID = 64
MAX_FILE_ID = 64
MAX_CUSTOM_ID = 512
MAX_SUBMIT_ID = 128  # a bus submission's Nats-Msg-Id as the ledger keeps it (batch_jobs.submit_id)
MAX_METADATA_KEYS = 16  # OpenAI's metadata: 16 pairs, keys up to 64 characters, values up to 512
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512


def job_id_for(team: str, submit_id: str) -> str:
    """A bus submission's job id: the same for the same (team, Nats-Msg-Id), so the client knows it beforehand."""
    return "batch_" + hashlib.sha256(f"{team}\0{submit_id}".encode()).hexdigest()[:32]


class BatchRequestCounts(Struct, frozen=True):
    total: Annotated[int, Meta(ge=0)] = 0
    completed: Annotated[int, Meta(ge=0)] = 0
    failed: Annotated[int, Meta(ge=0)] = 0


class BatchLineError(Struct, frozen=True):
    """One entry of a job's ``errors.data``: why validation failed, and at which line (1-based) if a line's."""

    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchJobRecord(Struct, frozen=True, kw_only=True):
    """A batch job as the ledger keeps it and the bus reports it (``<ns>.batch.events.<team>.<job>``)."""

    id: Annotated[str, Meta(max_length=MAX_BATCH_ID)]  # batch_<hex>
    team: str
    # the API key that created it (its lines are billed to it; "" from the bus); 32: shared.schema.MAX_KEY_PREFIX,
    # which this module cannot import (schema imports it): tests/unit/test_ledger_types.py holds them equal
    key_prefix: Annotated[str, Meta(max_length=32)] = ""
    endpoint: BatchEndpoint
    model: str = ""  # the lines' model (one per job, as OpenAI requires); "" until validated
    input_file_id: Annotated[str, Meta(max_length=MAX_FILE_ID)]
    completion_window: CompletionWindow = "24h"
    status: BatchStatus = "validating"
    source: BatchSource = "http"
    created_at: int
    expires_at: int  # created_at + the completion window: the deadline
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: BatchRequestCounts = BatchRequestCounts()
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[BatchLineError] = []
    metadata: dict[str, str] | None = None


# ---------------------------------------------------------------- the batch service <-> edges
class BatchLineRequest(Struct, frozen=True, kw_only=True):
    """One line for any edge to run (``<ns>.batch.line``), as the team's own request of class ``batch``.

    ``request_id`` is the line's for good (``batch_<job hex>_<line>``): its billing key, the same in every run of
    the line, and the ledger keeps one row per batch request id. ``run_id`` is this run's own (``<request_id>_r<hex>``):
    the id of its streams and of its request on a worker, which runs of one line that overlap must not share."""

    job_id: str
    team: str
    key_prefix: str = ""
    line_index: int
    request_id: str
    endpoint: BatchEndpoint
    body: bytes  # the line's ``body`` as JSON
    run_id: str = ""  # "": ``request_id`` (a batch service from before run ids)


class BatchLineReply(Struct, frozen=True):
    """What the edge answered: the HTTP status and body a client would have got."""

    status_code: int
    body: bytes
    request_id: str
    retry_after_s: float = 0.0  # 429 / 503: when to try again


class BatchLineResult(Struct, frozen=True, kw_only=True):
    """One ended line on ``<ns>.batch.results.<team>.<job>`` (Nats-Msg-Id ``<job>:<line>``: once per line)."""

    job_id: str
    line_index: int
    custom_id: str
    request_id: str = ""
    status_code: int = 0  # the edge's answer (200: in the output file; else the error file); 0: never ran
    body: bytes = b""  # the edge's answer's body (JSON)
    error_code: str = ""  # never ran: batch_cancelled | batch_expired | ...
    error_message: str = ""

    @property
    def ok(self) -> bool:
        return self.status_code == 200


class BatchApiRequest(Struct, frozen=True, kw_only=True):
    """An edge asking the batch service for a team (``<ns>.batch.api.<operation>``)."""

    team: str
    key_prefix: str = ""  # the caller's API key (create: the job's lines are billed to that key)
    job_id: str = ""  # retrieve, cancel
    input_file_id: str = ""  # create
    endpoint: str = ""  # create (validated by the service: 400 naming it)
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None
    after: str = ""  # list
    limit: int = 20


class BatchApiReply(Struct, frozen=True, kw_only=True):
    """A job (create, retrieve, cancel), a page of jobs (list), or an OpenAI-shaped error."""

    job: BatchJobRecord | None = None
    jobs: list[BatchJobRecord] = []
    has_more: bool = False
    error_status: int = 0
    error_message: str = ""
    error_param: str | None = None
    error_code: str | None = None


class BatchSubmit(Struct, frozen=True, kw_only=True):
    """A job published on ``<ns>.batch.submit.<team>`` (JetStream; ``Nats-Msg-Id`` names it: twice is once).

    The lines inline (``lines``: the JSONL bytes of an OpenAI batch input file) or an uploaded file's id."""

    endpoint: str
    lines: bytes = b""
    input_file_id: str = ""
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


# ---------------------------------------------------------------- a team's program <-> the batch service
BatchTeamRead = Literal["status", "follow", "results"]  # <ns>.batch.team.<team>.<read> (services/batch/team_reads.py)
BATCH_TEAM_READS: tuple[BatchTeamRead, ...] = ("status", "follow", "results")


class BatchTeamRequest(Struct, frozen=True, kw_only=True):
    """A team's read of one of its jobs; the team is the subject's, never the body's."""

    job_id: str
    revision: str = ""  # follow: the record's revision the caller has ("": none yet)
    wait_s: float = 0.0  # follow: how long to wait for another revision (the service caps it)
    after: int = 0  # results: the results stream's sequence after which to read
    limit: int = 100  # results: at most this many (the service caps it)


class BatchTeamReply(Struct, frozen=True, kw_only=True):
    """The job and its revision (status, follow; None: no such job yet), or a page of results, or an error."""

    job: BatchJobRecord | None = None
    revision: str = ""
    results: list[BatchLineResult] = []
    last: int = 0  # results: the sequence of this page's last result (the next page's ``after``)
    more: bool = False  # results: the page was full; ask for the next
    error_status: int = 0  # 400 a bad job id, 429 too many follows at once, 500
    error_message: str = ""
    retry_after_s: float = 0.0
