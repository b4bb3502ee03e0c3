"""Runs in vLLM's processes: kvd as a vLLM 0.32 offloading spec (SPEC section 12).

    --kv-transfer-config '{"kv_connector": "KvdOffloadingConnector",
      "kv_connector_module_path": "kvd_client.vllm", "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"spec_name": "KvdOffloadingSpec",
        "spec_module_path": "kvd_client.vllm"}}'

`KvdOffloadingSpec.get_manager()` runs in vLLM's scheduler process over kvd's
index verbs (`manager`); `get_worker()` in each TP worker, copying between
vLLM's canonical KV tensors and the worker's slots of the pool (`worker`,
through `copies`). `KvdOffloadingConnector` is vLLM's `OffloadingConnector`
plus the report of loads kvd could not serve (`connector`); vLLM's plain
connector also runs the spec, but cannot recompute such a load. `import
kvd_client` never imports this package, nor vLLM; this package imports vLLM
only when vLLM asks it for a class (`getattr`, as vLLM loads them), so
`kvd_client.vllm.copies` runs where vLLM is not installed (`tests/gpu/`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvdOffloadingConnector", "KvdOffloadingSpec"]


def __getattr__(name: str) -> Any:
    if name == "KvdOffloadingConnector":
        from kvd_client.vllm.connector import KvdOffloadingConnector

        return KvdOffloadingConnector
    if name == "KvdOffloadingSpec":
        from kvd_client.vllm.spec import KvdOffloadingSpec

        return KvdOffloadingSpec
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
