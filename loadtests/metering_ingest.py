"""Metering throughput: usage events per second into the ledger, and end-to-end lag at a given rate.

For each database (Postgres on 127.0.0.1:5432, the embedded SQLite) and each repetition, with
metering running as its own process (as in ``infermesh up``):

1. drain: ``--events`` usage messages are put on the stream while metering is stopped; metering
   starts and the time to commit them all gives the ingest rate (its batches are full here);
2. lag: for each ``--rates`` R, a fresh metering process, then R events/s published for
   ``--rate-seconds``; the lag is request arrival -> committed and acked, as metering's own
   ``/metrics`` summary reports it (p50, p99), read once everything is in.

    python -m loadtests.metering_ingest --out docs/results/metering_ingest
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import secrets
import statistics
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

from infermesh.processes import ProcessGroup
from shared import schema
from shared.bus import Bus
from shared.ports import free_port, wait_for_port
from shared.schema import UsageEvent
from shared.usage import dedupe_id, ensure_usage_stream

POSTGRES_ADMIN = os.environ.get("INFERMESH_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
METRIC = re.compile(r'^(infermesh_metering_[a-z_]+)(\{[^}]*\})? ([0-9.eE+-]+)$', re.M)


async def fresh_database(kind: str, folder: Path) -> tuple[str, object]:
    if kind == "sqlite":
        path = folder / f"ledger-{secrets.token_hex(4)}.db"
        return f"sqlite:///{path}", None
    import asyncpg

    name = f"im_bench_{secrets.token_hex(5)}"
    admin = await asyncpg.connect(POSTGRES_ADMIN)
    await admin.execute(f'CREATE DATABASE "{name}"')
    await admin.close()
    return POSTGRES_ADMIN.rsplit("/", 1)[0] + f"/{name}", name


async def drop_database(name: object) -> None:
    if name is None:
        return
    import asyncpg

    admin = await asyncpg.connect(POSTGRES_ADMIN)
    await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    await admin.close()


def metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {name + (labels or ""): float(value) for name, labels, value in METRIC.findall(text)}


def inserted(port: int) -> int:
    try:
        return int(metrics(port)['infermesh_metering_usage_total{result="inserted"}'])
    except Exception:
        return -1


class Metering:
    """One metering process on the bench's NATS and ledger."""

    def __init__(self, group: ProcessGroup, nats_url: str, namespace: str, database_url: str) -> None:
        self.port = free_port()
        env = {"INFERMESH_NATS_URL": nats_url, "INFERMESH_NAMESPACE": namespace,
               "INFERMESH_DATABASE_URL": database_url, "INFERMESH_LOG_LEVEL": "WARNING"}
        self.child = group.python_service(f"metering-{self.port}", "services.metering",
                                          ["--billing-port", str(self.port)], env)

    async def ready(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while inserted(self.port) < 0:
            if time.monotonic() > deadline or not self.child.alive():
                raise RuntimeError(f"metering did not start:\n{self.child.tail()}")
            await asyncio.sleep(0.1)

    def stop(self) -> None:
        self.child.popen.terminate()
        self.child.popen.wait(30)


def make_event(rng: random.Random, i: int, now: float) -> UsageEvent:
    prompt = rng.randrange(100, 30_000)
    return UsageEvent(f"{uuid.uuid4().hex}", 0, f"team{rng.randrange(10)}", f"im-key{rng.randrange(50):05d}",
                      f"model-{rng.randrange(3)}", "finished", "stop", prompt, rng.randrange(0, prompt),
                      rng.randrange(1, 2000), rng.uniform(20, 500), rng.uniform(200, 20_000), f"w{rng.randrange(16)}",
                      "", f"{rng.getrandbits(128):032x}", now)


async def publish(bus: Bus, event: UsageEvent) -> None:
    """Onto the stream without waiting for JetStream's ack: the bench's one process stands for many edges,
    and an acked publish per event would make it, not metering, the bottleneck on two cores (the edge's
    ``UsagePublisher`` does wait; its cost is the edge's). Dedupe ids as the edge sets them."""
    await bus.ledger.publish(bus.subjects.usage, schema.encode(event), headers={"Nats-Msg-Id": dedupe_id(event)})


async def publish_all(bus: Bus, events: list[UsageEvent]) -> None:
    for event in events:
        await publish(bus, event)
    await bus.nc.flush()
    while (await bus.ledger_js.stream_info(bus.subjects.usage_stream)).state.messages < len(events):
        await asyncio.sleep(0.05)


async def publish_at(bus: Bus, rate: float, seconds: float, rng: random.Random) -> tuple[int, float]:
    """Publish ``rate`` events/s, stamped when sent; (events, achieved rate)."""
    tick, sent = 0.01, 0
    started = time.monotonic()
    while (elapsed := time.monotonic() - started) < seconds:
        due = int(rate * elapsed) - sent
        now = time.time()
        for _ in range(due):
            await publish(bus, make_event(rng, sent, now))
            sent += 1
        await asyncio.sleep(tick)
    await bus.nc.flush()
    return sent, sent / (time.monotonic() - started)


async def wait_for(port: int, count: int, timeout_s: float) -> float:
    deadline = time.monotonic() + timeout_s
    while (done := inserted(port)) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {done}/{count} ingested after {timeout_s:.0f} s")
        await asyncio.sleep(0.02)
    return time.monotonic()


async def run_one(kind: str, args: argparse.Namespace, group: ProcessGroup, nats_url: str, folder: Path,
                  rep: int) -> dict:
    rng = random.Random(rep)
    url, handle = await fresh_database(kind, folder)
    namespace = f"bench{secrets.token_hex(4)}"
    bus = await Bus.connect(nats_url, namespace, "metering-bench")
    result: dict = {"database": kind, "rep": rep}
    try:
        await ensure_usage_stream(bus)
        events = [make_event(rng, i, time.time()) for i in range(args.events)]
        before = (await bus.ledger_js.stream_info(bus.subjects.usage_stream)).state.messages
        await publish_all(bus, events)
        assert before == 0
        metering = Metering(group, nats_url, namespace, url)
        await metering.ready()
        first = time.monotonic()
        while (count := inserted(metering.port)) <= 0:
            await asyncio.sleep(0.005)
            first = time.monotonic()
        done = await wait_for(metering.port, args.events, 600)
        result["drain_events_per_s"] = (args.events - count) / (done - first)
        metering.stop()
        total = args.events
        result["lag"] = []
        for rate in args.rates:
            metering = Metering(group, nats_url, namespace, url)
            await metering.ready()
            sent, achieved = await publish_at(bus, rate, args.rate_seconds, rng)
            total += sent
            await wait_for(metering.port, sent, 120)
            m = metrics(metering.port)
            result["lag"].append({"rate": rate, "achieved_rate": achieved, "events": sent,
                                  "lag_p50_ms": 1000 * m['infermesh_metering_lag_seconds{quantile="0.5"}'],
                                  "lag_p99_ms": 1000 * m['infermesh_metering_lag_seconds{quantile="0.99"}']})
            metering.stop()
        print(json.dumps(result), flush=True)
        return result
    finally:
        await bus.close()
        await drop_database(handle)


def summarize(runs: list[dict], rates: list[float]) -> dict:
    out: dict = {}
    for kind in sorted({r["database"] for r in runs}):
        mine = [r for r in runs if r["database"] == kind]
        out[kind] = {"drain_events_per_s_median": statistics.median(r["drain_events_per_s"] for r in mine),
                     "drain_events_per_s_runs": [round(r["drain_events_per_s"]) for r in mine], "lag": []}
        for i, rate in enumerate(rates):
            rows = [r["lag"][i] for r in mine]
            out[kind]["lag"].append({
                "rate": rate, "achieved_rate_median": statistics.median(x["achieved_rate"] for x in rows),
                "lag_p50_ms_median": statistics.median(x["lag_p50_ms"] for x in rows),
                "lag_p99_ms_median": statistics.median(x["lag_p99_ms"] for x in rows),
                "lag_p99_ms_runs": [round(x["lag_p99_ms"], 1) for x in rows]})
    return out


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    kinds = list(summary)
    left.bar(kinds, [summary[k]["drain_events_per_s_median"] for k in kinds], color=["#3b6ea5", "#e08a3c"][:len(kinds)])
    left.axhline(5000, color="red", linestyle="--", label="target 5,000/s")
    left.set_ylabel("usage events / s into the ledger (median)")
    left.set_title("ingest rate (drain of a backlog)")
    left.legend()
    for kind in kinds:
        lag = summary[kind]["lag"]
        right.plot([x["rate"] for x in lag], [x["lag_p99_ms_median"] for x in lag], marker="o", label=f"{kind} p99")
        right.plot([x["rate"] for x in lag], [x["lag_p50_ms_median"] for x in lag], marker=".", linestyle=":",
                   label=f"{kind} p50")
    right.set_xlabel("offered usage events / s")
    right.set_ylabel("arrival -> committed (ms)")
    right.set_yscale("log")
    right.set_title("end-to-end lag")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def main_async(args: argparse.Namespace) -> int:
    folder = Path(tempfile.mkdtemp(prefix="metering-bench-"))
    group = ProcessGroup(folder / "logs")
    port = free_port()
    group.spawn_nats(port, folder / "nats")
    if not wait_for_port(port, 15):
        raise SystemExit("nats-server did not start")
    nats_url = f"nats://127.0.0.1:{port}"
    runs = []
    try:
        for rep in range(args.reps):
            for kind in args.databases:
                runs.append(await run_one(kind, args, group, nats_url, folder, rep))
    finally:
        group.stop()
    summary = summarize(runs, args.rates)
    report = {"command": "python -m loadtests.metering_ingest " + " ".join(sys.argv[1:]), "events": args.events,
              "rate_seconds": args.rate_seconds, "summary": summary, "runs": runs,
              "machine": f"{os.cpu_count()} cores; metering, NATS, Postgres and the publisher share them"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(summary, out / "report.png")
    print(json.dumps(summary, indent=2))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--databases", default="postgres,sqlite", type=lambda s: s.split(","))
    parser.add_argument("--events", type=int, default=50_000)
    parser.add_argument("--rates", default="1000,2500,5000", type=lambda s: [float(x) for x in s.split(",")])
    parser.add_argument("--rate-seconds", type=float, default=10.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default="docs/results/metering_ingest")
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
