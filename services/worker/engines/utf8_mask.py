"""UTF-8 validity of raw text under a grammar (grammar.py): xgrammar's raw text (GLM's string
``<arg_value>``, free text) accepts any bytes, so a byte-level vocabulary can write invalid UTF-8 there.

The state of the accepted bytes is one of ``NUM_STATES``: 0 (no character pending), 1-3 (a character
still needs that many continuation bytes, 80-BF), 4-7 (right after the lead byte E0, ED, F0 or F4, whose
first continuation byte is narrower: A0-BF, 80-9F, 90-BF, 80-8F). Knowing only how many bytes are still
needed would let overlong forms, surrogates and code points past U+10FFFF through when the lead byte ends a
token (every byte is a token on a byte-level vocabulary); the strictness is Python's decoder's.

    ok = ok_words(decoded, always_ok, num_bits)  # once per vocabulary: (NUM_STATES, words) int32 bitmasks
    restrict(bits, ok[state])                     # clear the tokens that would make the text invalid
    state = advance(state, token_bytes)           # after each accepted token
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

NUM_STATES = 8
_PENDING = {1: (0x80, 0xBF, 0), 2: (0x80, 0xBF, 1), 3: (0x80, 0xBF, 2),  # state: (lowest, highest, next)
            4: (0xA0, 0xBF, 1), 5: (0x80, 0x9F, 1), 6: (0x90, 0xBF, 2), 7: (0x80, 0x8F, 2)}
_LEADS = {0xE0: 4, 0xED: 5, 0xF0: 6, 0xF4: 7}


def step(state: int, byte: int) -> int:
    """The state after one more byte, -1 if the byte makes the text invalid UTF-8."""
    if state:
        low, high, after = _PENDING[state]
        return after if low <= byte <= high else -1
    if byte < 0x80:
        return 0
    if 0xC2 <= byte <= 0xDF:
        return 1
    if 0xE0 <= byte <= 0xF4:
        return _LEADS.get(byte, 2 if byte <= 0xEF else 3)
    return -1  # a continuation byte, C0, C1, F5-FF


def valid_after(state: int, data: bytes) -> int:
    """The state after ``data`` (an incomplete character at its end is allowed), -1 if invalid."""
    for byte in data:
        state = step(state, byte)
        if state < 0:
            return -1
    return state


def advance(state: int, data: bytes) -> int:
    """The state after ``data`` as a lenient decoder sees it: an invalid byte ends the pending character
    (one U+FFFD) and is read again as the start of a new one."""
    if not state and data.isascii():
        return 0
    for byte in data:
        after = step(state, byte)
        state = after if after >= 0 else max(step(0, byte), 0)
    return state


def ok_words(decoded: Sequence[bytes], always_ok: Collection[int], num_bits: int) -> np.ndarray:
    """Per state, bitmask words (xgrammar's layout) of the tokens whose bytes keep the text valid UTF-8.
    Tokens without bytes and ``always_ok`` ones (stop and special tokens) stay as the grammar says; the
    padding bits past the vocabulary are set."""
    ok = np.zeros((NUM_STATES, num_bits), dtype=np.uint8)
    ok[0] = 1  # ASCII keeps any text valid that has no character pending, and continues none
    free = [token for token in always_ok if token < num_bits]
    for token, text in enumerate(decoded[:num_bits]):
        if not text:
            free.append(token)
        elif not text.isascii():
            ok[0, token] = valid_after(0, text) >= 0
            if 0x80 <= text[0] <= 0xBF:
                for state in range(1, NUM_STATES):
                    ok[state, token] = valid_after(state, text) >= 0
    ok[:, free] = 1
    ok[:, len(decoded):] = 1
    return np.packbits(ok, axis=1, bitorder="little").view(np.int32)


def restrict(bits: np.ndarray, ok: np.ndarray) -> bool:
    """Clear from the bitmask words ``bits`` (in place) the tokens ``ok`` does not allow, unless that would
    leave none; whether it did."""
    restricted = bits & ok
    if not restricted.any():
        return False
    bits[:] = restricted
    return True


def token_lists(ok: np.ndarray, vocab_size: int) -> list[tuple[bool, np.ndarray]]:
    """Per state, the shorter way to apply ``ok`` to a row of logits: (True, the allowed ids) to keep only
    those, or (False, the disallowed ids) to clear those."""
    bits = np.unpackbits(ok.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size].astype(bool)
    lists = []
    for row in bits:
        allowed = np.flatnonzero(row)
        keep = allowed.size <= vocab_size - allowed.size
        lists.append((keep, allowed if keep else np.flatnonzero(~row)))
    return lists
