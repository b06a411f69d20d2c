"""The served model's tokenizer on the edge: chat template, encode, stop tokens.

Loaded from the local folder a worker advertises in the registry, never from a hub.
A model that ships no chat template gets a plain, documented one (DEFAULT_CHAT_TEMPLATE).
"""

from __future__ import annotations

import json
import os
from array import array
from pathlib import Path
from typing import Any

from services.edge.incremental import CacheScope, PrefixTokens, cut_kinds_that_hold, sample_conversations

# Gemma's turn format, for Gemma checkpoints whose tokenizer ships no template
# (the GGUF-converted Gemma 3 270M): system text is folded into the first user turn.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set system = namespace(text='') %}"
    "{% for message in messages %}"
    "{% if message['role'] in ('system', 'developer') %}"
    "{% set system.text = system.text + message['content'] + '\\n\\n' %}"
    "{% else %}"
    "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else 'user' }}\n"
    "{% if loop.first or system.text %}{{ system.text }}{% set system.text = '' %}{% endif %}"
    "{{ message['content'] | trim }}<end_of_turn>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

# Any other model without a template: role-tagged turns, the assistant turn left open.
DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token if bos_token else '' }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


SYSTEM_ROLES = ("system", "developer")


def merge_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with every system / developer message joined, in order, into one leading system turn: what a
    template that allows one system turn can place (OpenAI's developer role is a system turn to these models)."""
    texts = [m["content"] for m in messages if m["role"] in SYSTEM_ROLES and m["content"]]
    rest = [m for m in messages if m["role"] not in SYSTEM_ROLES]
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest] if texts else rest


# The tags the edge's parsers read: kept in the text even where a tokenizer marks them special (GLM's tool tags
# are; a thought's <think> / </think> may be), so ``decode(..., skip_special_tokens=True)`` drops every other
# special token but these
KEPT_TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
             "</arg_value>")


class ModelTokenizer:
    def __init__(self, path: str) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        self.path = path
        self.hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        vocab = self.hf.get_vocab()
        self.vocab_size = len(self.hf)
        self.chat_template: str | None = None  # None: the model's own
        if not getattr(self.hf, "chat_template", None):
            is_gemma = "<start_of_turn>" in vocab and "<end_of_turn>" in vocab
            self.chat_template = GEMMA_CHAT_TEMPLATE if is_gemma else DEFAULT_CHAT_TEMPLATE
        self.stop_token_ids = sorted(self._stop_token_ids(vocab))
        fast = getattr(self.hf, "_tokenizer", None)
        same_text = not getattr(self.hf, "clean_up_tokenization_spaces", False)
        self._fast_decode = fast.decode if fast is not None and same_text else None
        self._dropped = self._dropped_specials(vocab)
        self.prefix_tokens = self._prefix_tokens(fast)

    def _dropped_specials(self, vocab: dict[str, int]) -> frozenset[int] | None:
        """The special tokens a decode that skips them drops, where some of ``KEPT_TAGS`` are special (else None:
        the tokenizer's own skipping is the same)."""
        special = set(self.hf.all_special_ids) | {i for i, t in self.hf.added_tokens_decoder.items() if t.special}
        kept = {vocab[tag] for tag in KEPT_TAGS if tag in vocab} & special
        return frozenset(special - kept) if kept else None

    def _prefix_tokens(self, fast: Any) -> PrefixTokens:
        """Agent turns tokenize only what is new (``incremental.py``), with the cuts this tokenizer keeps whole
        on conversations rendered by its template; none (the cache off) without a fast tokenizer."""
        if fast is None:
            return PrefixTokens(lambda texts: [self.encode(t, add_special_tokens=False) for t in texts], (), ())

        def encode_batch(texts: list[str]) -> list[list[int]]:
            return [e.ids for e in fast.encode_batch(texts, add_special_tokens=False)]

        samples = []
        for conversation in sample_conversations():
            try:
                samples.append(self.render(conversation))
            except Exception:  # a template that refuses a system turn, say: checked on the samples it renders
                continue
        # the special tokens its template writes (Gemma has thousands, nearly all unused: each is looked for)
        specials = [t.content for t in self.hf.added_tokens_decoder.values()
                    if t.special and any(t.content in sample for sample in samples)]
        return PrefixTokens(encode_batch, specials, cut_kinds_that_hold(encode_batch, specials, samples))

    def _stop_token_ids(self, vocab: dict[str, int]) -> set[int]:
        ids: set[int] = {vocab[t] for t in ("<end_of_turn>", "<|im_end|>", "<|eot_id|>") if t in vocab}
        if self.hf.eos_token_id is not None:
            ids.add(int(self.hf.eos_token_id))
        generation_config = Path(self.path) / "generation_config.json"
        if generation_config.is_file():
            eos = json.loads(generation_config.read_text()).get("eos_token_id")
            ids.update([eos] if isinstance(eos, int) else list(eos or []))
        return ids

    def apply_chat_template(self, messages: list[dict[str, Any]], scope: CacheScope = "") -> list[int]:
        return self.prefix_tokens.encode(self.render(messages), scope)

    def chat_ids(self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None = None,
                 scope: CacheScope = "") -> array:
        """``apply_chat_template`` as a 4-byte array: what preparation hands on (``prep.crossed``).
        ``template_kwargs``: the request's ``chat_template_kwargs`` (``enable_thinking``...); ``scope``: whose
        earlier prompts it may reuse the tokens of (``incremental.cache_scope``: the team and its cache_salt)."""
        return self.prefix_tokens.encode_ids(self.render(messages, template_kwargs), scope)

    def render(self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None = None) -> str:
        """The prompt text; a system (or developer) message after the first turn is rendered in place where the
        template places it, else merged into the leading system turn (``merge_system``): where the template raises
        on it or leaves its text out."""
        kwargs = template_kwargs or {}
        if not any(m["role"] == "developer" or (i and m["role"] == "system") for i, m in enumerate(messages)):
            return self._render(messages, kwargs)
        try:
            text = self._render(messages, kwargs)
        except Exception:  # justified: a template that refuses a non-leading system turn (raise_exception)
            return self._render(merge_system(messages), kwargs)
        if all(m["content"].strip() in text for m in messages if m["role"] in SYSTEM_ROLES):
            return text
        return self._render(merge_system(messages), kwargs)  # the template dropped it silently

    def _render(self, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> str:
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                           chat_template=self.chat_template, **kwargs)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        fast = getattr(self.hf, "_tokenizer", None)  # the Rust tokenizer: skips transformers' per-call overhead
        if fast is not None and not add_special_tokens:
            return fast.encode(text, add_special_tokens=False).ids
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Any, skip_special_tokens: bool = True) -> str:
        if skip_special_tokens and self._dropped is not None:  # special tags the parsers read stay (KEPT_TAGS)
            token_ids, skip_special_tokens = [t for t in token_ids if t not in self._dropped], False
        if self._fast_decode is not None:  # per token on the hot path: skip transformers' wrapper
            return self._fast_decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)
