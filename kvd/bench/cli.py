"""Runs in the operator's shell: the `kvd bench SUITE` sub-command.

Placeholder wiring; the suites are registered in SUITES.
"""

from __future__ import annotations

import argparse
from typing import Any


def add_bench_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="run a benchmark suite and print a markdown table")
    p.add_argument("suite")
    p.add_argument("--json", dest="json_path", default=None)


def run_bench(args: argparse.Namespace) -> int:
    print(f"suite {args.suite} is not built yet")
    return 2
