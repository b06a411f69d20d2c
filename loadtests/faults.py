"""The fault matrix: `infermesh up` (sim engine, ledger on Postgres) under streamed and plain load while, in
turn, one part of it is SIGKILLed: an edge (of two sharing the port), a router replica (of two), the admission
leader (of two), the breaker, metering, a worker mid-stream, and nats-server; then an edge and a worker SIGKILLed
together (one host: ``edge+worker``), and nats-server SIGSTOPped for 5 minutes (``jetstream-away``, ``--hold-s``).
`up`'s supervisor restarts each. ``--faults`` runs only the named ones.

Per fault: client errors by kind, hung requests (must be 0), usage the clients were shown vs rows in the ledger
(must be equal: nothing lost, nothing doubled), streams cut after tokens and whether the ledger billed them,
and recovery (first successful request after the kill; the killed process back).

    python -m loadtests.faults --out docs/results/faults
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

from loadtests.lib.faults_load import Load, first_success_after
from loadtests.lib.faults_report import ledger_rows, phase_report, write_report
from shared.ports import free_port

KEY = "faults-key"
FAULTS = {  # fault -> what its process's command line contains
    "edge": "services.edge", "router": "services.router", "admission": "services.admission",
    "breaker": "services.breaker", "metering": "services.metering", "worker": "services.worker",
    "nats": "nats-server",
}
# more faults: each takes down several processes at once, or stops one for a while (issue 38.3)
PAIRS = {"edge+worker": ("edge", "worker")}  # SIGKILLed together (one host): the edge's outbox bills its usage
PAUSES = {"jetstream-away": "nats"}  # SIGSTOPped for --hold-s (default 300 s), then SIGCONT: JetStream away
ALL_FAULTS = [*FAULTS, *PAIRS, *PAUSES]


def _say(message: str) -> None:
    print(f"faults: {message}", file=sys.stderr, flush=True)


class Mesh:
    """``infermesh up --engine sim --workers 2`` with its own NATS and a Postgres ledger."""

    def __init__(self, model_path: Path, database_url: str, state: Path, workers: int) -> None:
        self.port, self.billing_port = free_port(), free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        argv = [sys.executable, "-m", "infermesh.cli", "up", "--engine", "sim", "--workers", str(workers),
                "--model", "tiny", "--model-path", str(model_path), "--http-port", str(self.port),
                "--billing-port", str(self.billing_port), "--database-url", database_url,
                "--state-dir", str(state), "--sim-itl-ms", "10", "--namespace", "faults"]
        self.log = open(state / "up.log", "w")
        self.popen = subprocess.Popen(argv, env={**os.environ, "INFERMESH_DEV_KEY": KEY}, stdout=self.log,
                                      stderr=subprocess.STDOUT)
        self.workers = workers
        self.state = state

    def ready(self) -> bool:
        try:
            request = urllib.request.Request(f"http://127.0.0.1:{self.port}/ready",
                                             headers={"Authorization": f"Bearer {KEY}"})  # workers: a key's holder's
            with urllib.request.urlopen(request, timeout=2) as response:
                status = json.loads(response.read())
            return status.get("status") == "ready" and int(status.get("workers", 0)) >= self.workers
        except Exception:
            return False

    async def wait_ready(self, timeout_s: float) -> float:
        start = time.monotonic()
        while not self.ready():
            if self.popen.poll() is not None:
                raise RuntimeError(f"infermesh up exited ({self.popen.returncode}); see {self.log.name}")
            if time.monotonic() - start > timeout_s:
                raise RuntimeError(f"the mesh was not ready within {timeout_s}s; see {self.log.name}")
            await asyncio.sleep(0.1)
        return time.monotonic() - start

    def admission_leader(self) -> str:
        """The ``--admission-id`` of the replica that said last that it leads (and has not stepped down since)."""
        for log in sorted((self.state / "logs").glob("admission-*.log")):
            events = [line for line in log.read_text(errors="replace").splitlines()
                      if "is the leader" in line or "steps down" in line]
            if events and "is the leader" in events[-1]:
                return log.stem
        raise RuntimeError("no admission replica says it leads")

    def process(self, fault: str) -> psutil.Process:
        marker = f"--admission-id {self.admission_leader()}" if fault == "admission" else FAULTS[fault]
        for child in sorted(psutil.Process(self.popen.pid).children(recursive=True), key=lambda p: p.pid):
            try:
                if marker in " ".join(child.cmdline()):
                    return child
            except psutil.Error:
                continue
        raise RuntimeError(f"no {fault} process ({marker}) under infermesh up")

    def pids(self) -> set[int]:
        return {p.pid for p in psutil.Process(self.popen.pid).children(recursive=True)}

    def restarted(self, victim_cmdline: list[str], before: set[int]) -> bool:
        """A process with the victim's command line that was not there at the kill (replicas share one)."""
        for child in psutil.Process(self.popen.pid).children(recursive=True):
            try:
                if child.pid not in before and child.cmdline() == victim_cmdline:
                    return True
            except psutil.Error:
                continue
        return False

    async def back(self, victim_cmdline: list[str], before: set[int], since: float, limit_s: float) -> float | None:
        """Seconds until the killed process runs again (the same command, a new pid) and the mesh is ready."""
        while time.monotonic() - since < limit_s:
            if self.restarted(victim_cmdline, before) and self.ready():
                return time.monotonic() - since
            await asyncio.sleep(0.1)
        return None

    def stop(self) -> int:
        self.popen.send_signal(signal.SIGTERM)
        try:
            return self.popen.wait(60)
        finally:
            self.log.close()


