"""Runs in the test process: every `kvd bench` suite's `--quick` form, as an operator runs it.

One test a suite: `kvd bench SUITE --quick --json PATH` as a child process
(real daemons, real engines, no mocks), then its JSON checked against SPEC
section 10: `{"suite", "machine", "rows"}`, and each row with every field
the SPEC lists for its suite (the lists below are copied from the SPEC, so
that a field renamed in a suite fails here), values sane. A suite broken by
a later change fails its test.

Every process the bench starts carries a tag in its environment; whatever
carries it once the bench is done (or killed, on a timeout) is killed, and
a bench that left a process behind fails.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.integration.remote_hosts import needs_redis

# SPEC section 10, "Row fields": per suite, the rows of each shape and their
# fields, the first field naming the shape (a row with it is of that shape).
SPEC_FIELDS: dict[str, list[list[str]]] = {
    "transfer": [
        ["layout", "slot_bytes", "num_blocks", "store_gbps", "load_gbps", "memcpy_gbps", "ratio"]
    ],
    "rpc": [["clients", "p50_us", "p99_us", "ops_per_s", "echo_p50_us", "ratio"]],
    "index": [
        ["num_blocks", "policy", "us_per_key_prepare_store", "us_per_key_lookup", "bytes_per_block"]
    ],
    "trace": [["trace", "capacity_blocks", "policy", "hit_rate"]],
    "e2e": [
        [
            "variant",
            "prompt_tokens",
            "ttft_recompute_ms",
            "ttft_cached_ms",
            "speedup",
            "max_abs_diff",
        ]
    ],
    "throughput": [["variant", "hit_rate", "requests_per_s", "speedup"]],
    "mla": [["world_size", "layout", "host_bytes_per_block", "d2h_bytes_per_block"]],
    "soak": [["seconds", "ops", "faults", "violations", "rss_start_mb", "rss_end_mb"]],
    "vllm": [
        ["model", "prompt_tokens", "ttft_recompute_ms", "ttft_kvd_ms", "speedup", "tokens_equal"],
        ["waiting_requests", "kvd_us_per_request", "native_us_per_request", "ratio"],
    ],
    "lookup": [["keys", "p50_us", "p99_us", "inproc_p50_us", "ratio"]],
    "restart": [
        [
            "num_blocks",
            "blocks_ready_before",
            "blocks_ready_after",
            "blocks_verified",
            "seconds_to_first_hit",
        ]
    ],
    "remote": [["value_bytes", "fetch_gbps", "bare_get_gbps", "ratio"]],
    "disk": [
        [
            "row_bytes",
            "queue_depth",
            "fetch_gbps",
            "bare_read_gbps",
            "ratio",
            "store_gbps",
            "bare_write_gbps",
            "store_ratio",
            "files_store_gbps",
            "files_load_gbps",
        ]
    ],
    "sglang": [
        ["op", "pages", "page_bytes", "kvd_gbps", "file_gbps", "memcpy_gbps", "vs_memcpy"],
        ["exists_keys", "kvd_us_per_key", "dict_us_per_key", "file_us_per_key"],
    ],
    "peers": [
        [
            "system",
            "measure",
            "prompt_tokens",
            "ttft_ms",
            "step_ms",
            "requests_per_s",
            "hit_rate",
            "tokens_equal",
        ]
    ],
}
# SPEC fields a row may leave null: a peers row carries the figures of its measure
# only (a TTFT row has no decode step), and a ratio row no hit rate or tokens.
NULLABLE: dict[str, set[str]] = {
    "peers": {"ttft_ms", "step_ms", "requests_per_s", "hit_rate", "tokens_equal"},
}
# Rows a suite reports beyond the SPEC's, by their first field.
EXTRA_SHAPES: dict[str, set[str]] = {
    "remote": {"lookup_keys", "trace"},  # remote lookup latency, the two-host replay
    "vllm": {"workload", "copies"},  # multi-turn (not in --quick); a decode step's copies
}
STRINGS = {"layout", "policy", "trace", "variant", "model", "system", "measure", "copies",
           "tier", "event"}  # fmt: skip
BOOLS = {"tokens_equal", "stores_copied"}
# Figures that must be above 0: rates, ratios, times, sizes.
POSITIVE = (
    "ratio", "speedup", "_gbps", "_us", "_ms", "ops_per_s", "requests_per_s", "_per_block",
    "num_blocks", "slot_bytes", "clients", "keys", "world_size", "prompt_tokens",
    "capacity_blocks", "value_bytes", "waiting_requests", "seconds", "ops", "rss_",
    "_per_request", "_per_key_", "row_bytes", "queue_depth",
)  # fmt: skip
# Wall-clock limits of one quick run: generous, for a loaded 2-core host.
TIMEOUT_S = {"peers": 900, "vllm": 420, "e2e": 240, "throughput": 240, "soak": 180, "remote": 180}
DEFAULT_TIMEOUT_S = 150
GRACE_S = 30  # after SIGINT, for the bench's own cleanup
TAG = "KVD_BENCH_QUICK_TAG"
# Flags a quick run adds: peers runs kvd-off too (kvd's connector, no daemon).
FLAGS = {"peers": ["--systems", "kvd,lmcache,none,kvd-off"]}


def _tagged(tag: str) -> list[int]:
    """Live processes (not zombies) whose environment carries `TAG=tag`."""
    mark = f"{TAG}={tag}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if mark not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue  # gone, or not ours to read
        if state != "Z":
            pids.append(int(entry.name))
    return pids


def _kill_all(tag: str) -> list[int]:
    """SIGKILLs every live process with the tag; the pids it found."""
    found = _tagged(tag)
    for pid in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return found


def _left_behind(tag: str, wait_s: float = 15.0) -> list[int]:
    """Processes with the tag still alive after `wait_s` (a stop in progress may finish)."""
    deadline = time.monotonic() + wait_s
    while (pids := _tagged(tag)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return pids


def run_quick(suite: str, json_path: Path, log_path: Path) -> tuple[int, str]:
    """`kvd bench SUITE --quick --json PATH`: its exit status and the tail of its output.
    Nothing it started outlives this call."""
    tag = uuid.uuid4().hex
    env = {**os.environ, TAG: tag}
    timeout = TIMEOUT_S.get(suite, DEFAULT_TIMEOUT_S)
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvd",
                "bench",
                suite,
                "--quick",
                "--json",
                str(json_path),
                *FLAGS.get(suite, []),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.send_signal(signal.SIGINT)  # the bench's finally blocks stop its daemons
            try:
                proc.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        finally:
            if proc.poll() is None:  # this test itself was interrupted
                proc.kill()
                proc.wait()
            leftover = _left_behind(tag, wait_s=5.0 if timed_out else 15.0)
            _kill_all(tag)
    tail = log_path.read_text(errors="replace")[-6000:]
    if timed_out:
        pytest.fail(f"kvd bench {suite} --quick ran past {timeout} s:\n{tail}")
    assert not leftover, f"kvd bench {suite} left processes behind: {leftover}\n{tail}"
    return proc.returncode, tail


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _positive(field: str) -> bool:
    return any(part in field for part in POSITIVE)


def check_report(suite: str, report: Any) -> list[dict[str, Any]]:
    """The checks of SPEC section 10 every suite's JSON must pass; its rows."""
    assert isinstance(report, dict) and set(report) == {"suite", "machine", "rows"}, report
    assert report["suite"] == suite
    assert isinstance(report["machine"], dict) and report["machine"]
    rows = report["rows"]
    assert isinstance(rows, list) and rows, "no rows"
    shapes = {fields[0]: fields for fields in SPEC_FIELDS[suite]}
    extras = EXTRA_SHAPES.get(suite, set())
    seen = dict.fromkeys(shapes, 0)
    for row in rows:
        assert isinstance(row, dict) and row
        keys = [k for k in shapes if k in row]
        assert len(keys) <= 1, f"a row of two SPEC shapes: {row}"
        if keys:
            seen[keys[0]] += 1
            missing = [f for f in shapes[keys[0]] if f not in row]
            assert not missing, f"SPEC section 10 fields missing: {missing} in {row}"
            for field in shapes[keys[0]]:
                if field not in NULLABLE.get(suite, set()):
                    assert row[field] is not None, f"{field} is null in {row}"
        else:
            assert extras & set(row), f"a row of no shape SPEC section 10 names: {row}"
        for field, value in row.items():
            if field in STRINGS:
                assert isinstance(value, str) and value, f"{field}: {value!r}"
            elif field in BOOLS:
                assert isinstance(value, bool), f"{field}: {value!r}"
            elif _is_number(value):
                assert math.isfinite(value) and value >= 0, f"{field}: {value!r} in {row}"
                if _positive(field):
                    assert value > 0, f"{field}: {value!r} in {row}"
                if "hit_rate" in field or field == "cached_share":
                    assert value <= 1, f"{field}: {value!r}"
    assert all(seen.values()), f"no row of the shape(s) {[k for k, n in seen.items() if not n]}"
    return rows


