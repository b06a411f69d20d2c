"""Live fleet: agent sessions through the real mesh (HTTP edge + NATS + router + sim engines as processes).

Starts NATS, the router, the edge and ``decoders`` + ``prefill`` sim engines packed several to a
worker process (``infermesh up``'s own machinery), drives AgentSessions over HTTP with streamed
completions (loadtests/lib/http_agents.py), and measures every process's CPU time over the run. The
engines run on a clock factor (simulated seconds per real second): tokens through the edge per
wall second are the simulated rate times the factor, so the factor is what makes a fleet of
GB200-class engines fit a small machine.

Two clocks in the report: latencies are given in simulated time (wall x clock factor), beside an
offline fleet_sim run of the very same workload on the same fleet, and in wall time; throughput
through the edge and CPU per token are wall-clock figures.

    python -m loadtests.live_fleet --decoders 32 --prefill 8 --sessions 200 --clock-factor 2 \\
        --out docs/results/live_fleet
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from infermesh.bus_auth import admin_credentials
from infermesh.processes import ProcessGroup
from infermesh.up import MeshOptions, start_processes, wait_ready, worker_processes
from loadtests.lib.http_agents import LiveDriver, SafeVocab, peak_token_rate, rescale
from loadtests.lib.report import RequestRecord, summarize, write_markdown_table, write_report
from loadtests.lib.stats import percentile
from loadtests.lib.workloads import AgentSessions
from shared.ports import free_port

KEY = "live-fleet-key"
MODEL = "sim-fleet"


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds used so far by each named process."""
    import psutil

    out = {}
    for name, pid in pids.items():
        try:
            times = psutil.Process(pid).cpu_times()
            out[name] = times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return out


def machine_busy_s() -> float:
    """CPU seconds the whole machine (every process, ours or not) has been busy since boot."""
    import psutil

    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


class CpuSampler:
    """Samples the CPU time of named processes every ``interval_s`` in a thread (for peak utilisation)."""

    def __init__(self, pids: dict[str, int], interval_s: float = 1.0) -> None:
        self.pids, self.interval_s = pids, interval_s
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> "CpuSampler":
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter(), cpu_seconds(self.pids) | {"machine": machine_busy_s()}))
            self._stop.wait(self.interval_s)

    def peak_share(self, name: str, window_s: float = 10.0) -> float:
        """The highest share of one core ``name`` used over any window of about ``window_s``."""
        step = max(1, round(window_s / self.interval_s))
        shares = [(b[1].get(name, 0.0) - a[1].get(name, 0.0)) / (b[0] - a[0])  # each sample and the one step later
                  for a, b in zip(self.samples, self.samples[step:], strict=False) if b[0] > a[0]]
        return max(shares, default=math.nan)


def workload(args: argparse.Namespace, vocab_size: int) -> AgentSessions:
    return AgentSessions(args.sessions, turns=args.turns, scale=args.scale, think_time_s=args.think_time_s,
                         stagger_s=args.stagger_s, vocab_size=vocab_size, seed=args.seed)


def offline(args: argparse.Namespace, vocab_size: int) -> list[RequestRecord]:
    """The same workload on the same fleet in the offline discrete-event simulator (least-loaded routing)."""
    from loadtests.lib.fleet_sim import FleetConfig, FleetSim
    from services.worker.engines.cost_model import load_profile

    config = FleetConfig(load_profile(args.profile), num_workers=args.decoders, num_prefill=args.prefill,
                         policy="least_loaded", seed=args.seed)
    return FleetSim(config).run(workload(args, vocab_size)).records


