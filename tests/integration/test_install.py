"""Runs in the test process: the daemon as its own distribution, without torch or numpy.

A `sitecustomize` on `PYTHONPATH` hides modules from every child Python (a
`None` in `sys.modules` makes their import fail), so a real daemon and the
real `kvd` command run here as they would from `pip install ./client .`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kvd_tools.launcher import DaemonProcess

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "numpy")


@pytest.fixture
def hiding(tmp_path: Path) -> dict[str, str]:
    """An environment whose Python processes cannot import torch, numpy or kvd_tools."""
    (tmp_path / "sitecustomize.py").write_text(
        "import os, sys\n"
        "for name in os.environ['KVD_TEST_HIDE'].split(','):\n"
        "    sys.modules[name] = None\n"
    )
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, "KVD_TEST_HIDE": ",".join([*HEAVY, "kvd_tools"])}


def kvd(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvd", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, **env},
    )


def test_the_daemon_declares_no_torch_and_no_numpy() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "kvd-daemon"  # `kvd` on the public index is someone else's
    names = [d.split(";")[0].split("[")[0].split("<")[0].split(">")[0].split("=")[0].strip()
             for d in project["dependencies"]]  # fmt: skip
    assert not set(names) & {"torch", "numpy", "kvd-tools"}, names
    assert {"msgspec", "pyzmq", "posix_ipc", "uvloop", "prometheus-client", "redis"} <= set(names)
    tools = tomllib.loads((ROOT / "tools" / "pyproject.toml").read_text())["project"]
    assert tools["name"] == "kvd-tools" and "torch>=2.4" in tools["dependencies"]


def test_the_version_is_the_daemon_distributions() -> None:
    from importlib.metadata import version

    from kvd.version import DISTRIBUTION, __version__

    assert DISTRIBUTION == "kvd-daemon"
    assert __version__ == version("kvd-daemon") != "0.0.0+src"


def test_the_hiding_works(hiding: dict[str, str]) -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import torch"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, **hiding},
    )
    assert out.returncode != 0 and "torch" in out.stderr


def test_serve_and_ping_without_torch_numpy_or_tools(hiding: dict[str, str]) -> None:
    with DaemonProcess(env=hiding) as d:
        out = kvd(hiding, "ping", "--runtime-dir", str(d.runtime_dir))
        assert out.returncode == 0, out.stderr
        assert "ok" in out.stdout
        out = kvd(hiding, "stats", "--json", "--runtime-dir", str(d.runtime_dir))
        assert out.returncode == 0 and '"sessions"' in out.stdout
        assert d.proc is not None and d.proc.poll() is None
    assert "Traceback" not in d.log()


@pytest.mark.parametrize("args", [("bench", "rpc"), ("bench",), ("demo", "--quick"), ("demo",)])
def test_tool_commands_without_the_tools_say_what_to_install(
    hiding: dict[str, str], args: tuple[str, ...]
) -> None:
    out = kvd(hiding, *args)
    assert out.returncode == 2
    assert out.stdout == ""
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert "pip install kvd-tools" in out.stderr and f"kvd {args[0]}" in out.stderr


def test_help_without_the_tools_still_lists_them(hiding: dict[str, str]) -> None:
    out = kvd(hiding, "--help")
    assert out.returncode == 0
    assert "bench" in out.stdout and "demo" in out.stdout and "kvd-tools" in out.stdout


def test_the_daemon_imports_no_redis_without_a_remote_tier() -> None:
    code = ("import sys, kvd.io.server, kvd.control.service, kvd.cli\n"
            "assert 'redis' not in sys.modules, 'redis imported'\n")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
