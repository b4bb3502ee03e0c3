"""Runs in the test process: `kvd bench peers`' storing prefill is `--samples`
fresh prompts a length, each a miss, the same for every system.

The engine is a stand-in that records what it was asked (`peers_engine`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from kvd_tools.bench import peers
from kvd_tools.bench.peers_rows import Workload
from tests.unit.peers_engine import Recorder

ARGS = dict(system_tokens=64, conversations=2, turns=2, user_tokens=32, reply_tokens=32,
            prompt_tokens=[256, 512], decode_samples=1, decode_engines=1,
            trace_block_tokens=4)  # fmt: skip


def test_more_samples_add_store_prompts_and_leave_the_rest_of_the_round_alone() -> None:
    one = Workload.draw(SimpleNamespace(**ARGS, samples=1), 1000, seed=5)
    three = Workload.draw(SimpleNamespace(**ARGS, samples=3), 1000, seed=5)
    assert one.stores == {256: [], 512: []}
    for n in (256, 512):
        assert len(three.stores[n]) == 2 and all(len(q) == n for q in three.stores[n])
        assert three.ttft[n] not in three.stores[n], "fresh prompts, not the cached one"
    # Drawn after everything else: the other prompts of a seed do not move.
    for name in ("ttft", "decode", "warmup", "chat", "chat2", "trace"):
        assert getattr(one, name) == getattr(three, name), name


@pytest.mark.parametrize("system", ["kvd", "none"])
def test_the_storing_prefill_is_a_sample_per_fresh_prompt(
    system: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = Recorder()

    @contextlib.contextmanager
    def engine(srv: Any, model: str, **config: Any) -> Iterator[Recorder]:
        yield recorder

    monkeypatch.setattr(peers, "engine", engine)
    monkeypatch.setattr(peers, "settle", lambda proc, prompt: None)
    monkeypatch.setattr(peers, "hits", lambda proc, above=None, wait_s=3.0: 0.0)
    args = SimpleNamespace(**ARGS, samples=3, decode_tokens=2)
    work = Workload.draw(args, 1000, seed=5)
    got = peers.first_engine(0, system, peers.Serving({"kvd": None}), work, args, "model")  # type: ignore[arg-type]

    stores = {s.prompt_tokens: s for s in got if s.measure == "ttft_store"}
    for n in (256, 512):
        assert len(stores[n].tokens) == 3, "one sample per storing prefill"
        first = recorder.prompts.index(work.stores[n][0])
        # The fresh prompts, then the length's own prompt: its store (a cache) or its
        # first recompute (no connector), the last of the samples.
        assert recorder.prompts[first : first + 3] == [*work.stores[n], work.ttft[n]]
    # The median of three different TTFTs, not the first request's.
    asked = [recorder.prompts.index(q) + 1 for q in [*work.stores[256], work.ttft[256]]]
    assert stores[256].ttft_ms == pytest.approx(sorted(asked)[1])
