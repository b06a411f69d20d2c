"""The sim's scripted answers: which rule a prompt picks (pure), and the engine emitting them under a grammar."""

from __future__ import annotations

import json

import pytest

from services.worker.engines.sim_script import parse_script, tool_call_text

LOOP = {
    "rules": [
        {"pattern": "TASK-1", "tool_calls": [{"name": "Read", "arguments": {"file_path": "/w/notes.txt"}}]},
        {"pattern": "run: echo", "tool_calls": [{"name": "Bash", "arguments": {"command": "echo harness-$((40+2))"}}]},
        {"pattern": "harness-42", "tool_calls": [{"name": "Edit", "arguments": {"new_string": "EDITED"}}]},
        {"pattern": "EDITED", "text": "All done."},
    ],
    "default": "OK",
}


def test_the_rule_matching_latest_wins_so_each_turn_moves_the_loop_on() -> None:
    script = parse_script(LOOP)
    system = "You are an agent. Tools: Read, Bash, Edit. "
    turn1 = system + "user: TASK-1 please"
    turn2 = turn1 + script.pick(turn1) + " tool: notes say run: echo"
    turn3 = turn2 + script.pick(turn2) + " tool: harness-42"
    turn4 = turn3 + script.pick(turn3) + " tool: the file was updated"
    answers = [script.pick(turn) for turn in (turn1, turn2, turn3, turn4)]
    assert '"Read"' in answers[0] and '"Bash"' in answers[1] and '"Edit"' in answers[2]
    assert answers[3] == "All done."  # the Edit call's own EDITED is the newest match


def test_no_match_takes_the_default_and_no_default_means_the_usual_draws() -> None:
    assert parse_script(LOOP).pick("write a title for this chat") == "OK"
    assert parse_script({"rules": LOOP["rules"]}).pick("write a title") is None


def test_a_tie_goes_to_the_rule_listed_first() -> None:
    script = parse_script({"rules": [{"pattern": "a+", "text": "first"}, {"pattern": "a", "text": "second"}]})
    assert script.pick("xa") == "first"


def test_answers_are_hermes_calls_after_the_text() -> None:
    answer = parse_script({"rules": [{"pattern": "x", "text": "Let me look.", "tool_calls": [
        {"name": "Read", "arguments": {"path": "é"}}, {"name": "Ls"}]}]}).pick("x")
    assert answer == ('Let me look.\n<tool_call>\n{"name": "Read", "arguments": {"path": "é"}}\n</tool_call>\n'
                      '<tool_call>\n{"name": "Ls", "arguments": {}}\n</tool_call>')


@pytest.mark.parametrize("bad", [
    {"rules": [{"text": "no pattern"}]},
    {"rules": [{"pattern": "(", "text": "bad regex"}]},
    {"rules": [{"pattern": "x"}]},
    {"rules": [{"pattern": "x", "txt": "typo"}]},
    {"rules": [{"pattern": "x", "tool_calls": [{"arguments": {}}]}]},
    {"rulez": []},
])
def test_a_bad_script_is_refused_naming_the_problem(bad) -> None:
    with pytest.raises(ValueError, match="sim script"):
        parse_script(bad)


def _tool_sampling(tiny_model):
    """A hermes tool grammar for one tool, as the edge builds it."""
    from services.edge.tools import Tool, ToolSpec, build_constraint
    from shared.schema import SamplingParams, Structured

    tool = Tool("Read", None, {"type": "object", "properties": {"file_path": {"type": "string"}},
                               "required": ["file_path"]})
    constraint = build_constraint("hermes", ToolSpec((tool,), "auto"))
    return SamplingParams(max_tokens=200, stop_token_ids=[1], structured=Structured(constraint.kind, constraint.spec))


async def test_the_engine_emits_the_scripted_call_under_the_tool_grammar_and_refuses_one_it_does_not_admit(
        tiny_model, tmp_path) -> None:
    from transformers import AutoTokenizer

    from services.worker.engines.base import EngineRequestError
    from services.worker.engines.sim import SimEngine, SimEngineConfig

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"rules": [
        {"pattern": "read it", "tool_calls": [{"name": "Read", "arguments": {"file_path": "/w/a.txt"}}]},
        {"pattern": "wrong tool", "tool_calls": [{"name": "Write", "arguments": {"file_path": "/w/a.txt"}}]},
    ]}))
    eng = SimEngine(SimEngineConfig(tokenizer=str(tiny_model), ttft_ms=0, itl_ms=0, num_kv_blocks=64,
                                    script=str(script)))
    await eng.start()
    try:
        sampling = _tool_sampling(tiny_model)
        prompt = tokenizer.encode("user: please read it")
        outs = [out async for out in eng.generate("ok", prompt, sampling)]
        tokens = [t for out in outs for t in out.token_ids]
        assert outs[-1].finish_reason == "stop" and tokens[-1] == 1
        assert tokenizer.decode(tokens[:-1]) == tool_call_text("Read", {"file_path": "/w/a.txt"})
        with pytest.raises(EngineRequestError, match="leaves the request's grammar"):
            [out async for out in eng.generate("bad", tokenizer.encode("user: wrong tool"), sampling)]
        drawn = [out async for out in eng.generate("free", tokenizer.encode("user: hello"),
                                                   sampling.__class__(max_tokens=5))]
        assert sum(len(out.token_ids) for out in drawn) == 5  # no rule, no default: the usual draws
    finally:
        await eng.stop()
