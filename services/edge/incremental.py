"""Agent turns cost their new tokens: a prompt's unchanged prefix takes its tokens from an earlier prompt's.

An agent re-sends its whole history every turn, and the chat template renders it to the same text up to where
the new messages start. ``PrefixTokens`` keeps the texts and tokens of recent prompts; a new text that starts
with most of one is tokenized only from a *cut* inside the part they share::

    earlier  |---- text A -------------------------------------|
    new      |---- text A ---------------------------|-- new ...
                                         ^ c: the last cut of A before they part
    tokens   = A.ids[:i(c)] + encode(new[c:])         i(c): the tokens of A before c

A cut is a position no token spans, so tokenizing the pieces between cuts and joining them gives what the whole
text gives: the start of a special token (tokenizers split those out before anything else), or the start of a
line (``is_line_cut``: one newline between characters that are not whitespace; byte-level BPE's pre-tokenizer
regexes and metaspace's splits end a piece there). Texts are tokenized in such pieces (one ``encode_batch``), so
where each cut falls in the tokens is known without offsets. Which kinds hold is checked per tokenizer when it loads
(``cut_kinds_that_hold``, on test conversations): a kind for which one cut disagrees is never used, and a
tokenizer with none never uses the cache. tests/unit/test_incremental_tokens.py checks incremental == whole over
random conversations for every chat template the edge renders.

Bounded: at most ``max_entries`` prompts and ``max_tokens`` token ids in all (4-byte arrays), the least recently
used dropped first; a prompt that continues an earlier one replaces it; a prompt shorter than ``min_reuse_chars``
is tokenized whole and not kept (short chat requests would push the long agent histories out).

Scoped: a prompt reuses only prompts of its own scope (``cache_scope``: the team and its ``cache_salt``, as the
engine's prefix cache is salted). A shared cache would be a timing oracle: another team's ``count_tokens`` of a
guessed long prefix answers in ~11 ms instead of ~250 ms (200K tokens) when anyone sent that prefix recently.
The bounds are shared: another team's prompts may push a team's out (a cost in time, never a leak of text).
"""

from __future__ import annotations

import bisect
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from itertools import pairwise
from typing import Callable, Iterable, Literal, Sequence

from shared.prefix_hash import shared_prefix

CutKind = Literal["special", "line"]
CUT_KINDS: tuple[CutKind, ...] = ("special", "line")
PROBE_CHARS = 1024  # an earlier prompt is a candidate when its first characters equal the new one's
PIECE_CHARS = 2048  # cuts kept at most this often: each piece is tokenized on its own
MIN_REUSE_CHARS = 4096  # below this much shared text, tokenizing it all is as cheap

EncodeBatch = Callable[[list[str]], Sequence[Sequence[int]]]  # texts -> their token ids, no special tokens added
CacheScope = str  # whose earlier prompts a prompt may reuse: ``cache_scope(team, cache_salt)``


def cache_scope(team: str, cache_salt: str | None) -> CacheScope:
    """The scope of ``team``'s prompts with ``cache_salt``: length-prefixed, so no two (team, salt) pairs share one."""
    return f"{len(team)}:{team}{cache_salt or ''}"


@dataclass(slots=True)
class _Entry:
    scope: CacheScope
    text: str
    ids: array  # 'I': 4 bytes a token
    cut_chars: list[int]  # where the kept cuts are in the text, ascending
    cut_tokens: list[int]  # how many tokens come before each


