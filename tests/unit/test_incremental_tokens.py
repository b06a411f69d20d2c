"""services/edge/incremental.py: tokenizing only what is new since an earlier prompt gives exactly the tokens
tokenizing the whole prompt gives, over random growing, edited and interleaved conversations, for every chat
template the edge renders (the model's own, Gemma's, the default) on both tokenizer families in use (byte-level
BPE, metaspace BPE with special tokens); and the cache stays within its bounds."""

from __future__ import annotations

import random
from array import array
from pathlib import Path

import pytest

from infermesh.models import _CHAT_TEMPLATE as TINY_CHAT_TEMPLATE
from services.edge.incremental import PrefixTokens, cut_kinds_that_hold
from services.edge.tokenizer import DEFAULT_CHAT_TEMPLATE, GEMMA_CHAT_TEMPLATE, ModelTokenizer
from shared.prefix_hash import shared_prefix

GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
PIECES = ["the mesh routes a request", "naïve café — 東京 🙂", "def f(x):\n    return x + 1\n", "\n\n", "\n",
          "  indented", "\ttab", '{"name": "search", "arguments": {"q": "kv cache"}}', "end.", "", " ",
          "<start_of_turn>", "<|user|>", "line\r\nwindows", "1. first\n2. second", "trailing  ", "</s>"]


def _byte_level_tokenizer():
    """A byte-level BPE (GPT-2's, Llama 3's, Qwen's family) that has learnt merges of newlines and spaces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=900, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["\n".join(PIECES) * 20, "user: assistant: system:\n  \n\n   x\n \n" * 50],
                            trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   chat_template=TINY_CHAT_TEMPLATE)


def _metaspace_tokenizer():
    """A SentencePiece-style BPE (metaspace) with Gemma's turn tokens, as Gemma's tokenizer is made."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=GEMMA_SPECIALS, show_progress=False)
    tok.train_from_iterator([" ".join(PIECES) * 20, "user model the a of to\n" * 50], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                                   pad_token="<pad>")


@pytest.fixture(scope="module", params=["own", "default", "gemma"])
def tokenizer(request, tmp_path_factory) -> ModelTokenizer:
    folder = tmp_path_factory.mktemp(request.param)
    hf = _metaspace_tokenizer() if request.param == "gemma" else _byte_level_tokenizer()
    if request.param == "default":
        hf.chat_template = None
    hf.save_pretrained(folder)
    tok = ModelTokenizer(str(folder))
    expected = {"own": None, "default": DEFAULT_CHAT_TEMPLATE, "gemma": GEMMA_CHAT_TEMPLATE}[request.param]
    assert tok.chat_template == expected
    assert tok.prefix_tokens.kinds, "the cache must be on for this family, or the test shows nothing"
    # every cut kept, so that a wrong one cannot hide between kept ones
    tok.prefix_tokens = PrefixTokens(tok.prefix_tokens._encode_batch, tok.prefix_tokens._specials,
                                     tok.prefix_tokens.kinds, max_entries=4, max_tokens=20_000, piece_chars=1,
                                     min_reuse_chars=1)
    return tok


def _message(rng: random.Random, role: str) -> dict[str, str]:
    return {"role": role, "content": "".join(rng.choice(PIECES) + rng.choice(["", " ", "\n"])
                                             for _ in range(rng.randrange(1, 12)))}


def _whole(tok: ModelTokenizer, messages) -> list[int]:
    return tok.hf._tokenizer.encode(tok.render(messages), add_special_tokens=False).ids


@pytest.mark.parametrize("seed", range(6))
def test_incremental_equals_whole_over_random_conversations(tokenizer, seed):
    rng = random.Random(seed)
    system = _message(rng, "system")
    conversations = [[system], [system]]  # two agents sharing a system prompt, interleaved
    for turn in range(40):
        conversation = rng.choice(conversations)
        action = rng.random()
        if action < 0.7 or len(conversation) < 3:  # the usual turn: the reply and a new message
            conversation += [_message(rng, "assistant"), _message(rng, "user")]
        elif action < 0.85:  # an earlier message edited (a client that rewrites its history)
            conversation[rng.randrange(1, len(conversation))] = _message(rng, "user")
        else:  # compacted: the history cut short
            del conversation[rng.randrange(1, len(conversation)):]
            conversation.append(_message(rng, "user"))
        assert tokenizer.apply_chat_template(conversation) == _whole(tokenizer, conversation), (seed, turn)
    cache = tokenizer.prefix_tokens
    assert cache.num_reused > 0  # the test exercised reuse, not only the fallback
    assert len(cache._entries) <= cache.max_entries and cache.num_tokens <= cache.max_tokens


def test_a_kind_that_does_not_hold_is_found_and_never_used():
    def encode_batch(texts):  # a "tokenizer" that merges a newline with the next character: line cuts break
        out = []
        for text in texts:
            ids, i = [], 0
            while i < len(text):
                pair = text[i:i + 2]
                ids.append(hash(pair) % 1000 if pair.startswith("\n") else ord(text[i]))
                i += 2 if pair.startswith("\n") else 1
            out.append(ids)
        return out

    samples = ["a\nbc\nd" * 3, "<x>a<x>b"]
    assert cut_kinds_that_hold(encode_batch, ["<x>"], samples) == frozenset({"special"})
    assert cut_kinds_that_hold(encode_batch, [], ["no cuts at all here"]) == frozenset()
    cache = PrefixTokens(encode_batch, [], ())  # no kind holds: every text tokenized whole
    assert cache.encode("a\nb" * 50) == encode_batch(["a\nb" * 50])[0] and cache.num_reused == 0


