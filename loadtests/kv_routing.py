"""KV-aware routing in the offline fleet simulator: kv_aware vs round robin vs least loaded, same traffic.

    python -m loadtests.kv_routing                    # 3 seeds, medians -> docs/results/kv_routing/kv_routing.*
    python -m loadtests.kv_routing --sweep            # one seed: kv_aware's decode weight x KV capacity
    python -m loadtests.kv_routing --quick --no-write # a short smoke run

Fleet: 16 aggregated gb200-glm53 workers (FP8 KV, no host tier, so device capacity alone decides hits).
Traffic: closed-loop agent sessions (loadtests.lib.workloads.AgentSessions) at ``scale`` 0.1 of the real
token counts (600 new tokens a turn on a history of up to 14K, 30-token answers) with the think time
scaled alike (3 s for 30 s), kept at a steady number of sessions, measured after a warm-up. Each
worker's KV capacity is scaled the same way (0.1 x the profile's 1.09M tokens = 109K tokens), so it
holds the histories of about a dozen sessions: the fleet's working set fits when each session stays
on one worker, and is 16x too big when every worker sees every session (round robin).

Every configuration sees the same seeded sessions (an answer depends only on its prompt and the seed,
so the prompts of a session are the same whichever worker serves it; only timing differs). ``kv_aware``
is the live router's KvAwarePolicy as it is (loadtests/lib/fleet_sim.KvRouter), fed the workers' KV events
and exact instantaneous loads.

Infinite-cache hit rate: the kv_aware run's requests (arrival order; each prompt, and its answer once
it finished, which the next turn's prompt repeats) replayed through one prefix cache that never
evicts, counted as the block pool counts hits (whole blocks of the workers' block size, the last
prompt token always computed). It bounds what any routing can reach on that traffic.

Targets (the issue): kv_aware TTFT p50 <= 0.5 x round robin's; kv_aware hit rate within 5 percentage
points (absolute) of the infinite-cache hit rate.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from loadtests.lib.cache_bounds import Recording, Replayed, columns_table, infinite_cache_hits, replayed  # noqa: F401 (Replayed: re-exported)
from loadtests.lib.fleet_sim import FleetConfig, FleetSim
from loadtests.lib.report import summarize, write_report
from loadtests.lib.workloads import AgentSessions
from services.router.policy import KvRoutingConfig
from services.router.scoring import CostWeights
from services.worker.engines.cost_model import load_profile

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results" / "kv_routing"
PROFILE = "gb200-glm53"
TTFT_RATIO_TARGET = 0.5
HIT_GAP_TARGET = 0.05  # absolute: percentage points / 100


@dataclasses.dataclass
class Setup:
    num_workers: int = 16
    sessions: int = 160  # 10 per worker
    scale: float = 0.1  # token counts and think time
    think_s: float = 3.0  # 30 s x scale
    kv_fraction: float = 0.1  # of the profile's device KV blocks per worker (scaled like the tokens)
    warmup_s: float = 100.0
    measure_s: float = 200.0
    seeds: tuple[int, ...] = (1, 2, 3)

    @property
    def until_s(self) -> float:
        return self.warmup_s + self.measure_s


# label -> FleetConfig overrides. The first five are the default comparison; "session" is for reference.
CONFIGS: dict[str, dict] = {
    # the router as deployed for agents: KvAwarePolicy, Dynamo's weights (prefill 1, decode 1), and the
    # session's binding (X-Session-Id) kept unless its worker is gone, excluded or overloaded
    "kv_aware + sessions": dict(policy="kv_aware", kv_bind_sessions=True),
    "kv_aware no session id": dict(policy="kv_aware"),  # the cost alone, Dynamo's weights
    "kv_aware no session id decode 0.1": dict(policy="kv_aware",
                                               kv_routing=KvRoutingConfig(weights=CostWeights(decode=0.1))),
    "round_robin": dict(policy="round_robin"),
    "least_loaded": dict(policy="least_loaded"),
    "session": dict(policy="session"),  # the simulator's own sticky-session router, for reference
}
DEFAULT_CONFIGS = ("kv_aware + sessions", "kv_aware no session id", "kv_aware no session id decode 0.1",
                   "round_robin", "least_loaded")


# ---------------------------------------------------------------- runs
def fleet_config(setup: Setup, label: str, seed: int) -> FleetConfig:
    profile = load_profile(PROFILE)
    return FleetConfig(profile=profile, num_workers=setup.num_workers, kv_dtype="fp8", host_kv=False,
                       num_kv_blocks=int(profile.num_kv_blocks("fp8") * setup.kv_fraction), seed=seed, label=label,
                       **CONFIGS[label])


def run(setup: Setup, label: str, seed: int, config: FleetConfig | None = None) -> dict:
    """One configuration, one seed: its summary after the warm-up, with the infinite-cache hit rate of its traffic."""
    config = config or fleet_config(setup, label, seed)
    workload = Recording(AgentSessions(setup.sessions, scale=setup.scale, think_time_s=setup.think_s, seed=seed,
                                       stagger_s=setup.warmup_s / 2, steady_until_s=setup.until_s))
    started = time.perf_counter()
    sim = FleetSim(config)
    result = sim.run(workload, until_s=setup.until_s)
    wall = time.perf_counter() - started
    records = [r for r in result.records if r.finish_t is not None or r.error]
    summary = summarize(records, num_gpus=config.num_gpus, warmup_s=setup.warmup_s, duration_s=setup.measure_s)
    block_size = sim.decoders[0].pool.block_size
    cached, prompt = infinite_cache_hits(replayed(result.records, workload, setup.warmup_s), block_size)
    busy = sum(result.worker_busy.values()) / (len(result.worker_busy) * result.duration_s)
    summary.update(seed=seed, infinite_cache_hit_rate=cached / prompt if prompt else math.nan,
                   busy_fraction=busy, repins=result.num_repins, sim_wall_s=round(wall, 1),
                   kv_tokens_per_worker=config.num_kv_blocks * block_size)
    summary["hit_gap_pp"] = 100 * (summary["infinite_cache_hit_rate"] - summary["prefix_hit_rate"])
    if sim.kv_router is not None:
        measured = [r for r in records if r.arrival_t >= setup.warmup_s]
        actual = sum(r.num_cached_tokens for r in measured)
        expected = sum(sim.kv_router.expected_cached.get(r.request_id, 0) for r in measured)
        summary["router_expected_over_actual_cached"] = expected / actual if actual else math.nan
        summary["index_skipped_blocks"] = sim.kv_router.index.num_skipped_blocks
    print(f"  {label} seed {seed}: hit {summary['prefix_hit_rate']:.3f}"
          f" (infinite {summary['infinite_cache_hit_rate']:.3f}),"
          f" TTFT p50 {summary['ttft_p50_ms']:.0f} p90 {summary['ttft_p90_ms']:.0f} ms,"
          f" ITL p90 {summary['itl_p90_ms']:.1f}"
          f" ms, busy {busy:.2f}, {summary['requests']} requests ({wall:.0f} s)", file=sys.stderr)
    return summary


def median_summary(runs: list[dict]) -> dict:
    """Per figure, the median over seeds (numbers only)."""
    keys = [k for k, v in runs[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "seed"]
    out: dict = {}
    for key in keys:
        values = [r[key] for r in runs if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        out[key] = statistics.median(values) if values else math.nan
    out["seeds"] = [r["seed"] for r in runs]
    return out


def targets(configs: dict[str, dict], per_seed: dict[str, list[dict]]) -> dict:
    """Each kv_aware configuration against the issue's targets, on the medians and seed by seed."""
    out = {}
    rr, rr_runs = configs.get("round_robin"), per_seed.get("round_robin", [])
    for label, summary in configs.items():
        if not label.startswith("kv_aware"):
            continue
        entry: dict = {"hit_gap_pp": summary["hit_gap_pp"], "hit_ok": summary["hit_gap_pp"] <= 100 * HIT_GAP_TARGET,
                       "hit_ok_per_seed": [r["hit_gap_pp"] <= 100 * HIT_GAP_TARGET for r in per_seed[label]]}
        if rr is not None:
            entry["ttft_p50_ratio_to_rr"] = summary["ttft_p50_ms"] / rr["ttft_p50_ms"]
            entry["ttft_ok"] = entry["ttft_p50_ratio_to_rr"] <= TTFT_RATIO_TARGET
            entry["ttft_ok_per_seed"] = [k["ttft_p50_ms"] <= TTFT_RATIO_TARGET * r["ttft_p50_ms"]
                                         for k, r in zip(per_seed[label], rr_runs, strict=True)]
        out[label] = entry
    return out


