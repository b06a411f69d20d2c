"""Regenerate tests/fixtures/agents: run each real harness through its scripted tool loop on a sim mesh
(``infermesh up`` on the tiny test model) and keep every request it sent, secrets removed.

    python -m tests.agents.record                  # all three (installed by ./scripts/test in tests/agents)
    python -m tests.agents.record --harness codex  # one

Run it after bumping a harness in tests/agents/package.json, then commit the fixtures with the bump:
tests/e2e/test_agent_fixtures.py replays them against the edge."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from tests.agents.fixtures import FIXTURES, write_fixtures
from tests.agents.harnesses import HARNESSES
from tests.agents.session import agent_mesh


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--harness", action="append", choices=sorted(HARNESSES), help="default: all three")
    parser.add_argument("--out", type=Path, default=FIXTURES)
    args = parser.parse_args(argv)
    names = args.harness or sorted(HARNESSES)
    missing = [name for name in names if not HARNESSES[name].installed()]
    if missing:
        print(f"not installed: {missing} (npm install --prefix tests/agents)", file=sys.stderr)
        return 1
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="infermesh-agents-") as tmp:
        root = Path(tmp)
        os.environ["XDG_DATA_HOME"] = str(root / "data")  # up's secrets and keys: not the user's own
        from infermesh.models import make_tiny_llama

        model = make_tiny_llama(root / "tiny-llama")
        with agent_mesh(root / "runs", model, "sim") as mesh:
            for name in names:
                harness = HARNESSES[name]
                run = mesh.run(harness)
                if run.process.returncode != 0 or harness.final_answer() not in run.process.stdout:
                    print(f"{name} failed (exit {run.process.returncode}):\n{run.process.stdout[-2000:]}\n"
                          f"{run.process.stderr[-2000:]}", file=sys.stderr)
                    return 1
                paths = write_fixtures(name, harness.version, run.exchanges, mesh.root, args.out)
                print(f"{name} {harness.version}: {len(paths)} requests in {run.seconds:.1f} s -> "
                      f"{args.out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
