"""Runs in the operator's shell: the `kvd` command line (parse, build config, run)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvd.version import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvd", description="kvd: host-side KV-cache daemon for LLM inference engines"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    sub.add_parser("version", help="print the kvd version")
    from kvd.bench.cli import add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    match args.command:
        case "version":
            print(f"kvd {__version__}")
            return 0
        case "bench":
            from kvd.bench.cli import run_bench

            return run_bench(args)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
