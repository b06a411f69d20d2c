r"""Grammar-constrained decoding (xgrammar) with budget-aware closing, for the sim and vLLM engines.

Two types, one helper::

    cache = GrammarCache(tokenizer_path, vocab_size)          # once per engine (tokenizer, compiler)
    compiled = cache.compile(structured)                      # LRU by (kind, sha256(spec))
    decoder = ConstrainedDecoder(compiled, max_tokens, close_within, stop_token_ids)  # per request
    while not decoder.is_terminated():
        token = decoder.forced_token(remaining)               # None: sample freely ...
        if token is None:
            token = sample(logits, decoder.mask())            # ... under the allowed-token bitmask
        decoder.accept(token)
    token = choose(decoder.mask(), preferred, rng)            # the sim's seeded draw under a mask

Budget-aware closing. A grammar that is cut by ``max_tokens`` yields broken JSON. Once no
more than ``close_within`` tokens of the budget remain and something is open (no stop token is
allowed), the decoder estimates before each token how many tokens the *closing policy* needs
to finish the grammar from the current state: a dry run that accepts the policy's tokens on
the matcher, counts them and ``rollback``s. When ``remaining <= estimate + margin`` it enters
closing mode (sticky) and forces the policy's token at every step. Otherwise it also clears
from the mask the "openers" (tokens with ``,``, ``{``, ``[`` or ``"`` outside a string, or a
quote followed by one of them inside) after which the policy's closing would no longer fit
(one dry run each): a single ``,`` before a required object can raise the closing length by
twenty tokens, more than any margin; where only a few tokens are allowed outside raw text
(after GLM's ``</arg_value><``: ``/`` or the ``a`` of an optional argument) each one is
checked so. The policy picks, among the tokens the mask allows:

1. a stop token (the grammar is complete: end here);
2. the longest vocabulary token that is a prefix of ``find_jump_forward_string()`` (text the
   grammar forces anyway: required keys, ``": "``, the rest of an enum value, end tags), taken as
   bytes: it may end inside a multi-byte character (``jump_forward_bytes``);
3. in raw text (free text or a tag's content, e.g. GLM's string ``<arg_value>``: the mask
   allows letters and a newline, which no JSON string does): the longest token that writes
   on an end string, innermost first (``</arg_value>`` before ``</tool_call>``, which is
   mere text inside a value), continuing one whose start the last bytes already hold;
   inside a JSON string (a small lexer follows quotes and backslashes, restarting after
   each end string and GLM tag): a token of ``"}]`` starting with ``"``, longest first;
   otherwise: tokens of ``}``/``]`` (longest first), then an end string as in raw text
   (GLM's tags between arguments), then ``,``, then ``"``;
4. otherwise the shortest token, tokens with whitespace, brackets, commas, quotes, ``-`` or
   ``\`` last, ties by id.

The dry run and closing use the same deterministic policy, so the estimate is exactly what
closing takes from that state: entered with ``remaining >= estimate`` it always finishes.
While a stop token is allowed nothing is open (free text of an ``auto`` tool grammar, or a
finished grammar whose mask allows only stop), so nothing is forced.

Limits: the policy is greedy, not a shortest-path search. Strings under ``format``
(email, date-time) or ``pattern`` get no help beyond jump-forward: for ``format: email``
the shortest allowed token never reaches the ``@``, the dry run gives up after the
remaining budget and closing, started at once, fails. Only the first
``max_checked_openers`` allowed openers are checked. A budget smaller than the estimate on
entering the window cannot be saved (small vocabularies spell keys letter by letter: set
``close_within`` well above the longest closing; the decoder widens a window that is smaller than
the closing from the start plus ``WINDOW_SLACK``). Cost: one dry run per token inside the
window, plus one per allowed opener (tens of microseconds per dry-run token).

Also: xgrammar 0.2.8 compiles strings with ``maxLength``/``minLength`` to ``[^"\\\r\n]``,
which lets raw control characters in (json.loads rejects them); ``mask()`` clears tokens
with bytes below 0x20 while inside a string.

UTF-8 in raw text. xgrammar's raw text (free text, GLM's string ``<arg_value>``) accepts any bytes, so a
byte-level vocabulary could write a lone continuation byte, or a lead byte cut off by ``</arg_value>``: the
client got U+FFFD in string arguments (JSON strings have no such problem: xgrammar keeps them UTF-8). The
decoder tracks the UTF-8 state of the accepted bytes (utf8_mask.py: none pending, or which continuation
bytes the pending character still needs) and, while the mask is raw text's, clears the tokens that would
make the text invalid (``TokenVocab.utf8_ok``, one bitmask per state; tokens without bytes stay as the
grammar says; strict as Python's decoder). The dry run restricts its masks the same way, so the estimate
is still exactly what closing takes.
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import xgrammar as xgr

from services.worker.engines import utf8_mask
from services.worker.engines.call_ends import (
    MAX_TAGS_PRICED,
    CallShape,
    call_shape,
    greedy_token_count,
    trigger_token_ids,
)
from shared.schema import Structured

_CLOSERS = frozenset(b'"}]')
_PENALIZED = frozenset(b'{[,\\"}]-' + bytes(range(0x21)))  # and whitespace, control bytes
_CONTROL = frozenset(range(0x20))
_OPENERS_OUT = frozenset(b',{["')
_OPENERS_IN = frozenset(b",{[:")
_PROBES = (b"x", b"q", b"z", b"Q")  # all allowed: free text (or a string), never JSON structure
_RAW_PROBE = b"\n"  # also allowed: raw text (free text, a tag's content), never a JSON string
TAIL_BYTES = 32
WINDOW_SLACK = 32  # tokens added to the closing length from the start when that exceeds close_within


@dataclass(slots=True)
class TokenVocab:
    """What closing needs to know of a tokenizer's tokens, computed once per tokenizer.

    ``string_closers``: tokens of ``"}]`` only that start with ``"``; ``struct_closers``: tokens of
    ``}]`` only (both longest first); ``order``: the other tokens, shortest first, tokens with
    whitespace, control bytes, brackets, commas or backslashes last."""

    vocab_size: int
    decoded: list[bytes]
    string_closers: list[int]
    struct_closers: list[int]
    order: list[int]
    order_ids: np.ndarray
    by_bytes: dict[bytes, list[int]]
    max_token_bytes: int
    probes: list[int]
    raw_probes: list[int]  # probes and a newline token: all allowed only in raw text
    commas: list[int]
    no_control: np.ndarray  # bitmask words: the tokens without control bytes (0x00-0x1f)
    openers_out: np.ndarray  # tokens that may commit to more structure outside a string: , { [ "
    openers_in: np.ndarray  # ... inside a string: a quote followed by , { [ or :
    utf8_ok: np.ndarray  # bitmask words per UTF-8 state (utf8_mask.py): the tokens that keep raw text valid

    @classmethod
    def from_tokenizer_info(cls, info: xgr.TokenizerInfo) -> TokenVocab:
        decoded = list(info.decoded_vocab)
        special = set(info.special_token_ids) | set(info.stop_token_ids)
        by_bytes: dict[bytes, list[int]] = {}
        string_closers, struct_closers, keyed = [], [], []
        openers_out, openers_in, with_control = [], [], []
        for token, text in enumerate(decoded):
            if not _CONTROL.isdisjoint(text):
                with_control.append(token)
            if token in special or not text:
                continue
            by_bytes.setdefault(text, []).append(token)
            if _CLOSERS.issuperset(text) and text[:1] == b'"':
                string_closers.append((-len(text), token))
            elif _CLOSERS.issuperset(text) and b'"' not in text:
                struct_closers.append((-len(text), token))
            else:
                keyed.append((not _PENALIZED.isdisjoint(text), len(text), token))
            if not _OPENERS_OUT.isdisjoint(text):
                openers_out.append(token)
                if b'"' in text and not _OPENERS_IN.isdisjoint(text.split(b'"', 1)[1]):
                    openers_in.append(token)
        keyed.sort()
        order = [k[-1] for k in keyed]
        clean = np.ones(-(-info.vocab_size // 32) * 32, dtype=np.uint8)
        clean[with_control] = 0
        no_control = np.packbits(clean, bitorder="little").view(np.int32)
        utf8_ok = utf8_mask.ok_words(decoded, special, clean.size)
        return cls(info.vocab_size, decoded, [t for _, t in sorted(string_closers)],
                   [t for _, t in sorted(struct_closers)], order, np.array(order, dtype=np.int64), by_bytes,
                   max((len(b) for b in by_bytes), default=1),
                   [by_bytes[p][0] for p in _PROBES if p in by_bytes],
                   [by_bytes[p][0] for p in (*_PROBES, _RAW_PROBE) if p in by_bytes], by_bytes.get(b",", []),
                   no_control,
                   np.array(openers_out, dtype=np.int64), np.array(openers_in, dtype=np.int64), utf8_ok)


def _lex(text: bytes, in_string: bool, escaped: bool) -> tuple[bool, bool]:
    """JSON string state after ``text``: (inside a string, right after a backslash)."""
    for c in text:
        if escaped:
            escaped = False
        elif in_string and c == 0x5C:
            escaped = True
        elif c == 0x22:
            in_string = not in_string
    return in_string, escaped


GLM_XML_ENDS = ("</arg_value>", "</arg_key>")  # the inner end tags of xgrammar's glm_xml style, innermost first
GLM_XML_TAGS = ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")


def _end_strings(spec: str) -> tuple[str, ...]:
    """The end strings of a structural tag, innermost first (closing prefers them in raw text, in that
    order): a tag's content before the tag's own end, and for ``glm_xml`` content (GLM's
    ``<arg_value>v</arg_value>``) its implicit ``</arg_value>`` and ``</arg_key>``. Raw text may hold an
    outer end (``</tool_call>`` inside a value is text), so the inner one must be tried first."""
    ends: list[str] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key != "end":
                    walk(value)
            if node.get("style") == "glm_xml":
                ends.extend(GLM_XML_ENDS)
            end = node.get("end")
            if isinstance(end, str) and end:
                ends.append(end)
            elif isinstance(end, list):
                ends.extend(e for e in end if isinstance(e, str) and e)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    try:
        walk(json.loads(spec))
    except ValueError:
        pass
    return tuple(dict.fromkeys(ends))


def _boundaries(ends: Sequence[str]) -> tuple[bytes, ...]:
    """Strings after which no JSON string is open: the end strings, and GLM's tags when they are used
    (a ``"`` in a raw ``<arg_value>`` is text, so the JSON lexer restarts after each tag)."""
    tags = GLM_XML_TAGS if any(e in GLM_XML_ENDS for e in ends) else ()
    return tuple(dict.fromkeys(t.encode() for t in (*ends, *tags)))


def _advance(text: bytes, lexer: tuple[bool, bool], tail: bytes, boundaries: Sequence[bytes],
             ) -> tuple[tuple[bool, bool], bytes]:
    """The (JSON lexer state, tail) after accepting ``text``: the lexer restarts after the last boundary
    that ``text`` completes; ``tail`` keeps the last ``TAIL_BYTES`` bytes (how far an end string is written)."""
    joined = tail + text
    restart = -1
    for b in boundaries:
        at = joined.rfind(b)
        if at >= 0 and at + len(b) > len(tail):
            restart = max(restart, at + len(b) - len(tail))
    if restart >= 0:
        lexer, text = (False, False), text[restart:]
    return _lex(text, *lexer), joined[-TAIL_BYTES:]


def _bits_at(bits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Whether each of ``ids`` is allowed by the bitmask words ``bits`` (vectorized)."""
    return ((bits.view(np.uint32)[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1).astype(bool)


def _allowed(bits: np.ndarray, token: int) -> bool:
    return bool((int(bits[token >> 5]) >> (token & 31)) & 1)


def allowed_token_ids(mask: torch.Tensor, vocab_size: int | None = None) -> np.ndarray:
    """The token ids a bitmask (xgrammar layout, one row) allows, ascending."""
    bits = np.unpackbits(mask.reshape(-1).numpy().view(np.uint8), bitorder="little")
    ids = np.flatnonzero(bits)
    return ids if vocab_size is None else ids[ids < vocab_size]


def jump_forward_bytes(matcher: xgr.GrammarMatcher) -> bytes:
    """The matcher's jump-forward string as bytes. It may end inside a multi-byte character (the bytes
    that an enum's values share), which xgrammar's str conversion cannot decode: the raw bytes are then
    taken from the UnicodeDecodeError (its ``object``), and none at all if it does not hold them."""
    try:
        return matcher.find_jump_forward_string().encode()
    except UnicodeDecodeError as exc:
        return bytes(exc.object) if isinstance(exc.object, (bytes, bytearray)) else b""


def choose(mask: torch.Tensor, preferred: list[int], rng: random.Random, preferred_tries: int = 2) -> int:
    """A seeded draw under ``mask``: a token of ``preferred`` (the prompt) when one of a few draws is
    allowed, else uniform among the allowed tokens. Same mask, list and RNG state: same token."""
    bits = mask.reshape(-1).numpy()
    for _ in range(preferred_tries if preferred else 0):
        token = preferred[rng.randrange(len(preferred))]
        if 0 <= token < bits.size * 32 and _allowed(bits, token):
            return token
    allowed = allowed_token_ids(mask)
    if allowed.size == 0:
        raise ValueError("the mask allows no token")
    return int(allowed[rng.randrange(allowed.size)])


class GrammarCache:
    """One tokenizer's grammar compiler, and its compiled grammars by (kind, sha256(spec)), LRU.

    xgrammar's own compiler cache is off, so ``max_entries`` bounds memory and hits/misses are ours."""

    def __init__(self, tokenizer_path: str, vocab_size: int = 0, max_entries: int = 256,
                 max_threads: int = 8, any_whitespace: bool = False) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            self.tokenizer, vocab_size=vocab_size or len(self.tokenizer))
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads, cache_enabled=False)
        self.special_token_ids: list[int] = sorted(self.tokenizer.all_special_ids)  # banned under a grammar
        self.vocab = TokenVocab.from_tokenizer_info(self.tokenizer_info)
        self.max_entries = max_entries
        self.any_whitespace = any_whitespace  # False: one space after ':' and ',' (no whitespace loops)
        self.num_hits = 0
        self.num_misses = 0
        self._compiled: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def vocab_size(self) -> int:
        return self.tokenizer_info.vocab_size

    def compile(self, structured: Structured) -> xgr.CompiledGrammar:
        """The compiled grammar of a request (ValueError if the spec is invalid)."""
        key = (structured.kind, hashlib.sha256(structured.spec.encode()).hexdigest())
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                self.num_hits += 1
                return compiled
        compiled = self._compile(structured)
        # ConstrainedDecoder finds the vocab tables and the tags' end strings here
        compiled._infermesh_vocab = self.vocab
        compiled._infermesh_ends = _end_strings(structured.spec) if structured.kind == "structural_tag" else ()
        compiled._infermesh_calls = call_shape(structured.spec) if structured.kind == "structural_tag" else None
        with self._lock:
            self.num_misses += 1
            self._compiled[key] = compiled
            while len(self._compiled) > self.max_entries:
                self._compiled.popitem(last=False)
        return compiled

    def _compile(self, structured: Structured) -> xgr.CompiledGrammar:
        try:
            if structured.kind == "json_object":
                return self.compiler.compile_builtin_json_grammar()
            if structured.kind == "json_schema":
                return self.compiler.compile_json_schema(structured.spec, any_whitespace=self.any_whitespace)
            if structured.kind == "structural_tag":
                return self.compiler.compile_structural_tag(structured.spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"invalid {structured.kind} grammar: {exc}") from exc
        raise ValueError(f"unknown structured kind {structured.kind!r}")

    def decoder(self, structured: Structured, max_tokens: int, stop_token_ids: list[int] | None = None,
                ) -> ConstrainedDecoder:
        return ConstrainedDecoder(self.compile(structured), max_tokens, structured.close_within, stop_token_ids,
                                  banned_token_ids=self.special_token_ids)


