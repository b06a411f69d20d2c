"""services/edge/attempt.py: one request's attempts, on a fake clock (times are the ``now`` passed in).

The table feeds a ``RequestRun`` the router's answers, stream messages and the client leaving, and compares every
step's actions, abbreviated by ``brief``; ``drive`` also checks that the request settles exactly once however it
ends, and that nothing after that settles it again. The tests after the table look inside the actions: what is
sent (prefill, migration), the time to first token, the errors raised and the one usage record billed."""

from __future__ import annotations

import msgspec
import pytest

from services.edge.attempt import (
    TERMINAL,
    Abort,
    Action,
    Close,
    Emit,
    Fail,
    Finish,
    Limits,
    Phase,
    Report,
    RequestRun,
    Route,
    Send,
    Settle,
    StreamBroken,
    Usage,
)
from services.edge.errors import stream_failure
from services.edge.text import IncrementalDetokenizer, StopStringMatcher
from shared import errors
from shared.schema import (
    BillingContext,
    KvTransfer,
    RouteDecision,
    RouteRequest,
    SamplingParams,
    StreamEnd,
    StreamError,
    TokenChunk,
)

PROMPT = [101, 102, 103, 104]
HALF, TAIL = 1000, 1001  # the two tokens of "é": the first alone decodes to U+FFFD
KV = KvTransfer("p1", "r-prefill", len(PROMPT))
SAMPLING = SamplingParams(max_tokens=16, temperature=0.7, top_p=0.9, seed=42, stop_token_ids=[7])


class FakeDecoder:
    """Token id n is chr(n), except HALF + TAIL, which decode to "é" together (HALF alone to U+FFFD)."""

    def decode(self, token_ids, skip_special_tokens=True):
        assert skip_special_tokens
        out = []
        for i, t in enumerate(token_ids):
            if t == HALF:
                out.append("é" if token_ids[i + 1:i + 2] == [TAIL] else "\ufffd")
            elif t == TAIL:
                out.append("" if i and token_ids[i - 1] == HALF else "\ufffd")
            else:
                out.append(chr(t))
        return "".join(out)


def make_run(stop=(), max_tokens=16, retries=1, migrations=3, klass="interactive") -> RequestRun:
    billing = BillingContext(request_id="r", attempt=0, team="t", key_prefix="sk-t", model="m",
                             request_class=klass, worker_id="")
    return RequestRun("r", "m", list(PROMPT), msgspec.structs.replace(SAMPLING, max_tokens=max_tokens),
                      RouteRequest("r", "m", len(PROMPT), "s1", [], [11, 12], 2), IncrementalDetokenizer(FakeDecoder()),
                      StopStringMatcher(list(stop)), billing, "salt", Limits(retries, migrations))


# ---------------------------------------------------------------- inputs
def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def routed(worker: str, prefill: str = ""):
    return ("routed", RouteDecision(worker, prefill_worker_id=prefill))


def no_route(code: str = "no_capacity", message: str = "no worker left"):
    return ("route_failed", errors.service_unavailable(message, code))


def tok(text_or_ids, stream: str = "r"):
    token_ids = ids(text_or_ids) if isinstance(text_or_ids, str) else text_or_ids
    return ("msg", TokenChunk("w", 0, 0.0, stream, token_ids))


PROMPT_LEN = len(PROMPT)


def end(reason="stop", stream="r", prompt=PROMPT_LEN, cached=0, output=0, kv=None):
    return ("msg", StreamEnd("w", 0, 0.0, stream, reason, prompt, cached, output, kv))


def err(code: str, stream: str = "r", message: str = "it went away"):
    return ("msg", StreamError("w", 0, 0.0, stream, code, message))


LEFT = ("left",)


def feed(run: RequestRun, event, now: float) -> list[Action]:
    kind, *arg = event
    if kind == "routed":
        return run.routed(arg[0], now)
    if kind == "route_failed":
        return run.route_failed(arg[0])
    if kind == "left":
        return run.client_left()
    return run.message(arg[0], now)


