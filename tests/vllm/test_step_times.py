"""Runs in the test process: `kvd bench peers --step-times` in a real vLLM engine.

An engine with kvd's connector and no daemon (the bench's `kvd-off`), started
with `step_env`: every process of it times its part of each step, and the
report has the engine core's step, the forward pass and kvd's hooks.
"""

from __future__ import annotations

import time
from pathlib import Path

from kvd_tools.bench.peers import step_env
from kvd_tools.vllm_harness import step_times
from kvd_tools.vllm_harness.driver import EngineProcess
from kvd_tools.vllm_harness.engine import write_model


def test_every_process_of_an_engine_times_its_part_of_each_step(tmp_path: Path) -> None:
    model = write_model(tmp_path / "tiny-llama")
    where = tmp_path / "steps"
    where.mkdir()
    nowhere = tmp_path / "no-daemon.sock"
    kvd = {"kvd_endpoint": f"ipc://{nowhere}", "kvd_pool": "steps", "kvd_capacity_bytes": 1 << 26}
    env = step_env(where, "kvd-off")
    assert env is not None
    env[step_times.EVERY_ENV] = "0.5"
    proc = EngineProcess({"model": model, "kvd": kvd}, env=env)
    try:
        out = proc.generate([[(i * 7) % 500 + 3 for i in range(64)]], max_tokens=16)
        assert len(out[0]) == 16
        time.sleep(2.0)  # a dump or more after the last step
    finally:
        proc.stop()
    processes = {p.name for p in where.glob("*.json")}
    assert len(processes) >= 2, f"the engine core and the worker each write: {processes}"
    header, *rows = step_times.report(where)
    assert header.split()[-1] == "kvd-off"
    cells = {row.rsplit(None, 1)[0].strip(): row.rsplit(None, 1)[1] for row in rows}
    for part in ("engine core: one step", "scheduler: schedule", "worker: forward pass",
                 "KvdOffloadingConnector.build_connector_meta",
                 "OffloadingConnector.build_connector_meta",
                 "KvdOffloadingConnector.start_load_kv"):  # fmt: skip
        assert float(cells[part]) > 0, (part, rows)
    # A step holds its forward pass.
    assert float(cells["engine core: one step"]) > float(cells["worker: forward pass"])
