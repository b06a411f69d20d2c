"""What still works on east, over time, once west is killed or hung: the numbers in docs/deployments.md.

    python -m infermesh.supercluster_probe --fault kill                 # with the witness (the default)
    python -m infermesh.supercluster_probe --fault kill --leader-in west    # the meta group re-elects
    python -m infermesh.supercluster_probe --fault kill --no-witness    # east's JetStream API stops
    python -m infermesh.supercluster_probe --fault pause --ping-interval-s 1

Two deployments (namespaces ``east`` and ``west``, one server each) on a fresh supercluster; west answers
pings on its subject and holds a KV bucket. After the fault each operation below is tried from a client of
east at the chosen times, each with a 2 s limit, and the result (ok, no_responders, timeout, or the
JetStream error code) printed with how long it took, as one markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Awaitable, Callable, Sequence

import nats
from nats.js.api import KeyValueConfig
from nats.js.errors import APIError

from infermesh.nats_topology import plan_supercluster
from infermesh.supercluster import Supercluster

LIMIT_S = 2.0


async def outcome(call: Callable[[], Awaitable[object]]) -> str:
    started = time.monotonic()
    try:
        await asyncio.wait_for(call(), LIMIT_S)
        result = "ok"
    except nats.errors.NoRespondersError:
        result = "no_responders"
    except (asyncio.TimeoutError, nats.errors.TimeoutError):
        result = "timeout"
    except APIError as exc:
        result = f"error {exc.err_code}"
    return f"{result} ({time.monotonic() - started:.3f} s)"


async def probe(fault: str, witness: bool, ping_interval_s: float | None, at_s: Sequence[float],
                leader_in: str = "") -> None:
    with tempfile.TemporaryDirectory() as folder:
        plan = plan_supercluster(["east", "west"], 1, Path(folder), witness=witness, ping_interval_s=ping_interval_s)
        with Supercluster(plan) as supercluster:
            if leader_in:
                move_leader(supercluster, leader_in)
            await run(supercluster, fault, at_s)


def move_leader(supercluster: Supercluster, cluster: str, tries: int = 10) -> None:
    """Restart the meta leader's server until the leader is in ``cluster`` (the election is by chance)."""
    for _ in range(tries):
        leader = supercluster.meta_leader("east-0")
        if leader and supercluster.plan.server(leader).cluster == cluster:
            return
        if leader:
            supercluster.kill_server(leader)
            supercluster.start_server(leader)
        supercluster.wait_ready(60)
    raise RuntimeError(f"the meta leader did not land in {cluster} in {tries} elections")


async def quiet(_: Exception) -> None:
    """nats-py prints every connection error by default; west's going away is the point here."""


async def run(supercluster: Supercluster, fault: str, at_s: Sequence[float]) -> None:
    west = await nats.connect(supercluster.plan.url("west"), allow_reconnect=False, error_cb=quiet)
    east = await nats.connect(supercluster.plan.url("east"), error_cb=quiet)
    js = east.jetstream(timeout=LIMIT_S)

    async def pong(msg: nats.aio.msg.Msg) -> None:
        await msg.respond(b"pong")

    await west.subscribe("west.worker.w1.ping", cb=pong)
    await (await west.jetstream().create_key_value(KeyValueConfig(bucket="west_workers"))).put("w1", b"x")
    own = await js.create_key_value(KeyValueConfig(bucket="east_workers"))
    await js.add_stream(name="east_usage", subjects=["east.usage"])
    west_kv = await js.key_value("west_workers")
    made = iter(range(1_000_000))
    watch = await own.watch("watched")  # made before the fault: does it keep delivering?
    await watch.updates(timeout=LIMIT_S)  # None: no value yet

    async def watched() -> None:
        value = str(next(made)).encode()
        await own.put("watched", value)
        while (entry := await watch.updates(timeout=LIMIT_S)) is None or entry.value != value:
            pass
    operations: dict[str, Callable[[], Awaitable[object]]] = {
        "request to west's subject": lambda: east.request("west.worker.w1.ping", b"", timeout=LIMIT_S),
        "KV get, west's bucket": lambda: west_kv.get("w1"),
        "KV put, east's bucket": lambda: own.put("e1", b"y"),
        "KV get, east's bucket": lambda: own.get("e1"),
        "stream publish, east's": lambda: js.publish("east.usage", b"u"),
        "existing watch sees a put, east's": watched,
        "new watch (consumer), east's": lambda: own.watch("e1"),
        "create a bucket on east": lambda: js.create_key_value(KeyValueConfig(bucket=f"east_new{next(made)}")),
    }
    leader = supercluster.meta_leader("east-0")
    (supercluster.kill_cluster if fault == "kill" else supercluster.pause_cluster)("west")
    faulted = time.monotonic()
    rows = []
    for at in at_s:
        await asyncio.sleep(max(0.0, faulted + at - time.monotonic()))
        rows.append((f"{time.monotonic() - faulted:.1f}", supercluster.meta_leader("east-0") or "none",
                     [await outcome(call) for call in operations.values()]))
    print(f"fault: {fault} west; meta leader before: {leader}")
    print("| t after fault (s) | meta leader | " + " | ".join(operations) + " |")
    print("|---" * (len(operations) + 2) + "|")
    for at, now_leader, results in rows:
        print(f"| {at} | {now_leader} | " + " | ".join(results) + " |")
    if fault == "pause":
        supercluster.resume_cluster("west")
    else:
        await asyncio.to_thread(supercluster.start_cluster, "west")
        west = await nats.connect(supercluster.plan.url("west"), error_cb=quiet)
        await west.subscribe("west.worker.w1.ping", cb=pong)
    back = time.monotonic()
    while (await outcome(operations["request to west's subject"])).startswith(("timeout", "no_responders")):
        await asyncio.sleep(0.05)
    state = "resumed" if fault == "pause" else "ready"
    print(f"west answers again {time.monotonic() - back:.2f} s after it was {state}")
    await east.close()
    await west.close()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m infermesh.supercluster_probe", description=__doc__.split("\n")[0])
    parser.add_argument("--fault", choices=["kill", "pause"], default="kill")
    parser.add_argument("--no-witness", dest="witness", action="store_false")
    parser.add_argument("--ping-interval-s", type=float, default=None)
    parser.add_argument("--leader-in", default="", choices=["", "east", "west"],
                        help="restart servers until the JetStream meta leader is in this cluster first")
    parser.add_argument("--at", type=float, nargs="+", default=[0.1, 3, 6, 9, 12, 20],
                        help="seconds after the fault to try every operation (default 0.1 3 6 9 12 20)")
    args = parser.parse_args(argv)
    asyncio.run(probe(args.fault, args.witness, args.ping_interval_s, args.at, args.leader_in))


if __name__ == "__main__":
    main()
