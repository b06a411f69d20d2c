"""The served model's tokenizer on the edge: chat template, encode, stop tokens.

Loaded from the local folder a worker advertises in the registry, never from a hub.
A model that ships no chat template gets a plain, documented one (DEFAULT_CHAT_TEMPLATE).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# Role-tagged turns; the assistant turn is left open for generation.
DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token if bos_token else '' }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class ModelTokenizer:
    def __init__(self, path: str) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        self.path = path
        self.hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.has_chat_template = bool(getattr(self.hf, "chat_template", None))
        self.stop_token_ids = sorted(self._stop_token_ids())

    def _stop_token_ids(self) -> set[int]:
        ids: set[int] = set()
        if self.hf.eos_token_id is not None:
            ids.add(int(self.hf.eos_token_id))
        generation_config = Path(self.path) / "generation_config.json"
        if generation_config.is_file():
            eos = json.loads(generation_config.read_text()).get("eos_token_id")
            ids.update([eos] if isinstance(eos, int) else list(eos or []))
        return ids

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        text = self.hf.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=True,
            chat_template=None if self.has_chat_template else DEFAULT_CHAT_TEMPLATE,
        )
        return self.encode(text, add_special_tokens=False)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Any, skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)