def start_mesh(args: argparse.Namespace, state: Path, nats_url: str = "") -> tuple[ProcessGroup, MeshOptions, str]:
    """The mesh as processes (NATS too unless ``nats_url``), ready; returns (group, options, NATS URL)."""
    from infermesh.models import make_tiny_llama

    tokenizer = str(make_tiny_llama(state / "tokenizer"))
    options = MeshOptions(engine="sim", model=MODEL, model_path=tokenizer, http_port=free_port(), nats_url=nats_url,
                          namespace=f"fleet{uuid.uuid4().hex[:8]}", max_model_len=args.max_model_len,
                          state_dir=str(state), dev_key=KEY,
                          ready_timeout_s=120, sim_decoders=args.decoders, sim_prefill=args.prefill,
                          sim_profile=args.profile, sim_clock_factor=args.clock_factor,
                          sim_stream_interval=args.stream_interval, sim_engines_per_process=args.engines_per_process,
                          # the shape this benchmark measures (one edge's CPU per token): no replicas
                          router_replicas=1, admission_replicas=1, edge_replicas=1)
    options.check()
    group = ProcessGroup(state / "logs")
    try:
        nats_url = start_processes(group, options, tokenizer, state)
        ready = wait_ready(group, options, threading.Event())
    except BaseException:
        group.stop()
        raise
    if not ready:
        tails = "\n".join(f"--- {c.name}\n{c.tail()}" for c in group.children)
        group.stop()
        raise RuntimeError(f"the mesh did not become ready:\n{tails}")
    return group, options, nats_url


async def finished_by_worker(nats_url: str, options: MeshOptions) -> dict[str, int]:
    """Requests each engine finished (its load snapshot's counter), by worker id."""
    from shared.bus import Bus
    from shared.schema import LoadRequest, LoadSnapshot

    ids = [p.worker_id if p.num_engines == 1 else f"{p.worker_id}-{i}"
           for p in worker_processes(options) for i in range(p.num_engines)]
    bus = await Bus.connect(nats_url, options.namespace, "live-fleet-probe", admin_credentials())  # up's bus is locked
    try:
        snapshots = [await bus.request(bus.subjects.worker_load(w), LoadRequest(), LoadSnapshot) for w in ids]
    finally:
        await bus.close()
    return {w: s.num_finished_total for w, s in zip(ids, snapshots, strict=True)}


def run(args: argparse.Namespace, nats_url: str = "") -> dict:
    """Start the mesh, drive the sessions, stop the mesh; what was measured."""
    state = Path(tempfile.mkdtemp(prefix="infermesh-fleet-"))
    group, options, nats_url = start_mesh(args, state, nats_url)
    try:
        vocab = SafeVocab(options.model_path)
        pids = {c.name: c.popen.pid for c in group.children} | {"load generator": os.getpid()}
        driver = LiveDriver(options.host, options.http_port, KEY, MODEL, workload(args, vocab.size), vocab,
                            clock_factor=args.clock_factor, stream_interval=args.stream_interval, seed=args.seed)
        before, machine_before, started = cpu_seconds(pids), machine_busy_s(), time.perf_counter()
        with CpuSampler(pids) as sampler:
            records = asyncio.run(driver.run())
        wall_s = time.perf_counter() - started
        cpu = {name: seconds - before.get(name, 0.0) for name, seconds in cpu_seconds(pids).items()}
        machine_s = machine_busy_s() - machine_before
        dead = [c.name for c in group.dead()]
        finished = asyncio.run(finished_by_worker(nats_url, options)) if not dead else {}
    finally:
        group.stop()
        shutil.rmtree(state, ignore_errors=True)
    num_tokens = sum(len(r.token_times) for r in records)
    return {"records": records, "wall_s": wall_s, "cpu": cpu, "num_tokens": num_tokens, "dead": dead,
            "machine_busy_s": machine_s, "finished_by_worker": finished,
            "edge_peak_share": sampler.peak_share("edge"), "machine_peak_share": sampler.peak_share("machine"),
            "vocab_size": vocab.size,
            "worker_processes": len(worker_processes(options)), "driver": driver}


