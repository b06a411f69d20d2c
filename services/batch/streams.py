"""The batch service's JetStream streams, and reading a job's results back.

| stream                | subjects                            | what                                  | kept       |
|-----------------------|-------------------------------------|---------------------------------------|------------|
| ``<ns>_batch_submit`` | ``<ns>.batch.submit.<team>``        | jobs teams publish (BatchSubmit JSON) | 7 days     |
| ``<ns>_batch_results``| ``<ns>.batch.results.<team>.<job>`` | one BatchLineResult (JSON) per line   | 30 days    |
| ``<ns>_batch_events`` | ``<ns>.batch.events.<team>.<job>``  | the job record after each change     | last, 30 d |

Each has its ``max_bytes`` (shared/storage_caps.py); past it, the oldest messages go.

Submissions and results are deduplicated by ``Nats-Msg-Id`` (a submission's own id; ``<job>:<line>`` for a
result) within a day: publishing the same job twice makes one job, and a line that ends twice (run again after a
crash) keeps its first result. Past the window the service itself skips lines the results stream already has.
"""

from __future__ import annotations

import logging

import msgspec
from nats.js.api import DeliverPolicy, DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError

from shared.batch_schema import BatchLineResult
from shared.bus import Bus
from shared.replication import stream_replicas
from shared.storage_caps import store_caps
from shared.telemetry import traced

log = logging.getLogger("infermesh.batch")
DAY_S = 24 * 3600.0
SUBMIT_RETENTION_S = 7 * DAY_S
RESULTS_RETENTION_S = 30 * DAY_S


async def ensure_batch_streams(bus: Bus) -> None:
    s, replicas, caps = bus.subjects, stream_replicas(), store_caps()  # max_bytes reserved: shared/storage_caps.py
    for config in (
        StreamConfig(name=s.batch_submit_stream, subjects=[s.batch_submit_all], retention=RetentionPolicy.LIMITS,
                     storage=StorageType.FILE, max_age=SUBMIT_RETENTION_S, duplicate_window=DAY_S,
                     num_replicas=replicas, max_bytes=caps.batch_submit, discard=DiscardPolicy.NEW),
        StreamConfig(name=s.batch_results_stream, subjects=[s.batch_results_all], retention=RetentionPolicy.LIMITS,
                     storage=StorageType.FILE, max_age=RESULTS_RETENTION_S, duplicate_window=DAY_S,
                     num_replicas=replicas, max_bytes=caps.batch_results, discard=DiscardPolicy.NEW),
        StreamConfig(name=s.batch_events_stream, subjects=[s.batch_events_all], retention=RetentionPolicy.LIMITS,
                     storage=StorageType.FILE, max_age=RESULTS_RETENTION_S, max_msgs_per_subject=1,
                     allow_direct=True, num_replicas=replicas, discard=DiscardPolicy.NEW,
                     max_bytes=caps.batch_events),  # a job status: DIRECT.GET.<stream>.<subject>, naming the team
    ):
        try:
            await bus.js.add_stream(config)
        except BadRequestError:  # it exists (with an operator's config, perhaps): keep it
            log.info("stream %s exists with its own config", config.name)


def result_id(result: BatchLineResult) -> str:
    return f"{result.job_id}:{result.line_index}"


async def publish_result(bus: Bus, team: str, result: BatchLineResult) -> None:
    await bus.js.publish(bus.subjects.batch_results(team, result.job_id), msgspec.json.encode(result),
                         stream=bus.subjects.batch_results_stream, headers=traced({"Nats-Msg-Id": result_id(result)}))


async def read_results(bus: Bus, team: str, job_id: str) -> dict[int, BatchLineResult]:
    """Every result the stream holds for the job, by line (the first of a line wins)."""
    subject = bus.subjects.batch_results(team, job_id)
    try:
        info = await bus.js.stream_info(bus.subjects.batch_results_stream, subjects_filter=subject)
    except Exception:
        return {}
    count = (info.state.subjects or {}).get(subject, 0)
    results: dict[int, BatchLineResult] = {}
    if not count:
        return results
    sub = await bus.js.subscribe(subject, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL,
                                 stream=bus.subjects.batch_results_stream)
    try:
        seen = 0
        while seen < count:
            msg = await sub.next_msg(timeout=10)
            seen += 1
            result = msgspec.json.decode(msg.data, type=BatchLineResult)
            results.setdefault(result.line_index, result)
    finally:
        await sub.unsubscribe()
    return results
