"""The order batch lines are sent in, pure: earliest deadline first across jobs, shared prefixes together within one.

    across jobs   earliest ``expires_at`` first; ties by ``created_at``, then by when the job was added. A job's
                  lines all go before the next job's (EDF: the job closest to expiring finishes first).
    within a job  retries that are due (``defer``'s ``until`` <= now) first, oldest ``until`` first; then the
                  lines requeued at once (``requeue``), then the rest in prefix order:

    prefix order  lines whose prompts share a beginning are sent together, so the workers' KV cache of that
                  prefix stays hot. The rendered prompt (``prompt_text``: the chat messages as role and text,
                  or the completion prompt) is cut in blocks of PREFIX_BLOCK characters, up to PREFIX_DEPTH
                  blocks; the lines form a trie over those blocks, walked depth first with children in the
                  order they first appear in the file. So every group that shares its first k blocks is
                  contiguous, groups keep their first appearance's order, and lines equal over the first
                  PREFIX_BLOCK * PREFIX_DEPTH characters keep the file's order.

``Dispatcher("shuffled")`` sends a job's fresh lines in a random order seeded by the job's id instead of prefix
order: the control a benchmark compares prefix order against (loadtests/batch.py); retries and EDF are the same.

``next`` pops lines: a popped line is the caller's until it reports it (the job counts it) or hands it back with
``requeue`` / ``defer``. ``drop_job`` forgets a cancelled or expired job's lines that were not popped.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, get_args

import msgspec

from services.batch.lines import BatchLine

PREFIX_BLOCK = 64  # characters: about a 16-token KV block
PREFIX_DEPTH = 16  # blocks: prompts equal over their first 1,024 characters count as one group
DispatchOrder = Literal["prefix", "shuffled"]
DISPATCH_ORDERS: tuple[str, ...] = get_args(DispatchOrder)


class LineRef(NamedTuple):
    job_id: str
    index: int  # the line's 0-based index in its job's input file


def prompt_text(body: dict[str, Any]) -> str:
    """The part of a request body a worker prefills, as text: what lines may share a cached prefix of."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return "".join(_message_text(message) for message in messages)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    return msgspec.json.encode(prompt).decode()  # token ids or a list of prompts: still deterministic


def _message_text(message: Any) -> str:
    if not isinstance(message, dict):
        return msgspec.json.encode(message).decode()
    content = message.get("content")
    if isinstance(content, list):  # parts: their text, anything else (images) as JSON
        content = "".join(part["text"] if isinstance(part, dict) and isinstance(part.get("text"), str)
                          else msgspec.json.encode(part).decode() for part in content)
    elif not isinstance(content, str):
        content = msgspec.json.encode(content).decode()
    return f"<{message.get('role')}>{content}\n"


class PrefixTrie:
    """The trie of prefix order, a text at a time (a streamed input's lines, as they are read): ``path`` is the
    text's nodes, numbered by first appearance; sorting texts by path (stably) is prefix order."""

    def __init__(self, block: int = PREFIX_BLOCK, depth: int = PREFIX_DEPTH) -> None:
        self.block, self.depth = block, depth
        self._node_ids: dict[tuple[int, str], int] = {}  # (parent node, block text) -> node
        self._paths: dict[tuple[int, ...], tuple[int, ...]] = {}  # each path once: lines that share one share it

    def path(self, text: str) -> tuple[int, ...]:
        path, parent, block = [], -1, self.block
        for start in range(0, min(len(text), block * self.depth), block):
            parent = self._node_ids.setdefault((parent, text[start:start + block]), len(self._node_ids))
            path.append(parent)
        found = tuple(path)
        return self._paths.setdefault(found, found)


def prefix_order(texts: Sequence[str], block: int = PREFIX_BLOCK, depth: int = PREFIX_DEPTH) -> list[int]:
    """Positions of ``texts`` in prefix order (see the module docstring); a stable sort by trie path."""
    trie = PrefixTrie(block, depth)
    paths = [trie.path(text) for text in texts]
    return sorted(range(len(texts)), key=paths.__getitem__)