async def run_fault(mesh: Mesh, fault: str, concurrency: int, before_s: float, after_s: float,
                    hold_s: float = 300.0) -> dict:
    load = Load(mesh.base_url, KEY, "tiny")
    driver = asyncio.create_task(load.run(concurrency))
    await asyncio.sleep(before_s)
    if fault in PAUSES:
        return await _pause(mesh, fault, load, driver, hold_s, after_s)
    victims = [mesh.process(part) for part in PAIRS.get(fault, (fault,))]
    cmdline, before = victims[0].cmdline(), mesh.pids()
    killed_at = time.monotonic()
    for victim in victims:
        victim.send_signal(signal.SIGKILL)
    _say(f"{fault}: SIGKILLed pid {', '.join(str(v.pid) for v in victims)}")
    first_ok, back = await asyncio.gather(first_success_after(mesh.base_url, KEY, "tiny", killed_at, 60),
                                          mesh.back(cmdline, before, killed_at, 90))
    await asyncio.sleep(after_s)
    load.stop()
    await driver
    _say(f"{fault}: {len(load.outcomes)} requests; first success after {first_ok}s, back after {back}s")
    return {"fault": fault, "outcomes": load.outcomes, "first_success_s": first_ok, "back_s": back}


async def _pause(mesh: Mesh, fault: str, load: Load, driver: asyncio.Task, hold_s: float, after_s: float) -> dict:
    """The process SIGSTOPped for ``hold_s`` (the clients' requests time out or wait), then SIGCONT: usage of
    requests that ended before or during the pause must be billed once (the edges' outboxes hold it)."""
    victim = mesh.process(PAUSES[fault])
    victim.send_signal(signal.SIGSTOP)
    _say(f"{fault}: SIGSTOPped pid {victim.pid} for {hold_s:.0f}s")
    try:
        await asyncio.sleep(hold_s)
    finally:
        victim.send_signal(signal.SIGCONT)
    resumed_at = time.monotonic()
    first_ok = await first_success_after(mesh.base_url, KEY, "tiny", resumed_at, 120)
    await asyncio.sleep(after_s)
    load.stop()
    await driver
    _say(f"{fault}: {len(load.outcomes)} requests; first success {first_ok}s after SIGCONT")
    return {"fault": fault, "outcomes": load.outcomes, "first_success_s": first_ok, "back_s": 0.0}


async def _create_database(admin_url: str) -> tuple[str, str]:
    import asyncpg

    name = f"im_faults_{secrets.token_hex(4)}"
    admin = await asyncpg.connect(admin_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    return name, admin_url.rsplit("/", 1)[0].replace("postgresql://", "postgresql+asyncpg://", 1) + "/" + name


async def _drop_database(admin_url: str, name: str) -> None:
    import asyncpg

    admin = await asyncpg.connect(admin_url)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


async def main_async(args: argparse.Namespace) -> dict:
    from infermesh.models import make_tiny_llama

    state = Path(tempfile.mkdtemp(prefix="im-faults-"))
    model = make_tiny_llama(state / "tiny")
    db_name, database_url = await _create_database(args.postgres_admin_url)
    mesh = Mesh(model, database_url, state, args.workers)
    phases = []
    try:
        _say(f"mesh ready in {await mesh.wait_ready(120):.1f}s (logs: {state})")
        for fault in args.faults:
            phases.append(await run_fault(mesh, fault, args.concurrency, args.before_s, args.after_s, args.hold_s))
            await mesh.wait_ready(60)
        rows = await ledger_rows(database_url, settle_s=args.settle_s)
    finally:
        code = mesh.stop()
        if not args.keep_database:
            await _drop_database(args.postgres_admin_url, db_name)
    reports = [phase_report(p, rows) for p in phases]
    return {"command": "python -m loadtests.faults " + " ".join(sys.argv[1:]), "concurrency": args.concurrency,
            "workers": args.workers, "up_exit_code": code, "faults": reports}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", nargs="+", default=ALL_FAULTS, choices=ALL_FAULTS,
                        help="the faults to run, in order (e.g. only the new ones: edge+worker jetstream-away)")
    parser.add_argument("--hold-s", type=float, default=300.0, help="how long a paused process stays stopped")
    parser.add_argument("--concurrency", type=int, default=8, help="client loops, half streamed, half plain")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--before-s", type=float, default=3.0, help="load before the kill")
    parser.add_argument("--after-s", type=float, default=4.0, help="load after the mesh is back")
    parser.add_argument("--settle-s", type=float, default=5.0, help="ledger row count unchanged this long = caught up")
    parser.add_argument("--postgres-admin-url", default=os.environ.get(
        "INFERMESH_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres"))
    parser.add_argument("--keep-database", action="store_true")
    parser.add_argument("--out", default="", help="write faults.json and faults.png here")
    args = parser.parse_args()
    report = asyncio.run(main_async(args))
    print(json.dumps(report, indent=2))
    if args.out:
        write_report(report, Path(args.out))
    bad = [r["fault"] for r in report["faults"] if r["hung"] or r["lost"] or r["doubled"] or r["unbilled_cut_streams"]]
    if bad:
        _say(f"FAILED: {', '.join(bad)} lost, doubled, left unbilled or hung requests")
        sys.exit(1)


if __name__ == "__main__":
    main()
