"""What a run's own requests could hit, whatever the routing: the bounds a placement is measured against.

    infinite cache    one prefix cache that never evicts: what any routing can at most reach
    pooled LRU        one LRU prefix cache of the whole fleet's KV (workers x blocks each): what a perfect
                      placement over LRU engines reaches, with no block held twice

    gap to the ceiling = (infinite - pooled LRU)   capacity: no placement wins it back on LRU engines
                       + (pooled LRU - the run)     placement: duplicates and prefixes evicted on one
                                                    worker while another had room

Both replay the requests in time order, a finish before an arrival at the same instant, and count
hits as the block pool counts them: the longest run of a prompt's leading full blocks already
cached, at most (len - 1) // block_size blocks (the last prompt token is always computed). An
arrival caches every full block of its prompt; a finish caches the full blocks of prompt + answer
but its last token (never written to the KV cache). The pooled LRU keeps the engines' order: a
request's blocks are touched tail first, so its leading blocks are evicted last; it does not pin
the blocks of running requests (an engine cannot evict those), so it can only be a little optimistic.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from loadtests.lib.report import RequestRecord
from loadtests.lib.workloads import Arrival, Workload
from services.worker.engines.block_pool import Hasher, fast_hash_block


@dataclasses.dataclass(slots=True)
class Replayed:
    """One request of a run as a bound replays it."""

    arrival_t: float
    finish_t: float | None  # None: never finished (its answer never reached the cache)
    prompt: Sequence[int]
    output: Sequence[int]
    measured: bool = True  # counted in the hit rate (its prompt enters the cache either way)


class _Lru:
    """A set of block hashes with LRU eviction past ``capacity`` blocks (None: never evicts)."""

    def __init__(self, capacity: int | None) -> None:
        assert capacity is None or capacity > 0
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.blocks

    def touch(self, hashes: Sequence[int]) -> None:
        """Insert or refresh ``hashes`` tail first (the first block ends most recent), then evict."""
        blocks = self.blocks
        for h in reversed(hashes):
            blocks[h] = None
            blocks.move_to_end(h)
        if self.capacity is not None:
            while len(blocks) > self.capacity:
                blocks.popitem(last=False)


def prefix_cache_hits(requests: Iterable[Replayed], block_size: int, capacity_blocks: int | None = None,
                      hasher: Hasher = fast_hash_block) -> tuple[int, int]:
    """(cached prompt tokens, prompt tokens) of the measured requests through one prefix cache of
    ``capacity_blocks`` blocks (None: infinite), LRU-evicted."""
    requests = list(requests)
    events = [(r.arrival_t, 1, i) for i, r in enumerate(requests)]
    events += [(r.finish_t, 0, i) for i, r in enumerate(requests) if r.finish_t is not None]
    events.sort()
    cache = _Lru(capacity_blocks)
    chains: dict[int, list[int]] = {}  # request -> hashes of its prompt's full blocks
    num_cached = num_prompt = 0
    for _, kind, i in events:
        r = requests[i]
        if kind == 1:
            parent: int | None = None
            hits, hitting, chain = 0, True, []
            limit = (len(r.prompt) - 1) // block_size
            for start in range(0, len(r.prompt) - block_size + 1, block_size):
                parent = hasher(parent, r.prompt[start:start + block_size], ())
                if hitting and start // block_size < limit and parent in cache:
                    hits += 1
                else:
                    hitting = False
                chain.append(parent)
            cache.touch(chain)
            chains[i] = chain
            if r.measured:
                num_cached += hits * block_size
                num_prompt += len(r.prompt)
        else:
            chain = chains.pop(i, [])
            parent = chain[-1] if chain else None
            start = len(r.prompt) // block_size * block_size
            tail = list(r.prompt[start:]) + list(r.output[:-1])
            for j in range(0, len(tail) - block_size + 1, block_size):
                parent = hasher(parent, tail[j:j + block_size], ())
                chain.append(parent)
            cache.touch(chain)  # freed: the whole sequence goes back to the LRU, its tail oldest
    return num_cached, num_prompt


def infinite_cache_hits(requests: Iterable[Replayed], block_size: int,
                        hasher: Hasher = fast_hash_block) -> tuple[int, int]:
    """(cached prompt tokens, prompt tokens) of the measured requests, through one prefix cache that never evicts."""
    return prefix_cache_hits(requests, block_size, None, hasher)


def hit_bounds(requests: Sequence[Replayed], block_size: int, fleet_blocks: int) -> dict[str, float]:
    """The infinite-cache and pooled-LRU hit rates of one run's requests."""
    inf_cached, prompt = prefix_cache_hits(requests, block_size, None)
    lru_cached, _ = prefix_cache_hits(requests, block_size, fleet_blocks)
    return {"infinite_cache_hit_rate": inf_cached / prompt if prompt else float("nan"),
            "pooled_lru_hit_rate": lru_cached / prompt if prompt else float("nan")}


