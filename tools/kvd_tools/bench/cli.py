"""Runs in the operator's shell: the `kvd bench SUITE [--json PATH]` sub-command.

One sub-parser per registered suite (so `kvd bench index --help` shows that
suite's flags, `--quick` among them) plus `all`, which runs every suite with
its defaults (with `--quick`, each suite's quick form). A suite module is
imported only when it runs; see `kvd_tools.bench.suites` to add one.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvd_tools.bench.report import Row, SuiteReport, render, suite_report, write_json
from kvd_tools.bench.suites import SUITES, SuiteError, add_suite_arguments, resolve_args

ALL = "all"


def _add_json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--json",
        dest="json_path",
        type=Path,
        default=None,
        metavar="PATH",
        help="also write the results as JSON to PATH",
    )


def add_bench_parser(sub: Any) -> None:
    """Adds `bench` and one sub-command per suite to the `kvd` sub-parsers `sub`."""
    bench = sub.add_parser(
        "bench",
        help="run a benchmark suite and print a markdown table",
        description="Run a benchmark suite (SPEC section 10) and print a markdown table.",
    )
    suites = bench.add_subparsers(dest="suite", metavar="SUITE", required=True)
    for name, suite in SUITES.items():
        p = suites.add_parser(name, help=suite.help, description=suite.help)
        add_suite_arguments(p, suite)
        _add_json_flag(p)
    every = suites.add_parser(
        ALL, help="run every suite with its defaults", description="Run every suite."
    )
    _add_json_flag(every)
    every.add_argument(
        "--quick", action="store_true", help="each suite's quick form (seconds, small sizes)"
    )
    every.add_argument(
        "--plots",
        type=Path,
        default=Path("bench-plots"),
        metavar="DIR",
        help="write the PNG plots of the suites that draw one here (default: bench-plots)",
    )


def default_args(name: str, quick: bool = False) -> argparse.Namespace:
    """The arguments suite `name` runs with when given no flags (or only `--quick`)."""
    p = argparse.ArgumentParser(prog=f"kvd bench {name}")
    add_suite_arguments(p, SUITES[name])
    return resolve_args(SUITES[name], p.parse_args(["--quick"] if quick else []))


def run_suite(name: str, args: argparse.Namespace) -> tuple[list[Row], list[str], bool]:
    """Imports and runs suite `name`: its rows, its summary lines, and whether the
    suite's own verdict (`passed(rows)`, for a suite whose rows say pass or fail,
    such as the soak's violations) is a pass (True for a suite without one)."""
    module = importlib.import_module(SUITES[name].module)
    run: Callable[[argparse.Namespace], list[Row]] = module.run
    rows = run(args)
    summarize: Callable[[list[Row]], list[str]] | None = getattr(module, "summarize", None)
    summary = summarize(rows) if summarize is not None and rows else []
    passed: Callable[[list[Row]], bool] | None = getattr(module, "passed", None)
    return rows, summary, passed is None or passed(rows)


def run_bench(args: argparse.Namespace) -> int:
    """Runs the chosen suite (or all of them), prints tables, writes JSON if asked.

    Exit status 0; 1 when a suite ran and its own verdict is a fail (the soak
    saw a violation); 2 when a suite could not run (the others still do).
    """
    from kvd_tools.bench.machine import describe_machine

    names = list(SUITES) if args.suite == ALL else [args.suite]
    machine = describe_machine()
    reports: list[SuiteReport] = []
    status = 0
    for name in names:
        if args.suite == ALL:
            one = default_args(name, args.quick)
            if hasattr(one, "png"):
                one.png = args.plots / f"{name}.png"
        else:
            one = resolve_args(SUITES[name], args)
        try:
            rows, summary, passed = run_suite(name, one)
        except SuiteError as exc:
            print(f"kvd bench {name}: error: {exc}", file=sys.stderr)
            status = 2
            continue
        if not passed:
            print(f"kvd bench {name}: FAIL (see its summary)", file=sys.stderr)
            status = max(status, 1)
        print(render(name, rows, summary), flush=True)
        reports.append(suite_report(name, machine, rows))
    if args.json_path is not None and reports:
        write_json(args.json_path, reports if args.suite == ALL else reports[0])
    return status
