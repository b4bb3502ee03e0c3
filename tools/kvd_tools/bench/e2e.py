"""Runs in the operator's shell (as the demo engine's scheduler): `kvd bench e2e`.

Time to first token of the demo engine (`kvd_tools.demo`, TP=2 worker processes)
for one prompt per length, served twice: recomputed from scratch, and with
all of it but the last token's block loaded from kvd (stored by an earlier
identical request). Reports both TTFTs, their ratio and the largest
difference between the two runs' next-token logits (SPEC section 10: the
speedup grows with prompt length, outputs identical).
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvd_tools.bench.sizing import max_total_bytes, pool_footprint
from kvd_tools.demo.block_manager import blocks_for
from kvd_tools.demo.engine import Engine, EngineConfig
from kvd_tools.demo.model import ModelConfig, Variant, slot_bytes
from kvd_tools.demo.workload import random_prompts
from kvd_tools.launcher import PRIVATE_FLAGS, DaemonProcess

MAX_ABS_DIFF = 1e-4


def pool_bytes(model: ModelConfig, world_size: int, num_blocks: int) -> int:
    """A pool that holds `num_blocks` blocks with room to spare.

    A session may pin at most half a pool (`pin_cap_fraction`), and a cached
    prefill pins every block of the prompt: so 2.5x the prompt's blocks.
    """
    slots = 1 if model.variant == "mla" else world_size
    return num_blocks * slot_bytes(model, world_size) * slots * 5 // 2 + (16 << 20)


def _measure(engine: Engine, prompt: list[int], repeats: int) -> dict[str, Any]:
    engine.generate(prompt)  # stores the prompt's blocks (a miss: a full prefill)
    fresh = cached = None
    for _ in range(repeats):
        f = engine.generate(prompt, use_kvd=False)
        c = engine.generate(prompt)
        fresh = f if fresh is None or f.ttft_s < fresh.ttft_s else fresh
        cached = c if cached is None or c.ttft_s < cached.ttft_s else cached
    assert fresh is not None and cached is not None
    return {
        "prompt_tokens": len(prompt),
        "ttft_recompute_ms": fresh.ttft_s * 1e3,
        "ttft_cached_ms": cached.ttft_s * 1e3,
        "speedup": fresh.ttft_s / cached.ttft_s,
        "max_abs_diff": float(np.abs(cached.logits - fresh.logits).max()),
        "cached_tokens": cached.cached_tokens,
        "tokens_match": cached.tokens == fresh.tokens,
    }


def engine_config(variant: Variant, endpoint: str, args: argparse.Namespace) -> EngineConfig:
    model = ModelConfig(variant=variant)
    lengths: list[int] = args.prompt_tokens
    num_blocks = sum(blocks_for(n, model.block_tokens) for n in lengths)
    return EngineConfig.sized(
        model,
        endpoint,
        f"kvd-bench-e2e-{variant}",
        max_tokens=max(lengths) + 1,
        pool_bytes=pool_bytes(model, 2, num_blocks),
    )


def run_variant(config: EngineConfig, args: argparse.Namespace) -> list[dict[str, Any]]:
    model, variant = config.model, config.model.variant
    lengths: list[int] = args.prompt_tokens
    rows = []
    with Engine(config, f"kvd-bench-e2e-{variant}") as engine:
        # Untimed: the first pass touches the KV cache's pages and warms the kernels.
        engine.generate(random_prompts(1, min(lengths), model.vocab, seed=0)[0], use_kvd=False)
        for n in lengths:
            prompt = random_prompts(1, n, model.vocab, seed=n)[0]
            # Short prompts are cheap to repeat, and noise hurts them most.
            repeats = max(args.repeats, args.repeats * max(lengths) // n)
            rows.append({"variant": variant} | _measure(engine, prompt, repeats))
    return rows


ConfigFor = Callable[[Variant, str, argparse.Namespace], EngineConfig]
RunVariant = Callable[[EngineConfig, argparse.Namespace], list[dict[str, Any]]]


def run_variants(
    args: argparse.Namespace, config_for: ConfigFor, run_variant: RunVariant
) -> list[dict[str, Any]]:
    """`run_variant` for each variant of `--variant`, against one private daemon
    sized for the pools of all of them (each engine's pool stays to the end)."""
    variants: list[Variant] = ["mha", "mla"] if args.variant == "both" else [args.variant]
    unbound = [config_for(variant, "", args) for variant in variants]
    total = max_total_bytes(pool_footprint(c.pool, c.layout(), c.pool_bytes) for c in unbound)
    rows: list[dict[str, Any]] = []
    with DaemonProcess(base={**PRIVATE_FLAGS, "max-total-bytes": total}) as daemon:
        for variant in variants:
            rows += run_variant(config_for(variant, daemon.endpoint, args), args)
    return rows


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = run_variants(args, engine_config, run_variant)
    if args.png is not None:
        plot(rows, args.png)
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """TTFT against prompt length, recompute dashed and cached solid, one colour per variant."""
    from kvd_tools.demo.chart import Series, line_chart

    series = []
    for i, variant in enumerate(dict.fromkeys(r["variant"] for r in rows)):
        mine = [r for r in rows if r["variant"] == variant]
        for field, how, dashed in (
            ("ttft_recompute_ms", "recompute", True),
            ("ttft_cached_ms", "kvd", False),
        ):
            points = [(float(r["prompt_tokens"]), float(r[field])) for r in mine]
            series.append(Series(f"{variant} {how}", points, dashed, color=i))
    line_chart(path, "time to first token, TP=2 demo", "prompt tokens", "TTFT ms", series)


def summarize(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    for variant in dict.fromkeys(r["variant"] for r in rows):
        mine = sorted(
            (r for r in rows if r["variant"] == variant), key=lambda r: r["prompt_tokens"]
        )
        speedups = [r["speedup"] for r in mine]
        grows = all(b >= a for a, b in itertools.pairwise(speedups))
        worst = max(r["max_abs_diff"] for r in mine)
        same = worst <= MAX_ABS_DIFF and all(r["tokens_match"] for r in mine)
        lines.append(
            f"{variant}: speedup grows with prompt length: {'yes' if grows else 'no'} "
            f"({' -> '.join(f'{s:.1f}x' for s in speedups)}); outputs identical: "
            f"{'yes' if same else 'NO'} (max |diff| {worst:.1e} <= {MAX_ABS_DIFF:g}, "
            "same greedy token)"
        )
        missed = [r["prompt_tokens"] for r in mine if not r["cached_tokens"]]
        if missed:  # a "cached" run that found nothing measures recompute twice
            lines.append(f"{variant}: the cached run found NO cached tokens at {missed}")
    return lines
