"""Runs in the operator's shell (and is the demo's scheduler process): `kvd demo`.

For each variant (mha: a sharded pool; mla: a replicated one) it starts the
demo engine (2 TP worker processes), serves a multi-turn chat workload with
kvd and again by recomputing, and prints one row per request: prompt and
cached tokens, time to first token both ways, bytes moved, and how far the
logits of the cached run are from the recompute. Then it restarts the engine
(workers and scheduler session) while the daemon keeps running and shows the
first request after the restart hitting the cache.

Uses the daemon at `--endpoint`, else the one at the default endpoint if it
answers, else starts its own and stops it at the end. Exit status 0, or 1 on
any mismatch, a missing hit, or a daemon or engine failure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from kvd_client import protocol as p
from kvd_client.connection import Connection
from kvd_client.errors import ErrorCode, KvdError
from kvd_client.paths import control_endpoint, default_endpoint, read_admin_token, runtime_dir_of
from kvd_tools.demo import add_arguments
from kvd_tools.demo.engine import Engine, EngineConfig, EngineError
from kvd_tools.demo.model import ModelConfig, Variant
from kvd_tools.demo.workload import Turn, chat_workload
from kvd_tools.launcher import PRIVATE_FLAGS, DaemonProcess

MAX_ABS_DIFF = 1e-4
_POOL_BYTES = {False: 256 << 20, True: 32 << 20}  # by --quick
_COLUMNS = (
    ("request", 8),
    ("prompt", 7),
    ("cached", 7),
    ("TTFT kvd ms", 11),
    ("TTFT recompute ms", 17),
    ("speedup", 7),
    ("loaded", 9),
    ("stored", 9),
    ("max |diff|", 10),
    ("tokens", 6),
)


def _answers(endpoint: str) -> bool:
    conn = Connection(endpoint, role="admin", keeper=False, timeout_ms=300)
    try:
        conn.connect()
        return True
    except KvdError:
        return False
    finally:
        conn.close()


def _drop_pools(endpoint: str, pools: Sequence[str]) -> None:
    """Drops the demo's pools (with the operator token, where this user may read it)."""
    runtime = runtime_dir_of(endpoint)
    token = read_admin_token(runtime) if runtime is not None else ""
    conn = Connection(endpoint, role="admin", keeper=False, timeout_ms=2000)
    try:
        conn.connect()
        for pool in pools:
            try:
                conn.call(p.DropPool, pool, token)
            except KvdError as exc:
                if exc.code == ErrorCode.NO_SUCH_POOL:
                    continue  # nothing to drop
                if exc.code != ErrorCode.WRONG_ROLE:
                    raise
                # Emptying another's pool needs the same token: it stays as it is.
                print(f"kvd demo: cannot drop pool {pool} ({exc}); it keeps its blocks")
    except KvdError as exc:
        print(f"kvd demo: could not drop pools {list(pools)}: {exc}", file=sys.stderr)
    finally:
        conn.close()


@contextlib.contextmanager
def daemon_endpoint(endpoint: str | None, pools: Sequence[str]) -> Iterator[str]:
    """A daemon to talk to: the given one, the default one if it answers, else our own.

    A daemon that is not ours keeps running; the demo drops its pools from it
    at the start (so the first turns miss, as in the table) and at the end.
    """
    given = endpoint is not None
    endpoint = endpoint or default_endpoint()
    if _answers(endpoint):
        print(f"kvd demo: using the daemon at {endpoint}")
        _drop_pools(endpoint, pools)
        try:
            yield endpoint
        finally:
            _drop_pools(endpoint, pools)
        return
    if given:
        raise KvdError(f"no kvd daemon answers at {endpoint}")
    with DaemonProcess(base={**PRIVATE_FLAGS, "max-total-bytes": "1GiB"}) as daemon:
        print(f"kvd demo: started a daemon at {daemon.endpoint} (stopped at the end)")
        yield daemon.endpoint


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB"


def _line(values: Sequence[str]) -> str:
    return "| " + " | ".join(v.rjust(w) for v, (_, w) in zip(values, _COLUMNS, strict=True)) + " |"


def _serve(engine: Engine, turn: Turn, gen_tokens: int) -> dict[str, Any]:
    cached = engine.generate(turn.prompt, gen_tokens=gen_tokens)
    fresh = engine.generate(turn.prompt, use_kvd=False, gen_tokens=gen_tokens)
    return {
        "request": turn.name,
        "prompt_tokens": cached.prompt_tokens,
        "cached_tokens": cached.cached_tokens,
        "ttft_cached_ms": cached.ttft_s * 1e3,
        "ttft_recompute_ms": fresh.ttft_s * 1e3,
        "loaded_bytes": cached.load_bytes,
        "stored_bytes": cached.store_bytes,
        "max_abs_diff": float(np.abs(cached.logits - fresh.logits).max()),
        "tokens_match": cached.tokens == fresh.tokens,
    }


