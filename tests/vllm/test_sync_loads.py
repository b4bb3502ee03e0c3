"""Runs in the test process: vLLM 0.33's sync loads (`sync_load_budget_bytes`) and kvd.

vLLM 0.33 can load a hit within the step that runs its request (`expedited`
loads). kvd serves them where vLLM can be told that one failed (one KV cache
group: `invalid_block_ids` of a running request) and refuses the key, with
one line at start, where it cannot (several groups). The connector is built
on vLLM's own `__init__` replaced, since a real one needs an engine: what is
checked is only what kvd's `__init__` tells the spec.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec

from kvd_client.vllm import connector as kvd_connector


def extra_config_after_init(
    monkeypatch: pytest.MonkeyPatch, groups: int, **extra: Any
) -> dict[str, Any]:
    """The extra config kvd's connector hands vLLM's, for an engine of `groups`."""
    monkeypatch.setattr(kvd_connector, "weights_fingerprint", lambda _config: "weights")
    monkeypatch.setattr(  # the groups' specs are not built here
        kvd_connector, "describe_groups", lambda c: [["full_attention", 32, None]] * groups
    )
    monkeypatch.setattr(OffloadingConnector, "__init__", lambda *_args: None)
    config: dict[str, Any] = dict(extra)
    transfer = SimpleNamespace(kv_connector_extra_config=config,
                               kv_load_failure_policy="recompute")  # fmt: skip
    full = FullAttentionSpec(16, num_kv_heads=1, head_size=64, dtype=torch.float16)
    sliding = SlidingWindowSpec(16, num_kv_heads=1, head_size=64, dtype=torch.float16,
                                sliding_window=64)  # fmt: skip
    specs = [full, sliding][:groups]
    kv_cache_config = SimpleNamespace(
        kv_cache_groups=[KVCacheGroupSpec([f"layer.{i}"], spec) for i, spec in enumerate(specs)]
    )
    kvd_connector.KvdOffloadingConnector(
        SimpleNamespace(kv_transfer_config=transfer), KVConnectorRole.SCHEDULER, kv_cache_config
    )
    return config


def test_sync_loads_of_several_groups_are_refused_at_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    extra = extra_config_after_init(monkeypatch, 2, sync_load_budget_bytes=1 << 20)
    assert extra["kvd_connector"] is True
    assert "sync_load_budget_bytes" in extra["kvd_refuse"]  # kvd off, with one line


@pytest.mark.parametrize("budget", [0, 1 << 20])
def test_one_group_serves_sync_loads(monkeypatch: pytest.MonkeyPatch, budget: int) -> None:
    extra = extra_config_after_init(monkeypatch, 1, sync_load_budget_bytes=budget)
    assert extra["kvd_connector"] is True and "kvd_refuse" not in extra
