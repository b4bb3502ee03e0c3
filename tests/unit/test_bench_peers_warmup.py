"""Runs in the test process: `kvd bench peers`' new engines answer a warm-up request
before their rows, and the warm-up is counted in none of them.

The engines here are stand-ins that record what they were asked (the order of
requests is the subject, not vLLM); the peers quick test
(tests/integration/test_bench_quick.py) runs the same code on real engines.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from kvd_tools.bench import peers
from kvd_tools.bench.peers_rows import Workload


class Recorder:
    """Answers each request as the harness's engine does; keeps the prompts asked."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.prompts: list[list[int]] = []

    def ask(self, cmd: dict[str, Any], timeout: float = 600) -> Any:
        if cmd.get("metrics"):
            return {"metrics": {}}
        (prompt,) = cmd["prompts"]
        self.prompts.append(prompt)
        n = cmd["max_tokens"]
        return {"tokens": [[1] * n], "timings": [[0.01, 0.005 if n > 1 else None, 0.004, 0.005]],
                "seconds": 0.02, "logprobs": [[[[1, -0.1]]] * n]}  # fmt: skip


def test_each_new_engine_is_warmed_up_before_its_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[Recorder] = []

    @contextlib.contextmanager
    def engine(srv: Any, model: str, **config: Any) -> Iterator[Recorder]:
        started.append(Recorder(config))
        yield started[-1]

    monkeypatch.setattr(peers, "engine", engine)
    monkeypatch.setattr(peers.os, "sched_getaffinity", lambda pid: {3, 0, 1, 2})
    args = SimpleNamespace(system_tokens=64, conversations=2, turns=2, user_tokens=32,
                           reply_tokens=32, prompt_tokens=[256], decode_samples=1,
                           trace_block_tokens=4, gpu_blocks=24, model="llama", max_tokens=2,
                           trace_max_tokens=2)  # fmt: skip
    work = Workload.draw(args, 1000, seed=3)
    got = peers.second_engine(0, "none", peers.Serving({"kvd": None}), work, args, "model")

    assert len(started) == 2, "a new engine, then a third beside it"
    new, third = started
    warmup = work.warmup[::-1]
    # The two engines of two_engines on CPUs of their own (vLLM's automatic
    # binding would put both engines' forward passes on the same core).
    assert (new.config["cores"], third.config["cores"]) == ("0,1", "2,3")
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
