"""Runs in vLLM's processes, for the tests only: kvd's connector with every load zeroed.

The check that a comparison against vLLM without kvd can fail: an engine
whose `kv_connector_module_path` names this module (`corrupt_loads` in the
harness engine's config) gets kvd's connector and spec unchanged, except
that the worker, after each load's copy (it waits for it), writes zeros over the device pages
it loaded, as a block marked ready before its bytes were written would be
served. Importing it patches `KvdOffloadingWorker` in the importing process:
vLLM imports the connector's module in its scheduler process and in every
TP worker, before any load. Nothing outside the harness imports it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kvd_client.vllm import KvdOffloadingConnector, KvdOffloadingSpec
from kvd_client.vllm.worker import KvdOffloadingWorker

__all__ = ["KvdOffloadingConnector", "KvdOffloadingSpec"]
log = logging.getLogger("kvd_tools.vllm_harness")
_submit_load = KvdOffloadingWorker.submit_load


def _zeroed_load(
    self: KvdOffloadingWorker, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False
) -> bool:
    done = _submit_load(self, job_id, src_spec, dst_spec, expedited)
    self.wait({job_id})  # the copy is asynchronous: zero what it brought once it is in
    ids = torch.from_numpy(dst_spec.block_ids.astype("int64"))
    if len(ids):
        log.warning("kvd test harness: load job %d: %d pages zeroed", job_id, len(ids))
    for device in self._copies.tensors:  # per KV tensor, a (num_blocks, page_bytes) int8 view
        device.index_fill_(0, ids.to(device.device), 0)
    return done


if getattr(KvdOffloadingWorker.submit_load, "__name__", "") != "_zeroed_load":
    KvdOffloadingWorker.submit_load = _zeroed_load  # type: ignore[method-assign]
