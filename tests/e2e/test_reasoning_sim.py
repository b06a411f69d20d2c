"""Reasoning models on the sim mesh (router, admission, a sim worker, edge with ``reasoning_parser="glm45"``) with a
tiny model whose GLM-style template opens ``<think>`` (tests/thinking_models.py), driven by the official SDKs: the
thought apart in chat, Messages and Responses, streamed and whole alike; the budget closing the thought in the
engine; thinking turned off; a thought sent back; a tool call after a thought, grammar-enforced.

The sim draws its tokens from the prompt, which holds ``<think>`` but never ``</think>``: only the engine's budget
ends a thought, so where it ends is known (``expected``)."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from infermesh.local import LocalMesh
from services.worker.engines.sim import sim_token_ids
from tests.thinking_models import make_thinking_model
from tests.utils import eventually

pytestmark = [pytest.mark.e2e]
KEY = "test-key"
ASK = "The router looks at the prompt and finds a worker."
WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="session")
def glm_model(tiny_model, tmp_path_factory):
    return make_thinking_model(tiny_model, tmp_path_factory.mktemp("models") / "glm-think", "glm")


@pytest.fixture(scope="session")
def qwen_model(tiny_model, tmp_path_factory):
    return make_thinking_model(tiny_model, tmp_path_factory.mktemp("models") / "qwen-think", "qwen3")


@pytest.fixture
async def mesh(nats_url, namespace, glm_model, qwen_model, tiny_model):
    mesh = LocalMesh(nats_url, namespace, dev_key=KEY)
    await mesh.start_router()
    await mesh.start_admission()
    for name, path in (("glm", glm_model), ("qwen", qwen_model), ("tiny", tiny_model)):
        await mesh.start_worker(worker_id=f"sim-{name}", engine="sim", model=name, model_path=str(path),
                                max_model_len=1024, sim_ttft_ms=5, sim_itl_ms=1)
    await mesh.start_edge(reasoning_parser="glm45", reasoning_parsers="qwen=qwen3,tiny=none")
    await eventually(mesh.edge.mesh.is_ready, 10)
    await eventually(lambda: any(a.leadership.is_leader for a in mesh.admissions), 10)
    yield mesh
    await mesh.stop()


@pytest.fixture
def chat(mesh):
    return openai.AsyncOpenAI(base_url=mesh.base_url, api_key=KEY, max_retries=0)


async def expected(mesh, messages, budget: int, max_tokens: int, model: str = "glm") -> tuple[str, str, list[int]]:
    """The thought and answer the sim gives ``messages`` when the engine closes the thought after ``budget``
    tokens: its draws, with ``</think>`` written in (no draw taken for it), up to a stop token, split where the
    template left off."""
    tokenizer = await mesh.edge.mesh.tokenizer(mesh.edge.mesh.model_info(model))
    prompt = tokenizer.chat_ids(messages).tolist()
    draws = sim_token_ids(prompt, None, max_tokens)
    end = tokenizer.encode("</think>", add_special_tokens=False)
    output = (draws[:budget] + end + draws[budget:])[:max_tokens]
    stops = [i for i, token in enumerate(output) if token in tokenizer.stop_token_ids]
    output = output[:stops[0] + 1] if stops else output
    thought, _, answer = tokenizer.decode(output).partition("</think>")
    return thought, answer.lstrip("\n"), output


async def test_chat_separates_the_thought_and_the_budget_closes_it(mesh, chat):
    messages = [{"role": "user", "content": ASK}]
    thought, answer, output = await expected(mesh, messages, 5, 16)
    assert thought and answer
    whole = await chat.chat.completions.create(model="glm", messages=messages, max_tokens=16,
                                               extra_body={"thinking_token_budget": 5})
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content) == (thought, answer)
    assert message.model_extra["reasoning"] == thought  # current vLLM's name too
    assert whole.usage.completion_tokens == 16 and whole.usage.completion_tokens_details.reasoning_tokens == 6
    stream = await chat.chat.completions.create(model="glm", messages=messages, max_tokens=16, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"thinking_token_budget": 5})
    thoughts, texts, usage = [], [], None
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            thoughts.append(choice.delta.model_extra.get("reasoning_content") or "")
            texts.append(choice.delta.content or "")
            assert "</think>" not in texts[-1] + thoughts[-1]
    assert ("".join(thoughts), "".join(texts)) == (thought, answer)
    assert usage.completion_tokens_details.reasoning_tokens == 6


async def test_the_parser_is_chosen_per_model(mesh, chat):
    """qwen: a Qwen3-style template ("<think>\\n" opens the thought); tiny: no parser, its text is all answer.
    (Qwen's <|im_end|> is in the prompt, so the sim may draw it and stop: this prompt's first draws hold none.)"""
    story = "Once upon a time there was a little model that could only say a few words."
    messages = [{"role": "user", "content": story}]
    thought, answer, output = await expected(mesh, messages, 3, 14, "qwen")
    assert len(output) == 14 and thought and answer
    reply = await chat.chat.completions.create(model="qwen", messages=messages, max_tokens=14,
                                               extra_body={"thinking_token_budget": 3})
    assert (reply.choices[0].message.reasoning_content, reply.choices[0].message.content or "") == (thought, answer)
    assert reply.usage.completion_tokens == len(output) and reply.usage.completion_tokens_details.reasoning_tokens == 4
    tokenizer = await mesh.edge.mesh.tokenizer(mesh.edge.mesh.model_info("tiny"))
    plain = await chat.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                               extra_body={"thinking_token_budget": 3})
    assert plain.choices[0].message.content == tokenizer.decode(
        sim_token_ids(tokenizer.chat_ids(messages).tolist(), None, 8))
    assert plain.usage.completion_tokens_details is None


async def test_reasoning_effort_and_thinking_off(mesh, chat):
    messages = [{"role": "user", "content": ASK}]
    cut = await chat.chat.completions.create(model="glm", messages=messages, max_tokens=12, reasoning_effort="low")
    assert cut.choices[0].message.content == "" and cut.choices[0].finish_reason == "length"
    assert cut.usage.completion_tokens_details.reasoning_tokens == 12  # all thought: 1024 tokens allowed
    for off in ({"reasoning_effort": "none"}, {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}):
        plain = await chat.chat.completions.create(model="glm", messages=messages, max_tokens=12, **off)
        tokenizer = await mesh.edge.mesh.tokenizer(mesh.edge.mesh.model_info("glm"))
        prompt = tokenizer.chat_ids(messages, {"enable_thinking": False}).tolist()
        assert plain.choices[0].message.content == tokenizer.decode(sim_token_ids(prompt, None, 12))
        assert plain.choices[0].message.model_extra.get("reasoning_content") is None
        assert plain.usage.completion_tokens_details.reasoning_tokens == 0
    hidden = await chat.chat.completions.create(model="glm", messages=messages, max_tokens=16,
                                                extra_body={"thinking_token_budget": 5, "include_reasoning": False})
    thought, answer, _ = await expected(mesh, messages, 5, 16)
    assert hidden.choices[0].message.content == answer
    assert hidden.choices[0].message.model_extra.get("reasoning_content") is None


async def test_a_thought_sent_back_reaches_the_template(mesh, chat):
    """A past turn's thought goes to the template as ``reasoning_content``: this GLM-style template keeps the
    thoughts after the last user turn (here: the one being continued) and drops earlier ones, as GLM's does."""
    tokenizer = await mesh.edge.mesh.tokenizer(mesh.edge.mesh.model_info("glm"))
    past = [{"role": "user", "content": ASK}, {"role": "assistant", "content": "Yes.", "reasoning_content": "Hm"},
            {"role": "user", "content": "And then?"}]
    dropped = await chat.chat.completions.create(model="glm", messages=past, max_tokens=2)
    assert dropped.usage.prompt_tokens == len(tokenizer.chat_ids(past)) == len(tokenizer.chat_ids(
        [past[0], {"role": "assistant", "content": "Yes."}, past[2]]))
    current = past[:2]  # the assistant turn after the last user turn: its thought is rendered
    assert "<think>Hm</think>" in tokenizer.render(current)
    kept = await chat.chat.completions.create(model="glm", messages=current, max_tokens=2)
    assert kept.usage.prompt_tokens == len(tokenizer.chat_ids(current))
    assert kept.usage.prompt_tokens > len(tokenizer.chat_ids(past[:1] + [{"role": "assistant", "content": "Yes."}]))