@dataclass(slots=True)
class _Job:
    job_id: str
    rank: tuple[int, int, int]  # (expires_at, created_at, added): the EDF order
    fresh: deque[int]  # never sent, in prefix order
    requeued: deque[int] = field(default_factory=deque)  # handed back for an immediate retry
    deferred: list[tuple[float, int, int]] = field(default_factory=list)  # heap of (until, seq, index)


class Dispatcher:
    """Which batch line goes next. It only orders lines; how many run at once is the caller's ``n``."""

    def __init__(self, order: DispatchOrder = "prefix") -> None:
        assert order in DISPATCH_ORDERS, order
        self._shuffled = order == "shuffled"
        self._jobs: dict[str, _Job] = {}
        self._order: list[tuple[tuple[int, int, int], str]] = []  # (rank, job_id), sorted
        self._added = itertools.count()
        self._seq = itertools.count()

    def add_job(self, job_id: str, expires_at: int, created_at: int, lines: Sequence[BatchLine]) -> None:
        """Queue a validated job's lines (a job already queued is left as it is)."""
        trie = PrefixTrie()
        self.add_paths(job_id, expires_at, created_at, [line.index for line in lines],
                       [trie.path(prompt_text(line.body)) for line in lines])

    def add_paths(self, job_id: str, expires_at: int, created_at: int, indices: Sequence[int],
                  paths: Sequence[tuple[int, ...]]) -> None:
        """``add_job`` for lines known by index and prefix path (``PrefixTrie``, built as a streamed input was
        read): the bodies need not be in memory."""
        if job_id in self._jobs:
            return
        if self._shuffled:
            order = list(range(len(indices)))
            random.Random(job_id).shuffle(order)
        else:
            order = sorted(range(len(indices)), key=paths.__getitem__)
        job = _Job(job_id, (expires_at, created_at, next(self._added)), deque(indices[i] for i in order))
        self._jobs[job_id] = job
        bisect.insort(self._order, (job.rank, job_id))

    def next(self, n: int, now: float) -> list[LineRef]:
        """Pop up to ``n`` lines that may go now, in dispatch order."""
        taken: list[LineRef] = []
        for _, job_id in self._order:
            if len(taken) >= n:
                break
            job = self._jobs[job_id]
            while len(taken) < n and job.deferred and job.deferred[0][0] <= now:
                taken.append(LineRef(job_id, heapq.heappop(job.deferred)[2]))
            while len(taken) < n and job.requeued:
                taken.append(LineRef(job_id, job.requeued.popleft()))
            while len(taken) < n and job.fresh:
                taken.append(LineRef(job_id, job.fresh.popleft()))
        return taken

    def requeue(self, job_id: str, index: int) -> None:
        """Hand a popped line back to go again as soon as possible (ahead of its job's fresh lines)."""
        job = self._jobs.get(job_id)
        if job is not None:
            job.requeued.append(index)

    def defer(self, job_id: str, index: int, until: float) -> None:
        """Hand a popped line back to go again no earlier than ``until`` (a 429's backoff or Retry-After)."""
        job = self._jobs.get(job_id)
        if job is not None:
            heapq.heappush(job.deferred, (until, next(self._seq), index))

    def drop_job(self, job_id: str) -> int:
        """Forget a job (cancelled, expired, or all its lines answered); returns how many lines it still had."""
        job = self._jobs.pop(job_id, None)
        if job is None:
            return 0
        self._order.remove((job.rank, job_id))
        return len(job.fresh) + len(job.requeued) + len(job.deferred)

    def pending(self, job_id: str) -> int:
        """Lines of ``job_id`` not popped (or handed back), deferred ones included."""
        job = self._jobs.get(job_id)
        return 0 if job is None else len(job.fresh) + len(job.requeued) + len(job.deferred)

    def wake_at(self) -> float | None:
        """The earliest ``until`` among deferred lines, for a caller with nothing else ready to sleep until."""
        untils = [job.deferred[0][0] for job in self._jobs.values() if job.deferred]
        return min(untils) if untils else None
