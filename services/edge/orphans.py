"""Billing the requests of a dead edge: signed billing contexts out, workers' orphan reports in.

    edge A ── GenerateRequest(billing=sign(secret, id, context)) ──► worker
    edge A dies; the worker pings it, aborts its requests, publishes OrphanUsage to <ns>_orphans
    edge B (any edge: one shared durable consumer) ── verify ── UsageEvent ──► <ns>.usage, then ack

| report                                | what edge B does                                                  |
|---------------------------------------|-------------------------------------------------------------------|
| undecodable                           | logged, acked, dropped; counted ``undecodable``                   |
| no billing context (edge had no secret)| logged, acked, dropped; counted ``unsigned``                     |
| signature does not hold (forged)      | logged, acked, dropped; counted ``forged``                        |
| signed                                | the UsageEvent edge A would have published (``cancelled`` for an  |
|                                       | aborted orphan, ``finished`` for one that ended before its edge   |
|                                       | died; dedupe id ``<request_id>:<attempt>``), published, then acked|
| usage publish lost (NATS away 120 s)  | not acked: redelivered later                                      |

The signature is HMAC-SHA256 keyed by the edges' shared secret (``INFERMESH_EDGE_SECRET``) over the generate
request's id and the encoded context, so a worker can neither bill another team nor move a context onto
another request. Billing once: a report and the dead edge's own usage share the dedupe id, so JetStream's
duplicate window and the ledger's unique (request_id, attempt) key keep one. The counts are the engine's.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging

from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from shared import schema
from shared.bus import Bus
from shared.orphans import ACK_WAIT_S, ORPHANS_DURABLE, ensure_orphans_stream
from shared.schema import BillingContext, OrphanUsage, SignedBilling, UsageEvent
from shared.usage import ORPHAN_PUBLISH_WAIT_S, UsagePublisher

log = logging.getLogger("infermesh.edge")


def _mac(secret: bytes, request_id: str, context: bytes) -> bytes:
    return hmac.new(secret, request_id.encode() + b"\0" + context, hashlib.sha256).digest()


def sign(secret: bytes, request_id: str, context: BillingContext) -> SignedBilling:
    """The billing context of generate request ``request_id``, encoded and signed."""
    assert secret, "signing needs the edge secret"
    data = schema.encode(context)
    return SignedBilling(data, _mac(secret, request_id, data))


def verify(secret: bytes, request_id: str, signed: SignedBilling) -> BillingContext | None:
    """The context if its signature holds for ``request_id``; None if forged (or undecodable though signed)."""
    if not secret or not hmac.compare_digest(_mac(secret, request_id, signed.context), signed.signature):
        return None
    try:
        return schema.decode(signed.context, BillingContext)
    except Exception:
        return None


def orphan_usage_event(report: OrphanUsage, context: BillingContext, deployment: str = "") -> UsageEvent:
    """The usage the dead edge would have published: cancelled (aborted as an orphan) or finished (it ended just
    before its edge died), with the counts the engine reported.

    Cached tokens follow the edge's rule (services/edge/mesh.py): a remote prefill's hits when one computed
    the prompt (``prefill_cached_tokens``), else the reporting worker's own; a prefill bills no completion."""
    cached = report.num_cached_tokens if context.prefill_cached_tokens is None else context.prefill_cached_tokens
    completion = 0 if report.remote_decode else report.num_output_tokens  # a prefill's token was never sent
    duration_ms = max(0.0, 1000 * (report.ts - context.created_at)) if context.created_at else 0.0
    status = "cancelled" if report.finish_reason == "abort" else "finished"
    return UsageEvent(
        context.request_id, context.attempt, context.team, context.key_prefix, context.model, status,
        report.finish_reason,
        report.num_prompt_tokens, min(cached, report.num_prompt_tokens), completion,
        round(report.ttft_ms, 3), round(duration_ms, 3), context.worker_id, context.prefill_worker_id,
        context.trace_id, context.created_at, context.migrations, context.migration_prefill_tokens, deployment,
        context.batch_id, context.trajectory, context.run_id)