# ---------------------------------------------------------------- report
COLUMNS = [  # (header, key, multiplier, format)
    ("requests", "measured", 1, "{:.0f}"), ("prefix hit %", "prefix_hit_rate", 100, "{:.1f}"),
    ("infinite-cache hit %", "infinite_cache_hit_rate", 100, "{:.1f}"), ("gap pp", "hit_gap_pp", 1, "{:.1f}"),
    ("TTFT p50 ms", "ttft_p50_ms", 1, "{:.0f}"), ("TTFT p90 ms", "ttft_p90_ms", 1, "{:.0f}"),
    ("ITL p90 ms", "itl_p90_ms", 1, "{:.1f}"), ("TPOT p90 ms", "tpot_p90_ms", 1, "{:.1f}"),
    ("queue p50 ms", "queue_wait_p50_ms", 1, "{:.0f}"), ("out tok/s/GPU", "output_tok_s_per_gpu", 1, "{:.1f}"),
    ("busy % (a step in flight)", "busy_fraction", 100, "{:.0f}"),
]


def table(configs: dict[str, dict]) -> str:
    return columns_table(configs, COLUMNS)


def publish(stem: Path, title: str, command: str, configs: dict[str, dict], notes: dict, extra_md: str = "") -> None:
    write_report(stem, title=title, command=command, configs=configs, notes=notes)
    lines = [f"# {title}", "", f"Command: `{command}`", "", table(configs), extra_md]
    lines += [f"- **{key}**: {value}" for key, value in notes.items() if key not in ("per_seed",)]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {stem}.{{json,png,md}}", file=sys.stderr)


