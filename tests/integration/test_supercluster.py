"""Two deployments' NATS clusters joined by a gateway (infermesh/nats_topology.py), seen through the project's Bus.

Each deployment has its own namespace; a client of one cluster uses the other's namespace to reach it. The
failure tests print what they measured (``pytest -s``); docs/deployments.md records it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, AsyncIterator

import nats
import pytest
from nats.aio.msg import Msg

from infermesh.nats_topology import SuperclusterPlan, plan_supercluster
from infermesh.supercluster import Supercluster
from shared.bus import Bus, BusError
from shared.kv_cas import cas_put, ensure_bucket, get_last
from shared.kv_watch import follow
from shared.schema import WorkerPing, WorkerPong
from shared.usage import ensure_usage_stream
from tests.utils import eventually

pytestmark = pytest.mark.integration
PING_S = 1.0  # servers ping every connection each second, and drop one after 2 missed: a hung peer in ~2-3 s


def _ns() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


def _start(folder: Any, witness: bool = True) -> Supercluster:
    supercluster = Supercluster(plan_supercluster(["east", "west"], 1, folder, witness=witness,
                                                  ping_interval_s=PING_S))
    supercluster.start(timeout_s=60)
    return supercluster


@pytest.fixture(scope="module")
def shared_sc(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One supercluster for the tests that leave it as they found it."""
    supercluster = _start(tmp_path_factory.mktemp("supercluster"))
    yield supercluster
    supercluster.stop()


@pytest.fixture
def own_sc(tmp_path: Any) -> Any:
    """A supercluster of the test's own, for the tests that kill or pause a cluster."""
    supercluster = _start(tmp_path)
    yield supercluster
    supercluster.stop()


class Buses:
    """Connections to one supercluster, closed together."""

    def __init__(self, plan: SuperclusterPlan) -> None:
        self.plan = plan
        self._open: list[Bus] = []

    async def on(self, cluster: str, namespace: str, name: str = "test") -> Bus:
        bus = await Bus.connect(self.plan.url(cluster), namespace, f"{name}-{cluster}")
        self._open.append(bus)
        return bus

    async def close(self) -> None:
        for bus in self._open:  # a test that failed may leave a cluster paused: its buses cannot drain
            try:
                await asyncio.wait_for(bus.close(), 5)
            except (asyncio.TimeoutError, nats.errors.Error):
                pass


@pytest.fixture
async def buses(request: pytest.FixtureRequest) -> AsyncIterator[Buses]:
    supercluster = request.getfixturevalue("own_sc" if "own_sc" in request.fixturenames else "shared_sc")
    opened = Buses(supercluster.plan)
    yield opened
    await opened.close()


async def answer_pings(bus: Bus, worker_id: str, queue: str = "") -> Any:
    async def on_ping(_: WorkerPing, raw: Msg) -> None:
        await bus.respond(raw, WorkerPong(worker_id, 0.0))

    subscription = await bus.subscribe(bus.subjects.worker_ping("w1"), WorkerPing, on_ping, queue=queue)
    await bus.nc.flush()
    return subscription


async def ping(bus: Bus, timeout: float = 1.0) -> str:
    return (await bus.request(bus.subjects.worker_ping("w1"), WorkerPing(), WorkerPong, timeout=timeout)).worker_id


async def answered(bus: Bus) -> bool:
    """Whether a ping is answered now (interest crosses a gateway a moment after a subscription is made)."""
    try:
        await ping(bus, timeout=0.5)
        return True
    except BusError:
        return False


async def no_responders(bus: Bus) -> bool:
    """Whether a ping fails with NATS's no-responders status (not a timeout, not an answer)."""
    try:
        await ping(bus, timeout=0.5)
    except BusError as exc:
        return "no responder" in str(exc)
    return False


