"""Runs in the test process: the vLLM soak's short form (`kvd bench soak --vllm`, issue 24).

Two real vLLM engines on one small pool, a daemon with a Redis remote tier,
every fault kind once (SIGKILL with warm and cold restarts, a stall past a
lease, a Redis stall, vLLM's connector reset, an engine restart, evictions by
the other engine, the longest prompt, aborted requests); every answer checked
against vLLM without a connector. KVD_VLLM_SOAK_SECONDS sets the length
(default 90: each kind once, then a few at random).
"""

from __future__ import annotations

import os

import pytest

from kvd_tools.redis_launcher import available as redis_available
from kvd_tools.vllm_harness.soak import VllmSoakConfig, run_vllm_soak
from kvd_tools.vllm_harness.vllm_faults import Fault

SECONDS = float(os.environ.get("KVD_VLLM_SOAK_SECONDS", "90"))


@pytest.mark.slow
def test_two_vllm_engines_under_every_fault_answer_as_vllm_alone() -> None:
    # Nine kinds, one every 3 to 6 s: each once within 54 s, engines' faults to an
    # engine that is not starting again.
    result = run_vllm_soak(VllmSoakConfig(seconds=SECONDS, period_s=(3.0, 6.0)))
    print(f"\nvllm soak: {result.row()}")
    assert result.violations == [], "\n".join(result.violations[:10])
    kinds = {f for f in Fault if redis_available() or f != Fault.REMOTE_STALL}
    assert kinds <= set(result.faults_by_kind), result.faults_by_kind
    assert result.requests >= 40
    assert result.loaded_blocks > 0  # kvd served prefixes in between the faults
    assert result.vllm_loaded_bytes > 0  # and vLLM's connector did copy them in
    assert result.drained
    assert result.max_request_s <= result.request_bound_s