def brief(action: Action) -> tuple:
    if isinstance(action, Route):
        return ("route", action.request.request_id, *action.request.exclude_worker_ids)
    if isinstance(action, Send):
        return ("prefill" if action.prefill else "send", action.worker_id, action.request.request_id)
    if isinstance(action, Emit):
        return ("emit", action.text)
    if isinstance(action, Report):
        return ("ok", action.worker_id, action.stream_id) if action.ok else \
            ("bad", action.worker_id, action.stream_id, action.kind)
    if isinstance(action, Abort):
        kind = "drain" if action.drain else "supersede" if action.superseded else "abort"
        return (kind, action.worker_id, action.stream_id)
    if isinstance(action, Close):
        return ("close", action.stream_id)
    if isinstance(action, Settle):
        return ("settle", action.usage.status if action.usage else None)
    if isinstance(action, Finish):
        return ("finish", action.usage.finish_reason)
    assert isinstance(action, Fail)
    if isinstance(action.error, StreamBroken):
        return ("broken",)
    return ("fail", action.error.status, action.error.code)


def drive(run: RequestRun, *events, t0: float = 10.0) -> tuple[list[list[tuple]], list[Action]]:
    """Feed the events one second apart; every step's brief actions and all actions. The request must be settled
    exactly once by the end, with the usage it kept, and nothing later may settle it again."""
    actions = [run.start()]
    for i, event in enumerate(events):
        actions.append(feed(run, event, t0 + i))
    flat = [a for step in actions for a in step]
    settles = [a for a in flat if isinstance(a, Settle)]
    assert len(settles) == 1 and run.settled and run.phase in TERMINAL, settles
    assert run.usage is settles[0].usage and run.usage_so_far() is run.usage
    assert all(f.usage is run.usage for f in flat if isinstance(f, Finish))
    assert run.client_left() == [] and run.message(err("timeout")[1], t0 + 99) == []
    assert run.message(end()[1], t0 + 99) == [] and run.settled
    return [[brief(a) for a in step] for step in actions], flat


def fail_of(flat: list[Action]) -> Exception:
    (fail,) = [a for a in flat if isinstance(a, Fail)]
    return fail.error


def sends(flat: list[Action]) -> list[Send]:
    return [a for a in flat if isinstance(a, Send)]


ROUTE, SEND = [("route", "r")], [("send", "w1", "r")]
DONE = [("settle", "finished"), ("finish", "stop")]
ENDED = [("ok", "w1", "r"), ("close", "r"), *DONE]
PREFILL = [("prefill", "p1", "r-prefill")]
PREFILLED = [("ok", "p1", "r-prefill"), ("close", "r-prefill"), ("send", "w1", "r")]
# the failed attempt's abort is marked superseded: the next attempt bills the request, never the old one's orphan report
RETRY = [("bad", "w1", "r", "worker_unavailable"), ("supersede", "w1", "r"), ("close", "r"), ("route", "r-a1", "w1")]
MIGRATE = [("bad", "w1", "r", "broken"), ("supersede", "w1", "r"), ("close", "r"), ("route", "r-a1", "w1")]
MIGRATED = [("send", "w2", "r-a1")]
RETRY_ENDS = [RETRY[0], ("abort", "w1", "r"), RETRY[2]]  # the request ends with this attempt: a plain abort
MIGRATE_ENDS = [MIGRATE[0], ("abort", "w1", "r"), MIGRATE[2]]
BROKEN = [("settle", "failed"), ("broken",)]
UNBILLED = [("settle", None)]

