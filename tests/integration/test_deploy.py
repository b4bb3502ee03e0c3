"""Runs in the test process: the deploy files are valid for the tools that read them."""

from __future__ import annotations

import shutil
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


def test_sysusers_and_tmpfiles_name_the_service_user() -> None:
    sysusers = (DEPLOY / "sysusers.d" / "kvd.conf").read_text()
    assert "g kvd" in sysusers and "u kvd" in sysusers
    assert "d /run/kvd 0750 kvd kvd" in (DEPLOY / "tmpfiles.d" / "kvd.conf").read_text()