class ConstrainedDecoder:
    """One request's grammar state: the allowed-token mask, accepted tokens, budget-aware closing.

    ``stop_token_ids`` override the tokenizer's end-of-sequence tokens (empty or None: keep them).
    The grammar ends only by accepting one of them (``is_terminated``). ``vocab`` and ``end_strings``
    default to what ``GrammarCache.compile`` attached to ``compiled``."""

    def __init__(self, compiled: xgr.CompiledGrammar, max_tokens: int, close_within: int = 0,
                 stop_token_ids: list[int] | None = None, *, vocab: TokenVocab | None = None,
                 end_strings: tuple[str, ...] | None = None, margin: int = 3, max_dry_run: int = 256,
                 banned_token_ids: Sequence[int] = ()) -> None:
        assert max_tokens > 0 and close_within >= 0 and margin >= 0
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids) if stop_token_ids
                                          else None)
        self.vocab = vocab or getattr(compiled, "_infermesh_vocab", None) \
            or TokenVocab.from_tokenizer_info(compiled.tokenizer_info)
        ends = getattr(compiled, "_infermesh_ends", ()) if end_strings is None else end_strings
        self._ends = [e.encode() for e in ends]
        self._boundaries = _boundaries(ends)
        self.stop_token_ids = self.matcher.stop_token_ids
        self.max_tokens = max_tokens
        self.close_within = close_within
        self.margin = margin
        self.max_dry_run = max(max_dry_run, close_within)
        self.max_checked_openers = 8
        size = self.vocab.vocab_size
        self.bitmask = xgr.allocate_token_bitmask(1, size)
        self._bits = self.bitmask.numpy().reshape(-1)
        self._tail_bits = np.int32((1 << (size % 32)) - 1) if size % 32 else 0
        self._scratch = xgr.allocate_token_bitmask(1, size)
        self._scratch_bits = self._scratch.numpy().reshape(-1)
        self._mask_at = -1  # num_accepted when self.bitmask was last filled
        # Special tokens other than the stop tokens (<s>, <pad>, ...): xgrammar matches their literal text
        # ("<s>" is three characters of a string), but the edge's detokenizer drops them, so the text the
        # client gets would not be the text the grammar checked. They are never allowed under a grammar.
        self.banned_token_ids = sorted(set(banned_token_ids) - set(self.stop_token_ids))
        self._allowed_words: np.ndarray | None = None
        if self.banned_token_ids:
            words = np.full(self._bits.shape, -1, dtype=np.int32)
            for token in self.banned_token_ids:
                if token < size:
                    words[token >> 5] &= np.int32(~(1 << (token & 31)) if (token & 31) != 31 else 0x7FFFFFFF)
            self._allowed_words = words
        self._lexer = (False, False)  # JSON string state of the text since the last free-text point
        self._tail = b""  # the last TAIL_BYTES bytes accepted
        self._raw = False  # the mask at _mask_at is raw text's
        self._utf8 = 0  # UTF-8 state of the accepted bytes (utf8_mask.py): 0, or a character is pending
        self.utf8_restricted = False  # the mask at _mask_at had the tokens cleared that break UTF-8
        self._calls: CallShape | None = getattr(compiled, "_infermesh_calls", None)  # call_ends.py
        self._call_tail = b""  # the last bytes accepted, as many as the longest call end string
        self.made_call = False  # a call tag's end string was written
        self.num_accepted = 0
        self.closing = False
        self.num_forced = 0
        self.num_estimates = 0
        self.last_estimate: int | None = None
        if close_within > 0:
            # The window must exceed the longest closing, or closing starts too late to finish: a small
            # vocabulary spells GLM's tags letter by letter, and one call's fixed text alone can take
            # more than 128 tokens. So it is at least the closing from the start plus some slack.
            self.close_within = max(close_within, self.closing_length() + WINDOW_SLACK)
            self.max_dry_run = max(self.max_dry_run, self.close_within)

    # ------------------------------------------------------------ sampling under the grammar
    def mask(self) -> torch.Tensor:
        """The allowed next tokens, as xgrammar's int32 bitmask of shape (1, ceil(vocab/32)); reused."""
        if self._mask_at != self.num_accepted:
            self.matcher.fill_next_token_bitmask(self.bitmask)
            if self._tail_bits:  # xgrammar may set the padding bits past the vocabulary
                self._bits[-1] &= self._tail_bits
            if self._allowed_words is not None:
                self._bits &= self._allowed_words
            self._raw = self._is_raw(self._bits)
            # raw text takes any bytes: keep it valid UTF-8 (JSON strings are, by xgrammar)
            self.utf8_restricted = self._raw and utf8_mask.restrict(self._bits, self.vocab.utf8_ok[self._utf8])
            if self._lexer[0] and not self._raw and not self._stop_allowed(self._bits):
                # xgrammar 0.2.8 lets raw control characters into strings with maxLength/minLength
                # ([^"\\\r\n] instead of [^\0-\x1f"\\]), which json.loads rejects
                self._bits &= self.vocab.no_control
            self._mask_at = self.num_accepted
        return self.bitmask

    def accept(self, token_id: int) -> None:
        """Advance the grammar by one token (ValueError if the grammar does not allow it)."""
        if self._mask_at == self.num_accepted and self._stop_allowed(self._bits):
            self._lexer = (False, False)  # free text: quotes in it open no JSON string
        if not self.matcher.accept_token(token_id):
            raise ValueError(f"token {token_id} is not allowed by the grammar here")
        if self._calls is not None and not self.made_call and token_id < len(self.vocab.decoded):
            self._call_tail = (self._call_tail + self.vocab.decoded[token_id])[-self._calls.max_end_bytes:]
            self.made_call = any(end in self._call_tail for end in self._calls.ends)
        if token_id < len(self.vocab.decoded):
            text = self.vocab.decoded[token_id]
            self._lexer, self._tail = _advance(text, self._lexer, self._tail, self._boundaries)
            self._utf8 = utf8_mask.advance(self._utf8, text)
        self.num_accepted += 1

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    @property
    def utf8_state(self) -> int:
        """The UTF-8 state of the accepted bytes (utf8_mask.py): 0, or which bytes a pending character needs."""
        return self._utf8

    # ------------------------------------------------------------ budget-aware closing
    def forced_token(self, remaining: int) -> int | None:
        """The token to emit instead of sampling when ``remaining`` tokens of budget are too few
        to leave to chance, else None. Always a token the grammar allows here."""
        if self.close_within <= 0 or remaining > self.close_within or self.matcher.is_terminated():
            return None
        self.mask()
        if not self.closing:
            if self._stop_allowed(self._bits):
                return self._end_calls(remaining)  # nothing open: free text, or only the stop token is left
            self.last_estimate = self.closing_length(remaining)
            if remaining > self.last_estimate + self.margin:
                self._drop_unsafe_openers(remaining)
                return None
            self.closing = True
        self.num_forced += 1
        return self._closing_token(self._bits, self._lexer, self._tail, self._raw)

    def _end_calls(self, remaining: int) -> int | None:
        """In free text inside the window: the stop token once a call was made and one more could not
        finish; before any call, no token that could start one then (call_ends.py)."""
        calls = self._calls
        if calls is None:
            return None
        if calls.cost is None:
            calls.cost = self._price_call(calls)
        if remaining > calls.cost + self.margin:
            return None
        if self.made_call:
            self.num_forced += 1
            return next(t for t in self.stop_token_ids if _allowed(self._bits, t))
        if calls.trigger_ids is None:
            skip = set(self.banned_token_ids) | set(self.stop_token_ids)
            calls.trigger_ids = trigger_token_ids(self.vocab.decoded, calls.triggers, skip)
        ids = calls.trigger_ids
        if ids.size:
            words = self._bits.view(np.uint32)
            np.bitwise_and.at(words, ids >> 5, ~(np.uint32(1) << (ids & 31).astype(np.uint32)))
        return None

    def _price_call(self, calls: CallShape) -> int:
        """Tokens the most expensive call tag takes from free text: its begin string, then the closing
        policy's dry run to the stop token, on a fork of the matcher (this one is left as it was)."""
        v = self.vocab
        costs = []
        saved = (self.matcher, self._lexer, self._utf8)
        try:
            for begin in calls.begins[:MAX_TAGS_PRICED]:
                fork = saved[0].fork()
                if not fork.accept_string(begin):
                    continue
                self.matcher, self._lexer, self._utf8 = fork, (False, False), utf8_mask.advance(0, begin.encode())
                costs.append(greedy_token_count(begin.encode(), v.by_bytes, v.max_token_bytes) + self.closing_length())
        finally:
            self.matcher, self._lexer, self._utf8 = saved
        return max(costs, default=0)

    def closing_length(self, limit: int | None = None) -> int:
        """Tokens the closing policy takes from here to the stop token (dry run, state unchanged);
        ``limit`` + 1 (default ``max_dry_run``) when it does not finish within that many."""
        self.num_estimates += 1
        limit = self.max_dry_run if limit is None else min(limit, self.max_dry_run)
        m = self.matcher
        n = 0
        lexer, tail, utf8 = self._lexer, self._tail, self._utf8
        try:
            while not m.is_terminated():
                if n == limit:
                    return n + 1
                m.fill_next_token_bitmask(self._scratch)
                raw = self._is_raw(self._scratch_bits)
                if raw:  # as mask() restricts raw text, or the estimate would diverge from the forced path
                    utf8_mask.restrict(self._scratch_bits, self.vocab.utf8_ok[utf8])
                token = self._closing_token(self._scratch_bits, lexer, tail, raw)
                if not m.accept_token(token):
                    raise AssertionError(f"closing token {token} was not accepted")  # pragma: no cover
                text = self.vocab.decoded[token]
                lexer, tail = _advance(text, lexer, tail, self._boundaries)
                utf8 = utf8_mask.advance(utf8, text)
                n += 1
            return n
        finally:
            if n:
                m.rollback(n)

    def _drop_unsafe_openers(self, remaining: int) -> None:
        """Clear from the mask the tokens that open structure whose closing might no longer fit once
        sampled: one such token (``,`` before a required object, the ``a`` of GLM's ``<arg_key>`` of an
        optional argument) can raise the closing length by more than any margin. Where only a few tokens
        are allowed outside raw text (a choice between structures, or inside a string between enum values
        that part mid-string: 👨‍👩‍👧‍👦 and 👍🏽 share their first three bytes) each is checked by a dry
        run. Otherwise, outside a string, the first ``max_checked_openers`` allowed openers are checked
        and the rest dropped; inside a string they are all dropped (a bare ``"`` still closes it). Raw
        text opens nothing (its only way out is its end tag)."""
        v = self.vocab
        if self._raw:
            return
        in_string = self._lexer[0]
        allowed_ids = allowed_token_ids(self.bitmask, v.vocab_size)
        if allowed_ids is not None and allowed_ids.size <= self.max_checked_openers:
            allowed, num_checked = allowed_ids, allowed_ids.size
        else:
            candidates = v.openers_in if in_string else v.openers_out
            allowed = candidates[_bits_at(self._bits, candidates)]
            num_checked = 0 if in_string else self.max_checked_openers
        if allowed.size == 0:
            return
        unsafe = allowed[num_checked:].tolist()
        for token in allowed[:num_checked].tolist():
            if self._fits_after(token, remaining):
                continue
            unsafe.append(token)
        if len(unsafe) == allowed.size and allowed_ids is not None and allowed_ids.size == allowed.size:
            return  # every choice is too long: leave them, closing starts next (it may still fit)
        if unsafe:
            ids = np.array(unsafe, dtype=np.int64)
            words = self._bits.view(np.uint32)
            np.bitwise_and.at(words, ids >> 5, ~(np.uint32(1) << (ids & 31).astype(np.uint32)))

    def _fits_after(self, token: int, remaining: int) -> bool:
        """Whether the closing still fits the budget once ``token`` is taken (one dry run)."""
        if token in self.stop_token_ids:
            return True
        self.matcher.accept_token(token)
        lexer, tail, utf8 = self._lexer, self._tail, self._utf8
        self._lexer, self._tail = _advance(self.vocab.decoded[token], lexer, tail, self._boundaries)
        self._utf8 = utf8_mask.advance(utf8, self.vocab.decoded[token])
        try:
            needed = self.closing_length(remaining)
        finally:
            self._lexer, self._tail, self._utf8 = lexer, tail, utf8
            self.matcher.rollback(1)
        return needed + self.margin <= remaining - 1

    def _stop_allowed(self, bits: np.ndarray) -> bool:
        return any(_allowed(bits, t) for t in self.stop_token_ids)

    def _is_raw(self, bits: np.ndarray) -> bool:
        """Raw text (free text, or a tag's content such as GLM's string ``<arg_value>``): the probes
        and a newline are allowed, which no JSON string allows."""
        probes = self.vocab.raw_probes
        return bool(probes) and all(_allowed(bits, t) for t in probes)

    def _closing_token(self, bits: np.ndarray, lexer: tuple[bool, bool], tail: bytes, raw: bool) -> int:
        """The closing policy's token for the state whose mask is ``bits`` (see the module docstring); ``raw``:
        that mask is raw text's (told, not probed: the UTF-8 restriction may have cleared the probes)."""
        for token in self.stop_token_ids:
            if _allowed(bits, token):
                return token
        v = self.vocab
        jump = jump_forward_bytes(self.matcher)
        if jump:
            token = self._longest_prefix_token(bits, jump)
            if token is not None:
                return token
        in_string, escaped = lexer
        if raw:  # raw text: head for the innermost end tag
            token = self._end_token(bits, tail)
            if token is not None:
                return token
            candidates = v.struct_closers
        elif in_string and not escaped:
            candidates = v.string_closers
        else:  # JSON or tag structure: close what is open, else move on to the next member or value
            for token in v.struct_closers:
                if _allowed(bits, token):
                    return token
            token = self._end_token(bits, tail)
            if token is not None:
                return token
            candidates = v.commas + v.string_closers
        for token in candidates:
            if _allowed(bits, token):
                return token
        for token in v.order[:32]:
            if _allowed(bits, token):
                return token
        order = v.order_ids
        for start in range(32, order.size, 4096):
            chunk = order[start:start + 4096]
            hits = np.flatnonzero(_bits_at(bits, chunk))
            if hits.size:
                return int(chunk[hits[0]])
        allowed = allowed_token_ids(torch.from_numpy(bits), v.vocab_size)  # closers or specials only
        if allowed.size == 0:
            raise ValueError("the grammar allows no token here")
        return int(allowed[0])

    def _end_token(self, bits: np.ndarray, tail: bytes) -> int | None:
        """The longest allowed token that writes on an end string (innermost first): continuing it where
        ``tail`` already holds its start, else beginning it."""
        for end in self._ends:
            for k in range(min(len(end) - 1, len(tail)), -1, -1):
                if k and not tail.endswith(end[:k]):
                    continue
                token = self._longest_prefix_token(bits, end[k:])
                if token is not None:
                    return token
        return None

    def _longest_prefix_token(self, bits: np.ndarray, text: bytes) -> int | None:
        by_bytes = self.vocab.by_bytes
        for n in range(min(len(text), self.vocab.max_token_bytes), 0, -1):
            for token in by_bytes.get(text[:n], ()):
                if _allowed(bits, token):
                    return token
        return None
