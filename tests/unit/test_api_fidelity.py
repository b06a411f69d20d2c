"""API fidelity (issue 37.2): system / developer messages after the first turn, with real chat templates."""

from __future__ import annotations

import pytest

from services.edge.tokenizer import ModelTokenizer
from tests.unit.test_incremental_tokens import _byte_level_tokenizer

# renders every message where it stands, whatever its role (the tiny model's own template)
IN_PLACE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
# Llama 2 / Mistral style: one leading system turn, anything else raises
ONE_SYSTEM_RAISES = (
    "{% for m in messages %}"
    "{% if m['role'] in ('system', 'developer') and not loop.first %}"
    "{{ raise_exception('Only the first message may be a system message') }}{% endif %}"
    "<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>")
# Qwen style: a leading system turn rendered, a later one (or an unknown role) silently left out
ONE_SYSTEM_DROPS = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' and loop.first %}<system>{{ m['content'] }}\n"
    "{% elif m['role'] in ('user', 'assistant') %}<{{ m['role'] }}>{{ m['content'] }}\n{% endif %}"
    "{% endfor %}<assistant>")

CONVERSATION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "system", "content": "agents: claude"},
                {"role": "user", "content": "go"}]
MERGED = "<system>be brief\n\nagents: claude\n<user>hi\n<assistant>hello\n<user>go\n<assistant>"


def tokenizer(template: str, folder) -> ModelTokenizer:
    hf = _byte_level_tokenizer()
    hf.chat_template = template
    hf.save_pretrained(folder)
    return ModelTokenizer(str(folder))


def test_a_template_that_allows_more_system_turns_renders_them_in_place(tmp_path):
    tok = tokenizer(IN_PLACE, tmp_path)
    assert tok.render(CONVERSATION) == ("<system>be brief\n<user>hi\n<assistant>hello\n<system>agents: claude\n"
                                        "<user>go\n<assistant>")


@pytest.mark.parametrize("template", [ONE_SYSTEM_RAISES, ONE_SYSTEM_DROPS], ids=["raises", "drops"])
def test_a_template_that_allows_one_system_turn_gets_them_merged(template, tmp_path):
    tok = tokenizer(template, tmp_path)
    assert tok.render(CONVERSATION) == MERGED
    developer = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"},
                 {"role": "developer", "content": "agents: claude"}]
    assert tok.render(developer) == "<system>be brief\n\nagents: claude\n<user>hi\n<assistant>"
    no_leading = [{"role": "user", "content": "hi"}, {"role": "system", "content": "agents: claude"}]
    assert tok.render(no_leading) == "<system>agents: claude\n<user>hi\n<assistant>"