def test_the_cache_keeps_its_bounds_and_drops_the_least_recently_used():
    def encode_batch(texts):
        return [[ord(c) for c in text] for text in texts]

    cache = PrefixTokens(encode_batch, [], ("line",), max_entries=2, max_tokens=1_000, piece_chars=10,
                         min_reuse_chars=10)
    texts = [f"{name}\n" + "x\n" * 200 for name in ("a", "b", "c")]
    for text in texts:
        assert cache.encode(text) == encode_batch([text])[0]
    assert len(cache._entries) == 2 and cache.num_tokens <= 1_000
    assert [e.text[0] for e in cache._entries.values()] == ["b", "c"]
    longer = texts[2] + "y\n" * 30  # continues c: reuses it, and replaces it
    assert cache.encode(longer) == encode_batch([longer])[0] and cache.num_reused > 0
    assert [e.text[0] for e in cache._entries.values()] == ["b", "c"] and len(cache._entries) == 2
    huge = "z\n" * 2_000  # more than the whole budget: tokenized, not kept
    assert cache.encode(huge) == encode_batch([huge])[0] and cache.num_tokens <= 1_000


@pytest.mark.parametrize("a, b, expected", [("", "", 0), ("abc", "abd", 2), ("abc", "abc", 3), ("ab", "abc", 2),
                                            ("x" * 200_000 + "a", "x" * 200_000 + "b", 200_000)])
def test_shared_prefix(a, b, expected):
    assert shared_prefix(a, b) == expected == shared_prefix(b, a)


def test_the_real_gemma_tokenizer_when_present():
    folder = Path.home() / ".cache/infermesh/models/gemma-3-270m"
    if not (folder / "tokenizer.json").exists():  # justified: the real 262K-vocabulary tokenizer is converted by
        # ./scripts/up (a minute, the model too), not in the suite; the metaspace family is covered above either way
        pytest.skip("Gemma 3 270M is converted by ./scripts/up, not by the tests")
    tok = ModelTokenizer(str(folder))
    assert tok.prefix_tokens.kinds == frozenset({"special", "line"})
    rng = random.Random(7)
    conversation = [_message(rng, "system")]
    for _ in range(30):
        conversation += [_message(rng, "user"), _message(rng, "assistant")]
        assert tok.apply_chat_template(conversation) == _whole(tok, conversation)


def test_a_cut_is_used_only_where_the_token_it_starts_is_shared_too():
    def encode_batch(texts):  # "<x>" is special; "A<" merges, as a BPE merge would across a cut
        out = []
        for text in texts:
            ids = []
            for n, part in enumerate(text.split("<x>")):
                if n:
                    ids.append(1000)
                i = 0
                while i < len(part):
                    if part[i:i + 2] == "A<":
                        ids.append(2000)
                        i += 2
                    else:
                        ids.append(ord(part[i]))
                        i += 1
            out.append(ids)
        return out

    cache = PrefixTokens(encode_batch, ["<x>"], ("special",), piece_chars=1, min_reuse_chars=1)
    cached, new = "A" * 2000 + "<x>" + "B" * 50, "A" * 2000 + "<y>" + "C" * 10  # they share "A" * 2000 + "<"
    assert cache.encode(cached) == encode_batch([cached])[0]
    assert cache.encode(new) == encode_batch([new])[0]  # not A*2000 from the cache + "<y>..." tokenized apart
    longer = cached + "D" * 20  # shares the special token whole: its cut is used
    assert cache.encode(longer) == encode_batch([longer])[0] and cache.num_reused == 2000


def test_a_template_that_refuses_some_samples_still_loads(tmp_path):
    hf = _byte_level_tokenizer()
    hf.chat_template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system turn') }}{% endif %}"
                        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    hf.save_pretrained(tmp_path)
    tok = ModelTokenizer(str(tmp_path))  # the samples with a system turn are skipped, not fatal
    conversation = [{"role": "user", "content": "a\nb"}, {"role": "assistant", "content": "c"}]
    assert tok.apply_chat_template(conversation) == _whole(tok, conversation)


def test_a_short_prompt_is_tokenized_whole_and_not_kept():
    def encode_batch(texts):
        return [[ord(c) for c in text] for text in texts]

    cache = PrefixTokens(encode_batch, [], ("line",), min_reuse_chars=100)
    assert cache.encode("a\nb" * 10) == encode_batch(["a\nb" * 10])[0] and not cache._entries
    assert cache.encode("a\nb" * 50) == encode_batch(["a\nb" * 50])[0] and len(cache._entries) == 1


def test_encode_ids_is_the_callers_own_copy_of_encode():
    cache = PrefixTokens(lambda texts: [[ord(c) for c in t] for t in texts], (), ("line",), min_reuse_chars=0)
    first = "alpha\nbeta\ngamma\n" * 40
    ids = cache.encode_ids(first)
    assert isinstance(ids, array) and ids.typecode == "I" and ids.tolist() == cache.encode(first)
    ids[0] = 0  # the caller's: the cache is not changed
    ids.extend([1, 2, 3])
    longer = first + "delta\n"
    assert cache.encode_ids(longer).tolist() == [ord(c) for c in longer]
