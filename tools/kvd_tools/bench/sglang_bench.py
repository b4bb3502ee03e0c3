"""Runs in the operator's shell: `kvd bench sglang`, SGLang's HiCache storage: kvd vs HiCacheFile.

SGLang's own host pool (`MHATokenToKVPoolHost`, page_first, bf16; built as
its scheduler builds it, on the CPU: `kvd_tools.sglang_harness`) holds
`--pages` pages of `--page-tokens` tokens. Each round, interleaved so a
noisy neighbour hits all alike, moves the same pages three ways:

- kvd: `KvdHiCacheStorage` loaded through SGLang's `dynamic` backend, as
  SGLang's cache controller calls it with `interface_v1`: `batch_set_v1` of
  the pages under fresh keys (into an emptied pool), then `batch_get_v1` of
  them into other host pages (keys, pin or prepare, copy, release: all of it);
- file: SGLang's `HiCacheFile` on a directory in /dev/shm (memory, as kvd's
  pool is), called as the controller calls a backend without `interface_v1`
  (`_generic_page_set` / `_generic_page_get`: flat pages, `batch_set`,
  `batch_get`, `set_from_flat_data_page`);
- memcpy: one `copy_` of the same bytes (the K and V ranges of the pages)
  into a buffer and back, the bound no copy beats.

GB/s are page bytes over seconds, medians of `--rounds`. `batch_exists`
is timed per key on `--exists-keys` keys that are all there (the longest
walk): kvd (the ready table), an in-process dict counting leading keys,
and HiCacheFile (a file stat per key). Goals (issue 28): kvd >= 0.8x
memcpy, and ahead of HiCacheFile on every figure.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from kvd_tools import sglang_harness as h
from kvd_tools.bench.report import Row
from kvd_tools.bench.suites import SuiteError
from kvd_tools.launcher import PRIVATE_FLAGS, DaemonProcess


def _timed(fn: Callable[..., Any], *args: Any) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> list[Row]:
    why = h.missing()
    if why is not None:
        raise SuiteError(why)
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    ps, n = args.page_tokens, args.pages
    device = h.device_pool(tokens=n * ps, page_size=ps, layers=args.layers, heads=args.heads,
                           head_dim=args.head_dim)  # fmt: skip
    host = h.host_pool(device, layout="page_first", ratio=(2 * n + args.exists_keys + 1) / n)
    page_bytes = host.size_per_token * ps
    src, dst = host.alloc(n * ps), host.alloc(n * ps)
    for idx in (src, dst):  # consecutive pages: memcpy's K and V ranges
        if not torch.equal(idx, torch.arange(int(idx[0]), int(idx[0]) + n * ps)):
            raise SuiteError("host pool pages are not consecutive")
    host.kv_buffer.view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(0))
    # A load pins its batch, at most half the pool (the daemon's pin_cap_fraction).
    capacity = 4 * max(n, args.exists_keys) * page_bytes
    flags = {**PRIVATE_FLAGS, "max-total-bytes": str(2 * capacity + (64 << 20))}
    file_dir = tempfile.mkdtemp(prefix="kvd-bench-hicache-", dir="/dev/shm")
    try:
        with DaemonProcess(base=flags) as daemon:
            extra = h.kvd_extra(daemon.endpoint, "bench-sglang", kvd_capacity_bytes=capacity)
            kvd = StorageBackendFactory.create_backend("dynamic", h.storage_config(extra), host)
            kvd.register_mem_pool_host(host)
            file_cfg = h.storage_config({"file_storage_path": file_dir})
            file = StorageBackendFactory.create_backend("file", file_cfg, host)
            try:
                return _measure(args, host, kvd, file, src, dst, page_bytes)
            finally:
                kvd.close()
    finally:
        shutil.rmtree(file_dir, ignore_errors=True)


def _measure(args: argparse.Namespace, host: Any, kvd: Any, file: Any, src: torch.Tensor,
             dst: torch.Tensor, page_bytes: int) -> list[Row]:  # fmt: skip
    ps, n = host.page_size, args.pages
    total = n * page_bytes
    k, v = host.kv_buffer[0], host.kv_buffer[1]
    s0, d0 = int(src[0]), int(dst[0])
    buf = torch.empty((2, n * ps, *k.shape[1:]), dtype=k.dtype)
    times: dict[str, list[float]] = {m: [] for m in
                                     ("kvd_set", "kvd_get", "file_set", "file_get",
                                      "memcpy_set", "memcpy_get")}  # fmt: skip
    firsts = src[::ps].tolist()
    dfirsts = dst[::ps].tolist()

    def file_set(keys: list[str]) -> None:
        pages = [host.get_data_page(i) for i in firsts]  # _generic_page_set
        if not file.batch_set(keys, pages):
            raise SuiteError("HiCacheFile refused a set")

    def file_get(keys: list[str]) -> None:
        got = file.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys])
        for i, page in zip(dfirsts, got, strict=True):  # _generic_page_get
            if page is None:
                raise SuiteError("HiCacheFile missed a page it stored")
            host.set_from_flat_data_page(i, page)

    def memcpy_set() -> None:
        buf[0].copy_(k[s0 : s0 + n * ps])
        buf[1].copy_(v[s0 : s0 + n * ps])

    def memcpy_get() -> None:
        k[d0 : d0 + n * ps].copy_(buf[0])
        v[d0 : d0 + n * ps].copy_(buf[1])

    for r in range(args.rounds + 1):  # round 0 warms up, unrecorded
        keys = h.page_hashes([r * 1_000_003 + i for i in range(n * ps)], ps)
        if not kvd.clear():
            raise SuiteError("kvd: the pool could not be emptied")
        t = {
            "kvd_set": _timed(_all, kvd.batch_set_v1, keys, src, "set"),
            "kvd_get": _timed(_all, kvd.batch_get_v1, keys, dst, "get"),
        }
        _check(host, src, dst, n)
        file.clear()
        t["file_set"] = _timed(file_set, keys)
        t["file_get"] = _timed(file_get, keys)
        t["memcpy_set"] = _timed(memcpy_set)
        t["memcpy_get"] = _timed(memcpy_get)
        if r:
            for m, s in t.items():
                times[m].append(s)
    gbps = {m: total / statistics.median(s) / 1e9 for m, s in times.items()}
    rows: list[Row] = []
    for op in ("set", "get"):
        kv, fl, mc = gbps[f"kvd_{op}"], gbps[f"file_{op}"], gbps[f"memcpy_{op}"]
        rows.append({"op": op, "pages": n, "page_bytes": page_bytes, "kvd_gbps": round(kv, 3),
                     "file_gbps": round(fl, 3), "memcpy_gbps": round(mc, 3),
                     "vs_memcpy": round(kv / mc, 3), "vs_file": round(kv / fl, 2)})  # fmt: skip
    rows.append(_exists(args, kvd, file, ps))
    return rows


def _all(call: Callable[..., list[bool]], keys: list[str], idx: torch.Tensor, what: str) -> None:
    results = call(keys, idx)
    if not all(results):
        raise SuiteError(f"kvd: a {what} of the bench's pages failed: {results}")


def _check(host: Any, src: torch.Tensor, dst: torch.Tensor, n: int) -> None:
    ps = host.page_size
    for i in (0, n - 1):
        a = host.get_data_page(int(src[i * ps])).view(torch.uint8)
        b = host.get_data_page(int(dst[i * ps])).view(torch.uint8)
        if not torch.equal(a, b):
            raise SuiteError(f"kvd: page {i} came back different")


def _exists(args: argparse.Namespace, kvd: Any, file: Any, ps: int) -> Row:
    """us per key of `batch_exists` over keys that are all there."""
    m = args.exists_keys
    keys = h.page_hashes(list(range(7, 7 + m * ps)), ps)
    slot = kvd.mem_pool_host.alloc(m * ps)
    _all(kvd.batch_set_v1, keys, slot, "set")
    flat = [kvd.mem_pool_host.get_data_page(int(i)) for i in slot[::ps]]
    if not file.batch_set(keys, flat):
        raise SuiteError("HiCacheFile refused a set")
    table = dict.fromkeys(keys, True)

    def in_dict() -> int:
        hits = 0
        for key in keys:
            if key not in table:
                break
            hits += 1
        return hits

    per: dict[str, list[float]] = {"kvd": [], "dict": [], "file": []}
    for _ in range(args.exists_repeats):
        for name, fn in (("kvd", lambda: kvd.batch_exists(keys)), ("dict", in_dict),
                         ("file", lambda: file.batch_exists(keys))):  # fmt: skip
            start = time.perf_counter()
            hits = fn()
            per[name].append((time.perf_counter() - start) / m * 1e6)
            if hits != m:
                raise SuiteError(f"{name}: batch_exists found {hits} of {m}")
    us = {k: statistics.median(v) for k, v in per.items()}
    return {"exists_keys": m, "kvd_us_per_key": round(us["kvd"], 4),
            "dict_us_per_key": round(us["dict"], 4), "file_us_per_key": round(us["file"], 4),
            "vs_file": round(us["file"] / us["kvd"], 2)}  # fmt: skip


def summarize(rows: list[Row]) -> list[str]:
    lines = []
    for r in rows:
        if "op" in r:
            lines.append(f"{r['op']}: kvd {r['vs_memcpy']}x memcpy (goal >= 0.8), "
                         f"{r['vs_file']}x HiCacheFile")  # fmt: skip
        else:
            lines.append(f"batch_exists: kvd {r['kvd_us_per_key']} us/key, dict "
                         f"{r['dict_us_per_key']}, HiCacheFile {r['file_us_per_key']}")  # fmt: skip
    return lines