def figures(args: argparse.Namespace, result: dict) -> dict:
    """The wall-clock figures of a run (the report's notes)."""
    records, wall_s, cpu, driver = result["records"], result["wall_s"], result["cpu"], result["driver"]
    wall = summarize(records, num_gpus=args.decoders + args.prefill)
    return {
        "clock_factor": args.clock_factor, "wall_s": round(wall_s, 1),
        "requests": len(records), "errors": sum(1 for r in records if r.error), "dead_processes": result["dead"],
        "error_samples": sorted({r.error for r in records if r.error})[:5],
        "streamed_tokens": result["num_tokens"],
        "edge_tok_s_wall": result["num_tokens"] / wall_s,
        "edge_tok_s_wall_peak_10s": peak_token_rate(records),
        "edge_cpu_ms_per_token": cpu.get("edge", math.nan) * 1000 / max(1, result["num_tokens"]),
        "edge_cpu_share_mean": cpu.get("edge", math.nan) / wall_s,
        "edge_cpu_share_peak_10s": result["edge_peak_share"],
        "cpu_share_by_process": {k: round(v / wall_s, 3) for k, v in sorted(cpu.items())},
        "mesh_cpu_share": sum(cpu.values()) / wall_s, "machine_cpu_share": result["machine_busy_s"] / wall_s,
        "machine_cpu_share_peak_10s": result["machine_peak_share"],
        "machine_cores": os.cpu_count(),
        "finished_by_worker": result["finished_by_worker"],
        "ttft_wall_ms": {q: wall[f"ttft_{q}_ms"] for q in ("p50", "p90", "p99")},
        "itl_wall_ms": {q: wall[f"itl_{q}_ms"] for q in ("p50", "p90", "p99")},
        "send_lateness_p99_ms": percentile([x * 1000 for x in driver.lateness], 99),
        "max_in_flight_requests": driver.max_in_flight, "max_concurrent_sessions": driver.max_concurrent_sessions,
        "sessions_completed": len({r.session_id for r in records}),
        "worker_processes": result["worker_processes"], "safe_vocab_size": result["vocab_size"],
    }