# (limits and stop strings, events, the actions of start() and of each event)
TABLE = {
    "routed, tokens, end message": (
        {}, [routed("w1"), tok("hi"), end(output=2)],
        [ROUTE, SEND, [("emit", "hi")], ENDED]),
    "a remote prefill ends with a KV handle": (
        {}, [routed("w1", "p1"), tok([9], "r-prefill"), end("remote", "r-prefill", kv=KV), tok("hi"), end()],
        [ROUTE, PREFILL, [], PREFILLED, [("emit", "hi")], ENDED]),
    "a remote prefill ends without a KV handle": (
        {}, [routed("w1", "p1"), end("length", "r-prefill", output=1), tok("hi"), end()],
        [ROUTE, PREFILL, PREFILLED, [("emit", "hi")], ENDED]),
    "a failed remote prefill: the decode worker computes the prompt": (
        {}, [routed("w1", "p1"), err("engine_error", "r-prefill"), tok("hi"), end()],
        [ROUTE, PREFILL, [("bad", "p1", "r-prefill", "engine_error"), ("close", "r-prefill"), ("send", "w1", "r")],
         [("emit", "hi")], ENDED]),
    "a bad request at the prefill is the client's error, not the worker's": (
        {}, [routed("w1", "p1"), err("bad_request", "r-prefill")],
        [ROUTE, PREFILL, [("close", "r-prefill"), *UNBILLED, ("fail", 400, None)]]),
    "a stop string, then the abort's end message": (
        {"stop": ["lo"]}, [routed("w1"), tok("hel"), tok("lo!"), tok("xx"), end("abort", cached=3, output=8)],
        [ROUTE, SEND, [("emit", "he")], [("emit", "l"), ("ok", "w1", "r"), ("drain", "w1", "r")], [],
         [("close", "r"), *DONE]]),
    "a stop string, then an error ends the drain": (
        {"stop": ["lo"]}, [routed("w1"), tok("hello"), err("timeout")],
        [ROUTE, SEND, [("emit", "hel"), ("ok", "w1", "r"), ("drain", "w1", "r")], [("close", "r"), *DONE]]),
    "the end message flushes the text held back for a stop string": (
        {"stop": ["xyz"]}, [routed("w1"), tok("ab"), end("length", output=2)],
        [ROUTE, SEND, [], [("ok", "w1", "r"), ("close", "r"), ("emit", "ab"), ("settle", "finished"),
                           ("finish", "length")]]),
    "an error before the first token: a retry on another worker": (
        {}, [routed("w1"), err("worker_unavailable"), routed("w2"), tok("hi", "r-a1"), end(stream="r-a1")],
        [ROUTE, SEND, RETRY, [("send", "w2", "r-a1")], [("emit", "hi")],
         [("ok", "w2", "r-a1"), ("close", "r-a1"), *DONE]]),
    "the retry fails too: its error is raised, nothing billed": (
        {}, [routed("w1"), err("worker_unavailable"), routed("w2"), err("timeout", "r-a1")],
        [ROUTE, SEND, RETRY, [("send", "w2", "r-a1")],
         [("bad", "w2", "r-a1", "timeout"), ("abort", "w2", "r-a1"), ("close", "r-a1"), *UNBILLED,
          ("fail", 503, "timeout")]]),
    "no retry left (retries=0)": (
        {"retries": 0}, [routed("w1"), err("worker_unavailable")],
        [ROUTE, SEND, [*RETRY_ENDS, *UNBILLED, ("fail", 503, "worker_unavailable")]]),
    "bad_request before the first token: invalid_request, no report": (
        {}, [routed("w1"), err("bad_request")],
        [ROUTE, SEND, [("abort", "w1", "r"), ("close", "r"), *UNBILLED, ("fail", 400, None)]]),
    "a non-retryable stream error before the first token": (
        {}, [routed("w1"), err("shutdown")],
        [ROUTE, SEND, [("bad", "w1", "r", "shutdown"), ("abort", "w1", "r"), ("close", "r"), *UNBILLED,
                       ("fail", 502, "engine_error")]]),
    "the retry finds no capacity: the first failure is raised": (
        {}, [routed("w1"), err("worker_unavailable"), no_route()],
        [ROUTE, SEND, RETRY, [*UNBILLED, ("fail", 503, "worker_unavailable")]]),
    "the retry's router is down: its error is raised": (
        {}, [routed("w1"), err("worker_unavailable"), no_route("router_unavailable")],
        [ROUTE, SEND, RETRY, [*UNBILLED, ("fail", 503, "router_unavailable")]]),
    "no worker at all": (
        {}, [no_route()],
        [ROUTE, [*UNBILLED, ("fail", 503, "no_capacity")]]),
    "an error after tokens: the stream migrates": (
        {}, [routed("w1"), tok("he"), err("worker_unavailable"), routed("w2"), tok("llo", "r-a1"),
             end(stream="r-a1")],
        [ROUTE, SEND, [("emit", "he")], MIGRATE, MIGRATED, [("emit", "llo")],
         [("ok", "w2", "r-a1"), ("close", "r-a1"), *DONE]]),
    "a migrated stream that fails before its own first token migrates again": (
        {}, [routed("w1"), tok("he"), err("timeout"), routed("w2"), err("engine_error", "r-a1"), routed("w3"),
             tok("y", "r-a2"), end(stream="r-a2")],
        [ROUTE, SEND, [("emit", "he")], [("bad", "w1", "r", "broken"), *MIGRATE[1:]], MIGRATED,
         [("bad", "w2", "r-a1", "engine_error"), ("supersede", "w2", "r-a1"), ("close", "r-a1"),
          ("route", "r-a2", "w1", "w2")], [("send", "w3", "r-a2")], [("emit", "y")],
         [("ok", "w3", "r-a2"), ("close", "r-a2"), *DONE]]),
    "the migration limit is reached: the stream is cut, billed what was sent": (
        {"migrations": 1}, [routed("w1"), tok("he"), err("worker_unavailable"), routed("w2"), tok("l", "r-a1"),
                            err("engine_error", "r-a1")],
        [ROUTE, SEND, [("emit", "he")], MIGRATE, MIGRATED, [("emit", "l")],
         [("bad", "w2", "r-a1", "broken"), ("abort", "w2", "r-a1"), ("close", "r-a1"), *BROKEN]]),
    "migrations=0: the client opted out": (
        {"migrations": 0}, [routed("w1"), tok("he"), err("worker_unavailable")],
        [ROUTE, SEND, [("emit", "he")], [*MIGRATE_ENDS, *BROKEN]]),
    "no worker takes the migration over": (
        {}, [routed("w1"), tok("he"), err("worker_unavailable"), no_route()],
        [ROUTE, SEND, [("emit", "he")], MIGRATE, BROKEN]),
    "bad_request after tokens: cut, no report": (
        {}, [routed("w1"), tok("he"), err("bad_request")],
        [ROUTE, SEND, [("emit", "he")], [("abort", "w1", "r"), ("close", "r"), *BROKEN]]),
    "every token was sent when the worker failed: finished by length": (
        {"max_tokens": 3}, [routed("w1"), tok("abc"), err("worker_unavailable")],
        [ROUTE, SEND, [("emit", "abc")], [*MIGRATE_ENDS, ("settle", "finished"), ("finish", "length")]]),
    "every token was sent, and migrations=0: finished by length all the same": (
        {"max_tokens": 3, "migrations": 0}, [routed("w1"), tok("abc"), err("worker_unavailable")],
        [ROUTE, SEND, [("emit", "abc")], [*MIGRATE_ENDS, ("settle", "finished"), ("finish", "length")]]),
    "every token was sent: the text held back for a stop string is flushed": (
        {"max_tokens": 3, "stop": ["xyz"]}, [routed("w1"), tok("abc"), err("worker_unavailable")],
        [ROUTE, SEND, [("emit", "a")], [*MIGRATE_ENDS, ("emit", "bc"), ("settle", "finished"),
                                        ("finish", "length")]]),
    "the client leaves while routing: nothing billed": (
        {}, [LEFT],
        [ROUTE, UNBILLED]),
    "the client leaves while a migration is routed: billed what it was sent": (
        {}, [routed("w1"), tok("he"), err("worker_unavailable"), LEFT],
        [ROUTE, SEND, [("emit", "he")], MIGRATE, [("settle", "cancelled")]]),
    "the client leaves during the remote prefill: its end message bills the prompt": (
        {}, [routed("w1", "p1"), LEFT, tok([9], "r-prefill"), end("remote", "r-prefill", cached=2, output=1, kv=KV)],
        [ROUTE, PREFILL, [("drain", "p1", "r-prefill")], [], [("close", "r-prefill"), ("settle", "cancelled")]]),
    "the client leaves during the remote prefill, no end message comes": (
        {}, [routed("w1", "p1"), LEFT, err("timeout", "r-prefill")],
        [ROUTE, PREFILL, [("drain", "p1", "r-prefill")], [("close", "r-prefill"), *UNBILLED]]),
    "the client leaves before the first token: the end message bills": (
        {}, [routed("w1"), LEFT, end("abort", cached=1, output=3)],
        [ROUTE, SEND, [("drain", "w1", "r")], [("close", "r"), ("settle", "cancelled")]]),
    "the client leaves before the first token, no end message comes: nothing billed": (
        {}, [routed("w1"), LEFT, err("timeout")],
        [ROUTE, SEND, [("drain", "w1", "r")], [("close", "r"), *UNBILLED]]),
    "the client leaves after tokens: the end message bills": (
        {}, [routed("w1"), tok("hi"), LEFT, tok("zz"), end("abort", output=5)],
        [ROUTE, SEND, [("emit", "hi")], [("drain", "w1", "r")], [], [("close", "r"), ("settle", "cancelled")]]),
    "the client leaves after tokens, the drain times out: billed what was seen": (
        {}, [routed("w1"), tok("hi"), LEFT, err("timeout")],
        [ROUTE, SEND, [("emit", "hi")], [("drain", "w1", "r")], [("close", "r"), ("settle", "cancelled")]]),
    "the client leaves after a stop string: the drained abort still finishes it": (
        {"stop": ["lo"]}, [routed("w1"), tok("hello"), LEFT, end("abort", output=6)],
        [ROUTE, SEND, [("emit", "hel"), ("ok", "w1", "r"), ("drain", "w1", "r")], [], [("close", "r"), *DONE]]),
}


