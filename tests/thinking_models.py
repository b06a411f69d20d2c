"""Tiny reasoning models made at test time: the tiny random Llama with chat templates of our own that think as
GLM's and Qwen3's do (the generation prompt opens ``<think>``; ``enable_thinking: false`` closes it at once),
``<think>`` / ``</think>`` as added, non-special tokens (as Qwen3's and DeepSeek-R1's tokenizers have them), and
the embeddings grown to the new vocabulary so vLLM serves it. A random model never writes ``</think>`` itself:
the engine's thought budget (which writes it) is what makes a test deterministic.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# GLM-4.7 / GLM-5's turn format: the assistant turn opens <think> (thinking on) or writes </think> (off); a past
# turn's thought is rendered only after the last user turn (the tool loop in progress), else dropped
GLM_TEMPLATE = (
    "[gMASK]<sop>"
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m['role'] in ('system', 'developer') %}<|system|>\n{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<|user|>\n{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<|assistant|>"
    "{% if m.get('reasoning_content') and loop.index0 > ns.last_user %}<think>{{ m['reasoning_content'] }}</think>"
    "{% else %}</think>{% endif %}\n{{ m['content'] }}"
    "{% else %}<|observation|>\n{{ m['content'] }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{{ '</think>' if enable_thinking is defined and not enable_thinking else '<think>' }}{% endif %}"
)

# Qwen3 (thinking) style: ChatML turns; the generation prompt opens "<think>\n", or writes an empty thought
QWEN3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and m.get('reasoning_content') and loop.last %}"
    "<think>\n{{ m['reasoning_content'] }}\n</think>\n\n{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{{ '<think>\n\n</think>\n\n' if enable_thinking is defined and not enable_thinking else '<think>\n' }}"
    "{% endif %}"
)

TEMPLATES = {"glm": GLM_TEMPLATE, "qwen3": QWEN3_TEMPLATE}
SPECIALS = {"glm": ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"],
            "qwen3": ["<|im_start|>", "<|im_end|>"]}
MARKER = ".thinking-ready"


def make_thinking_model(tiny: Path, folder: Path, style: str) -> Path:
    """``tiny`` (infermesh.models.make_tiny_llama's folder) as a reasoning model of ``style`` (glm or qwen3)."""
    if (folder / MARKER).is_file():
        return folder
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from tokenizers import AddedToken
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tiny)
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False),
                    AddedToken("</think>", special=False, normalized=False)])
    tok.add_special_tokens({"additional_special_tokens": SPECIALS[style]})
    tok.chat_template = TEMPLATES[style]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM.from_pretrained(tiny, dtype=torch.bfloat16)
        model.resize_token_embeddings(len(tok), mean_resizing=False)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["vocab_size"] == len(tok), "the embeddings cover every token"
    model.generation_config.save_pretrained(folder)
    (folder / MARKER).write_text("ok\n")
    return folder
