"""Runs in vLLM's processes: `KvdOffloadingConnector`, vLLM's connector plus what kvd needs.

vLLM's own connector asserts that every transfer succeeded and has no way to
say that a load was not served or a store not copied. This subclass:

- hands vLLM the loads kvd could not serve (the worker's `load_errors`,
  `get_block_ids_with_load_errors`), whose scheduler recomputes them when
  `kv_load_failure_policy` is "recompute" (the README's command sets it;
  with vLLM's default "fail" the request fails with an error instead, and a
  warning at start says so);
- carries, each step, the scheduler side's `StepNotes` to the workers
  (`KvdConnectorMetadata`: until when the session's slots are held, which
  stores a reset cancelled), and the workers' reports of their store copies
  back (`KvdWorkerMetadata`), so that a store not copied is completed as
  failed and never becomes ready;
- names the engine's weights in the default pool name (`weights_fingerprint`:
  revision, quantization, overrides, and the names, sizes and mtimes of the
  weight files of a local model), which vLLM's offloading config leaves out;
- marks the config (`kvd_connector`): the spec turns kvd off under vLLM's
  plain connector, which can neither recompute a load kvd could not serve
  nor hear of a failed copy;
- names the engine's KV cache groups (`kvd_groups`: vLLM's kind, tokens per
  block and window of each, `kvd_client.vllm.groups`), which vLLM's
  offloading config leaves out, for the pool's layout and the manager's
  lookups by kind;
- reports a load kvd could not serve per request (vLLM's `failed_recving`)
  in an engine of several KV cache groups, whose block ids vLLM cannot map
  back to requests (its `_handle_invalid_blocks` raises on them there), and
  block by block (`invalid_block_ids`) in an engine of one, where vLLM
  recomputes only the blocks that failed.

Everything else is vLLM's connector unchanged. Load it with `kv_connector_module_path`:

    {"kv_connector": "KvdOffloadingConnector",
     "kv_connector_module_path": "kvd_client.vllm",
     "kv_load_failure_policy": "recompute", ...}
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)

from kvd_client.vllm.groups import describe_groups
from kvd_client.vllm.manager import KvdOffloadingManager, StepNotes
from kvd_client.vllm.worker import IdleWorker, KvdOffloadingWorker

log = logging.getLogger("kvd_client.vllm")
# Files whose bytes are a model's weights, as the loaders vLLM ships read them.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack", ".h5")
MAX_WEIGHT_DIRS = 1_000  # directories walked at most (a model's are a handful)


def weights_digest(model: str) -> str:
    """A digest of the weight files of the local model directory `model` (their
    relative names, sizes and mtimes, and `config.json`'s), "" for a name that is
    not a directory (a hub id: its revision names it). New weights written at
    the same path give another digest, so their engines never share a pool with
    the old weights' ones; the weights' bytes are not read."""
    root = Path(model)
    if not root.is_dir():
        return ""
    entries = []
    for num, (dirpath, dirnames, filenames) in enumerate(os.walk(root)):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if name.endswith(WEIGHT_SUFFIXES) or name == "config.json":
                path = Path(dirpath, name)
                try:
                    st = path.stat()
                except OSError:
                    continue
                entries.append(f"{path.relative_to(root)}:{st.st_size}:{st.st_mtime_ns}")
        if num >= MAX_WEIGHT_DIRS:
            break
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()[:16]


def weights_fingerprint(vllm_config: Any) -> str:
    """What, beyond the model's name, makes two engines' KV differ: revision,
    quantization, overrides, the weight files of a local model (`weights_digest`),
    and for dummy weights the seed they are drawn from."""
    model, load = vllm_config.model_config, vllm_config.load_config
    overrides = model.hf_overrides  # a dict, or a function: named, never by address
    parts = [
        # vLLM keeps the asked revision ("main") in a str subclass whose `resolved`
        # holds the commit it resolved to: the commit names the weights.
        str(getattr(model.revision, "resolved", None) or model.revision),
        str(model.quantization),
        json.dumps(overrides, sort_keys=True, default=str)
        if isinstance(overrides, dict)
        else getattr(overrides, "__qualname__", type(overrides).__name__),
        str(load.load_format),
    ]
    if str(load.load_format) == "dummy":
        parts.append(f"seed={model.seed}")
    else:
        parts.append(f"files={weights_digest(str(model.model))}")
    return ";".join(parts)


RESERVED_CPU_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"


def reserved_cores_note(vllm_config: Any) -> tuple[int, str] | None:
    """On vLLM's CPU build, what to tell the operator about the core vLLM reserves for
    a KV connector: (log level, line), or None (another platform, the variable set,
    or OpenMP threads bound by hand, where vLLM reserves nothing). vLLM 0.32's CPU
    executor, binding automatically, reserves one core a rank for its scheduler on
    x86 and Arm, and one more a rank when any KV connector is configured (for
    NIXL's transfers; `ompmultiprocessing.py`). kvd copies on the worker's own
    thread and its daemon is another process: that core idles. Where the host has
    no more cores than that, vLLM reserves none at all and its OpenMP threads share
    the scheduler's core: a decode step 1.3x as long on 2 cores (`kvd bench peers`).
    A hint, not vLLM's own count: vLLM counts physical cores of the ranks' NUMA
    nodes, this the CPUs the process may run on."""
    if RESERVED_CPU_ENV in os.environ:
        return None
    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") != "auto":
        return None
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return None
        parallel = vllm_config.parallel_config
        ranks = int(getattr(parallel, "local_world_size", 0) or parallel.world_size)
        cpus = len(os.sched_getaffinity(0))
    except Exception:  # nothing to ask: say nothing rather than guess
        return None
    line = (
        f"vLLM's CPU build reserves {ranks} more core(s) for any KV connector, which kvd "
        f"does not use; set {RESERVED_CPU_ENV}={ranks} to give them to the model "
        "(vLLM then warns that it is below its minimum: expected)"
    )
    if cpus <= 2 * ranks:
        return logging.WARNING, (
            f"{line}. With {cpus} CPUs vLLM likely reserves none now, and its threads "
            "share the scheduler's core (decode steps up to 1.4x as long)"
        )
    return logging.INFO, line


@dataclass
class KvdConnectorMetadata(OffloadingConnectorMetadata):
    """vLLM's per-step metadata, and the scheduler side's `StepNotes` for the workers."""

    kvd: StepNotes | None = None


@dataclass
class KvdWorkerMetadata(OffloadingWorkerMetadata):
    """vLLM's worker-to-scheduler metadata, and the workers' store copies:
    `copies[token] = (workers that reported, all of them copied)`."""

    copies: dict[int, tuple[int, bool]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        base = super().aggregate(other)
        assert isinstance(base, OffloadingWorkerMetadata)
        copies = dict(self.copies)
        for token, (workers, copied) in getattr(other, "copies", {}).items():
            had, ok = copies.get(token, (0, True))
            copies[token] = (had + workers, ok and copied)
        return KvdWorkerMetadata(base.completed_jobs, base.transfer_stats, copies)


class KvdOffloadingConnector(OffloadingConnector):
    # vLLM 0.33's sleep-mode hooks keep the defaults, as in vLLM's own connector:
    # `supports_sleep_mode` True, `unregister_kv_caches` / `restore_kv_caches` no-ops.
    # Sleep mode drains transfers first and brings the KV cache back at the same
    # addresses, so the worker's views of it stay valid; kvd registers no device
    # memory with anything that would have to let go of it (NIXL, Mooncake do).

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        extra.setdefault("kvd_weights", weights_fingerprint(vllm_config))
        extra["kvd_connector"] = True  # the spec refuses vLLM's plain connector
        extra["kvd_groups"] = describe_groups(kv_cache_config)
        groups = len(kv_cache_config.kv_cache_groups)
        # A load kvd cannot serve: per request where block ids are per group.
        self._failed_per_request = groups > 1
        if groups > 1 and int(extra.get("sync_load_budget_bytes") or 0) > 0:
            # vLLM 0.33's sync loads run their request in the step of the load; vLLM
            # takes such a load's failure block by block only (invalid_block_ids), which
            # it refuses from engines of several groups, and failed_recving covers only
            # loads it waits for: a failed one would be computed on as if loaded.
            extra.setdefault(
                "kvd_refuse",
                f"sync_load_budget_bytes > 0 in an engine of {groups} KV cache groups "
                "(vLLM 0.33 cannot be told that such a load failed); set it to 0",
            )
        super().__init__(vllm_config, role, kv_cache_config)
        policy = vllm_config.kv_transfer_config.kv_load_failure_policy
        note = reserved_cores_note(vllm_config) if role == KVConnectorRole.SCHEDULER else None
        if note is not None:
            log.log(*note)
        if role == KVConnectorRole.SCHEDULER and policy != "recompute":
            log.warning(
                "kv_load_failure_policy is %r: a load kvd cannot serve fails its request; "
                "set it to 'recompute' to recompute the blocks instead",
                policy,
            )

    # -- the scheduler side ------------------------------------------------------

    def _kvd_manager(self) -> KvdOffloadingManager | None:
        manager = self.connector_scheduler.manager if self.connector_scheduler else None
        return manager if isinstance(manager, KvdOffloadingManager) else None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output)
        manager = self._kvd_manager()
        if manager is None or not isinstance(meta, OffloadingConnectorMetadata):
            return meta
        return KvdConnectorMetadata(
            load_jobs=meta.load_jobs,
            store_jobs=meta.store_jobs,
            jobs_to_flush=meta.jobs_to_flush,
            kvd=manager.step_notes(),
        )

    def update_connector_output(self, connector_output: Any) -> None:
        meta = connector_output.kv_connector_worker_meta
        manager = self._kvd_manager()
        if manager is not None and isinstance(meta, KvdWorkerMetadata) and meta.copies:
            manager.on_copies(meta.copies)  # before vLLM's completions of the same jobs
        super().update_connector_output(connector_output)

    # -- the worker side ---------------------------------------------------------

    def _kvd_worker(self) -> KvdOffloadingWorker | IdleWorker | None:
        worker = self.connector_worker.worker if self.connector_worker is not None else None
        return worker if isinstance(worker, KvdOffloadingWorker | IdleWorker) else None

    def _note(self, meta: Any) -> None:
        worker = self._kvd_worker()
        if worker is not None and isinstance(meta, KvdConnectorMetadata):
            worker.note(meta.kvd)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        worker = self._kvd_worker()
        if worker is not None:
            worker.reports_load_errors = True

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._note(kv_connector_metadata)  # it may start the deferred stores
        super().handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._note(self._connector_metadata)
        super().start_load_kv(forward_context, **kwargs)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        meta = super().build_connector_worker_meta()
        worker = self._kvd_worker()
        copies = worker.take_copies() if worker is not None else {}
        if meta is None and not copies:
            return None
        if meta is not None and not isinstance(meta, OffloadingWorkerMetadata):
            return meta
        # Always kvd's type, so that every worker's aggregates with every other's.
        base = meta if meta is not None else OffloadingWorkerMetadata()
        return KvdWorkerMetadata(
            base.completed_jobs,
            base.transfer_stats,
            {token: (1, copied) for token, copied in copies.items()},
        )

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """vLLM's, and in an engine of several groups the requests of the loads kvd
        could not serve as `failed_recving` (they are in `finished_recving` too, as
        vLLM wants: the worker reports every job done): vLLM recomputes them."""
        worker = self._kvd_worker()
        # vLLM pops the jobs it reports; the worker settles each job's failure when
        # vLLM's get_finished reports it, so the failures are taken after.
        jobs = dict(self.connector_worker._load_jobs) if self.connector_worker is not None else {}
        results = super().get_transfer_results(finished_req_ids)
        failed = worker.take_failed_loads() if worker is not None else set()
        requests = {jobs[job] for job in failed if job in jobs}
        if self._failed_per_request:
            results.failed_recving |= requests
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        worker = self._kvd_worker()
        blocks = worker.take_load_errors() if worker is not None else set()
        return set() if self._failed_per_request else blocks