@pytest.mark.parametrize("kwargs, events, expected", TABLE.values(), ids=TABLE.keys())
def test_action_sequences(kwargs, events, expected):
    steps, _ = drive(make_run(**kwargs), *events)
    assert steps == expected


# ---------------------------------------------------------------- what is sent
def test_the_prefill_half_computes_the_prompt_for_one_token_and_the_decode_pulls_its_kv():
    run = make_run()
    _, flat = drive(run, routed("w1", "p1"), end("remote", "r-prefill", cached=3, output=1, kv=KV),
                    tok("hi"), end(cached=4, output=2))
    prefill, decode = sends(flat)
    assert prefill.prefill and not decode.prefill
    assert prefill.request.prompt_token_ids == PROMPT and prefill.request.remote_decode
    assert prefill.request.sampling == msgspec.structs.replace(SAMPLING, max_tokens=1)
    assert prefill.request.cache_salt == "salt" and prefill.request.kv_transfer is None
    assert (prefill.billing.worker_id, prefill.billing.prefill_worker_id) == ("w1", "p1")
    assert prefill.billing.prefill_cached_tokens is None and prefill.billing.request_id == "r"
    assert decode.request.kv_transfer == KV and not decode.request.remote_decode
    assert decode.request.sampling == SAMPLING and decode.request.output_token_ids == []
    assert decode.billing.prefill_cached_tokens == 3
    # the prompt is billed once, with the prefill worker's hits: the KV the decode worker pulled is not cached
    assert run.usage == Usage("finished", "stop", 0, "w1", "p1", 4, 3, 2, 2000.0)


