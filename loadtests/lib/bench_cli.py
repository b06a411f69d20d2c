"""What every report-writing benchmark's ``main`` does around its run: its own command line kept in the report,
the summary printed (the per-row results left to the files), the report written where ``--out`` says."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    return args


def conclude(report: dict, out: str, write_report: Callable[[dict, Path], None]) -> dict:
    print(json.dumps({k: v for k, v in report.items() if k != "results"}, indent=1))
    if out:
        write_report(report, Path(out))
    return report
