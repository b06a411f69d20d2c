"""Stream and bucket replication on a real 3-server NATS cluster (routes on loopback): with
INFERMESH_STREAM_REPLICAS=3 every stream, bucket and object store provisioning makes has three copies, and with
one server SIGKILLed the usage stream and a bucket still take writes and keep what they had. A setting the
cluster cannot hold fails provisioning at once."""

from __future__ import annotations

import asyncio
import time
import uuid

import nats.errors
import nats.js.errors
import pytest

from infermesh.bus_auth import provision
from infermesh.bus_roles import streams
from infermesh.nats_topology import plan_supercluster
from infermesh.supercluster import Supercluster
from shared.bus import Bus
from shared.nats_auth import NatsCredentials
from shared.replication import ENV, replicas_for_cluster, stream_replicas


def test_the_setting_is_read_in_one_place_and_follows_the_cluster_size():
    assert stream_replicas({}) == 1 and stream_replicas({ENV: "3"}) == 3
    for bad in ("0", "6", "three"):
        with pytest.raises(ValueError, match=ENV):
            stream_replicas({ENV: bad})
    assert [replicas_for_cluster(n) for n in (1, 2, 3, 5)] == [1, 1, 3, 3]


async def _until_written(write, within_s: float = 20.0):
    """``write()``'s result once a leader takes it (a lost leader is replaced within seconds)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return await write()
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError, nats.js.errors.NoStreamResponseError,
                nats.js.errors.ServiceUnavailableError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


@pytest.fixture
def cluster(tmp_path):
    with Supercluster(plan_supercluster(["c"], 3, tmp_path, witness=False)) as running:
        yield running


async def test_provisioned_streams_have_three_copies_and_survive_a_lost_server(cluster, monkeypatch):
    monkeypatch.setenv(ENV, "3")
    namespace, url = f"r{uuid.uuid4().hex[:6]}", cluster.plan.url("c")
    await provision(url, namespace, NatsCredentials())
    bus = await Bus.connect(url, namespace, "test-replication", NatsCredentials())
    try:
        for name in streams(bus.subjects):  # the buckets' and object stores' streams included
            info = await bus.js.stream_info(name)
            assert info.config.num_replicas == 3 and len(info.cluster.replicas) == 2, name
        workers = await bus.js.key_value(bus.subjects.workers_bucket)
        await workers.put("before", b"1")
        await bus.js.publish(bus.subjects.usage, b"{}", timeout=10)

        leader = (await bus.js.stream_info(f"KV_{bus.subjects.workers_bucket}")).cluster.leader
        cluster.kill_server(leader)  # the bucket's own leader: a new one is elected from the copies
        # until then a write finds no responder (as a service's does: each retries its writes)
        await _until_written(lambda: workers.put("after", b"2"))
        assert (await workers.get("before")).value == b"1" and (await workers.get("after")).value == b"2"
        ack = await _until_written(lambda: bus.js.publish(bus.subjects.usage, b"{}", timeout=5))
        assert ack.seq == 2  # the first message is kept: the stream goes on from it
    finally:
        await bus.close()


async def test_more_replicas_than_servers_fails_provisioning(cluster, monkeypatch):
    monkeypatch.setenv(ENV, "5")
    with pytest.raises(Exception, match="no suitable peers for placement"):
        await provision(cluster.plan.url("c"), f"r{uuid.uuid4().hex[:6]}", NatsCredentials())
