"""services/router/session_store.py on real NATS: one binding per session under concurrent writers, idle TTL."""

from __future__ import annotations

import asyncio

import pytest

from services.router.session_store import BindingConflict, SessionStore, session_key
from shared.bus import Bus
from shared.schema import SessionBinding
from tests.utils import eventually

pytestmark = pytest.mark.integration


@pytest.fixture
async def buses(nats_url, namespace):
    opened = [await Bus.connect(nats_url, namespace, f"replica-{i}") for i in range(4)]
    yield opened
    for bus in opened:
        await bus.close()


async def test_concurrent_binders_of_one_session_end_with_one_binding(buses):
    stores = [SessionStore(bus, idle_ttl_s=60) for bus in buses]
    for store in stores:
        await store.start()
    for round_ in range(20):
        session = f"session-{round_}"
        seen = [await store.get(session) for store in stores]
        assert all(binding is None for binding, _ in seen)
        results = await asyncio.gather(*(
            store.put(SessionBinding(session, f"w{i}", 1.0), revision) for i, (store, (_, revision))
            in enumerate(zip(stores, seen, strict=True))), return_exceptions=True)
        winners = [i for i, r in enumerate(results) if not isinstance(r, BaseException)]
        assert len(winners) == 1, results
        assert all(isinstance(r, BindingConflict) for i, r in enumerate(results) if i not in winners)
        for store in stores:  # every replica reads the one winner
            binding, revision = await store.get(session)
            assert binding.worker_id == f"w{winners[0]}" and revision == results[winners[0]]


async def test_a_repin_names_the_revision_it_replaces(buses):
    store = SessionStore(buses[0], idle_ttl_s=60)
    await store.start()
    first = await store.put(SessionBinding("s", "w1", 1.0), 0)
    second = await store.put(SessionBinding("s", "w2", 2.0, repins=1, reason="gone"), first)
    with pytest.raises(BindingConflict):  # a replica still holding the first revision loses
        await store.put(SessionBinding("s", "w3", 3.0, repins=1, reason="gone"), first)
    binding, revision = await store.get("s")
    assert (binding.worker_id, binding.repins, binding.reason, revision) == ("w2", 1, "gone", second)
    assert binding.ts > 0


async def test_an_idle_session_lapses_and_binds_afresh(buses):
    store = SessionStore(buses[0], idle_ttl_s=1)
    await store.start()
    await store.put(SessionBinding("idle", "w1", 1.0), 0)
    assert (await store.get("idle"))[0] is not None

    async def lapsed() -> bool:
        return (await store.get("idle"))[0] is None

    await eventually(lapsed, 5, 0.1)
    _, revision = await store.get("idle")
    await store.put(SessionBinding("idle", "w2", 2.0), revision)  # the expiry marker's revision
    assert (await store.get("idle"))[0].worker_id == "w2"


def test_session_keys_are_valid_kv_keys_for_any_id():
    for session in ("plain", "with spaces/and.dots", "ünïcode", "x" * 256):
        key = session_key(session)
        assert key.startswith("s-") and len(key) == 34 and key[2:].isalnum()
    assert session_key("a") != session_key("b")


async def test_a_session_id_is_its_teams_another_team_naming_it_binds_its_own(buses):
    store = SessionStore(buses[0], idle_ttl_s=60)
    await store.start()
    await store.put(SessionBinding("shared-id", "w1", 1.0, team="alpha"), 0)
    theirs, revision = await store.get("shared-id", "beta")
    assert theirs is None  # beta sees nothing of alpha's session...
    await store.put(SessionBinding("shared-id", "w2", 2.0, team="beta"), revision)
    assert (await store.get("shared-id", "alpha"))[0].worker_id == "w1"  # ...and binding its own moves nothing
    assert (await store.get("shared-id", "beta"))[0].worker_id == "w2"


def test_session_keys_differ_by_team_and_never_collide_across_the_split():
    assert session_key("s", "alpha") != session_key("s", "beta")
    assert session_key("bc", "a") != session_key("c", "ab")  # the same joined text, another (team, id)
