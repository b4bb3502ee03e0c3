"""Runs in the operator's shell: the registry of `kvd bench` suites and their flags.

Adding a suite takes two steps:

1. write a module `kvd/bench/<name>.py` with
   `run(args: argparse.Namespace) -> list[Row]` (rows carry the SPEC section 10
   field names, in column order) and, optionally,
   `summarize(rows: list[Row]) -> list[str]` (lines printed under the table);
2. add `"<name>": Suite("kvd.bench.<name>", help, add_arguments)` to `SUITES`.

The registry imports no suite module: flags are declared here, and a suite
module (with its torch, zmq, ...) is imported only when it runs, so `kvd
--help` stays fast. A suite that cannot run as asked raises `SuiteError`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass


class SuiteError(Exception):
    """A suite cannot run as asked (missing input, bad data); the CLI prints it, exit 2."""


@dataclass(frozen=True, slots=True)
class Suite:
    module: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]


def positive_ints(text: str) -> list[int]:
    """An argparse type: `10000,100000` -> [10000, 100000]; each must be >= 1."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def positive_int(text: str) -> int:
    """An argparse type: one integer >= 1."""
    values = positive_ints(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one integer, got {text!r}")
    return values[0]


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def _index_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sizes",
        type=positive_ints,
        default=[10_000, 100_000, 1_000_000],
        metavar="N,...",
        help="index sizes in blocks (default: 10000,100000,1000000)",
    )
    p.add_argument(
        "--min-batches",
        type=positive_int,
        default=2000,
        metavar="N",
        help="steady-state batches of 64 keys to time, at least (default: 2000)",
    )
    p.add_argument(
        "--min-seconds",
        type=_non_negative_float,
        default=0.5,
        metavar="S",
        help="time each steady-state measurement for at least S seconds (default: 0.5)",
    )


def _trace_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trace",
        type=str,
        action="append",
        default=None,
        metavar="PATH",
        help="Mooncake-format JSONL trace; repeat for several "
        "(default: ../shared/traces/synthetic_trace.jsonl)",
    )
    p.add_argument(
        "--capacity",
        type=positive_ints,
        default=[2000, 6000, 29000],
        metavar="N,...",
        help="cache capacities in blocks (default: 2000,6000,29000)",
    )


def _rpc_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--clients",
        type=positive_ints,
        default=[1, 4, 8],
        metavar="N,...",
        help="client process counts (default: 1,4,8)",
    )
    p.add_argument(
        "--ops",
        type=positive_int,
        default=5000,
        metavar="N",
        help="lookups per client and per server (default: 5000)",
    )


def _mla_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--world-sizes",
        type=positive_ints,
        default=[2, 4],
        metavar="N,...",
        help="TP sizes (default: 2,4)",
    )


SUITES: dict[str, Suite] = {
    "index": Suite(
        "kvd.bench.index",
        "block index: us per key and bytes per block, by size and policy",
        _index_arguments,
    ),
    "trace": Suite(
        "kvd.bench.trace",
        "hit rate of each policy and of Belady's optimum replaying a request trace",
        _trace_arguments,
    ),
    "rpc": Suite(
        "kvd.bench.rpc",
        "lookup of 64 keys: p50/p99 and ops/s at 1, 4, 8 clients, against a bare pyzmq echo",
        _rpc_arguments,
    ),
    "mla": Suite(
        "kvd.bench.mla",
        "host and device-to-host bytes per block, replicated vs sharded, at TP=N",
        _mla_arguments,
    ),
}