@pytest.mark.parametrize("prefill_ends", [end("length", "r-prefill", cached=3, output=1),
                                          err("engine_error", "r-prefill")], ids=["without a handle", "failed"])
def test_without_a_kv_handle_the_decode_worker_computes_the_prompt_and_its_hits_are_billed(prefill_ends):
    run = make_run()
    _, flat = drive(run, routed("w1", "p1"), prefill_ends, tok("hi"), end(cached=2, output=2))
    decode = sends(flat)[-1]
    assert decode.request.kv_transfer is None and decode.billing.prefill_cached_tokens is None
    assert run.usage.cached_tokens == 2 and run.usage.prompt_tokens == 4


def test_time_to_first_token_runs_from_the_attempts_send_and_is_reported_by_that_attempt_only():
    run = make_run()
    steps = [(10.0, routed("w1")), (10.25, tok("h")), (11.0, tok("i")), (12.0, end(output=2))]
    reports = [a for now, e in steps for a in feed(run, e, now) if isinstance(a, Report)]
    assert run.usage.ttft_ms == pytest.approx(250.0) and reports[-1].ttft_ms == pytest.approx(250.0)

    run = make_run()  # a retry: from its own send; a remote prefill's time counts (the client waits for it)
    steps = [(10.0, routed("w1")), (11.0, err("timeout")), (20.0, routed("w2", "p2")),
             (20.3, end("remote", "r-a1-prefill", kv=KV)), (20.5, tok("h", "r-a1")), (21.0, end(stream="r-a1"))]
    reports = [a for now, e in steps for a in feed(run, e, now) if isinstance(a, Report)]
    assert run.usage.ttft_ms == pytest.approx(500.0)
    assert [(r.worker_id, r.ok, r.ttft_ms) for r in reports] == [("w1", False, 0.0), ("p2", True, 0.0),
                                                                 ("w2", True, pytest.approx(500.0))]

    run = make_run()  # a migration: the client's first token came from the first worker; the new one reports none
    steps = [(10.0, routed("w1")), (10.1, tok("h")), (11.0, err("timeout")), (12.0, routed("w2")),
             (13.0, tok("i", "r-a1")), (14.0, end(stream="r-a1"))]
    reports = [a for now, e in steps for a in feed(run, e, now) if isinstance(a, Report)]
    assert run.usage.ttft_ms == pytest.approx(100.0) and reports[-1].ttft_ms == 0.0


