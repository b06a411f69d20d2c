"""Batch service configuration (env INFERMESH_*, flags --*)."""

from __future__ import annotations

from dataclasses import dataclass

from services.batch.dispatch import DISPATCH_ORDERS
from shared.config import BusConfig


@dataclass(slots=True)
class BatchConfig(BusConfig):
    """Batch: jobs from /v1/batches and <ns>.batch.submit.<team>, run line by line on idle capacity."""

    database_url: str = ""  # INFERMESH_DATABASE_URL: the ledger's database (job state); "" = the embedded SQLite
    batch_id: str = ""  # this replica's id (default: a random one)
    max_in_flight: int = 16  # lines running at once, across jobs (admission gives them only idle capacity)
    line_timeout_s: float = 900.0  # a line with no answer this long is run again (its edge died)
    retry_s: float = 1.0  # the first pause before a line refused for capacity (429, 503) is sent again
    retry_max_s: float = 30.0
    max_line_tries: int = 8  # tries of a line that keeps failing with 5xx before it is an error line
    tick_s: float = 0.5  # deadlines, cancels and progress are looked at this often
    leader_ttl_s: float = 5.0  # one replica runs the jobs; another takes over this long after it died
    dispatch_order: str = "prefix"  # within a job: "prefix" (shared prefixes together) | "shuffled" (benchmarks)
    completion_window_s: int = 0  # a job's deadline after its creation (0: its completion_window, 24 h)
    max_jobs_per_team: int = 100  # a team's unfinished jobs at once; one more is refused (429, OpenAI's words)
    max_input_bytes_per_team: int = 2 * 1024**3  # the input bytes of a team's unfinished jobs, the new one's too
    spool_dir: str = ""  # where inputs are spooled while their jobs run (unlinked at once; "" = the temp dir)
    submit_retry_s: float = 2.0  # a bus submission that failed unexpectedly (a database blip) comes again after this
    submit_max_deliveries: int = 5  # ... up to this many times; then it is a failed job saying why (submissions.py)
    submit_restart_s: float = 1.0  # the submissions consumer that died is restarted after this, doubling
    submit_restart_max_s: float = 30.0
    max_follows_per_team: int = 8  # a team's follows (long polls, team_reads.py) waiting at once; one more: 429
    follow_wait_max_s: float = 20.0  # the longest a follow waits for a change before it answers as things are
    results_page_max: int = 256  # results a team's page holds at most (each one message get)
    max_reads_per_team: int = 4  # a team's status and results reads answered at once (each in its own task); more: 429

    def __post_init__(self) -> None:
        assert self.max_in_flight >= 1 and self.line_timeout_s > 0 and 0 < self.retry_s <= self.retry_max_s
        assert self.max_line_tries >= 1 and self.tick_s > 0 and self.leader_ttl_s >= 1
        assert self.dispatch_order in DISPATCH_ORDERS, f"dispatch_order must be one of {DISPATCH_ORDERS}"
        assert self.completion_window_s >= 0
        assert self.max_jobs_per_team >= 1 and self.max_input_bytes_per_team >= 1
        assert self.submit_retry_s > 0 and self.submit_max_deliveries >= 1
        assert 0 < self.submit_restart_s <= self.submit_restart_max_s
        assert self.max_follows_per_team >= 1 and self.max_reads_per_team >= 1
        assert self.follow_wait_max_s > 0 and self.results_page_max >= 1
