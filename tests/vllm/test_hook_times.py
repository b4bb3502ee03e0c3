"""Runs in the test process: `kvd bench peers --hook-times`' table, written only between hooks.

A dump inside a copy (`submit_load` runs inside `start_load_kv`) would add
the file write to the outer hook's time; this checks that every dump
happens with no hook running, and that the table it writes adds up.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvd_tools.vllm_harness import hook_times


def test_dumps_happen_between_hooks_and_count_every_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(hook_times.ENV, str(tmp_path))
    monkeypatch.setattr(hook_times, "_table", {})
    monkeypatch.setattr(hook_times, "_calls", [0])
    # 5 does not divide a step's 4 calls: the 5th call is a copy inside a hook.
    monkeypatch.setattr(hook_times, "DUMP_EVERY", 5)
    depths: list[int] = []
    real_dump = hook_times._dump

    def dump() -> None:
        depths.append(hook_times._depth[0])
        real_dump()

    monkeypatch.setattr(hook_times, "_dump", dump)
    inner = hook_times._timed("submit_load", lambda: None)
    outer = hook_times._timed("start_load_kv", lambda: [inner() for _ in range(3)])
    steps = 10  # 40 calls: several dumps are due
    for _ in range(steps):
        outer()
    assert depths and set(depths) == {0}  # never inside `start_load_kv`
    assert hook_times._depth[0] == 0
    table = json.loads(next(tmp_path.glob("*.json")).read_text())
    written = sum(calls for calls, *_ in table.values())
    assert written <= 4 * steps and written % 4 == 0  # whole steps: dumped between them
    assert hook_times._table["submit_load"][0] == 3 * steps
    assert hook_times._table["start_load_kv"][0] == steps


def test_report_names_the_longest_call_beside_the_means(tmp_path: Path) -> None:
    # 10 steps of build_connector_meta: nine of 1 ms and one of 50 ms (a mean of 5.9 ms)
    table = {
        "build_connector_meta": [10, 0.059, 0.050],
        "update_connector_output": [10, 0.002, 0.0004],
    }
    (tmp_path / "123.json").write_text(json.dumps(table))
    (line,) = hook_times.report(tmp_path)
    assert line.startswith("scheduler (pid 123, 10 steps): 6100 us a step")
    assert "longest calls (ms): build_connector_meta 50.00, update_connector_output 0.40" in line
    # A table written before the longest call was kept still reads.
    (tmp_path / "123.json").write_text(json.dumps({"build_connector_meta": [10, 0.059]}))
    (line,) = hook_times.report(tmp_path)
    assert "longest" not in line and "5900 us a step" in line