def test_a_retry_opens_a_new_stream_on_another_worker_with_the_routing_hints_kept():
    run = make_run()
    _, flat = drive(run, routed("w1"), err("worker_unavailable"), routed("w2"), tok("hi", "r-a1"),
                    end(stream="r-a1"))
    route = [a for a in flat if isinstance(a, Route)][-1].request
    assert route == RouteRequest("r-a1", "m", 4, "s1", ["w1"], [11, 12], 2)
    retry = sends(flat)[-1]
    assert retry.request.request_id == "r-a1" and retry.request.attempt == 1
    assert retry.request.output_token_ids == [] and retry.request.sampling == SAMPLING
    assert (retry.billing.attempt, retry.billing.worker_id, retry.billing.request_id) == (1, "w2", "r")
    assert run.usage == Usage("finished", "stop", 1, "w2", "", 4, 0, 2, 1000.0)


@pytest.mark.parametrize("klass", ["interactive", "batch"])
def test_every_send_carries_the_request_class_the_engine_schedules_by(klass):
    """Prefill, decode and a migration's resend all tell the worker the class (batch goes behind, in the engine)."""
    run = make_run(klass=klass)
    _, flat = drive(run, routed("w1", "p1"), end("remote", "r-prefill", cached=3, output=1, kv=KV), tok("ab"),
                    err("worker_unavailable"), routed("w2"), tok("cd", "r-a1"), end(stream="r-a1", output=4))
    assert [s.request.request_class for s in sends(flat)] == [klass] * 3


