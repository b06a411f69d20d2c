"""The tool soak benchmark, small: its seeded plan, and 20 requests through a sim-engine mesh."""

from __future__ import annotations

import json

import pytest
from jsonschema import Draft202012Validator

from loadtests import tool_soak
from loadtests.lib.tool_soak_plan import KINDS, MAX_SCHEMA_DEPTH, depth, plan_requests
from loadtests.lib.tool_soak_shape import Answer, Outcome, classify
from services.edge.tools.validate import NAME_RE

NUM_REQUESTS = 20


def test_the_plan_is_seeded_valid_and_within_the_edges_caps():
    plans = plan_requests(60, 7, (16, 512), "tiny")
    assert [p.body for p in plans] == [p.body for p in plan_requests(60, 7, (16, 512), "tiny")]
    assert [p.body for p in plans] != [p.body for p in plan_requests(60, 8, (16, 512), "tiny")]
    assert {k for p in plans for k in p.kinds} == set(KINDS)
    assert {p.choice for p in plans} == {"required", "auto", "named"}
    assert {p.body["max_tokens"] for p in plans} <= {16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512}
    for plan in plans:
        names = [t["function"]["name"] for t in plan.tools]
        assert len(set(names)) == len(names) and all(NAME_RE.match(n) for n in names)
        assert len(json.dumps(plan.tools).encode()) <= 512 << 10
        for tool in plan.tools:
            Draft202012Validator.check_schema(tool["function"]["parameters"])
            assert depth(tool["function"]["parameters"]) <= MAX_SCHEMA_DEPTH


def test_answers_are_classified_by_what_the_request_allowed():
    plan = next(p for p in plan_requests(200, 0, (16, 512), "tiny")
                if p.choice == "required" and not p.parallel and p.kinds == ("none",))
    name = plan.tools[0]["function"]["name"]
    call = {"id": "call_1", "name": name, "arguments": "{"}
    assert classify(plan, Answer(None, [call], "length"))[0] is Outcome.CUT
    assert classify(plan, Answer(None, [call], "tool_calls"))[0] is Outcome.UNPARSEABLE
    assert classify(plan, Answer("hi", [], "stop"))[0] is Outcome.INVALID  # required, no call
    assert classify(plan, Answer(None, [call, call], "tool_calls"))[0] is Outcome.INVALID  # not parallel
    assert classify(plan, Answer(None, [{**call, "name": "other"}], "tool_calls"))[0] is Outcome.INVALID
    assert classify(plan, Answer(None, [call], "tool_calls", ["no usage"]))[0] is Outcome.NOT_OPENAI_SHAPED


@pytest.mark.e2e
@pytest.mark.slow
async def test_a_small_soak_on_the_sim_engine_answers_every_request_and_keeps_the_engine(nats_url, tiny_model,
                                                                                          tmp_path):
    args = tool_soak.parse_args(["--engine", "sim", "--model-path", str(tiny_model), "--requests",
                                 str(NUM_REQUESTS), "--timeout-s", "120", "--out", str(tmp_path)])
    report = await tool_soak.run(args, nats_url)
    stem = tool_soak.write(report, tmp_path)

    outcomes = report["summary"]["outcomes"]
    assert sum(outcomes.values()) == NUM_REQUESTS
    assert outcomes["hung"] == outcomes["not_openai_shaped"] == outcomes["sdk_error"] == 0, report["summary"]
    assert outcomes["unparseable"] == outcomes["invalid"] == 0, report["summary"]["examples"]
    assert outcomes["ok_valid"] > 0
    engine = report["engine"]
    assert engine["serving_at_end"] and engine["restarts"] == 0 and engine["registry_events"] == []
    assert report["summary"]["engine_death_errors"] == 0
    assert stem.with_suffix(".png").stat().st_size > 0 and "| ok_valid |" in stem.with_suffix(".md").read_text()
    # the cut answers split by budget (loadtests/tool_soak_budget.py): every one is counted once, and on the sim
    # (which closes by the same policy) none is cut with room for the call
    from loadtests.tool_soak_budget import reclassify

    split = reclassify(report, str(tiny_model))
    assert sum(split.values()) == outcomes["cut"] and split.get("cut", 0) == 0, split
