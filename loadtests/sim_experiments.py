"""The seed deployment's findings (GLM-5.3 on GB200 NVL72) re-run in the offline fleet simulator.

    python -m loadtests.sim_experiments {budget,kv-dtype,pd-split,pd-ratio,all} [--quick]

Each experiment runs its configurations side by side on the same seeded agent-session traffic
and writes docs/results/sim_<name>.{json,png,md}. Traffic: closed-loop agent sessions (~6K new
tokens per turn on a shared history of up to 140K, ~300 output tokens, exponential think time),
kept at a steady number of sessions (a finished session is replaced), measured after a warm-up.
Workers are single GB200 GPUs running the gb200-glm53 profile; sessions stick to their workers
(re-pinned when a worker is overloaded); prefill workers keep a host-DRAM KV tier.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Callable

from loadtests.lib.fleet_sim import FleetConfig, FleetSim
from loadtests.lib.report import summarize, write_markdown_table, write_report
from loadtests.lib.workloads import AgentSessions
from services.worker.engines.cost_model import load_profile

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
THINK_S = 30.0  # assumption: an agent's tool calls and its own planning between model turns


@dataclasses.dataclass
class Setup:
    warmup_s: float = 300.0  # sessions start over the first 300 s; then a mix of young and old sessions
    measure_s: float = 600.0
    scale: float = 1.0
    seed: int = 1
    output_tokens: int = 300  # mean answer length per turn
    ratios: tuple[int, ...] = (1, 2, 3, 4, 5, 6)  # decoders per prefill worker, for the ratio sweep
    sessions: tuple[int, ...] = ()  # ratio sweep: run these session counts instead of bisecting

    @property
    def until_s(self) -> float:
        return self.warmup_s + self.measure_s


def run(label: str, config: FleetConfig, num_sessions: int, setup: Setup) -> dict:
    """One configuration on the agent traffic: its summary (figures after the warm-up)."""
    workload = AgentSessions(num_sessions, think_time_s=THINK_S, stagger_s=setup.warmup_s, steady_until_s=None,
                             scale=setup.scale, seed=setup.seed, output_tokens=setup.output_tokens)
    started = time.perf_counter()
    result = FleetSim(config).run(workload, until_s=setup.until_s)
    summary = summarize([r for r in result.records if r.finish_t is not None or r.error],
                        num_gpus=config.num_gpus, warmup_s=setup.warmup_s,
                        duration_s=setup.measure_s)
    summary.update(sessions=num_sessions, num_prefill=config.num_prefill, num_decode=config.num_workers,
                   kv_dtype=config.kv_dtype,
                   prefill_budget=config.max_num_batched_tokens or config.profile.max_num_batched_tokens,
                   repins=result.num_repins, sim_wall_s=round(time.perf_counter() - started, 1))
    print(f"  {label}: TTFT p50 {summary['ttft_p50_ms']:.0f} ms, ITL p90 {summary['itl_p90_ms']:.1f} ms, "
          f"queue p50 {summary['queue_wait_p50_ms']:.0f} ms, hit {summary['prefix_hit_rate']:.3f}, "
          f"user {summary['user_decode_tok_s_p50']:.0f} tok/s ({summary['sim_wall_s']} s)", file=sys.stderr)
    return summary


def fleet(**overrides: object) -> FleetConfig:
    options: dict[str, object] = dict(profile=load_profile("gb200-glm53"), policy="session", host_kv=True)
    options.update(overrides)
    return FleetConfig(**options)  # type: ignore[arg-type]


def publish(name: str, title: str, configs: dict[str, dict], notes: dict, command: str) -> None:
    stem = RESULTS / f"sim_{name}"
    write_report(stem, title=title, command=command, configs=configs, notes=notes)
    lines = [f"# {title}", "", f"Command: `{command}`", "", write_markdown_table(configs), ""]
    lines += [f"- **{key}**: {value}" for key, value in notes.items()]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {stem}.{{json,png,md}}", file=sys.stderr)


# ---------------------------------------------------------------- the experiments
def budget(setup: Setup, loads_per_rank: tuple[int, ...] = (32, 40), ranks: int = 4) -> tuple[dict, dict]:
    """(a) Per-GPU prefill token budget 8K vs 4K, prefix-heavy agent traffic, prefill on one 4-GPU
    attention-DP instance (its ranks step in lockstep, the wide-EP MoE joins them) and 8 decoders, at
    two loads; the same with independent prefill GPUs at the higher load as the control."""
    configs = {}
    runs = [(ranks, "DP4 lockstep", n) for n in loads_per_rank] + [(1, "independent", loads_per_rank[-1])]
    for group, name, per_rank in runs:
        sessions = per_rank * ranks
        for b in (8192, 4096):
            configs[f"{name}, {sessions} sessions, budget {b}"] = run(
                f"{name} {sessions} budget {b}", fleet(num_prefill=ranks, num_workers=2 * ranks,
                                                       max_num_batched_tokens=b, prefill_dp_group=group),
                sessions, setup)
    return configs, {"sessions per prefill rank": list(loads_per_rank),
                     "seed": "median queue wait 550 -> 110 ms, TTFT about -20%"}


def kv_dtype(setup: Setup, sessions: int = 72) -> tuple[dict, dict]:
    """(b) FP8 vs NVFP4 KV on 4 aggregated workers, ~18 sessions each (a working set of ~1.3M tokens per
    worker: more than FP8's 1.09M, less than NVFP4's 1.59M): cached tokens per decoder, hit rate, TTFT."""
    profile = load_profile("gb200-glm53")
    configs = {}
    for dtype in ("fp8", "nvfp4"):
        summary = run(dtype, fleet(num_workers=4, kv_dtype=dtype, host_kv=False), sessions, setup)
        summary["kv_tokens_per_decoder"] = profile.num_kv_blocks(dtype) * profile.block_size
        configs[f"KV {dtype}"] = summary
    return configs, {"sessions": sessions, "host tier": "off, so the device capacity alone decides hits",
                     "seed": "1.09M -> 1.63M cached tokens per decoder"}


def pd_split(setup: Setup, loads: tuple[int, ...] = (40, 52)) -> tuple[dict, dict]:
    """(c) Aggregated vs P/D split on the same 5 GPUs: p90 inter-token latency, at two loads."""
    configs = {}
    for sessions in loads:
        configs[f"aggregated 5, {sessions} sessions"] = run("aggregated", fleet(num_workers=5), sessions, setup)
        configs[f"P/D 1:4, {sessions} sessions"] = run("pd", fleet(num_workers=4, num_prefill=1), sessions, setup)
    return configs, {"sessions": list(loads), "seed": "p90 ITL about -40% with the split"}


def meets_targets(summary: dict, ttft_p90_ms: float) -> bool:
    return (summary["errors"] == 0 and summary["user_decode_tok_s_p50"] >= 100.0
            and summary["ttft_p90_ms"] <= ttft_p90_ms)


def pd_ratio(setup: Setup, ttft_p90_ms: float = 3000.0) -> tuple[dict, dict]:
    """(d) P:D 1:1..1:6: the most sessions per prefill group meeting 100 tok/s/user and a TTFT bound."""
    configs = {}
    for k in setup.ratios:
        if setup.sessions:  # fixed points instead of a search: every run is reported
            for n in setup.sessions:
                summary = run(f"1:{k} with {n} sessions", fleet(num_prefill=1, num_workers=k), n, setup)
                summary.update(sessions_per_gpu=n / (k + 1), meets_targets=meets_targets(summary, ttft_p90_ms))
                configs[f"1:{k}, {n} sessions"] = summary
            continue
        lo, hi, best = 1, 24, None  # bisect on sessions / 4 (4..96): the largest count meeting the targets
        while lo <= hi:
            mid = (lo + hi) // 2
            summary = run(f"1:{k} with {4 * mid} sessions", fleet(num_prefill=1, num_workers=k), 4 * mid, setup)
            if meets_targets(summary, ttft_p90_ms):
                best, lo = summary, mid + 1
            else:
                hi = mid - 1
        if best is None:
            continue
        best["sessions_per_gpu"] = best["sessions"] / (k + 1)
        configs[f"1:{k} ({best['sessions']} sessions)"] = best
    return configs, {"targets": f"per-user decode p50 >= 100 tok/s, TTFT p90 <= {ttft_p90_ms:.0f} ms, no errors",
                     "seed": "1:4 best, 66 sessions per prefill group"}


EXPERIMENTS: dict[str, tuple[str, Callable[[Setup], tuple[dict, dict]]]] = {
    "budget": ("(a) Prefill budget per GPU, 8K vs 4K", budget),
    "kv-dtype": ("(b) FP8 vs NVFP4 KV cache", kv_dtype),
    "pd-split": ("(c) P/D split vs aggregated", pd_split),
    "pd-ratio": ("(d) P:D ratio sweep at 100 tok/s/user", pd_ratio),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiment", choices=[*EXPERIMENTS, "all"])
    parser.add_argument("--quick", action="store_true", help="a short, scaled-down run (smoke test)")
    parser.add_argument("--no-write", action="store_true", help="print figures, write no report")
    parser.add_argument("--output-tokens", type=int, default=300, help="mean answer length per turn")
    parser.add_argument("--ratios", default="1,2,3,4,5,6", help="ratio sweep: decoders per prefill worker")
    parser.add_argument("--sessions", default="", help="ratio sweep: fixed session counts instead of a search")
    args = parser.parse_args(argv)
    setup = Setup(warmup_s=60, measure_s=60, scale=0.1) if args.quick else Setup()
    setup.output_tokens = args.output_tokens
    setup.ratios = tuple(int(k) for k in args.ratios.split(","))
    setup.sessions = tuple(int(n) for n in args.sessions.split(",") if n)
    suffix = "" if args.output_tokens == 300 else f"_out{args.output_tokens}"
    names = list(EXPERIMENTS) if args.experiment == "all" else [args.experiment]
    for name in names:
        title, experiment = EXPERIMENTS[name]
        print(title, file=sys.stderr)
        configs, notes = experiment(setup)
        notes.update(setup=dataclasses.asdict(setup), think_time_s=THINK_S, profile="gb200-glm53")
        if not args.no_write:
            command = f"python -m loadtests.sim_experiments {name}" + (" --quick" if args.quick else "")
            if suffix:
                command += f" --output-tokens {args.output_tokens}"
            if args.ratios != "1,2,3,4,5,6":
                command += f" --ratios {args.ratios}"
            if args.sessions:
                command += f" --sessions {args.sessions}"
            publish(name.replace("-", "_") + suffix,
                    title + (f", {args.output_tokens}-token answers" if suffix else ""),
                    configs, notes, command)


if __name__ == "__main__":
    main()