def test_a_migration_resumes_token_exact_on_the_next_worker():
    run = make_run(max_tokens=10)
    _, flat = drive(run, routed("w1"), tok("ab"), err("worker_unavailable"), routed("w2"), tok("cd", "r-a1"),
                    err("stream_gap", "r-a1"), routed("w3"), tok("e", "r-a2"),
                    end("length", "r-a2", cached=9, output=5))
    routes = [a.request for a in flat if isinstance(a, Route)]
    assert [r.exclude_worker_ids for r in routes] == [[], ["w1"], ["w1", "w2"]]
    first, second, third = sends(flat)
    assert second.request.prompt_token_ids == PROMPT and second.request.output_token_ids == ids("ab")
    assert third.request.output_token_ids == ids("abcd")
    assert [s.request.sampling.max_tokens for s in (first, second, third)] == [10, 8, 6]
    for s in (second, third):  # the same sampling and seed: the engine replays them over the tokens so far
        assert s.request.sampling == msgspec.structs.replace(SAMPLING, max_tokens=s.request.sampling.max_tokens)
        assert s.request.kv_transfer is None and s.request.cache_salt == "salt"
    assert [(s.request.attempt, s.billing.attempt, s.billing.worker_id) for s in (second, third)] == \
        [(1, 1, "w2"), (2, 2, "w3")]
    # the billing signed into each attempt counts the migrations so far, this one's recomputation included
    assert [(s.billing.migrations, s.billing.migration_prefill_tokens) for s in (first, second, third)] == \
        [(0, 0), (1, 4 + 2), (2, 4 + 2 + 4 + 4)]
    # one request for the client: its prompt, every token it got; the recomputation is platform cost
    assert run.usage == Usage("finished", "length", 2, "w3", "", 4, 4, 5, 1000.0, 2, 14)


def test_a_character_split_across_a_migration_is_emitted_whole():
    _, flat = drive(make_run(), routed("w1"), tok([ord("a"), HALF]), err("timeout"), routed("w2"),
                    tok([TAIL], "r-a1"), end(stream="r-a1"))
    assert "".join(a.text for a in flat if isinstance(a, Emit)) == "aé"
    assert sends(flat)[-1].request.output_token_ids == [ord("a"), HALF]


# ---------------------------------------------------------------- errors raised
def test_the_stream_errors_raised_name_what_broke_in_their_detail_and_only_a_stable_text_to_the_client():
    """The detail (worker ids, the engine's exception text, the router's answer) is the log's (StreamBroken.detail);
    the client's text says what kind of thing failed and names the request id (issue 38, review finding 15)."""
    _, flat = drive(make_run(migrations=1), routed("w1"), tok("a"), err("worker_unavailable", message="w1 left"),
                    routed("w2"), tok("b", "r-a1"), err("engine_error", "r-a1", "CUDA fell over"))
    broken = fail_of(flat)
    assert broken.detail == "engine_error: CUDA fell over (the migration limit of 1 is reached)"
    assert str(broken) == stream_failure("engine_error", "r")

    _, flat = drive(make_run(migrations=0), routed("w1"), tok("a"), err("worker_unavailable", message="w1 left"))
    assert fail_of(flat).detail == "worker_unavailable: w1 left"

    _, flat = drive(make_run(), routed("w1"), tok("a"), err("worker_unavailable", message="w1 left"),
                    no_route(message="all busy"))
    broken = fail_of(flat)
    assert broken.detail == "worker_unavailable: w1 left; no other worker could take the stream over (all busy)"
    assert str(broken) == stream_failure("worker_unavailable", "r") and "request ID r." in str(broken)
    assert "w1" not in str(broken) and "busy" not in str(broken)


@pytest.mark.parametrize("code", ["worker_unavailable", "engine_error", "timeout", "stream_gap", "shutdown"])
def test_before_the_first_token_the_error_is_an_api_error_without_the_workers_text(code):
    _, flat = drive(make_run(retries=0), routed("w1"),
                    err(code, message="RuntimeError: worker w1 at /models/secret/tokenizer.json fell over"))
    error = fail_of(flat)
    assert isinstance(error, errors.ApiError) and error.message == stream_failure(code, "r")
    assert "w1" not in error.json().decode() and "secret" not in error.json().decode()
    assert error.status == (503 if code != "shutdown" else 502)

    _, flat = drive(make_run(), routed("w1"), err("bad_request", message="prompt too long"))
    error = fail_of(flat)
    assert (error.status, error.type, error.message) == (400, "invalid_request_error", "prompt too long")