class OrphanBiller:
    """One edge's share of the orphans stream: pulls reports, bills the signed ones, acks each once handled."""

    def __init__(self, bus: Bus, secret: bytes, usage: UsagePublisher, batch_size: int = 16,
                 fetch_wait_s: float = 1.0, deployment: str = "") -> None:
        assert secret, "an edge without the edge secret cannot verify orphan reports"
        self.bus, self.secret, self.usage = bus, secret, usage
        self.deployment = deployment  # the reporting workers' (the link's): where the request was served
        self.batch_size, self.fetch_wait_s = batch_size, fetch_wait_s
        self.stats = {"billed": 0, "forged": 0, "unsigned": 0, "undecodable": 0, "retried": 0}
        self._sub = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    async def start(self) -> None:
        await ensure_orphans_stream(self.bus)
        s = self.bus.subjects
        self._sub = await self.bus.js.pull_subscribe(
            s.orphans_all, durable=ORPHANS_DURABLE, stream=s.orphans_stream,
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=ACK_WAIT_S, deliver_policy=DeliverPolicy.ALL,
                                  filter_subject=s.orphans_all))
        self._task = asyncio.create_task(self._consume(), name="orphan-billing")

    async def stop(self) -> None:
        """Bounded: nats-py's fetch can swallow a cancel when a report lands at that moment (edges stopping
        while workers report their requests hung a clean stop for good), so the loop also checks a flag."""
        self._stopping = True
        if self._task is not None:
            for _ in range(3):
                self._task.cancel()
                done, _pending = await asyncio.wait([self._task], timeout=self.fetch_wait_s + 1.0)
                if done:
                    break
            else:
                log.warning("the orphan biller did not stop")
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:
                pass

    async def _consume(self) -> None:
        assert self._sub is not None
        while not self._stopping:
            try:
                msgs = await self._sub.fetch(self.batch_size, timeout=self.fetch_wait_s)
            except TimeoutError:  # asyncio's or nats-py's: nothing came, ask again
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # NATS away for a moment
                log.warning("orphan report fetch failed: %s", exc)
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                if self._stopping:
                    return  # the rest come back to another edge after the ack wait
                try:
                    await self._handle(msg)
                except Exception:  # an ack lost with the connection: the report comes back after ack_wait
                    log.exception("an orphan report was not handled (it comes back after the ack wait)")

    async def _handle(self, msg: Msg) -> None:
        event = self.judge(msg.data)
        if event is not None and not await self.usage.publish_within(event, ORPHAN_PUBLISH_WAIT_S):
            self.stats["retried"] += 1
            await msg.nak(delay=5.0)  # the usage stream is away: another try later, maybe on another edge
            return
        if event is not None:
            self.stats["billed"] += 1
        await msg.ack()

    def judge(self, data: bytes) -> UsageEvent | None:
        """The usage to publish for one report, or None (counted and logged) if it must not be billed."""
        try:
            report = schema.decode(data, OrphanUsage)
        except Exception as exc:
            self.stats["undecodable"] += 1
            log.error("undecodable orphan report dropped: %s", exc)
            return None
        if report.billing is None:
            self.stats["unsigned"] += 1
            log.error("orphan report %s from %s carries no billing context (its edge had no secret): not billed",
                      report.request_id, report.worker_id)
            return None
        context = verify(self.secret, report.request_id, report.billing)
        if context is None:
            self.stats["forged"] += 1
            log.error("orphan report %s from %s: its billing signature does not hold: not billed",
                      report.request_id, report.worker_id)
            return None
        try:  # a round trip validates the bounds (a worker's counts are not trusted to fit the ledger)
            return schema.decode(schema.encode(orphan_usage_event(report, context, self.deployment)), UsageEvent)
        except Exception as exc:
            self.stats["undecodable"] += 1
            log.error("orphan report %s from %s cannot be billed: %s", report.request_id, report.worker_id, exc)
            return None
