"""The shared circuit breaker through the whole mesh: one worker fails every request, three edges and
two routers stop sending to it, exactly one probe per half-open period, and recovery closes it."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest

from infermesh.local import LocalMesh
from shared.bus import Bus
from shared.schema import BreakerTransition, Outcome
from tests.utils import eventually

pytestmark = [pytest.mark.e2e]
KEY = "test-key"


async def test_a_failing_worker_is_cut_off_probed_once_per_period_and_closed_on_recovery(nats_url, namespace,
                                                                                        tiny_model):
    mesh = LocalMesh(nats_url, namespace, dev_key=KEY)
    breaker = await mesh.start_breaker(cooldown_s=1.0)
    for _ in range(2):
        await mesh.start_router()
    workers = {}
    for wid in ("sim-ok-1", "sim-ok-2", "sim-bad"):
        workers[wid] = await mesh.start_worker(worker_id=wid, engine="sim", model="tiny", model_path=str(tiny_model),
                                               max_model_len=4096, sim_ttft_ms=2, sim_itl_ms=1)
    workers["sim-bad"].engine.config.fail_rate = 1.0
    for _ in range(3):
        edge = await mesh.start_edge()
        await eventually(edge.mesh.is_ready, 10)
    probe = await Bus.connect(nats_url, namespace, "probe")
    outcomes: list[tuple[float, Outcome]] = []
    transitions: list[tuple[float, BreakerTransition]] = []

    async def on_outcome(outcome: Outcome, _raw) -> None:
        outcomes.append((time.monotonic(), outcome))

    async def on_transition(t: BreakerTransition, _raw) -> None:
        transitions.append((time.monotonic(), t))

    await probe.subscribe(probe.subjects.outcome_all, Outcome, on_outcome)
    await probe.subscribe(probe.subjects.breaker_transitions, BreakerTransition, on_transition)
    await probe.nc.flush()
    clients = [openai.AsyncOpenAI(base_url=mesh.url_of(i), api_key=KEY, max_retries=0) for i in range(3)]
    failures: list[BaseException] = []
    stop = asyncio.Event()

    async def traffic(n: int) -> None:
        i = 0
        while not stop.is_set():
            try:
                reply = await clients[i % 3].completions.create(model="tiny", prompt=[5 + n, 7 + i % 900, 9, 11],
                                                                 max_tokens=3)
                assert reply.choices[0].finish_reason == "length"
            except BaseException as exc:  # noqa: BLE001 - every client error fails the test below
                failures.append(exc)
            i += 1
            await asyncio.sleep(0.01)

    def bad_states() -> list[str]:
        return [t.new for _, t in transitions if t.worker_id == "sim-bad"]

    clients_task = asyncio.gather(*(traffic(n) for n in range(6)))
    try:
        await eventually(lambda: bad_states().count("open") >= 3, 20)  # opened, probed, failed, again
        workers["sim-bad"].engine.config.fail_rate = 0.0  # it recovers
        await eventually(lambda: "closed" in bad_states(), 10)
        await eventually(lambda: any(o.worker_id == "sim-bad" and o.ok and t > closed_at(transitions)
                                     for t, o in outcomes), 5)
    finally:
        stop.set()
        await clients_task
        await probe.close()
        await mesh.stop()

    assert not failures, failures[:3]  # every client got a normal answer (a failed attempt is retried elsewhere)
    bad = [(t, o) for t, o in outcomes if o.worker_id == "sim-bad"]
    moves = [(t, tr) for t, tr in transitions if tr.worker_id == "sim-bad"]
    first_open = next(t for t, tr in moves if tr.new == "open")
    # within 2 s of opening, no edge sends it normal traffic: only probes, one per half-open period
    periods = [(t, moves[i + 1][0] if i + 1 < len(moves) else float("inf"))
               for i, (t, tr) in enumerate(moves) if tr.new == "half_open"]
    probe_ids = set()
    for start, end in periods:  # every period (the last ends with the close) had exactly one request: its probe
        ids = {o.request_id for t, o in bad if start <= t <= end}  # the outcome comes before the move it causes
        assert len(ids) == 1, (start - first_open, ids)
        probe_ids |= ids
    normal_after = [t - first_open for t, o in bad
                    if first_open + 2.0 < t < closed_at(transitions) and o.request_id not in probe_ids]
    assert not normal_after, normal_after  # no normal traffic 2 s after it opened, from any of the 3 edges
    last_normal = max((t - first_open for t, o in bad if t < closed_at(transitions) and o.request_id not in probe_ids),
                      default=0.0)
    print(f"breaker: last normal request {last_normal * 1000:.0f} ms after opening; {len(periods)} half-open periods")
    assert sum(1 for _, tr in moves if tr.new == "half_open") >= 2
    assert breaker.stats["transitions:probe_failed"] >= 1 and breaker.stats["transitions:probe_succeeded"] == 1
    assert sum(r.stats["probes"] for r in mesh.routers) == sum(1 for _, tr in moves if tr.new == "half_open")


def closed_at(transitions) -> float:
    return next((t for t, tr in transitions if tr.worker_id == "sim-bad" and tr.new == "closed"), float("inf"))