class PrefixTokens:
    """``encode(text)`` equals the tokenizer's, costing what is new since an earlier prompt."""

    def __init__(self, encode_batch: EncodeBatch, special_tokens: Iterable[str], kinds: Iterable[CutKind],
                 max_entries: int = 64, max_tokens: int = 8 << 20, piece_chars: int = PIECE_CHARS,
                 min_reuse_chars: int = MIN_REUSE_CHARS) -> None:
        self._encode_batch = encode_batch
        self._specials = tuple(t for t in special_tokens if t)
        # a cut is used only if the text it starts (a special token, or a line's first character) is shared too
        self._cut_span = max(map(len, self._specials), default=1)
        self.kinds = frozenset(kinds)
        self.max_entries, self.max_tokens = max_entries, max_tokens
        self.piece_chars, self.min_reuse_chars = piece_chars, min_reuse_chars
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._next_key = 0
        self.num_tokens = 0  # held in all entries
        self.num_reused = self.num_encoded = 0  # tokens taken from earlier prompts / tokenized here

    def encode(self, text: str, scope: CacheScope = "") -> list[int]:
        return self.encode_ids(text, scope).tolist()

    def encode_ids(self, text: str, scope: CacheScope = "") -> array:
        """``encode`` as a 4-byte array (the caller's own copy): a long prompt's ids stay in one buffer from here to
        the bus (its list of 200K ints costs ~2 ms to make and ~2 ms to turn back into an array). Only earlier
        prompts of ``scope`` are reused (``cache_scope``)."""
        if not self.kinds or len(text) < self.min_reuse_chars:  # nothing to reuse, nothing worth keeping for later
            ids = self._encode_batch([text])[0]
            self.num_encoded += len(ids)
            return array("I", ids)
        found = self._best_entry(text, scope)
        # the last cut whose context both texts share: what is before it, and what it starts
        at = -1 if found is None else bisect.bisect_right(found[1].cut_chars, found[2] - self._cut_span) - 1
        if found is None or at < 0 or found[1].cut_chars[at] < self.min_reuse_chars:
            ids, cut_chars, cut_tokens = self._tokenize(text, 0)
            return self._remember(_Entry(scope, text, ids, cut_chars, cut_tokens), None)
        key, entry, shared = found
        start, before = entry.cut_chars[at], entry.cut_tokens[at]
        rest, cut_chars, cut_tokens = self._tokenize(text, start)
        ids = entry.ids[:before]
        ids.extend(rest)
        self.num_reused += before
        continues = shared >= len(entry.text) - self.piece_chars  # the new prompt continues this one: it replaces it
        return self._remember(_Entry(scope, text, ids, entry.cut_chars[:at + 1] + cut_chars,
                                     entry.cut_tokens[:at + 1] + [before + n for n in cut_tokens]),
                              key if continues else None)

    # ------------------------------------------------------------ pieces
    def cuts(self, text: str, start: int = 0) -> list[int]:
        """The kept cuts in ``text`` after ``start``: at most one per ``piece_chars``."""
        found: list[int] = []
        if "special" in self.kinds:
            for token in self._specials:
                at = text.find(token, start + 1)
                while at >= 0:
                    found.append(at)
                    at = text.find(token, at + len(token))
        if "line" in self.kinds:
            at = text.find("\n", start)
            while 0 <= at < len(text) - 1:
                if is_line_cut(text, at + 1):
                    found.append(at + 1)
                at = text.find("\n", at + 1)
        kept: list[int] = []
        for at in sorted(found):
            if at - (kept[-1] if kept else start) >= self.piece_chars:
                kept.append(at)
        return kept

    def _tokenize(self, text: str, start: int) -> tuple[array, list[int], list[int]]:
        """``text[start:]``'s ids, in pieces between its cuts; the cuts, and the tokens before each (from start)."""
        cut_chars = self.cuts(text, start)
        pieces = self._encode_batch(_split(text, start, cut_chars))
        ids, cut_tokens = array("I"), []
        for piece in pieces[:-1]:
            ids.extend(piece)
            cut_tokens.append(len(ids))  # the piece ended at a cut
        ids.extend(pieces[-1])
        self.num_encoded += len(ids)
        return ids, cut_chars, cut_tokens

    # ------------------------------------------------------------ entries
    def _best_entry(self, text: str, scope: CacheScope) -> tuple[int, _Entry, int] | None:
        """``scope``'s entry sharing the longest prefix with ``text``: its key, it, and how many characters they
        share."""
        best = None
        for key, entry in self._entries.items():
            probe = min(PROBE_CHARS, len(entry.text), len(text))
            if entry.scope == scope and entry.text[:probe] == text[:probe]:
                shared = shared_prefix(entry.text, text)
                if best is None or shared > best[2]:
                    best = (key, entry, shared)
        if best is not None:
            self._entries.move_to_end(best[0])
        return best

    def _remember(self, entry: _Entry, replaced: int | None) -> array:
        if replaced is not None:
            self.num_tokens -= len(self._entries.pop(replaced).ids)
        if len(entry.ids) <= self.max_tokens:
            self._entries[self._next_key] = entry
            self._next_key += 1
            self.num_tokens += len(entry.ids)
        while self._entries and (len(self._entries) > self.max_entries or self.num_tokens > self.max_tokens):
            self.num_tokens -= len(self._entries.popitem(last=False)[1].ids)
        return entry.ids[:]  # a copy: the entry's ids are extended in place by a later prompt's


def is_line_cut(text: str, at: int) -> bool:
    """A line starts at ``at`` after one newline between two characters that are not whitespace. (After a run of
    newlines or spaces, no: byte-level BPE tokenizes "\n\n" at the end of a piece as one token, "ĊĊ", and before
    a letter as two.)"""
    return (1 < at < len(text) and text[at - 1] == "\n" and not text[at].isspace()
            and not text[at - 2].isspace())


def _split(text: str, start: int, cuts: list[int]) -> list[str]:
    return [text[a:b] for a, b in pairwise([start, *cuts, len(text)])]


def cut_kinds_that_hold(encode_batch: EncodeBatch, special_tokens: Iterable[str],
                        samples: Iterable[str]) -> frozenset[CutKind]:
    """The cut kinds at which tokenizing ``samples`` in pieces gives what the whole text gives, at every cut (and
    that cut at least once)."""
    samples, specials = list(samples), list(special_tokens)
    holding = set()
    for kind in CUT_KINDS:
        probe = PrefixTokens(encode_batch, specials, (kind,))
        cut_at_all = False
        for text in samples:
            cuts = _every_cut(probe, text)
            cut_at_all = cut_at_all or bool(cuts)
            pieces = encode_batch(_split(text, 0, cuts))
            if [t for piece in pieces for t in piece] != list(encode_batch([text])[0]):
                break
        else:
            if cut_at_all:
                holding.add(kind)
    return frozenset(holding)


def _every_cut(probe: PrefixTokens, text: str) -> list[int]:
    """Every cut of ``probe``'s kinds in ``text``, not only the kept ones."""
    return [at for at in range(1, len(text))
            if ("special" in probe.kinds and any(text.startswith(t, at) for t in probe._specials))
            or ("line" in probe.kinds and is_line_cut(text, at))]


def sample_conversations() -> list[list[dict[str, str]]]:
    """What a tokenizer's cuts are checked on: turns of words, code, JSON, unicode, blank lines and indents."""
    texts = ["Name three colours.", "Red, green and blue.\n\nAnything else?",
             "def f(x):\n    return {\"a\": [1, 2]}\n\n\n# done\n", "  leading spaces\nand\ttabs \n",
             "naïve café — 東京 🙂\nemoji and CJK", '{"tool": "search", "arguments": {"q": "x"}}',
             "line one\nline two\n- item\n1. first\n\r\nwindows\r\nend", "trailing newline\n\n"]
    conversation = [{"role": "system", "content": "You are terse.\nAnswer in one line."}]
    for i, text in enumerate(texts):
        conversation.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return [conversation, conversation[1:], [{"role": "user", "content": text} for text in texts[:1]]]
