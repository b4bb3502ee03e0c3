"""Runs in the operator's shell: the `kvd demo` and `kvd bench` sub-commands of the `kvd` CLI.

`kvd.cli` adds these when this package is installed (and one line saying
what to install when it is not); both are parsed here so that `kvd --help`
declares their flags without importing torch.
"""

from __future__ import annotations

import argparse
from typing import Any


def add_commands(sub: Any) -> None:
    """Adds `demo` and `bench` (with one sub-command per suite) to the `kvd` sub-parsers."""
    from kvd_tools.bench.cli import add_bench_parser
    from kvd_tools.demo import add_arguments as add_demo_arguments

    demo = sub.add_parser(
        "demo",
        help="run the demo TP=2 inference engine against kvd",
        description="Run the demo inference engine (2 TP worker processes, MHA and MLA) "
        "against a kvd daemon; starts its own daemon unless one answers.",
    )
    add_demo_arguments(demo)
    add_bench_parser(sub)


def run(args: argparse.Namespace) -> int:
    """Runs the parsed `kvd demo` or `kvd bench` command; its exit status."""
    if args.command == "demo":
        from kvd_tools.demo.runner import main as run_demo

        return run_demo(args)
    from kvd_tools.bench.cli import run_bench

    return run_bench(args)