# ---------------------------------------------------------------- what is billed
def test_a_stop_string_bills_the_tokens_the_client_was_sent_and_the_end_messages_hits():
    run = make_run(stop=["lo"])
    drive(run, routed("w1"), tok("hello"), tok("xx"), end("abort", cached=9, output=8))
    assert run.usage == Usage("finished", "stop", 0, "w1", "", 4, 4, 5, 1000.0,  # cached capped at the prompt
                              stop_sequence="lo")  # which stop string ended it (Anthropic's stop_sequence)

    run = make_run(stop=["lo"])  # the drain ended with an error: a remote prefill's hits are still known
    drive(run, routed("w1", "p1"), end("remote", "r-prefill", cached=3, kv=KV), tok("hello"), err("timeout"))
    assert (run.usage.cached_tokens, run.usage.prefill_worker_id) == (3, "p1")


def test_a_cut_stream_bills_what_was_sent():
    run = make_run(migrations=1)
    drive(run, routed("w1"), tok("ab"), err("timeout"), routed("w2"), tok("c", "r-a1"), err("timeout", "r-a1"))
    assert run.usage == Usage("failed", "timeout", 1, "w2", "", 4, 0, 3, 1000.0, 1, 6)


def test_a_cancelled_request_is_billed_the_engines_counts_from_its_end_message():
    run = make_run()  # before the first token: the prompt the engine computed, and what it generated
    drive(run, routed("w1"), LEFT, end("abort", prompt=4, cached=2, output=3))
    assert run.usage == Usage("cancelled", "abort", 0, "w1", "", 4, 2, 3, 0.0)

    run = make_run()  # after tokens: what was seen is billed if the end message never comes
    for now, event in [(10.0, routed("w1")), (11.0, tok("hi")), (12.0, LEFT)]:
        feed(run, event, now)
    assert run.usage_so_far() == Usage("cancelled", "abort", 0, "w1", "", 4, 0, 2, 1000.0) and not run.settled
    (settle,) = [a for a in run.message(end("abort", cached=1, output=5)[1], 13.0) if isinstance(a, Settle)]
    assert settle.usage == run.usage == Usage("cancelled", "abort", 0, "w1", "", 4, 1, 5, 1000.0)

    run = make_run()  # a remote prefill's one token never reached the client
    drive(run, routed("w1", "p1"), LEFT, end("remote", "r-prefill", prompt=4, cached=2, output=1, kv=KV))
    assert (run.usage.prompt_tokens, run.usage.cached_tokens, run.usage.completion_tokens) == (4, 2, 0)


def test_a_migrated_request_cancelled_is_billed_once_with_its_migrations():
    run = make_run()
    drive(run, routed("w1"), tok("ab"), err("timeout"), routed("w2"), tok("c", "r-a1"), LEFT,
          end("abort", "r-a1", prompt=4, cached=6, output=4))
    assert run.usage == Usage("cancelled", "abort", 1, "w2", "", 4, 4, 4, 1000.0, 1, 6)

    run = make_run()  # it left while the migration was being routed: billed the tokens it got
    drive(run, routed("w1"), tok("ab"), err("timeout"), LEFT)
    assert run.usage == Usage("cancelled", "abort", 1, "", "", 4, 0, 2, 1000.0)


def test_the_stream_awaited_follows_the_phase():
    run = make_run()
    run.start()
    run.routed(RouteDecision("w1", prefill_worker_id="p1"), 1.0)
    assert (run.phase, run.stream_id) == (Phase.PREFILLING, "r-prefill")
    run.client_left()
    assert (run.phase, run.stream_id) == (Phase.CANCELLED, "r-prefill")

    run = make_run()
    run.start()
    run.routed(RouteDecision("w1"), 1.0)
    run.message(err("timeout")[1], 2.0)
    assert (run.phase, run.stream_id) == (Phase.ROUTING, "r-a1")
    run.routed(RouteDecision("w2", prefill_worker_id="p2"), 3.0)
    assert run.stream_id == "r-a1-prefill"
    run.message(end("remote", "r-a1-prefill", kv=KV)[1], 4.0)
    assert (run.phase, run.stream_id) == (Phase.STREAMING, "r-a1")
