"""Runs in vLLM's processes: `KvdOffloadingSpec`, the entry point vLLM loads (SPEC section 12).

vLLM builds one spec in its scheduler process (`get_manager`) and one in each
TP worker (`get_worker`). Extra-config keys: `kvd_endpoint` (default
`KVD_ENDPOINT`, then the default runtime dir), `kvd_pool` (default derived,
`kvd_client.vllm.pool`), `kvd_capacity_bytes` (the pool's size when this
engine creates it). A pool whose layout does not match, or a KV cache kvd
cannot hold, is one log line and offloading off for this engine. Engines
of several KV cache groups (hybrid models) are served, each group looked
up by its kind (`kvd_client.vllm.groups`), and so are offload blocks of
several device blocks (vLLM's `block_size` or `blocks_per_chunk` extra
key: a kvd block is then one chunk).
`kvd_ready_table` (default true): look up from the pool's ready table where
it can be mapped; false: every lookup is a round trip that also pins.
`kvd_copies` (CPU workers): "sync" (the default) copies inside `submit_*`,
"thread" on a thread of its own (`kvd_client.vllm.copies`; CUDA workers copy
on side streams either way).
kvd runs only under `KvdOffloadingConnector` (it sets `kvd_connector`):
under vLLM's plain `OffloadingConnector` a load kvd could not serve would be
computed on as if loaded, so there kvd is off, with one log line.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from kvd_client.errors import KvdError
from kvd_client.scheduler import Scheduler
from kvd_client.settings import ClientSettings
from kvd_client.vllm.copies import CPU_MODES, DEFAULT_CPU_MODE
from kvd_client.vllm.groups import window_groups
from kvd_client.vllm.manager import KvdOffloadingManager
from kvd_client.vllm.metrics import metric_definitions
from kvd_client.vllm.pool import choose_pool
from kvd_client.vllm.worker import IdleWorker, KvdOffloadingWorker

log = logging.getLogger("kvd_client.vllm")
LOOKUP_TIMEOUT_MS = 500  # the scheduler waits at most this on a stalled daemon


class KvdOffloadingSpec(OffloadingSpec):
    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        return metric_definitions()

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        self.replicated_layout = bool(config.replicated_layout)
        self.choice = choose_pool(config)
        self.endpoint = self.choice.endpoint or ClientSettings.from_env().endpoint
        self._manager: KvdOffloadingManager | None = None
        self._worker: OffloadingWorker | None = None

    def _refusal(self) -> str | None:
        """Why kvd cannot hold this engine's KV, or None; the same answer in the
        scheduler and in every worker, since all read the same config."""
        if not self.extra_config.get("kvd_connector"):  # set by KvdOffloadingConnector
            return (
                "vLLM's plain OffloadingConnector cannot recompute a load kvd could not "
                "serve; set kv_connector to KvdOffloadingConnector and "
                "kv_connector_module_path to kvd_client.vllm (README, Use with vLLM)"
            )
        if self.extra_config.get("kvd_refuse"):
            return str(self.extra_config["kvd_refuse"])  # set by KvdOffloadingConnector
        if self.config.canonical_layout:
            return "the canonical host layout (kvd stores each worker's pages)"
        return None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            scheduler = None
            refusal = self._refusal()
            if refusal is not None:
                log.warning("kvd offloading off for this engine: %s", refusal)
            else:
                try:
                    scheduler = Scheduler(
                        self.choice.name,
                        self.choice.layout,
                        engine_id=self.config.engine_id,
                        endpoint=self.endpoint,
                        capacity_bytes=self.choice.capacity_bytes,
                        timeout_ms=LOOKUP_TIMEOUT_MS,
                        use_table=bool(self.extra_config.get("kvd_ready_table", True)),
                    )
                except KvdError as exc:
                    log.warning(
                        "kvd offloading off for this engine: pool %r: %s", self.choice.name, exc
                    )
            layout = self.choice.layout
            self._manager = KvdOffloadingManager(
                scheduler,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                writers=1 if layout.replicated else layout.world_size,
                window_groups=window_groups(layout.groups),
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            refusal = self._refusal()
            if refusal is not None:  # the manager is off too: no job comes
                log.warning("kvd offloading off for worker rank %d: %s", self.config.parallel.rank,
                            refusal)  # fmt: skip
                self._worker = IdleWorker()
                return self._worker
            copies = str(self.extra_config.get("kvd_copies", DEFAULT_CPU_MODE))
            if copies not in CPU_MODES:
                log.warning("kvd_copies %r is not one of %s: %s", copies, CPU_MODES,
                            DEFAULT_CPU_MODE)  # fmt: skip
                copies = DEFAULT_CPU_MODE
            self._worker = KvdOffloadingWorker(
                kv_caches,
                endpoint=self.endpoint,
                pool=self.choice.name,
                layout=self.choice.layout,
                engine_id=self.config.engine_id,
                rank=self.config.parallel.rank,
                capacity_bytes=self.choice.capacity_bytes,
                blocks_per_chunk=self.blocks_per_chunk,
                copies=copies,
            )
        return self._worker
