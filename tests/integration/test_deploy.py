"""Runs in the test process: the deploy files are valid for the tools that read them."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

DEPLOY = Path(__file__).parents[2] / "deploy"


def test_systemd_unit_verifies(tmp_path: Path) -> None:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (.ci/run installs Debian's systemd)")
    unit = (DEPLOY / "kvd.service").read_text()
    assert "Type=notify" in unit and "LimitMEMLOCK=infinity" in unit
    # PrivateDevices would hide /dev/shm from the engines.
    assert "PrivateDevices=" not in unit
    # A warm restart needs the manifest in the runtime dir and the service
    # user's shm to outlive the process (SPEC 13), across stop and start too.
    assert "RuntimeDirectoryPreserve=yes" in unit and "RemoveIPC=no" in unit
    # verify insists that ExecStart's binary exists: point it at this venv's kvd.
    kvd = Path(sys.executable).with_name("kvd")
    assert kvd.exists()
    (tmp_path / "kvd.service").write_text(unit.replace("/usr/local/bin/kvd", str(kvd)))
    out = subprocess.run(
        [tool, "verify", str(tmp_path / "kvd.service")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr


def systemd_tool(name: str) -> str:
    tool = shutil.which(name)
    if tool is None:
        pytest.skip(f"{name} is not installed (.ci/run installs Debian's systemd)")
    return tool


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)


def entries(path: Path) -> dict[str, list[str]]:
    """An /etc/passwd-style file: name -> its other fields."""
    rows = [line.split(":") for line in path.read_text().splitlines() if line]
    return {row[0]: row[1:] for row in rows}


def test_sysusers_and_tmpfiles_make_the_service_user_and_its_runtime_dir(tmp_path: Path) -> None:
    """The real tools on the real files, into an empty root: the user and group
    exist as the unit expects, and /run/kvd is theirs, mode 0750."""
    sysusers, tmpfiles = systemd_tool("systemd-sysusers"), systemd_tool("systemd-tmpfiles")
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)  # sysusers locks /etc/passwd in the root
    conf = DEPLOY / "sysusers.d" / "kvd.conf"
    dry = run(sysusers, f"--root={root}", "--dry-run", str(conf))
    assert dry.returncode == 0, dry.stderr
    assert "Creating group 'kvd'" in dry.stderr and "Creating user 'kvd'" in dry.stderr
    assert not (root / "etc" / "passwd").exists()  # a dry run writes nothing
    made = run(sysusers, f"--root={root}", str(conf))
    assert made.returncode == 0, made.stderr
    uid, gid, _, home, shell = entries(root / "etc" / "passwd")["kvd"][1:]
    assert (home, shell) == ("/nonexistent", "/usr/sbin/nologin")
    group = entries(root / "etc" / "group")["kvd"]
    assert group[1] == gid and "kvd" in group[2].split(",")
    assert 0 < int(uid) < 1000 and 0 < int(gid) < 1000  # a system user

    created = run(tmpfiles, "--create", f"--root={root}", str(DEPLOY / "tmpfiles.d" / "kvd.conf"))
    root_user = os.geteuid() == 0
    # Giving /run/kvd to kvd takes root: without it tmpfiles makes the
    # directory, then fails that one step.
    assert created.returncode == 0 or not root_user, created.stderr
    runtime = root / "run" / "kvd"
    assert runtime.is_dir(), f"tmpfiles made no /run/kvd: {created.stderr}"
    st = runtime.lstat()
    assert stat.S_IMODE(st.st_mode) == 0o750, oct(st.st_mode)
    if not root_user:
        assert "chown" in created.stderr, created.stderr
        pytest.skip("making /run/kvd owned by kvd takes root (the mode was checked)")
    # The owner tmpfiles resolved in the root's own passwd: the files agree.
    assert (st.st_uid, st.st_gid) == (int(uid), int(gid))