def targets_md(verdict: dict) -> str:
    lines = ["", "| kv_aware config | TTFT p50 / round robin (target <= 0.5) | per seed | "
             "infinite-cache hit - hit, pp (target <= 5) | per seed |", "|---|---:|---|---:|---|"]
    for label, v in verdict.items():
        ttft = (f"{v['ttft_p50_ratio_to_rr']:.2f} {'met' if v['ttft_ok'] else 'missed'}"
                if "ttft_ok" in v else "n/a (no round_robin run)")
        lines.append(f"| {label} | {ttft} | {v.get('ttft_ok_per_seed', '')} | "
                     f"{v['hit_gap_pp']:.1f} {'met' if v['hit_ok'] else 'missed'} | {v['hit_ok_per_seed']} |")
    return "\n".join(lines) + "\n"


def compare(setup: Setup, labels: Sequence[str]) -> tuple[dict, dict]:
    per_seed: dict[str, list[dict]] = {label: [] for label in labels}
    for seed in setup.seeds:
        for label in labels:
            per_seed[label].append(run(setup, label, seed))
    configs = {label: median_summary(runs) for label, runs in per_seed.items()}
    return configs, per_seed


def sweep(setup: Setup, decode_weights: Sequence[float], kv_fractions: Sequence[float]) -> dict[str, dict]:
    """kv_aware only, one seed: the decode weight against the KV capacity per worker."""
    configs = {}
    seed = setup.seeds[0]
    for fraction in kv_fractions:
        s = dataclasses.replace(setup, kv_fraction=fraction)
        for weight in decode_weights:
            label = f"kv_aware decode {weight:g}, KV x{fraction:g}"
            config = dataclasses.replace(fleet_config(s, "kv_aware", seed), label=label,
                                         kv_routing=KvRoutingConfig(weights=CostWeights(decode=weight)))
            configs[label] = run(s, label, seed, config)
        label = f"round_robin, KV x{fraction:g}"
        configs[label] = run(s, "round_robin", seed)
    return configs


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help=f"comma-separated, of {list(CONFIGS)}")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--sessions", type=int, default=Setup.sessions)
    parser.add_argument("--kv-fraction", type=float, default=Setup.kv_fraction)
    parser.add_argument("--sweep", action="store_true", help="one seed: decode weight x KV capacity, kv_aware only")
    parser.add_argument("--quick", action="store_true", help="a short smoke run (4 workers, 40 sessions, 90 s)")
    parser.add_argument("--no-write", action="store_true", help="print figures, write no report")
    parser.add_argument("--out", default="", help="report stem (default docs/results/kv_routing/kv_routing or sweep)")
    args = parser.parse_args(argv)
    setup = Setup(sessions=args.sessions, kv_fraction=args.kv_fraction,
                  seeds=tuple(int(s) for s in args.seeds.split(",") if s))
    if args.quick:
        setup = dataclasses.replace(setup, num_workers=4, sessions=40, warmup_s=30.0, measure_s=60.0)
    command = " ".join(["python -m loadtests.kv_routing", shlex.join(sys.argv[1:] if argv is None else argv)]).strip()
    notes = {"setup": dataclasses.asdict(setup), "profile": PROFILE, "kv_dtype": "fp8", "host tier": "off",
             "infinite cache": "the run's own requests through one never-evicting prefix cache of the workers' "
                               "block size (loadtests/lib/cache_bounds.infinite_cache_hits)",
             "gap": "infinite-cache hit rate minus the config's hit rate, in absolute percentage points",
             "router view": "kv_aware sees every KV event and exact loads at once (the DES's perfect information)",
             "least_loaded": "the simulator's Router: fewest running + waiting requests"}
    if args.sweep:
        configs = sweep(setup, decode_weights=(1.0, 0.5, 0.25, 0.1, 0.0),
                        kv_fractions=(args.kv_fraction, 2 * args.kv_fraction))
        if not args.no_write:
            publish(Path(args.out) if args.out else RESULTS / "sweep",
                    "kv_aware: decode weight x KV capacity (one seed)", command, configs, notes)
        print(table(configs))
        return configs
    labels = [label for label in args.configs.split(",") if label]
    configs, per_seed = compare(setup, labels)
    verdict = targets(configs, per_seed)
    notes.update(targets=verdict, per_seed=per_seed,
                 medians=f"over seeds {list(setup.seeds)}, figure by figure (a median row is not one run)")
    print(table(configs) + targets_md(verdict))
    if not args.no_write:
        publish(Path(args.out) if args.out else RESULTS / "kv_routing",
                "KV-aware routing vs round robin vs least loaded: 16 workers, agent sessions", command, configs, notes,
                targets_md(verdict))
    return {"configs": configs, "targets": verdict}


if __name__ == "__main__":
    main()
