"""Runs in the test process: `kvd bench peers`' decode step is timed on every
system's engines at once, asked in turn, each engine its own prompts.

The engines are stand-ins that record what they were asked (`peers_engine`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvd_tools.bench import peers
from kvd_tools.bench.peers_rows import DECODE_PROMPT_TOKENS, Workload, percentile
from kvd_tools.vllm_harness.engine import BLOCK_SIZE
from tests.unit.peers_engine import Recorder

ARGS = dict(system_tokens=64, conversations=2, turns=2, user_tokens=32, reply_tokens=32,
            prompt_tokens=[256], samples=1, trace_block_tokens=4, decode_samples=3,
            decode_tokens=4, gpu_blocks=24, model="llama", step_times=None)  # fmt: skip


class Stepper(Recorder):
    """A recorder whose decode step is its own (`step_s`), and that notes, in one
    log shared by all, which engine each request went to."""

    def __init__(self, name: str, step_s: float, log: list[str]) -> None:
        super().__init__()
        self.name, self.step_s, self.log = name, step_s, log

    def ask(self, cmd: dict[str, Any], timeout: float = 600) -> Any:
        reply = super().ask(cmd, timeout)
        if not cmd.get("metrics"):
            self.log.append(self.name)
            reply["timings"][0][1] = self.step_s
        return reply


def test_every_systems_engines_are_asked_in_turn_and_each_system_gets_its_own_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    log: list[str] = []
    started: list[Stepper] = []
    steps = {"kvd": [0.006, 0.008], "none": [0.005, 0.007]}
    served: list[str] = []

    @contextlib.contextmanager
    def serving(system: str, args: Any, venv: Path) -> Iterator[peers.Serving]:
        served.append(system)
        yield peers.Serving({"kvd": None}, env={"system": system})

    @contextlib.contextmanager
    def engine(srv: peers.Serving, model: str, **config: Any) -> Iterator[Stepper]:
        assert srv.env is not None
        system = srv.env["system"]
        assert served[-1] == system, "an engine starts while its own system serves"
        k = sum(e.name.startswith(system) for e in started)
        proc = Stepper(f"{system}{k}", steps[system][k], log)
        # Room for the prompt and its tokens, in a small cache.
        assert config["max_model_len"] >= DECODE_PROMPT_TOKENS + 4
        assert config["num_gpu_blocks"] * BLOCK_SIZE >= config["max_model_len"]
        started.append(proc)
        yield proc

    monkeypatch.setattr(peers, "serving", serving)
    monkeypatch.setattr(peers, "engine", engine)
    monkeypatch.setattr(peers, "hits", lambda proc, above=None, wait_s=3.0: 0.0)
    monkeypatch.setattr(peers, "QUIET_S", 0.0)
    args = SimpleNamespace(**ARGS, decode_engines=2)
    work = Workload.draw(args, 1000, seed=3)
    got = peers.decode_engines(0, ["kvd", "none"], work, args, Path("venv"), "model")  # type: ignore[arg-type]

    # Warm-ups, then each prompt to all four engines, the first rotating.
    asked = log[4:]
    assert asked == ["kvd0", "kvd1", "none0", "none1",
                     "kvd1", "none0", "none1", "kvd0",
                     "none0", "none1", "kvd0", "kvd1"]  # fmt: skip
    # The j-th engine of each system its own run of prompts, the same for every system.
    runs = [work.decode[:3], work.decode[3:]]
    assert len(work.decode) == 6 and runs[0] != runs[1]
    for n, proc in enumerate(started):
        assert proc.prompts[1:] == runs[n % 2], "an engine's own prompts, in order"
    by = {s.system: s for s in got}
    assert [s.measure for s in got] == ["decode_step", "decode_step"]
    # The median of a system's requests on both its engines, no other system's.
    for system, (a, b) in steps.items():
        expect = percentile([a] * 3 + [b] * 3, 0.5) * 1e3
        assert by[system].step_ms == pytest.approx(expect)
    assert by["kvd"].step_ms != by["none"].step_ms
    assert len(by["kvd"].tokens) == 6 and by["kvd"].hit_rate == 0.0

    # The next round starts the systems' engines in another order (none's first),
    # each engine still its own run of prompts and each system its own steps.
    started.clear()
    log.clear()
    got = peers.decode_engines(1, ["kvd", "none"], work, args, Path("venv"), "model")  # type: ignore[arg-type]
    assert [e.name for e in started] == ["none0", "none1", "kvd0", "kvd1"]
    for n, proc in enumerate(started):
        assert proc.prompts[1:] == runs[n % 2], "an engine's own prompts, in order"
    by = {s.system: s for s in got}
    for system, (a, b) in steps.items():
        expect = percentile([a] * 3 + [b] * 3, 0.5) * 1e3
        assert by[system].step_ms == pytest.approx(expect)
