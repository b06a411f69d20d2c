"""Aggregated vs disaggregated (P/D) inter-token latency and TTFT on the same GPUs, in the offline fleet sim.

    python -m loadtests.sim_pd_itl [--loads 96,128] [--seeds 1,2,3] [--no-trace] [--quick]

The acceptance point: the seed deployment (GLM-5.3, GB200 NVL72) saw about -40% p90 inter-token
latency with prefill and decode on separate workers. Here 8 gb200-glm53 GPUs run as 8 aggregated
workers, as 2 prefill + 6 decode and as 3 prefill + 5 decode, on

- agent sessions (loadtests.lib.workloads.AgentSessions, the sim_experiments traffic: ~6K new tokens per
  turn on a history growing to 140K, ~300-token answers, 30 s think time; sessions stick to workers,
  prefill workers keep a host KV tier) at each load, one run per seed, medians over seeds;
- the Mooncake trace (open loop, kv_aware routing), once: the trace is fixed;
- sensitivity, one seed: the aggregated fleet's chunked-prefill budget, and every pool stepping in
  lockstep as the attention-DP ranks of a wide-EP instance do.

Two inter-token latencies are reported: "ITL gaps", every gap between consecutive tokens of every
request pooled (vLLM's benchmark ITL), and "ITL per request", each request's mean gap
(last token - first token) / (tokens - 1), which is AIPerf's (and genai-perf's) inter_token_latency
and this repo's TPOT. Writes docs/results/sim_pd_itl.{json,md,png} (loadtests/lib/sim_pd_itl_report.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import sys
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

from loadtests.lib.fleet_sim import FleetConfig, FleetSim
from loadtests.lib.report import _json_safe, summarize
from loadtests.lib.stats import median_finite, median_over, percentile, quantile_points, ratio, share_above
from loadtests.lib.workloads import AgentSessions, MooncakeTrace, Workload
from loadtests.replay import DEFAULT_TRACE
from loadtests.sim_experiments import RESULTS, THINK_S, fleet
from services.worker.engines.cost_model import load_profile
from services.worker.engines.scheduler import SimRequest

STEM = RESULTS / "sim_pd_itl"
SPLITS = {"aggregated 8": (0, 8), "P/D 2:6": (2, 6), "P/D 3:5": (3, 5)}  # label: (prefill GPUs, decode GPUs)
BASELINE = "aggregated 8"
KEYS = [f"{m}_p{q}_ms" for m in ("itl", "tpot", "ttft") for q in (50, 90, 99)] + [
    "itl_p99.9_ms", "itl_stall_share", "queue_wait_p50_ms", "queue_wait_p90_ms", "handoff_p50_ms", "handoff_p90_ms",
    "user_decode_tok_s_p50", "output_tok_s_per_gpu", "prefix_hit_rate", "measured", "errors", "num_gpus", "repins"]
RATIO_KEYS = ["itl_p90_ms", "tpot_p90_ms", "ttft_p90_ms", "itl_p50_ms", "tpot_p50_ms", "ttft_p50_ms",
              "output_tok_s_per_gpu"]
CDF_QS = [0, 1, 2, 5, 10, 20, 30, 40, 50, 60, 70, 80, 85, 90, 92, 94, 95, 96, 97, 98, 99, 99.5, 99.7, 99.8,
          99.9, 99.95]  # percentiles kept of each distribution, for the PNG's CCDFs
STALL_FACTOR = 2.0  # a gap longer than this times the run's median gap is a stall (a step that carried prefill)


@dataclasses.dataclass
class Setup:
    loads: tuple[int, ...] = (96, 128)  # agent sessions on the 8 GPUs
    seeds: tuple[int, ...] = (1, 2, 3)
    warmup_s: float = 300.0  # sessions start over the warm-up; figures cover the measure window after it
    measure_s: float = 600.0
    scale: float = 1.0
    output_tokens: int = 300
    trace: str = str(DEFAULT_TRACE)  # "": no trace scenario
    trace_limit: int | None = None
    trace_warmup_s: float = 60.0
    budgets: tuple[int, ...] = (2048, 512, 256)  # sensitivity: aggregated per-step prefill budgets (profile: 8192)
    lockstep_sessions: int = 48  # sensitivity: pools as lockstep DP groups at this load (0: skip)


class _Sim(FleetSim):
    """The fleet, noting when each prefilled request is handed to its decoder (P/D)."""

    def __init__(self, config: FleetConfig) -> None:
        super().__init__(config)
        self.handoff_t: dict[str, float] = {}

    def _hand_to_decoder(self, prefilled: SimRequest, client: Any, workload: Workload) -> None:
        self.handoff_t[prefilled.request_id] = self.now
        super()._hand_to_decoder(prefilled, client, workload)


def measure(label: str, config: FleetConfig, workload: Workload, *, until_s: float, warmup_s: float,
            duration_s: float | None) -> dict:
    """One simulated run: its summary (KEYS) and the percentile points of its ITL and TTFT distributions."""
    started = time.perf_counter()
    sim = _Sim(config)
    result = sim.run(workload, until_s=until_s)
    records = [r for r in result.records if r.finish_t is not None or r.error]
    summary = summarize(records, num_gpus=config.num_gpus, warmup_s=warmup_s, duration_s=duration_s)
    measured = [r for r in records if r.arrival_t >= warmup_s]
    gaps = [1000.0 * (b - a) for r in measured for a, b in pairwise(r.token_times)]
    per_request = [1000.0 * (r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1)
                   for r in measured if len(r.token_times) > 1]
    ttft = [1000.0 * (r.first_token_t - r.arrival_t) for r in measured if r.first_token_t is not None]
    summary["itl_p99.9_ms"] = percentile(gaps, 99.9)
    summary["itl_stall_share"] = share_above(gaps, STALL_FACTOR * summary["itl_p50_ms"])
    summary["repins"] = result.num_repins
    handoff = [1000.0 * (r.first_token_t - sim.handoff_t[r.request_id]) for r in measured
               if r.first_token_t is not None and r.request_id in sim.handoff_t]  # KV pull + the decoder's first step
    summary["handoff_p50_ms"], summary["handoff_p90_ms"] = percentile(handoff, 50), percentile(handoff, 90)
    out = {key: summary.get(key, math.nan) for key in KEYS}
    out["sim_wall_s"] = round(time.perf_counter() - started, 1)
    out["cdf"] = {"itl_gap_ms": quantile_points(gaps, CDF_QS), "itl_request_ms": quantile_points(per_request, CDF_QS),
                  "ttft_ms": quantile_points(ttft, CDF_QS)}
    print(f"  {label}: ITL gaps p90 {out['itl_p90_ms']:.2f} ms, per request p90 {out['tpot_p90_ms']:.2f} ms, "
          f"TTFT p50/p90 {out['ttft_p50_ms']:.0f}/{out['ttft_p90_ms']:.0f} ms, "
          f"{out['output_tok_s_per_gpu']:.1f} tok/s/GPU, hit {out['prefix_hit_rate']:.3f} ({out['sim_wall_s']} s)",
          file=sys.stderr)
    return out


def agents(setup: Setup, sessions: int, seed: int) -> AgentSessions:
    return AgentSessions(sessions, think_time_s=THINK_S, stagger_s=setup.warmup_s, steady_until_s=None,
                         scale=setup.scale, seed=seed, output_tokens=setup.output_tokens)


def run_agents(setup: Setup, label: str, sessions: int, seed: int, **overrides: object) -> dict:
    run = measure(f"{label}, {sessions} sessions, seed {seed}", fleet(seed=seed, **overrides),
                  agents(setup, sessions, seed), until_s=setup.warmup_s + setup.measure_s,
                  warmup_s=setup.warmup_s, duration_s=setup.measure_s)
    return {"seed": seed, **run}


def combine(runs: list[dict]) -> dict:
    """One configuration over its seeds: medians of the figures and, point by point, of the CDFs."""
    cdf = {name: [median_finite(r["cdf"][name][i] for r in runs) for i in range(len(CDF_QS))]
           for name in runs[0]["cdf"]}
    return {"median": median_over(runs, KEYS), "cdf": cdf,
            "runs": [{k: v for k, v in r.items() if k != "cdf"} for r in runs]}


def compare(configs: dict[str, dict]) -> dict[str, dict]:
    """Each P/D configuration over the aggregated one: ratios of the medians, and per seed for the p90s."""
    base = configs[BASELINE]
    out = {}
    for label, config in configs.items():
        if label == BASELINE:
            continue
        entry = {key: ratio(config["median"][key], base["median"][key]) for key in RATIO_KEYS}
        base_runs = {r["seed"]: r for r in base["runs"]}
        for key in ("itl_p90_ms", "tpot_p90_ms", "ttft_p90_ms"):
            entry[f"{key}_per_seed"] = [ratio(r[key], base_runs[r["seed"]][key]) for r in config["runs"]
                                        if r["seed"] in base_runs]
        out[label] = entry
    return out


def agent_scenario(setup: Setup, sessions: int) -> dict:
    configs = {}
    for label, (prefill, decode) in SPLITS.items():
        configs[label] = combine([run_agents(setup, label, sessions, seed, num_prefill=prefill, num_workers=decode)
                                  for seed in setup.seeds])
    return {"workload": "agent sessions", "sessions": sessions, "seeds": list(setup.seeds), "configs": configs,
            "ratios": compare(configs)}


def trace_scenario(setup: Setup) -> dict:
    profile = load_profile("gb200-glm53")
    configs = {}
    for label, (prefill, decode) in SPLITS.items():
        config = FleetConfig(profile=profile, num_workers=decode, num_prefill=prefill, policy="kv_aware", host_kv=True)
        workload = MooncakeTrace(setup.trace, limit=setup.trace_limit)
        run = measure(f"Mooncake trace, {label}", config, workload, until_s=math.inf,
                      warmup_s=setup.trace_warmup_s, duration_s=None)
        configs[label] = combine([{"seed": 0, **run}])
    stats = MooncakeTrace(setup.trace, limit=setup.trace_limit).stats()
    return {"workload": "Mooncake trace", "trace": Path(setup.trace).name, "trace_stats": stats,
            "policy": "kv_aware", "configs": configs, "ratios": compare(configs)}


def sensitivity(setup: Setup) -> dict:
    """One seed: at the highest load, the aggregated fleet with smaller prefill budgets and P/D 3:5 with the
    layer-major KV layout; at a light load, every pool as one lockstep DP group (a wide-EP instance)."""
    seed, high = setup.seeds[0], max(setup.loads)
    out: dict[str, dict] = {}
    for budget in setup.budgets:
        out[f"aggregated 8, budget {budget}, {high} sessions"] = run_agents(
            setup, f"aggregated 8, budget {budget}", high, seed, num_workers=8, max_num_batched_tokens=budget)
    label = f"P/D 3:5, LBHNC KV layout, {high} sessions"  # vLLM's layer-major layout: 78x the descriptors
    out[label] = run_agents(setup, "P/D 3:5, LBHNC", high, seed, num_prefill=3, num_workers=5, kv_layout="LBHNC")
    if n := setup.lockstep_sessions:
        out[f"aggregated 8 as one DP8 lockstep group, {n} sessions"] = run_agents(
            setup, "aggregated DP8 lockstep", n, seed, num_workers=8, decode_dp_group=8)
        out[f"P/D 3:5 as DP3 + DP5 lockstep groups, {n} sessions"] = run_agents(
            setup, "P/D 3:5 DP3+DP5 lockstep", n, seed, num_prefill=3, num_workers=5, prefill_dp_group=3,
            decode_dp_group=5)
    return out


def profile_constants() -> dict:
    p = load_profile("gb200-glm53")
    return {"link_bytes_per_s": p.link_bytes_per_s, "descriptor_overhead_s": p.descriptor_overhead_s,
            "max_num_batched_tokens": p.max_num_batched_tokens, "step_overhead_s": p.step_overhead_s,
            "kv_layout": fleet().kv_layout}


def command_line(args: argparse.Namespace) -> str:
    parts = ["python -m loadtests.sim_pd_itl"]
    for flag in ("loads", "seeds"):
        if getattr(args, flag) != parse_args([]).__dict__[flag]:
            parts.append(f"--{flag} {getattr(args, flag)}")
    parts += [flag for flag, on in (("--no-trace", args.no_trace), ("--no-sensitivity", args.no_sensitivity),
                                    ("--quick", args.quick)) if on]
    return " ".join(parts)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loads", default="96,128", help="agent sessions on the 8 GPUs, comma-separated")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--no-trace", action="store_true", help="skip the Mooncake trace")
    parser.add_argument("--no-sensitivity", action="store_true", help="skip the budget and lockstep runs")
    parser.add_argument("--quick", action="store_true", help="a short, scaled-down smoke run")
    parser.add_argument("--out", default=str(STEM), help="report path stem")
    parser.add_argument("--render", action="store_true", help="only re-render the MD and PNG from <out>.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    from loadtests.lib.sim_pd_itl_report import render

    args = parse_args(argv)
    stem = Path(args.out)
    if args.render:
        report = json.loads((stem.parent / f"{stem.name}.json").read_text())
        render(report, stem)
        return report
    setup = Setup(loads=tuple(int(n) for n in args.loads.split(",")),
                  seeds=tuple(int(s) for s in args.seeds.split(",")))
    if args.quick:
        setup = dataclasses.replace(setup, warmup_s=60, measure_s=60, scale=0.1, trace_limit=200, trace_warmup_s=0,
                                    budgets=(512,), lockstep_sessions=min(setup.loads))
    if args.no_trace:
        setup.trace = ""
    started = time.perf_counter()
    scenarios = {f"agents, {n} sessions": agent_scenario(setup, n) for n in setup.loads}
    if setup.trace:
        scenarios["Mooncake trace"] = trace_scenario(setup)
    report = {"title": "Aggregated vs P/D on 8 GPUs: inter-token latency and TTFT", "command": command_line(args),
              "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "setup": dataclasses.asdict(setup), "profile": "gb200-glm53", "think_time_s": THINK_S,
              "profile_constants": profile_constants(), "splits": SPLITS, "cdf_percentiles": CDF_QS,
              "stall_factor": STALL_FACTOR, "scenarios": scenarios,
              "sensitivity": {} if args.no_sensitivity else sensitivity(setup)}
    report["sim_wall_s"] = round(time.perf_counter() - started, 1)
    stem.parent.mkdir(parents=True, exist_ok=True)
    (stem.parent / f"{stem.name}.json").write_text(json.dumps(_json_safe(report), indent=1, allow_nan=False) + "\n")
    render(report, stem)
    print(f"wrote {stem}.{{json,md,png}} in {report['sim_wall_s']} s", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
