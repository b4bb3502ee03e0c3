"""Runs in the test process: the `kvd` command line against a real daemon."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvd_tools.launcher import DaemonProcess


def kvd(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvd", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_version_and_help() -> None:
    out = kvd("version")
    assert out.returncode == 0 and out.stdout.startswith("kvd ")
    out = kvd("--help")
    assert out.returncode == 0
    for command in ("serve", "stats", "ping", "pools", "pool", "bench", "version"):
        assert command in out.stdout
    out = kvd("serve", "--help")
    for flag in (
        "--runtime-dir",
        "--lease-ms",
        "--job-timeout-ms",
        "--max-total-bytes",
        "--log-level",
        "--config",
    ):
        assert flag in out.stdout


def test_bad_config_value_is_one_line_and_exit_2(tmp_path: Path) -> None:
    out = kvd("serve", "--runtime-dir", str(tmp_path), "--lease-ms", "-5")
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "lease_ms" in out.stderr
    cfg = tmp_path / "kvd.toml"
    cfg.write_text('policy = "fifo"\n')
    out = kvd("serve", "--config", str(cfg))
    assert out.returncode == 2 and "policy" in out.stderr and out.stderr.count("\n") == 1
    cfg.write_text("lease_ms = 100\nnot_a_key = 1\n")
    out = kvd("serve", "--config", str(cfg))
    assert out.returncode == 2 and "not_a_key" in out.stderr
    cfg.write_text(
        "[[pools]]\nname = 'p'\nmodel = 'm'\ndtype = 'bf16'\nblock_tokens = 16\n"
        "world_size = 1\nslot_bytes = 0\ncapacity_bytes = '1MiB'\n"
    )
    out = kvd("serve", "--config", str(cfg))
    assert out.returncode == 2 and "pools[0].slot_bytes" in out.stderr


def test_client_commands(daemon: DaemonProcess) -> None:
    rt = str(daemon.runtime_dir)
    out = kvd("ping", "--runtime-dir", rt)
    assert out.returncode == 0 and "ok" in out.stdout
    from kvd_client import Layout, Scheduler

    with Scheduler(
        "cli",
        Layout("m", "bf16", 16, 1, False, 4096),
        engine_id="e",
        endpoint=daemon.endpoint,
        capacity_bytes=1 << 20,
    ) as s:
        s.prepare_store([b"a", b"b"])
        s.complete_store([b"a", b"b"])
        out = kvd("pools", "--endpoint", daemon.endpoint)
        assert out.returncode == 0 and "| cli | m | 1 | no | adaptive | 256 | 2 |" in out.stdout
        out = kvd("stats", "--runtime-dir", rt, "--json")
        stats = json.loads(out.stdout)
        (pool,) = stats["pools"]
        assert pool["name"] == "cli" and pool["blocks_ready"] == 2
        assert stats["counters"]["requests.PrepareStore"] == 1
        assert kvd("stats", "--runtime-dir", rt).returncode == 0
    out = kvd("pool", "drop", "cli", "--runtime-dir", rt)
    assert out.returncode == 0
    out = kvd("pool", "drop", "cli", "--runtime-dir", rt)
    assert out.returncode == 1 and "NO_SUCH_POOL" in out.stderr


def test_client_command_without_daemon(tmp_path: Path) -> None:
    out = kvd("ping", "--runtime-dir", str(tmp_path), "--timeout-ms", "200")
    assert out.returncode == 1 and "UNAVAILABLE" in out.stderr


def test_declared_pool_from_config(tmp_path: Path) -> None:
    cfg = tmp_path / "kvd.toml"
    cfg.write_text(
        "[[pools]]\nname = 'declared'\nmodel = 'm'\ndtype = 'bf16'\n"
        "block_tokens = 16\nworld_size = 2\nreplicated = true\nslot_bytes = 4096\n"
        "capacity_bytes = '1MiB'\npolicy = 'arc'\n"
    )
    d = DaemonProcess(config=str(cfg)).start()
    try:
        out = kvd("stats", "--runtime-dir", str(d.runtime_dir), "--json")
        (pool,) = json.loads(out.stdout)["pools"]
        assert (pool["name"], pool["policy"], pool["num_blocks"]) == ("declared", "arc", 256)
    finally:
        d.stop()


def test_bench_rpc_distinct_lookups_beside_a_daemon_on_the_metrics_port(tmp_path: Path) -> None:
    """The bench's private daemon stays off the metrics port a host daemon may hold."""
    import socket

    holder = socket.socket()
    try:
        holder.bind(("127.0.0.1", 9464))  # stand in for the host's own kvd
        holder.listen()
    except OSError:
        pass  # something already holds it: just as good
    try:
        out_json = tmp_path / "rpc.json"
        out = kvd(
            "bench", "rpc", "--clients", "1", "--ops", "300", "--distinct",
            "--policy", "adaptive", "--json", str(out_json),
            timeout=180,
        )  # fmt: skip
    finally:
        holder.close()
    assert out.returncode == 0, out.stderr[-2000:]
    (row,) = json.loads(out_json.read_text())["rows"]
    assert row["clients"] == 1 and row["p50_us"] > 0 and row["echo_p50_us"] > 0
    assert row["ratio"] == pytest.approx(row["p50_us"] / row["echo_p50_us"], rel=0.01)


@pytest.mark.parametrize("copier", ["torch", "native", "auto"])
def test_bench_transfer_names_its_copier(tmp_path: Path, copier: str) -> None:
    """Every row says which copier ran; a small job under `auto` takes torch copies."""
    from kvd_client.backends import native

    if copier == "native" and not native.available():
        pytest.skip("the native copier is not built")
    out_json = tmp_path / "transfer.json"
    out = kvd(
        "bench", "transfer", "--total-mb", "4", "--repeats", "1", "--copier", copier,
        "--json", str(out_json),
        timeout=180,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out_json.read_text())["rows"]
    assert [(r["layout"], r["slot_bytes"]) for r in rows] == [
        (layout, size)
        for layout in ("contiguous", "per_layer")
        for size in (16384, 262144, 2097152)
    ]
    expected = "torch" if copier == "auto" else copier  # 4 MiB jobs stay in cache
    assert {r["copier"] for r in rows} == {expected}
    for r in rows:
        assert r["ratio"] == pytest.approx(
            min(r["store_gbps"], r["load_gbps"]) / r["memcpy_gbps"], abs=0.01
        )
    words = "native (" if expected == "native" else "torch indexing"
    assert f"copier: {words}" in out.stdout


def test_bench_transfer_refuses_a_copier_cuda_does_not_have() -> None:
    out = kvd("bench", "transfer", "--device", "cuda", "--copier", "torch")
    assert out.returncode != 0
    assert "--copier applies to --device cpu" in out.stderr