def gap_split(hit_rate: float, bounds: dict[str, float]) -> dict[str, float]:
    """A run's hit rate against its bounds: share of the ceiling, and the gap (pp) split capacity vs placement."""
    ceiling, lru = bounds["infinite_cache_hit_rate"], bounds["pooled_lru_hit_rate"]
    return {"of_ceiling": hit_rate / ceiling if ceiling else float("nan"),
            "gap_pp": 100 * (ceiling - hit_rate), "capacity_gap_pp": 100 * (ceiling - lru),
            "placement_gap_pp": 100 * (lru - hit_rate)}


class Recording:
    """A workload wrapper that keeps every arrival and every answer, for the bounds' replay."""

    def __init__(self, inner: Workload) -> None:
        self.inner = inner
        self.arrivals: dict[str, Arrival] = {}
        self.outputs: dict[str, list[int]] = {}

    def _keep(self, arrivals: list[Arrival]) -> list[Arrival]:
        self.arrivals.update((a.request_id, a) for a in arrivals)
        return arrivals

    def start(self) -> list[Arrival]:
        return self._keep(self.inner.start())

    def on_complete(self, arrival: Arrival, output_token_ids: list[int], t: float) -> list[Arrival]:
        self.outputs[arrival.request_id] = list(output_token_ids)
        return self._keep(self.inner.on_complete(arrival, output_token_ids, t))

    @property
    def done(self) -> bool:
        return self.inner.done


def replayed(records: list[RequestRecord], recording: Recording, warmup_s: float = 0.0) -> list[Replayed]:
    """Every routed request of a run; measured as summarize measures (finished or failed, arrived after warm-up)."""
    out = []
    for r in records:
        arrival = recording.arrivals[r.request_id]
        out.append(Replayed(r.arrival_t, r.finish_t, arrival.prompt_token_ids, recording.outputs.get(r.request_id, []),
                            measured=(r.finish_t is not None or r.error is not None) and r.arrival_t >= warmup_s))
    return out


BOUNDS_COLUMNS = [  # (header, summary key, multiplier, format)
    ("hit %", "prefix_hit_rate", 100, "{:.1f}"), ("ceiling %", "infinite_cache_hit_rate", 100, "{:.1f}"),
    ("of ceiling %", "of_ceiling", 100, "{:.1f}"), ("pooled LRU %", "pooled_lru_hit_rate", 100, "{:.1f}"),
    ("capacity gap pp", "capacity_gap_pp", 1, "{:.1f}"), ("placement gap pp", "placement_gap_pp", 1, "{:.1f}"),
    ("TTFT p50 ms", "ttft_p50_ms", 1, "{:.1f}"), ("TTFT p90 ms", "ttft_p90_ms", 1, "{:.1f}"),
    ("TTFT p99 ms", "ttft_p99_ms", 1, "{:.0f}"), ("wall s", "sim_wall_s", 1, "{:.1f}"),
]


def bounds_table(configs: dict[str, dict]) -> str:
    """A markdown table: each configuration's hit rate against its bounds, and its TTFT."""
    return columns_table(configs, BOUNDS_COLUMNS)


def columns_table(configs: dict[str, dict], columns: list[tuple[str, str, float, str]]) -> str:
    """A markdown table of configurations' summaries: (header, summary key, multiplier, format) per column; a
    missing or non-finite figure is "n/a"."""
    lines = ["| config | " + " | ".join(h for h, *_ in columns) + " |", "|---|" + "---:|" * len(columns)]
    for label, s in configs.items():
        cells = []
        for _, key, mult, fmt in columns:
            value = s.get(key)
            ok = isinstance(value, (int, float)) and value == value and abs(value) != float("inf")
            cells.append(fmt.format(value * mult) if ok else "n/a")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
