"""Runs in the test process: the plug-in's failure rules (SPEC section 12, issue 24).

The plug-in's manager and worker on vLLM's own classes against a real daemon.
Each of these failed before its fix.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    LookupResult,
    ReqContext,
)

from kvd_client.scheduler import Scheduler
from kvd_client.vllm import KvdOffloadingSpec
from kvd_client.vllm.manager import UNSERVABLE, KvdLoadStoreSpec, KvdOffloadingManager
from kvd_client.vllm.worker import KvdOffloadingWorker
from kvd_tools.launcher import DaemonProcess
from kvd_tools.vllm_harness.engine import write_model
from kvd_tools.vllm_harness.offload_config import offloading_config as config
from tests.vllm.test_spec import registered

SLOT = 4096  # bytes a block in `config()`


def key(i: int, group: int = 0) -> bytes:
    """An OffloadKey as vLLM makes them: a 32-byte block hash and a 4-byte group."""
    return i.to_bytes(32, "big") + group.to_bytes(4, "big")


def plugin(
    d: DaemonProcess, engine_id: str = "engine-0", **extra: Any
) -> tuple[KvdOffloadingSpec, KvdOffloadingManager, KvdOffloadingWorker, torch.Tensor]:
    extra.setdefault("kvd_capacity_bytes", 1 << 20)
    cfg = dataclasses.replace(config(kvd_endpoint=d.endpoint, **extra), engine_id=engine_id)
    spec = KvdOffloadingSpec(cfg)
    manager = spec.get_manager()
    page = spec.choice.layout.slot_bytes
    tensor = torch.zeros((16, page), dtype=torch.int8)
    caches = CanonicalKVCaches(
        [CanonicalKVCacheTensor(tensor, page)], [[CanonicalKVCacheRef(0, page)]]
    )
    worker = spec.get_worker(caches)
    assert isinstance(manager, KvdOffloadingManager) and isinstance(worker, KvdOffloadingWorker)
    worker.reports_load_errors = True  # what KvdOffloadingConnector sets
    return spec, manager, worker, tensor


def observer(d: DaemonProcess, s: KvdOffloadingSpec) -> Scheduler:
    """Another engine's scheduler on the same pool, asking the daemon (no table)."""
    return Scheduler(s.choice.name, s.choice.layout, engine_id="observer", endpoint=d.endpoint,
                     use_table=False, timeout_ms=10_000)  # fmt: skip


# -- 3. long prompts: bounded requests, no exception ---------------------------------


def test_a_lookup_of_100k_keys_without_the_table_answers_a_count() -> None:
    n, ready = 100_000, 70_000
    keys = [key(i) for i in range(n)]
    # A lease that outlasts the daemon's loop on these long requests (2 to 10 us a key).
    with DaemonProcess(lease_ms="5000") as d:
        s, manager, worker, _ = plugin(
            d, kvd_ready_table=False, bytes_per_block=64, kvd_capacity_bytes=64 << 20
        )
        other = observer(d, s)
        try:
            for i in range(0, ready, 5_000):  # stored in requests the daemon takes
                part = keys[i : i + 5_000]
                assert other.prepare_store(part) is not None
                assert other.complete_store(part)
            assert other.lookup(keys) == ready  # one Scheduler.lookup, split
            assert other.lookup_and_pin(keys)[0] == ready
            other.complete_load(keys[:ready])
        finally:
            other.close()
        ctx = registered(ReqContext("long"), keys)
        assert manager.lookup(keys[0], ctx) is LookupResult.HIT  # type: ignore[arg-type]
        assert manager.lookup(keys[ready - 1], ctx) is LookupResult.HIT  # type: ignore[arg-type]
        assert manager.lookup(keys[ready], ctx) is LookupResult.MISS  # type: ignore[arg-type]
        load = manager.prepare_load(keys[:ready], ctx)  # type: ignore[arg-type]
        assert isinstance(load, KvdLoadStoreSpec) and load.generation != UNSERVABLE
        assert len(load.block_ids) == ready
        manager.complete_load(keys[:ready], ctx)  # type: ignore[arg-type]
        out = manager.prepare_store(keys, ReqContext("w"))  # type: ignore[arg-type]
        assert out is not None and len(out.keys_to_store) == n - ready
        manager.shutdown()
        worker.shutdown()


# -- 2. new weights at the same path: another pool -------------------------------------


def test_new_weights_at_the_same_path_get_another_pool(tmp_path: Path) -> None:
    """A model directory whose weights file is rewritten (the same name and size,
    other bytes, a later mtime): the fingerprint, so the default pool, changes."""
    from safetensors.torch import save_file
    from vllm.engine.arg_utils import EngineArgs

    from kvd_client.vllm.connector import weights_fingerprint
    from kvd_client.vllm.pool import choose_pool

    model = write_model(tmp_path / "m")
    weights = Path(model) / "model.safetensors"

    def write(seed: int) -> None:
        tensor = torch.randn((64, 64), generator=torch.Generator().manual_seed(seed))
        save_file({"w": tensor}, str(weights))

    def fingerprint() -> str:
        args = EngineArgs(model=model, skip_tokenizer_init=True, load_format="safetensors")
        return weights_fingerprint(args.create_engine_config())

    write(0)
    before = fingerprint()
    assert fingerprint() == before  # stable
    st = weights.stat()
    write(1)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert weights.stat().st_size == st.st_size
    after = fingerprint()
    assert after != before
    names = {choose_pool(config(kvd_weights=f)).name for f in (before, after)}
    assert len(names) == 2