class Follower:
    """A KV bucket as a watch keeps it: key -> value, through shared/kv_watch.follow."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self._watcher: Any = None
        self._task: asyncio.Task[None] | None = None

    async def start(self, bus: Bus, bucket: str) -> "Follower":
        self._watcher = await (await bus.js.key_value(bucket)).watchall()
        self._task = asyncio.create_task(follow(self._watcher, bucket, lambda k, v, _: self.values.__setitem__(k, v),
                                                lambda k: self.values.pop(k, None), lambda: None))
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._watcher is not None:
            await self._watcher.stop()


async def put(bus: Bus, bucket: str, key: str, value: bytes) -> None:
    _, revision = await get_last(bus, bucket, key)
    await cas_put(bus, bucket, key, value, revision)


# ---------------------------------------------------------------- a healthy supercluster
async def test_a_responder_on_west_answers_a_client_of_east(buses):
    west_ns = _ns()
    await answer_pings(await buses.on("west", west_ns), "w1")
    east = await buses.on("east", west_ns)
    await eventually(lambda: answered(east), 5)
    started = time.monotonic()
    assert [await ping(east) for _ in range(20)] == ["w1"] * 20
    print(f"measured: request/reply east -> west {(time.monotonic() - started) / 20 * 1000:.2f} ms each")


async def test_queue_group_members_on_west_share_requests_from_east_exactly_once(buses):
    west_ns = _ns()
    for replica in ("r1", "r2"):
        await answer_pings(await buses.on("west", west_ns, replica), replica, queue="router")
    east = await buses.on("east", west_ns)
    await eventually(lambda: answered(east), 5)
    answers = [await ping(east) for _ in range(40)]
    assert len(answers) == 40 and set(answers) == {"r1", "r2"}


async def test_a_queue_group_serves_a_request_in_the_clients_own_cluster_first(buses):
    namespace = _ns()
    await answer_pings(await buses.on("west", namespace, "far"), "far", queue="router")
    near = await answer_pings(await buses.on("east", namespace, "near"), "near", queue="router")
    east = await buses.on("east", namespace)
    assert [await ping(east) for _ in range(20)] == ["near"] * 20
    await near.unsubscribe()
    await eventually(lambda: answered(east), 5)
    assert await ping(east) == "far"


async def test_a_kv_bucket_made_on_west_is_readable_and_watchable_from_east(buses):
    west_ns = _ns()
    west = await buses.on("west", west_ns)
    bucket = west.subjects.workers_bucket
    await ensure_bucket(west, bucket)
    await put(west, bucket, "w1", b"one")
    east = await buses.on("east", west_ns)
    assert (await get_last(east, bucket, "w1"))[0] == b"one"
    assert (await east.js.stream_info(f"KV_{bucket}")).cluster.name == "west"
    follower = await Follower().start(east, bucket)
    try:
        await eventually(lambda: follower.values.get("w1") == b"one", 5)
        await put(west, bucket, "w1", b"two")
        await put(east, bucket, "w2", b"written from east")  # a write from east lands in west's bucket too
        await eventually(lambda: follower.values == {"w1": b"two", "w2": b"written from east"}, 5)
        assert (await get_last(west, bucket, "w2"))[0] == b"written from east"
    finally:
        await follower.stop()


async def test_a_stream_made_by_a_client_of_east_is_placed_in_east_and_takes_usage_from_west_once(buses):
    east_ns = _ns()
    east = await buses.on("east", east_ns)
    await ensure_usage_stream(east)
    assert (await east.js.stream_info(east.subjects.usage_stream)).cluster.name == "east"
    west = await buses.on("west", east_ns)
    for _ in range(2):  # the same usage event twice: the stream's duplicate window keeps one
        ack = await west.js.publish(west.subjects.usage, b"usage", headers={"Nats-Msg-Id": "req-1:0"})
        assert ack.stream == east.subjects.usage_stream
    assert (await east.js.stream_info(east.subjects.usage_stream)).state.messages == 1


# ---------------------------------------------------------------- a cluster lost, hung, and back
async def test_when_west_is_killed_east_keeps_working_and_wests_subjects_fail_fast(own_sc, buses):
    east_ns, west_ns = _ns(), _ns()
    west = await buses.on("west", west_ns)
    await answer_pings(west, "w1")
    await ensure_bucket(west, west.subjects.workers_bucket)
    await put(west, west.subjects.workers_bucket, "w1", b"before")
    east_of_west = await buses.on("east", west_ns)  # an edge of east, reaching west's deployment
    east = await buses.on("east", east_ns)
    await ensure_bucket(east, east.subjects.workers_bucket)
    await eventually(lambda: answered(east_of_west), 5)
    follower = await Follower().start(east_of_west, west.subjects.workers_bucket)
    try:
        await eventually(lambda: follower.values.get("w1") == b"before", 5)

        leader = own_sc.meta_leader("east-0")
        own_sc.kill_cluster("west")
        took = await eventually(lambda: no_responders(east_of_west), 2)
        started = time.monotonic()
        assert await no_responders(east_of_west)
        print(f"measured: request to killed west: no responders {took:.3f} s after the kill, then each in "
              f"{(time.monotonic() - started) * 1000:.1f} ms")

        js = east_of_west.nc.jetstream(timeout=1.0)  # west's buckets answer nothing: the JS API times out
        started = time.monotonic()
        with pytest.raises(nats.errors.TimeoutError):
            await js.get_last_msg(f"KV_{west.subjects.workers_bucket}", f"$KV.{west.subjects.workers_bucket}.w1")
        print(f"measured: KV get of killed west's bucket: timeout after {time.monotonic() - started:.2f} s")

        await put(east, east.subjects.workers_bucket, "e1", b"still")  # east's own JetStream: puts and gets
        assert (await get_last(east, east.subjects.workers_bucket, "e1"))[0] == b"still"
        took = await eventually(lambda: watch_opens(east, east.subjects.workers_bucket), 30, interval_s=0.2)
        print(f"measured: a new watch (consumer) on east works {took:.2f} s after the kill "
              f"(meta leader {leader} before, {own_sc.meta_leader('east-0')} now)")

        await asyncio.to_thread(own_sc.start_cluster, "west")
        back = time.monotonic()
        await eventually(lambda: answered(east_of_west), 15)
        print(f"measured: west answers again {time.monotonic() - back:.2f} s after it was ready")
        await put(west, west.subjects.workers_bucket, "w1", b"after")  # west's bus reconnected by itself
        took = await eventually(lambda: follower.values.get("w1") == b"after", 30)
        print(f"measured: east's old watch on west's bucket saw west's new put {took:.2f} s after it")
    finally:
        await follower.stop()


async def watch_opens(bus: Bus, bucket: str) -> bool:
    try:
        watcher = await (await bus.nc.jetstream(timeout=1.0).key_value(bucket)).watchall()
    except (nats.errors.Error, asyncio.TimeoutError):
        return False
    await watcher.stop()
    return True


async def test_a_hung_west_times_out_until_the_gateway_pings_give_up_then_fails_fast(own_sc, buses):
    west_ns = _ns()
    await answer_pings(await buses.on("west", west_ns), "w1")
    east_of_west = await buses.on("east", west_ns)
    await eventually(lambda: answered(east_of_west), 5)
    own_sc.pause_cluster("west")
    paused = time.monotonic()
    with pytest.raises(BusError, match="timeout"):
        await ping(east_of_west, timeout=0.5)
    took = await eventually(lambda: no_responders(east_of_west), 20)
    print(f"measured: hung west (SIGSTOP), ping_interval {PING_S} s x2: timeouts, then no responders "
          f"{time.monotonic() - paused:.2f} s after the pause")
    assert took >= PING_S  # the gateway stayed up (messages went into the void) for at least one ping
    own_sc.resume_cluster("west")
    took = await eventually(lambda: answered(east_of_west), 15)
    print(f"measured: resumed west answers again after {took:.2f} s")


async def test_without_a_witness_losing_west_stops_easts_jetstream_api(tmp_path):
    supercluster = _start(tmp_path, witness=False)
    east = await Bus.connect(supercluster.plan.url("east"), _ns(), "east")
    try:
        await ensure_bucket(east, east.subjects.workers_bucket)
        assert await watch_opens(east, east.subjects.workers_bucket)
        supercluster.kill_cluster("west")
        await put(east, east.subjects.workers_bucket, "e1", b"a put is a publish: it goes on")
        assert not await watch_opens(east, east.subjects.workers_bucket)  # a consumer needs the meta quorum
        await asyncio.to_thread(supercluster.start_cluster, "west")
        await eventually(lambda: watch_opens(east, east.subjects.workers_bucket), 30, interval_s=0.2)
    finally:
        await east.close()
        supercluster.stop()