async def test_a_tool_call_after_a_thought_is_grammar_enforced(mesh, chat):
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    for stream in (False, True):
        kwargs = dict(model="glm", messages=messages, max_tokens=160, tools=[WEATHER], tool_choice="required",
                      extra_body={"thinking_token_budget": 4})
        if not stream:
            reply = await chat.chat.completions.create(**kwargs)
            message, finish, usage = reply.choices[0].message, reply.choices[0].finish_reason, reply.usage
            thought, calls = message.reasoning_content, message.tool_calls
        else:
            thoughts, calls_by_index, finish, usage = [], {}, None, None
            async for chunk in await chat.chat.completions.create(**kwargs, stream=True,
                                                                  stream_options={"include_usage": True}):
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    finish = choice.finish_reason or finish
                    thoughts.append(choice.delta.model_extra.get("reasoning_content") or "")
                    for call in choice.delta.tool_calls or []:
                        calls_by_index.setdefault(call.index, []).append(call)
            thought = "".join(thoughts)
            calls = [parts[0] for parts in calls_by_index.values()]
        assert thought and finish == "tool_calls" and [c.function.name for c in calls] == ["weather"]
        assert 1 <= usage.completion_tokens_details.reasoning_tokens <= 5  # the budget closed it (or the model)
    whole_args = json.loads(message.tool_calls[0].function.arguments)
    assert isinstance(whole_args["city"], str)