def _print_row(row: dict[str, Any]) -> None:
    speedup = row["ttft_recompute_ms"] / max(row["ttft_cached_ms"], 1e-9)
    values = (
        row["request"] + (" *" if row["after_restart"] else ""),
        str(row["prompt_tokens"]),
        str(row["cached_tokens"]),
        f"{row['ttft_cached_ms']:.1f}",
        f"{row['ttft_recompute_ms']:.1f}",
        f"{speedup:.2f}x",
        _mib(row["loaded_bytes"]),
        _mib(row["stored_bytes"]),
        f"{row['max_abs_diff']:.1e}",
        "same" if row["tokens_match"] else "DIFFER",
    )
    print(_line(values), flush=True)


def run_variant(
    variant: Variant, endpoint: str, quick: bool, gen_tokens: int
) -> list[dict[str, Any]]:
    """Serves the workload, restarts the engine, serves the rest; one row per request."""
    model = ModelConfig(variant=variant)
    before, after = chat_workload(quick, model.vocab)
    longest = max(len(t.prompt) for t in before + after)
    config = EngineConfig.sized(
        model,
        endpoint,
        f"kvd-demo-{variant}",
        max_tokens=longest + gen_tokens,
        pool_bytes=_POOL_BYTES[quick],
    )
    layout = config.layout()
    pool = (
        "replicated pool (rank 0 stores, every rank loads the one copy)"
        if layout.replicated
        else "sharded pool (each rank stores and loads its own heads)"
    )
    print(
        f"\n{variant}: {model.identity}\n  TP={config.world_size}, {model.block_tokens}-token "
        f"blocks, {layout.slot_bytes // 1024} KiB per rank per block, {pool}"
    )
    print(_line([name for name, _ in _COLUMNS]))
    print(_line(["-" * w for _, w in _COLUMNS]))
    rows: list[dict[str, Any]] = []
    for incarnation, turns in enumerate((before, after)):
        engine_id = f"kvd-demo-{variant}-{os.getpid()}-{incarnation}"
        with Engine(config, engine_id) as engine:
            for turn in turns:
                row = {"variant": variant, "after_restart": incarnation > 0}
                row |= _serve(engine, turn, gen_tokens)
                _print_row(row)
                rows.append(row)
        if incarnation == 0:
            print("| (engine restarted: new worker processes and kvd sessions; same daemon)")
    first = rows[len(before)]
    print(
        f"after the restart, {first['request']} found {first['cached_tokens']} of its "
        f"{first['prompt_tokens']} prompt tokens in kvd"
    )
    return rows


def check(rows: Sequence[dict[str, Any]]) -> list[str]:
    """What the demo promises and did not deliver (empty when all is well)."""
    problems = []
    seen: set[tuple[str, str]] = set()
    for row in rows:
        name = f"{row['variant']} {row['request']}"
        if row["max_abs_diff"] > MAX_ABS_DIFF:
            problems.append(f"{name}: logits differ by {row['max_abs_diff']:.2e} > {MAX_ABS_DIFF}")
        if not row["tokens_match"]:
            problems.append(f"{name}: greedy tokens differ from the recompute")
        key = (row["variant"], row["request"][0])
        if key in seen and row["cached_tokens"] == 0:
            problems.append(f"{name}: a later turn of the conversation did not hit")
        seen.add(key)
    for variant in sorted({r["variant"] for r in rows}):
        first = next((r for r in rows if r["variant"] == variant and r["after_restart"]), None)
        if first is None or first["cached_tokens"] == 0:
            problems.append(f"{variant}: the first request after the restart did not hit")
    return problems


def main(args: argparse.Namespace) -> int:
    """Runs the demo with the flags of `kvd_tools.demo.add_arguments`; the exit status."""
    logging.basicConfig(level=logging.WARNING, format="kvd demo: %(name)s: %(message)s")
    variants: list[Variant] = ["mha", "mla"] if args.variant == "both" else [args.variant]
    rows: list[dict[str, Any]] = []
    try:
        endpoint = args.endpoint or (
            control_endpoint(args.runtime_dir) if args.runtime_dir else None
        )
        with daemon_endpoint(endpoint, [f"kvd-demo-{v}" for v in variants]) as endpoint:
            for variant in variants:
                rows += run_variant(variant, endpoint, args.quick, args.gen_tokens)
    except (KvdError, EngineError) as exc:
        print(f"kvd demo: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # everything started was stopped on the way out
        print("kvd demo: interrupted", file=sys.stderr)
        return 130
    if args.json_path is not None:
        args.json_path.write_text(json.dumps(rows, indent=2))
    problems = check(rows)
    print(
        "\n* = after the engine restart; loaded/stored = bytes copied between the workers' "
        "KV caches and the kvd pool, all ranks"
    )
    for line in problems:
        print(f"FAIL {line}")
    if not problems:
        worst = max(r["max_abs_diff"] for r in rows)
        print(f"ok: cached logits within {worst:.1e} of recompute, greedy tokens identical")
    return 1 if problems else 0


def cli(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvd demo", description="Run the demo inference engine against a kvd daemon."
    )
    add_arguments(parser)
    return main(parser.parse_args(argv))
