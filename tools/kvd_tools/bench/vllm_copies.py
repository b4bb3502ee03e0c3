"""Runs in the operator's shell: `kvd bench vllm`'s copies part, a decode step while stores run.

On the CPU, is vLLM's step faster when the plug-in's worker copies on a
thread of its own (`kvd_copies` "thread", torch and the native copier
release the GIL) than inside `submit_store` ("sync")? Each mode gets the
real plug-in (`KvdOffloadingSpec`: its manager and worker, a private
daemon) over canonical KV tensors of `BENCH_LLAMA`'s shape, and runs
steps as vLLM's worker does: the step's deferred store submitted, then the
forward pass of a decode batch (`BENCH_LLAMA`'s matmuls over a batch of
tokens, on torch's threads), then `get_finished`. Rows: `copies` (the
mode), `decode_batch`, `store_blocks_per_step`, `step_ms` (median),
`store_mib_per_step`, `forward_ms` (the same step without a store),
`stores_copied` (every store copied and reported). The modes' steps and a
step without a store alternate round by round, so a shared host's load
drifts evenly over them. No vLLM engine: the step is what the worker changes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from kvd_tools.launcher import DaemonProcess

COPIES_POOL_BYTES = 256 << 20  # each mode's pool
DEVICE_BLOCKS = 512
MODES = ("sync", "thread")


def copies_rows(
    args: argparse.Namespace, daemon: DaemonProcess, shape: dict[str, Any], page_bytes: int
) -> list[dict[str, Any]]:
    """Rounds of one step of each mode and one without a store, alternated (a shared
    host's load drifts), `copy_steps` rounds after one to warm up; medians."""
    weights = _weights(shape)
    plugins = {mode: _Plugin(daemon, shape, page_bytes, mode) for mode in MODES}
    times: dict[str, list[float]] = {mode: [] for mode in (*MODES, "none")}
    try:
        for step in range(args.copy_steps + 1):
            for mode, plugin in plugins.items():
                seconds = plugin.step(step, args.store_blocks, weights, args.decode_batch)
                if step:
                    times[mode].append(seconds)
            start = time.perf_counter()
            _forward(weights, args.decode_batch)
            if step:
                times["none"].append(time.perf_counter() - start)
        copied = {mode: plugin.drain() for mode, plugin in plugins.items()}
    finally:
        for plugin in plugins.values():
            plugin.close()
    forward_ms = statistics.median(times["none"]) * 1000
    return [{"copies": mode, "decode_batch": args.decode_batch,
             "store_blocks_per_step": args.store_blocks,
             "store_mib_per_step": args.store_blocks * page_bytes / (1 << 20),
             "step_ms": statistics.median(times[mode]) * 1000, "forward_ms": forward_ms,
             "stores_copied": copied[mode]} for mode in MODES]  # fmt: skip


def _weights(shape: dict[str, Any]) -> list[list[torch.Tensor]]:
    h, m = shape["hidden_size"], shape["intermediate_size"]
    gen = torch.Generator().manual_seed(0)
    return [[torch.randn(h, 3 * h, generator=gen), torch.randn(h, h, generator=gen),
             torch.randn(h, 2 * m, generator=gen), torch.randn(m, h, generator=gen)]
            for _ in range(shape["num_hidden_layers"])]  # fmt: skip


def _forward(weights: list[list[torch.Tensor]], batch: int) -> None:
    x = torch.ones(batch, weights[0][0].shape[0])
    for qkv, out, up, down in weights:
        x = x + (x @ qkv)[:, : x.shape[1]] @ out
        gate, val = (x @ up).chunk(2, dim=1)
        x = torch.nn.functional.silu(gate).mul_(val) @ down
        x = x / x.norm(dim=1, keepdim=True)


class _Plugin:
    """The real plug-in in one mode: its manager and worker over canonical tensors."""

    def __init__(
        self, daemon: DaemonProcess, shape: dict[str, Any], page_bytes: int, mode: str
    ) -> None:
        from vllm.v1.kv_offload.base import (
            CanonicalKVCacheRef,
            CanonicalKVCaches,
            CanonicalKVCacheTensor,
        )

        from kvd_client.vllm import KvdOffloadingSpec
        from kvd_tools.vllm_harness.offload_config import offloading_config

        layers = shape["num_hidden_layers"]
        page = page_bytes // layers
        tensors = [torch.randint(-100, 100, (DEVICE_BLOCKS, page), dtype=torch.int8)
                   for _ in range(layers)]  # fmt: skip
        refs = [[CanonicalKVCacheRef(i, page) for i in range(layers)]]
        caches = CanonicalKVCaches([CanonicalKVCacheTensor(t, page) for t in tensors], refs)
        spec = KvdOffloadingSpec(offloading_config(
            kvd_endpoint=daemon.endpoint, kvd_copies=mode, bytes_per_block=page_bytes,
            kvd_capacity_bytes=COPIES_POOL_BYTES, kvd_pool=f"bench-copies-{mode}",
            kvd_ready_table=False))  # fmt: skip
        self.mode = mode
        self.manager, self.worker = spec.get_manager(), spec.get_worker(caches)
        self.pending: dict[int, tuple[list[bytes], Any]] = {}
        self.copied = True

    def step(self, step: int, n: int, weights: list[list[torch.Tensor]], batch: int) -> float:
        """vLLM's worker step: the deferred store of `n` blocks, the forward pass,
        `get_finished`; its seconds."""
        from vllm.v1.kv_offload.base import GPULoadStoreSpec, ReqContext

        keys = [f"{self.mode}-{step}-{i}".encode().ljust(32, b".") + bytes(4) for i in range(n)]
        ctx = ReqContext(f"r{step}")
        out = self.manager.prepare_store(keys, ctx)
        first = step * n % (DEVICE_BLOCKS - n)
        start = time.perf_counter()
        self.worker.note(self.manager.step_notes())
        if out is not None:
            blocks = GPULoadStoreSpec(list(range(first, first + n)), (n,), (0,))
            self.worker.submit_store(step, blocks, out.store_spec)
            self.pending[step] = (keys, ctx)
        _forward(weights, batch)
        finished = self.worker.get_finished()
        seconds = time.perf_counter() - start
        self._settle(finished)
        return seconds

    def drain(self) -> bool:
        """Waits for the stores in flight; whether every store was copied."""
        self.worker.wait(set(self.pending))
        self._settle(self.worker.get_finished())
        return self.copied and not self.pending

    def _settle(self, finished: list[Any]) -> None:
        """What the connector carries: the copies to the manager, then each store completed."""
        copies = self.worker.take_copies()
        self.manager.on_copies({token: (1, ok) for token, ok in copies.items()})
        for result in finished:
            keys, ctx = self.pending.pop(result.job_id)
            self.manager.complete_store(keys, ctx)
        self.copied &= all(copies.values())

    def close(self) -> None:
        self.worker.shutdown()
        self.manager.shutdown()
