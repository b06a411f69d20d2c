"""shared/schema.py (msgpack codec of bus messages) and shared/subjects.py (subject names)."""

from __future__ import annotations

import msgspec
import pytest

from shared.schema import (
    AbortRequest,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    GenerateRequest,
    KvEventBatch,
    LoadRequest,
    LoadSnapshot,
    RouteDecision,
    RouteRejected,
    RouteReply,
    RouteRequest,
    SamplingParams,
    StreamEnd,
    StreamError,
    StreamMessage,
    TokenChunk,
    WorkerInfo,
    decode,
    encode,
)
from shared.subjects import Subjects

SAMPLING = SamplingParams(max_tokens=8, temperature=0.2, top_p=0.9, seed=7, stop_token_ids=[1, 2], ignore_eos=True)
KV_EVENTS = [
    BlockStored(block_hashes=[11, 12], parent_block_hash=None, token_ids=list(range(32)), block_size=16),
    BlockStored(block_hashes=[13], parent_block_hash=12, token_ids=[1] * 16, block_size=16, lora_id=3, medium="GPU"),
    BlockRemoved(block_hashes=[11], medium="GPU"),
    AllBlocksCleared(),
]

STRUCTS = [
    WorkerInfo("w1", "decode", "m", "sim", 16, 100, 2048, "/tok", kv_dtype="fp8", heartbeat_ttl_s=3.0,
               started_at=1.5, ts=2.5),
    LoadRequest(),
    LoadSnapshot("w1", 4, 1.25, 2, 1, 30, 100, num_aborted_total=1, num_finished_total=9),
    RouteRequest("r1", "m", 42, session_id="s", exclude_worker_ids=["w2"]),
    RouteRequest("r1", "m", 42),
    SAMPLING,
    SamplingParams(max_tokens=1),
    GenerateRequest("r1", "m", [1, 2, 3], SAMPLING, attempt=1),
    AbortRequest("r1"),
    KvEventBatch("w1", 3, 1.0, KV_EVENTS),
    KvEventBatch("w1", 4, 1.0, []),
]


@pytest.mark.parametrize("message", STRUCTS, ids=lambda m: type(m).__name__)
def test_struct_round_trip(message):
    assert decode(encode(message), type(message)) == message


@pytest.mark.parametrize(
    "message, union",
    [
        (TokenChunk("w1", 1, 1.0, "r1", [5, 6]), StreamMessage),
        (StreamEnd("w1", 2, 1.0, "r1", "length", 10, 4, 2), StreamMessage),
        (StreamError("w1", 3, 1.0, "r1", "engine_error", "boom"), StreamMessage),
        (RouteDecision("w1", num_cached_tokens_expected=32), RouteReply),
        (RouteRejected("no_capacity", "none"), RouteReply),
    ],
    ids=lambda x: getattr(x, "__name__", type(x).__name__),
)
def test_tagged_union_round_trip(message, union):
    got = decode(encode(message), union)
    assert type(got) is type(message)
    assert got == message


def test_kv_events_keep_their_kinds():
    got = decode(encode(KvEventBatch("w1", 1, 0.0, KV_EVENTS)), KvEventBatch)
    assert [type(e) for e in got.events] == [BlockStored, BlockStored, BlockRemoved, AllBlocksCleared]


@pytest.mark.parametrize(
    "message, kind",
    [
        (TokenChunk("w1", 1, 1.0, "r1", [5]), RouteReply),  # wrong tag for the union
        (AbortRequest("r1"), LoadSnapshot),  # missing fields
    ],
)
def test_decode_wrong_kind_fails(message, kind):
    with pytest.raises(msgspec.ValidationError):
        decode(encode(message), kind)


def test_load_snapshot_kv_usage():
    assert LoadSnapshot("w", 0, 0.0, 0, 0, 25, 100).kv_usage == 0.25
    assert LoadSnapshot("w", 0, 0.0, 0, 0, 25, 0).kv_usage == 0.0


@pytest.mark.parametrize(
    "name, expected",
    [
        (lambda s: s.route, "{ns}.router.route"),
        (lambda s: s.worker_generate("w1"), "{ns}.worker.w1.generate"),
        (lambda s: s.worker_abort("w1"), "{ns}.worker.w1.abort"),
        (lambda s: s.worker_load("w1"), "{ns}.worker.w1.load"),
        (lambda s: s.load("w1"), "{ns}.load.w1"),
        (lambda s: s.load_all, "{ns}.load.*"),
        (lambda s: s.kv_events("w1"), "{ns}.kv.w1"),
        (lambda s: s.kv_events_all, "{ns}.kv.*"),
        (lambda s: s.stream_prefix("e1"), "{ns}.stream.e1"),
        (lambda s: s.stream("e1", "r1"), "{ns}.stream.e1.r1"),
        (lambda s: s.workers_bucket, "{ns}_workers"),
    ],
)
@pytest.mark.parametrize("namespace", [None, "t42"])
def test_subject_names(name, expected, namespace):
    subjects = Subjects() if namespace is None else Subjects(namespace)
    assert name(subjects) == expected.format(ns=namespace or "im")


@pytest.mark.parametrize("namespace", ["", "a.b", "a*", "a>", "a b", "a\tb"])
def test_invalid_namespace(namespace):
    with pytest.raises(ValueError):
        Subjects(namespace)


@pytest.mark.parametrize("bad_id", ["", "w.1", "w*", "*", ">", "w 1"])
@pytest.mark.parametrize("build", [lambda s, x: s.worker_generate(x), lambda s, x: s.stream_prefix(x),
                                   lambda s, x: s.stream(x, "r1")], ids=["worker_generate", "stream_prefix", "stream"])
def test_invalid_ids(build, bad_id):
    with pytest.raises(ValueError):
        build(Subjects("ns"), bad_id)


def test_usage_and_dead_letters_round_trip():
    from shared.schema import DeadLetter, UsageEvent

    usage = UsageEvent("r1", 1, "alpha", "im-abc", "m", "failed", "worker_unavailable", 10, 2, 5, 1.5, 9.0, "w1",
                       "w0", "ab" * 16, 1.7e9)
    assert decode(encode(usage), UsageEvent) == usage
    letter = DeadLetter(reason="rejected", error="DataError: value too long", stream_seq=7, subject="im.usage",
                        data=encode(usage), headers={"Nats-Msg-Id": "r1:1"}, ts=1.7e9)
    assert decode(encode(letter), DeadLetter) == letter


def test_a_stream_error_code_outside_the_closed_set_does_not_decode():
    bad = StreamError("w1", 3, 1.0, "r1", "exploded", "boom")  # type: ignore[arg-type]
    with pytest.raises(msgspec.ValidationError):
        decode(encode(bad), StreamMessage)


def test_usage_subjects_and_streams():
    subjects = Subjects("t1")
    assert (subjects.usage, subjects.usage_stream) == ("t1.usage", "t1_usage")
    assert (subjects.usage_dead_letters, subjects.usage_dead_letter_stream) == ("t1.usage_dlq", "t1_usage_dlq")