def markdown(args: argparse.Namespace, command: str, notes: dict, configs: dict[str, dict]) -> str:
    n = notes
    cpu = ", ".join(f"{k} {v * 100:.0f}%" for k, v in n["cpu_share_by_process"].items())
    served = {role: [v for k, v in n["finished_by_worker"].items() if k.startswith(role)]
              for role in ("prefill", "decode")}
    spread = "; ".join(f"{role}: {min(v)}-{max(v)} requests per engine" for role, v in served.items() if v)
    others = n["machine_cpu_share"] - n["mesh_cpu_share"]
    tok_s = f"**{n['edge_tok_s_wall']:,.0f}** / {n['edge_tok_s_wall_peak_10s']:,.0f}"
    edge_share = f"{n['edge_cpu_share_mean'] * 100:.0f}% / {n['edge_cpu_share_peak_10s'] * 100:.0f}%"
    mesh_share = f"{n['mesh_cpu_share'] * 100:.0f}% / {others * 100:.0f}%"
    return f"""# Live fleet: {args.sessions} agent sessions through the mesh

{args.decoders} simulated decoders + {args.prefill} prefill workers ({args.profile}, {args.engines_per_process} engines
per process: {n['worker_processes']} worker processes) behind the path `infermesh up` runs (one edge, one router,
admission, breaker, metering with its ledger, batch; NATS locked), all processes on this
{n['machine_cores']}-core machine, driven over HTTP (streamed `/v1/completions` of token ids, usage included) by
{args.sessions} closed-loop agent sessions (AgentSessions at scale {args.scale}; think time {args.think_time_s:g} s
and session starts spread over {args.stagger_s:g} s, simulated{f'; {args.turns} turns' if args.turns else ''}).

    {command}

## Through the edge (wall clock)

| figure | value |
|---|---:|
| clock factor (simulated s per real s) | {args.clock_factor:g} |
| run time | {n['wall_s']:.0f} s |
| requests / **errors** | {n['requests']} / **{n['errors']}** |
| sessions completed / most concurrent | {n['sessions_completed']} / {n['max_concurrent_sessions']} |
| streamed tokens | {n['streamed_tokens']:,} |
| **tokens/s through the edge** (mean / peak 10 s) | {tok_s} |
| **edge CPU per streamed token** | **{n['edge_cpu_ms_per_token'] * 1000:.0f} µs** |
| edge CPU, share of one core (mean / peak 10 s) | {edge_share} |
| CPU of mesh + load generator / other tenants (of {n['machine_cores']} cores) | {mesh_share} |
| TTFT wall p50 / p99 | {n['ttft_wall_ms']['p50']:,.1f} / {n['ttft_wall_ms']['p99']:,.1f} ms |
| ITL wall p50 / p99 | {n['itl_wall_ms']['p50']:,.2f} / {n['itl_wall_ms']['p99']:,.2f} ms |
| most requests in flight | {n['max_in_flight_requests']} |

**The tokens/s above is the offered load, not a capacity**: it is what {args.sessions} closed-loop sessions that
think {args.think_time_s:g} s (simulated) between turns ask for, and the edge served all of it using the share of a
core shown. What one edge can sustain is a different measurement (a load that does not wait on itself).

CPU by process (share of one core over the run): {cpu}. Requests served: {spread}.
Edge CPU per token is all of the edge's CPU over the run (HTTP, validation, routing, the prefill
leg, detokenization, SSE) divided by the tokens it streamed.

## Simulated time, beside the offline simulator

Live times x {args.clock_factor:g} = simulated time, so the mesh's own wall-clock latency (HTTP, NATS hops,
event-loop queueing) appears multiplied by the clock factor. `offline` is loadtests/lib/fleet_sim.py on the
same workload, fleet and profile (least-loaded routing; the live router counts requests per worker).

{write_markdown_table(configs)}"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decoders", type=int, default=32)
    parser.add_argument("--prefill", type=int, default=8)
    parser.add_argument("--engines-per-process", type=int, default=8)
    parser.add_argument("--profile", default="gb200-glm53")
    parser.add_argument("--clock-factor", type=float, default=2.0, help="simulated seconds per real second")
    parser.add_argument("--stream-interval", type=int, default=1)
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--turns", type=int, default=None, help="cap on turns per session (default: to full history)")
    parser.add_argument("--scale", type=float, default=0.05, help="AgentSessions token scale")
    parser.add_argument("--think-time-s", type=float, default=10.0, help="mean think time, simulated seconds")
    parser.add_argument("--stagger-s", type=float, default=10.0, help="session starts spread over this, simulated s")
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="loadtests/out/live_fleet", help="path prefix for .json, .png and .md")
    parser.add_argument("--records", default="", help="also write every request's record (wall clock) as JSONL here")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    argv = sys.argv[1:]
    if "--records" in argv:  # where the raw records went is not part of the experiment
        del argv[argv.index("--records"):argv.index("--records") + 2]
    command = "python -m loadtests.live_fleet " + " ".join(argv)
    result = run(args)
    notes = figures(args, result)
    if args.records:
        import msgspec

        Path(args.records).write_bytes(b"\n".join(msgspec.json.encode(r) for r in result["records"]) + b"\n")
    print(json.dumps(notes, indent=2, default=str), flush=True)
    num_gpus = args.decoders + args.prefill
    configs = {f"live (x{args.clock_factor:g} to sim time)": summarize(rescale(result["records"], args.clock_factor),
                                                                       num_gpus=num_gpus),
               "offline fleet_sim": summarize(offline(args, result["vocab_size"]), num_gpus=num_gpus)}
    out = Path(args.out)
    write_report(out, title=f"Live fleet: {args.decoders}+{args.prefill} sim engines, {args.sessions} agent sessions "
                 f"(clock x{args.clock_factor:g})", command=command, configs=configs, notes=notes)
    (out.parent / (out.name + ".md")).write_text(markdown(args, command, notes, configs))
    print(write_markdown_table(configs))
    print(f"wrote {out}.json, .png and .md")


if __name__ == "__main__":
    main()
