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
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)

from kvd_client.vllm import connector as kvd_connector


def extra_config_after_init(
    monkeypatch: pytest.MonkeyPatch, groups: int, **extra: Any
) -> dict[str, Any]:
    """The extra config kvd's connector hands vLLM's, for an engine of `groups`."""
    monkeypatch.setattr(kvd_connector, "weights_fingerprint", lambda _config: "weights")
    monkeypatch.setattr(OffloadingConnector, "__init__", lambda *_args: None)
    transfer = SimpleNamespace(kv_connector_extra_config=dict(extra),
                               kv_load_failure_policy="recompute")  # fmt: skip
    kv_cache_config = SimpleNamespace(kv_cache_groups=[object()] * groups)
    kvd_connector.KvdOffloadingConnector(
        SimpleNamespace(kv_transfer_config=transfer), KVConnectorRole.SCHEDULER, kv_cache_config
    )
    return transfer.kv_connector_extra_config


def test_sync_loads_of_several_groups_are_refused_at_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    extra = extra_config_after_init(monkeypatch, 2, sync_load_budget_bytes=1 << 20)
    assert extra["kvd_connector"] is True
    assert extra.get("kvd_refuse")  # kvd is off for the engine, with one line


@pytest.mark.parametrize("budget", [0, 1 << 20])
def test_one_group_serves_sync_loads(monkeypatch: pytest.MonkeyPatch, budget: int) -> None:
    extra = extra_config_after_init(monkeypatch, 1, sync_load_budget_bytes=budget)
    assert extra["kvd_connector"] is True and "kvd_refuse" not in extra