def _by(rows: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    return [r for r in rows if key in r]


def check_suite(suite: str, rows: list[dict[str, Any]]) -> None:
    """What each suite promises beyond its fields, where it holds in any run."""
    if suite == "mla":  # exactly 1/N
        for ws in {r["world_size"] for r in rows}:
            rep, sh = (next(r for r in rows if r["world_size"] == ws and r["layout"] == kind)
                       for kind in ("replicated", "sharded"))  # fmt: skip
            assert rep["host_bytes_per_block"] * ws == sh["host_bytes_per_block"]
            assert rep["d2h_bytes_per_block"] * ws == sh["d2h_bytes_per_block"]
    elif suite == "restart":  # every block back and verified, from RAM and from disk
        for r in rows:
            assert r["blocks_ready_before"] == r["num_blocks"]
            assert r["blocks_ready_after"] == r["blocks_verified"] == r["num_blocks"]
        disk = [r for r in rows if r["tier"] == "disk"]
        assert {r["event"] for r in disk} == {"sigkill", "reboot"}, rows
        # After a reboot RAM is empty: every block came from the disk.
        assert all(r["from_disk"] == r["num_blocks"] for r in disk if r["event"] == "reboot")
    elif suite == "disk":  # both row sizes; rows read back from disk equal what was stored
        assert {r["row_bytes"] for r in rows} == {256 << 10, 2 << 20}, rows
        for r in rows:
            assert r["blocks_checked"] > 0 and r["blocks_verified"] == r["blocks_checked"], r
            assert r["disk_bad_rows"] == 0 and r["disk_errors"] == 0, r
    elif suite == "soak":
        assert rows[0]["violations"] == 0, rows[0].get("findings")
        assert rows[0]["ops"] > 0 and rows[0]["faults"] > 0
    elif suite == "e2e":  # outputs identical
        assert all(r["max_abs_diff"] <= 1e-4 and r["tokens_match"] for r in rows), rows
        assert all(r["cached_tokens"] > 0 for r in rows), rows
    elif suite == "throughput":
        zero = [r for r in rows if r["hit_rate"] == 0]
        assert zero and all(r["speedup"] == 1 for r in zero), rows
    elif suite == "trace":  # Belady's optimum bounds every policy (RAM alone)
        ram = [r for r in rows if "tier" not in r]
        best = {r["capacity_blocks"]: r["hit_rate"] for r in ram if r["policy"] == "belady"}
        assert best and all(r["hit_rate"] <= best[r["capacity_blocks"]] for r in ram), rows
        assert {"lru", "arc"} <= {r["policy"] for r in ram}
        _check_disk_tier(rows)
    elif suite == "transfer":
        assert {r["layout"] for r in rows} == {"contiguous", "per_layer"}
    elif suite == "vllm":
        assert all(r["tokens_equal"] for r in _by(rows, "model")), rows
    elif suite == "remote":
        assert _by(rows, "lookup_keys") and _by(rows, "trace"), rows
    elif suite == "sglang":  # both directions through the backend; kvd pages came back equal
        assert {r["op"] for r in _by(rows, "op")} == {"set", "get"}, rows
    elif suite == "peers":  # every measure for each system; kvd serves the TTFT prompts
        from kvd_tools.bench.peers_rows import MEASURES

        for system in ("kvd", "lmcache", "none", "ratio"):
            assert {r["measure"] for r in rows if r["system"] == system} == set(MEASURES), rows
        # Tokens equal, or parting only at a near-tie (peers_rows.matches), everywhere.
        kvd = [r for r in rows if r["system"] == "kvd"]
        assert all(r["tokens_equal"] for r in kvd), kvd
        served = [r for r in kvd if r["measure"] in ("ttft_cached", "ttft_new_engine")]
        assert served and all(r["hit_rate"] > 0 for r in served), kvd
        floor = [r for r in kvd if r["measure"] == "ttft_vllm_cache"]  # vLLM's own cache
        assert floor and all(r["ttft_ms"] > 0 for r in floor), kvd
        stored = {r["system"]: r for r in rows if r["measure"] == "ttft_store"}  # the prefills
        assert all(stored[name]["ttft_ms"] > 0 for name in ("kvd", "lmcache", "none")), stored
        assert stored["ratio"]["ttft_vs_none"] > 0 and stored["ratio"]["lmcache_ttft_vs_none"] > 0
        # kvd's connector with no daemon: every measure, the same tokens, nothing served.
        off = [r for r in rows if r["system"] == "kvd-off"]
        assert {r["measure"] for r in off} == set(MEASURES), rows
        assert all(r["tokens_equal"] for r in off), off
        assert all(not r["hit_rate"] for r in off), off
        assert stored["ratio"]["off_ttft_vs_none"] > 0


def _check_disk_tier(rows: list[dict[str, Any]]) -> None:
    """`kvd bench trace`'s disk rows on the shared trace: per policy, RAM + a disk
    10x larger hits at least as often as RAM alone, the disk serves hits, and
    admitting on the second store writes fewer blocks than admitting every one."""
    alone = {(r["policy"], r["capacity_blocks"]): r["hit_rate"] for r in rows if "tier" not in r}
    refs = {(r["policy"], r["capacity_blocks"]) for r in rows if r.get("tier") == "ram"}
    tiered = [r for r in rows if r.get("tier") == "ram+disk"]
    assert {"lru", "arc"} <= {r["policy"] for r in tiered}, rows
    written: dict[tuple[str, int], dict[str, int]] = {}
    for r in tiered:
        policy, capacity = r["policy"], r["capacity_blocks"]
        assert r["disk_capacity_blocks"] == 10 * capacity, r
        assert {(policy, capacity), (policy, 11 * capacity)} <= refs, r
        assert r["hit_rate"] >= alone[policy, capacity], r
        assert r["disk_hit_rate"] > 0, r
        assert r["hit_rate"] == pytest.approx(r["ram_hit_rate"] + r["disk_hit_rate"], abs=2e-4)
        written.setdefault((policy, capacity), {})[r["disk_admit"]] = r["disk_blocks_written"]
    for pair in written.values():
        assert 0 < pair["second"] < pair["always"], written


def _needs_lmcache() -> Any:
    """`kvd bench peers` needs LMCache's venv (`make lmcache-venv`); --quick skips
    without it, and so does its test."""
    from kvd_tools.bench.lmcache_server import default_venv, missing

    why = missing(default_venv())
    return pytest.mark.skipif(why is not None, reason=why or "")


def _param(suite: str) -> Any:
    if suite == "peers":
        return pytest.param(suite, marks=[_needs_lmcache()])
    if suite == "sglang":  # make venv installs it; the suite says why when it cannot run
        absent = importlib.util.find_spec("sglang") is None
        return pytest.param(suite, marks=[pytest.mark.skipif(absent, reason="no sglang")])
    return pytest.param(suite, marks=[needs_redis]) if suite == "remote" else suite


@pytest.mark.parametrize("suite", [_param(s) for s in SPEC_FIELDS])
def test_bench_quick(suite: str, tmp_path: Path) -> None:
    json_path = tmp_path / f"{suite}.json"
    status, tail = run_quick(suite, json_path, tmp_path / f"{suite}.log")
    assert status == 0, f"kvd bench {suite} --quick exited with {status}:\n{tail}"
    assert json_path.is_file(), f"no JSON written:\n{tail}"
    rows = check_report(suite, json.loads(json_path.read_text()))
    check_suite(suite, rows)


def test_every_suite_has_a_quick_test() -> None:
    """A suite added to the registry gets its fields written here from the SPEC."""
    from kvd_tools.bench.suites import SUITES

    assert set(SUITES) == set(SPEC_FIELDS)
    for name, suite in SUITES.items():
        assert suite.quick, f"{name} has no --quick values"


def test_quick_values_give_way_to_the_flags_given() -> None:
    from kvd_tools.bench.cli import default_args
    from kvd_tools.bench.suites import SUITES, suite_args

    quick = suite_args("rpc", ["--quick", "--ops", "5000"])  # 5000: the default, given
    assert quick.ops == 5000 and quick.clients == SUITES["rpc"].quick["clients"]
    assert suite_args("rpc", ["--ops", "7"]).clients == [1, 4, 8]  # no --quick: defaults
    for name, suite in SUITES.items():  # `kvd bench all --quick`
        args = default_args(name, quick=True)
        assert all(getattr(args, dest) == value for dest, value in suite.quick.items())