async def test_messages_thinking_blocks(mesh):
    client = anthropic.AsyncAnthropic(base_url=mesh.base_url.removesuffix("/v1"), api_key=KEY, max_retries=0)
    messages = [{"role": "user", "content": ASK}]
    thought, answer, _ = await expected(mesh, messages, 5, 16)
    thinking = {"type": "enabled", "budget_tokens": 5}
    whole = await client.messages.create(model="glm", messages=messages, max_tokens=16, thinking=thinking)
    assert [b.type for b in whole.content] == ["thinking", "text"]
    assert (whole.content[0].thinking, whole.content[1].text) == (thought, answer)
    assert whole.content[0].signature
    kinds = []
    async with client.messages.stream(model="glm", messages=messages, max_tokens=16, thinking=thinking) as stream:
        async for event in stream:
            kinds.append(event.delta.type if event.type == "content_block_delta" else event.type)
        streamed = await stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None), getattr(b, "signature", None), getattr(b, "text", None))
            for b in streamed.content] == [(b.type, getattr(b, "thinking", None), getattr(b, "signature", None),
                                            getattr(b, "text", None)) for b in whole.content]
    assert "thinking_delta" in kinds and "signature_delta" in kinds and "text_delta" in kinds
    assert kinds.index("signature_delta") < kinds.index("text_delta")
    again = await client.messages.create(  # the thinking block goes back as the SDK gave it
        model="glm", max_tokens=4, thinking=thinking,
        messages=[*messages, {"role": "assistant", "content": [b.model_dump() for b in whole.content]},
                  {"role": "user", "content": "And then?"}])
    assert again.content[0].type == "thinking"
    off = await client.messages.create(model="glm", messages=messages, max_tokens=8, thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"]


async def test_responses_reasoning_items(mesh, chat):
    whole = await chat.responses.create(model="glm", input=ASK, max_output_tokens=12, reasoning={"effort": "low"})
    assert [item.type for item in whole.output] == ["reasoning"] and whole.status == "incomplete"
    assert whole.output[0].content[0].type == "reasoning_text" and whole.output[0].content[0].text
    assert whole.usage.output_tokens_details.reasoning_tokens == 12
    assert (whole.reasoning.effort, whole.reasoning.summary) == ("low", None)  # as asked
    kinds, final = [], None
    async with chat.responses.stream(model="glm", input=ASK, max_output_tokens=12,
                                     reasoning={"effort": "low"}) as stream:
        async for event in stream:
            kinds.append(event.type)
            final = getattr(event, "response", final)
    assert "response.reasoning_text.delta" in kinds and "response.reasoning_text.done" in kinds
    assert [item.model_dump(exclude={"id"}) for item in final.output] == [
        item.model_dump(exclude={"id"}) for item in whole.output]
    off = await chat.responses.create(model="glm", input=ASK, max_output_tokens=8, reasoning={"effort": "minimal"})
    assert [item.type for item in off.output] == ["message"] and off.usage.output_tokens_details.reasoning_tokens == 0
