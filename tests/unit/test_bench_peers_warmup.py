"""Runs in the test process: `kvd bench peers`' new engines answer a warm-up request
before their rows, and the warm-up is counted in none of them.

The engines here are stand-ins that record what they were asked (`peers_engine`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from kvd_tools.bench import peers
from kvd_tools.bench.peers_rows import Workload
from kvd_tools.bench.suites import SuiteError
from tests.unit.peers_engine import Recorder


def test_each_new_engine_is_warmed_up_before_its_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[Recorder] = []

    @contextlib.contextmanager
    def engine(srv: Any, model: str, **config: Any) -> Iterator[Recorder]:
        started.append(Recorder(config))
        yield started[-1]

    monkeypatch.setattr(peers, "engine", engine)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 0, 1, 2})
    args = SimpleNamespace(system_tokens=64, conversations=2, turns=2, user_tokens=32,
                           reply_tokens=32, prompt_tokens=[256], decode_samples=1, decode_engines=1,
                           trace_block_tokens=4, gpu_blocks=24, model="llama", max_tokens=2,
                           trace_max_tokens=2, samples=1)  # fmt: skip
    work = Workload.draw(args, 1000, seed=3)
    got = peers.second_engine(0, "none", peers.Serving({"kvd": None}), work, args, "model")  # type: ignore[arg-type]

    assert len(started) == 2, "a new engine, then a third beside it"
    new, third = started
    warmup = work.warmup[::-1]
    # The two engines of two_engines on CPUs of their own (vLLM's automatic
    # binding would put both engines' forward passes on the same core).
    assert (new.config["cores"], third.config["cores"]) == ("0,1", "2,3")
    # ... and every thread of each (vLLM's engine core spins on a floating CPU).
    assert (new.pinned, third.pinned) == ({0, 1}, {2, 3})
    assert new.prompts[:2] == [warmup, work.ttft[256]], (
        "the new engine's first row after one warm-up"
    )
    assert third.prompts[0] == warmup, "the third engine answers a warm-up before two_engines"
    assert third.prompts[1:] == [q for e, q in work.chat2 if e == 1]
    two = next(s for s in got if s.measure == "two_engines")
    assert len(two.tokens) == len(work.chat2), "the warm-up is not one of the row's requests"
    first = next(s for s in got if s.measure == "ttft_new_engine")
    assert len(first.tokens) == 1


def test_two_engines_split_the_cpus_and_one_cpu_is_left_to_vllm() -> None:
    assert peers.halves([0, 1]) == ("0", "1")
    assert peers.halves([2, 5, 7]) == ("2", "5,7")
    assert peers.halves([0]) == (None, None)


def test_an_engine_bound_to_cores_keeps_its_systems_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`engine(cores=...)` adds vLLM's binding to the system's environment (LMCache's
    engines keep theirs) and leaves it alone without cores; a TP engine is refused
    (vLLM wants one CPU list a rank)."""
    envs: list[dict[str, str] | None] = []
    stopped: list[bool] = []

    class Started:
        def __init__(self, config: dict[str, Any], *, env: Any = None, python: Any = None) -> None:
            envs.append(env)

        def stop(self) -> None:
            stopped.append(True)

    monkeypatch.setattr(peers, "EngineProcess", Started)
    srv = peers.Serving({"kvd": None}, None, {"LMCACHE_TRACK_USAGE": "false"})
    with peers.engine(srv, "model", cores="1") as bound:
        assert isinstance(bound, Started) and not stopped
    with peers.engine(srv, "model") as unbound:
        assert isinstance(unbound, Started)
    assert stopped == [True, True], "each engine stopped when its block ends"
    assert envs == [
        {"LMCACHE_TRACK_USAGE": "false", "VLLM_CPU_OMP_THREADS_BIND": "1"},
        {"LMCACHE_TRACK_USAGE": "false"},
    ]
    assert srv.env == {"LMCACHE_TRACK_USAGE": "false"}
    with pytest.raises(SuiteError, match="one-rank"), peers.engine(srv, "m", cores="0", tp=2):
        raise AssertionError("a TP engine bound to one CPU list was started")


def test_the_harness_times_a_request_from_vllms_timestamps() -> None:
    """[TTFT, seconds a later token, queued to scheduled, scheduled to first token]."""
    from kvd_tools.vllm_harness.engine import _timings

    stats = SimpleNamespace(first_token_latency=0.05, num_generation_tokens=3, queued_ts=10.0,
                            scheduled_ts=10.01, first_token_ts=10.04, last_token_ts=10.06)  # fmt: skip
    first, step, wait, forward = _timings(SimpleNamespace(metrics=stats))
    assert (first, round(step or 0, 6), round(wait or 0, 6), round(forward or 0, 6)) == (
        0.05,
        0.01,
        0.01,
        0.03,
    )
    assert _timings(SimpleNamespace(metrics=None)) == [None, None, None, None]
