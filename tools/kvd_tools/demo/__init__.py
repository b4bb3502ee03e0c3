"""Runs in the operator's shell: `kvd demo`, a small TP inference engine that caches in kvd.

- `model`: the decoder (MHA or MLA attention), Megatron-style TP, paged KV cache
- `block_manager`: block hashes (the kvd keys) and device block ids
- `step`: the messages between the engine's scheduler and its TP workers
- `tp_worker`: one rank: model shard, KV cache, `kvd_client.Worker`
- `engine`: the scheduler side: lookup, load, prefill, store, decode
- `workload`: multi-turn chats and fixed prompt batches from a seed
- `runner`: `kvd demo` itself (table, checks, engine restart)
- `chart`: PNG line charts for `kvd bench e2e|throughput --png` (numpy and zlib only)

The flags live here, not in `runner`, so that `kvd --help` can declare them
without importing torch.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `kvd demo` (parsed arguments go to `kvd_tools.demo.runner.main`)."""
    parser.add_argument(
        "--variant",
        choices=("mha", "mla", "both"),
        default="both",
        help="mha: a sharded pool; mla: a replicated one (default: both)",
    )
    parser.add_argument("--quick", action="store_true", help="short prompts (for tests)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--endpoint",
        default=None,
        help="a running daemon's control endpoint (default: the default endpoint if a "
        "daemon answers there, else a daemon of the demo's own, stopped at the end)",
    )
    where.add_argument("--runtime-dir", default=None, help="a running daemon's runtime directory")
    parser.add_argument(
        "--gen-tokens", type=_positive, default=4, help="greedy tokens per request (default: 4)"
    )
    parser.add_argument(
        "--json",
        dest="json_path",
        type=Path,
        default=None,
        metavar="PATH",
        help="also write the rows as JSON to PATH",
    )
