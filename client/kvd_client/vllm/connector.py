"""Runs in vLLM's processes: `KvdOffloadingConnector`, which reports the loads kvd could not serve.

vLLM's own connector asserts that every transfer succeeded and has no way to
say that a load was not served. kvd's worker never fails a transfer; a load
it cannot serve leaves its device blocks in the worker's `load_errors`, and
this connector hands them to vLLM (`get_block_ids_with_load_errors`), whose
scheduler recomputes them when `kv_load_failure_policy` is "recompute" (the
README's command sets it; with vLLM's default "fail" the request fails with
an error instead, and a warning at start says so). It also names the engine's weights
(revision, quantization, overrides) in the default pool name, which vLLM's
offloading config leaves out, and turns offloading off for an engine with
several KV cache groups, whose failed loads vLLM cannot take block by block.
Everything else is vLLM's connector unchanged. Load it with `kv_connector_module_path`:

    {"kv_connector": "KvdOffloadingConnector",
     "kv_connector_module_path": "kvd_client.vllm.connector",
     "kv_load_failure_policy": "recompute", ...}
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)

from kvd_client.vllm.worker import IdleWorker, KvdOffloadingWorker

log = logging.getLogger("kvd_client.vllm")


def weights_fingerprint(vllm_config: Any) -> str:
    """What, beyond the model's name, makes two engines' KV differ: revision,
    quantization, overrides, and for dummy weights the seed they are drawn from."""
    model, load = vllm_config.model_config, vllm_config.load_config
    overrides = model.hf_overrides  # a dict, or a function: named, never by address
    parts = [
        str(model.revision),
        str(model.quantization),
        json.dumps(overrides, sort_keys=True, default=str)
        if isinstance(overrides, dict)
        else getattr(overrides, "__qualname__", type(overrides).__name__),
        str(load.load_format),
    ]
    if str(load.load_format) == "dummy":
        parts.append(f"seed={model.seed}")
    return ";".join(parts)


class KvdOffloadingConnector(OffloadingConnector):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        extra.setdefault("kvd_weights", weights_fingerprint(vllm_config))
        groups = len(kv_cache_config.kv_cache_groups)
        if groups > 1:  # vLLM cannot map failed blocks back to requests then
            extra["kvd_refuse"] = (
                f"{groups} KV cache groups in the engine (vLLM takes failed loads "
                "block by block only from engines with one)"
            )
        super().__init__(vllm_config, role, kv_cache_config)
        policy = vllm_config.kv_transfer_config.kv_load_failure_policy
        if role == KVConnectorRole.SCHEDULER and policy != "recompute":
            log.warning(
                "kv_load_failure_policy is %r: a load kvd cannot serve fails its request; "
                "set it to 'recompute' to recompute the blocks instead",
                policy,
            )

    def _kvd_worker(self) -> KvdOffloadingWorker | IdleWorker | None:
        worker = self.connector_worker.worker if self.connector_worker is not None else None
        return worker if isinstance(worker, KvdOffloadingWorker | IdleWorker) else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        worker = self._kvd_worker()
        if worker is not None:
            worker.reports_load_errors = True

    def get_block_ids_with_load_errors(self) -> set[int]:
        worker = self._kvd_worker()
        return worker.take_load_errors() if worker is not None else set()
