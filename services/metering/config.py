"""Metering configuration (env INFERMESH_*, flags --*)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import BusConfig


@dataclass(slots=True)
class MeteringConfig(BusConfig):
    """Metering: the usage stream into the ledger (Postgres or SQLite), keys and spend onto the bus, billing HTTP."""

    database_url: str = ""  # INFERMESH_DATABASE_URL; "" = the embedded SQLite ledger
    billing_host: str = "127.0.0.1"
    billing_port: int = 8001  # the billing API and dashboards (0: any free port, -1: none)
    consumer: str = "metering"  # the durable consumer's name (replicas share it)
    batch_size: int = 1000  # usage messages per transaction, at most
    fetch_wait_s: float = 0.02  # how long a fetch waits to fill a batch (part of the lag when traffic is light)
    ack_wait_s: float = 30.0  # a message not acked this long is redelivered (a metering replica died)
    writers: int = 2  # batches in flight at once (one commits while the next is fetched and decoded)
    sync_s: float = 0.5  # keys, prices, budgets and spend are brought onto the bus this often
    spend_sync_s: float = 0.1  # after usage is committed, spend reaches admission within this
    retry_max_s: float = 2.0  # the longest pause between attempts while the database is away
    writer_restart_s: float = 0.5  # a writer that died is restarted after this, doubling up to writer_restart_max_s
    writer_restart_max_s: float = 10.0
    max_lag_s: float = 30.0  # /health is 503 while a usage message stored this long ago is not yet in the ledger
    # the trace UI's page of one trace, "{trace_id}" in it (Jaeger: http://127.0.0.1:16686/trace/{trace_id}): the
    # dashboard links each usage row to its trace there; "" = no links
    trace_url: str = ""
    responses_retention_s: float = 30 * 86400.0  # a stored response (the Responses API's store) is kept this long
    responses_sweep_s: float = 60.0  # expired stored responses are deleted this often (no read sees them meanwhile)

    def __post_init__(self) -> None:
        assert self.batch_size >= 1 and self.fetch_wait_s > 0 and self.ack_wait_s > 0 and self.sync_s > 0
        assert self.writers >= 1 and self.spend_sync_s > 0
        assert 0 < self.writer_restart_s <= self.writer_restart_max_s and self.max_lag_s > 0
        assert self.billing_port >= -1 and self.responses_retention_s > 0 and self.responses_sweep_s > 0
