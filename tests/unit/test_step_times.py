"""Runs in the test process: `step_times` wraps the parts it names, and its report
puts each system's median call side by side."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from kvd_tools.vllm_harness import step_times


def _scheduler_module() -> types.ModuleType:
    """A module named as vLLM's scheduler's, whose class has the methods `TIMED` names."""
    module = types.ModuleType("vllm.v1.core.sched.scheduler")

    class Scheduler:
        def schedule(self, n: int) -> int:
            return n + 1

        def update_from_output(self) -> str:
            return "done"

        def other(self) -> int:
            return 7

    module.Scheduler = Scheduler  # type: ignore[attr-defined]
    return module


def test_patch_times_the_named_methods_once_and_keeps_what_they_return(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(step_times, "_calls", {})
    monkeypatch.setenv(step_times.ENV, str(tmp_path))
    monkeypatch.setenv(step_times.TAG_ENV, "kvd")
    module = _scheduler_module()
    step_times.patch(module)
    step_times.patch(module)  # a second patch does not wrap the wrapper
    sched = module.Scheduler()
    assert [sched.schedule(n) for n in range(5)] == [1, 2, 3, 4, 5]
    assert sched.update_from_output() == "done" and sched.other() == 7
    assert len(step_times._calls["Scheduler.schedule"]) == 5  # once a call, not twice
    assert len(step_times._calls["Scheduler.update_from_output"]) == 1
    assert "Scheduler.other" not in step_times._calls
    step_times.dump()
    record = json.loads((tmp_path / f"steps-{os.getpid()}.json").read_text())
    assert record["tag"] == "kvd" and len(record["calls"]["Scheduler.schedule"]) == 5


def test_report_sets_each_systems_median_call_side_by_side(tmp_path: Path) -> None:
    def write(pid: int, tag: str, calls: dict[str, list[float]]) -> None:
        (tmp_path / f"steps-{pid}.json").write_text(
            json.dumps({"tag": tag, "process": "VLLM::Worker", "calls": calls})
        )

    # Two kvd workers (medians 5,000 and 5,200: their median 5,100), one none's.
    write(1, "kvd", {"GPUModelRunner._model_forward": [4900, 5000, 9000],
                     "KvdOffloadingConnector.start_load_kv": [14, 15, 16]})  # fmt: skip
    write(2, "kvd", {"GPUModelRunner._model_forward": [5200, 5200, 5300]})
    write(3, "none", {"GPUModelRunner._model_forward": [4700, 4800, 4900]})
    write(4, "kvd", {"EngineCore.step": [6000, 6100]})
    write(5, "none", {"EngineCore.step": [5500]})
    # Not step times: another tool's table, a list, an earlier run's partial file.
    (tmp_path / "steps-6.json").write_text(json.dumps({"build_connector_meta": [1, 0.1]}))
    (tmp_path / "steps-7.json").write_text(json.dumps([1, 2]))
    (tmp_path / "steps-8.json").write_text('{"tag": "kvd", "ca')
    (tmp_path / "rows.json").write_text(json.dumps({"rows": []}))  # not even looked at
    (tmp_path / "steps-9.error").write_text("lmcache: cannot time vllm.x: boom\n")
    lines = step_times.report(tmp_path)
    header, step, forward, less, hook, nesting, error, left_out = lines
    assert header.split()[-2:] == ["kvd", "none"]
    assert step.startswith("engine core: one step") and step.split()[-2:] == ["6050.0", "5500.0"]
    assert forward.startswith("worker: forward pass")
    assert forward.split()[-2:] == ["5100.0", "4800.0"]
    assert less.startswith("engine core: one step less the forward pass")
    assert less.split()[-2:] == ["950.0", "700.0"]
    # A hook only kvd's engines have: none's column says so.
    assert hook.startswith("KvdOffloadingConnector.start_load_kv")
    assert hook.split()[-2:] == ["15.0", "-"]
    assert "includes the base class's" in nesting
    assert error == "not timed: lmcache: cannot time vllm.x: boom"
    assert left_out == "not step times, left out: steps-6.json, steps-7.json, steps-8.json"
    assert step_times.report(tmp_path / "nothing") == []


def test_the_site_directory_installs_the_hook_only_when_asked(tmp_path: Path) -> None:
    """A fresh interpreter with `SITE_DIR` on its path: a `TIMED` module imported after
    start is patched with `KVD_STEP_TIMES` set, and left alone without it."""
    probe = tmp_path / "probe"
    (probe / "vllm" / "v1" / "core" / "sched").mkdir(parents=True)
    for d in ["vllm", "vllm/v1", "vllm/v1/core", "vllm/v1/core/sched"]:
        (probe / d / "__init__.py").write_text("")
    (probe / "vllm/v1/core/sched/scheduler.py").write_text(
        "class Scheduler:\n    def schedule(self):\n        return 1\n"
    )
    code = (
        "from vllm.v1.core.sched.scheduler import Scheduler\n"
        "print(getattr(Scheduler.schedule, '__kvd_step_timed__', False), Scheduler().schedule())"
    )
    path = os.pathsep.join([str(step_times.SITE_DIR), str(probe)])
    base = {k: v for k, v in os.environ.items() if k != step_times.ENV}
    for env, expect in [({step_times.ENV: str(tmp_path)}, "True 1"), ({}, "False 1")]:
        out = subprocess.run([sys.executable, "-c", code], env={**base, **env, "PYTHONPATH": path},
                             capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
        assert out.stdout.strip() == expect, out.stderr


def test_a_decode_engine_gets_the_step_variables_beside_its_systems_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`peers.engine` merges `step_env` over the system's environment and its cores."""
    from kvd_tools.bench import peers

    got: list[dict[str, str] | None] = []
    stopped: list[bool] = []

    class Engine:
        def __init__(
            self, config: dict, env: dict[str, str] | None = None, python: str | None = None
        ):
            got.append(env)

        def stop(self) -> None:
            stopped.append(True)

    monkeypatch.setattr(peers, "EngineProcess", Engine)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    srv = peers.Serving({"kv_transfer": {}}, env={"LMCACHE_TRACK_USAGE": "false"})
    timed = peers.step_env(tmp_path, "lmcache")
    assert timed is not None and peers.step_env(None, "lmcache") is None
    with peers.engine(srv, "model", cores="1", more_env=timed) as proc:
        assert isinstance(proc, Engine) and not stopped
    assert stopped == [True]  # stopped on leaving
    (env,) = got
    assert env is not None
    assert env["LMCACHE_TRACK_USAGE"] == "false" and env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert env[step_times.ENV] == str(tmp_path) and env[step_times.TAG_ENV] == "lmcache"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(step_times.SITE_DIR), "/elsewhere"]
