"""Runs in the test process: only the service group can connect to the daemon or map a pool.

Tests run as root, so the test creates a group and two users (one in the
group, one outside it) and drops privileges in child processes.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import subprocess
import sys

import pytest

from kvd_client import Layout, Scheduler
from kvd_tools.launcher import DaemonProcess

GROUP, MEMBER, OUTSIDER = "kvdtestgrp", "kvdtestmember", "kvdtestoutsider"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create users")


def _ensure_users() -> None:
    try:
        grp.getgrnam(GROUP)
    except KeyError:
        subprocess.run(["groupadd", "-f", GROUP], check=True)
    for user, extra in ((MEMBER, ["-G", GROUP]), (OUTSIDER, [])):
        try:
            pwd.getpwnam(user)
        except KeyError:
            subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", *extra, user], check=True)


PROBE = r"""
import json, os, socket, sys
import posix_ipc
from kvd_client import protocol as p  # imported as root: the venv may be unreadable after
from kvd_client.connection import Connection
from kvd_client.errors import KvdError
user_uid, user_gid, groups, sock_path, shm_name, token_path, pool = json.loads(sys.argv[1])
os.setgroups(groups); os.setgid(user_gid); os.setuid(user_uid)
result = {}
try:
    open(token_path).read(); result["token"] = "ok"
except OSError as exc:
    result["token"] = type(exc).__name__
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(sock_path); result["connect"] = "ok"
except OSError as exc:
    result["connect"] = type(exc).__name__
finally:
    s.close()
try:
    posix_ipc.SharedMemory(shm_name).close_fd(); result["shm"] = "ok"
except posix_ipc.Error as exc:
    result["shm"] = type(exc).__name__
if result["connect"] == "ok":  # a group member may not drop a pool without the token
    conn = Connection("ipc://" + sock_path, role="admin", keeper=False, timeout_ms=5000)
    conn.connect()
    try:
        conn.call(p.DropPool, pool); result["drop"] = "ok"
    except KvdError as exc:
        result["drop"] = exc.code.value
    finally:
        conn.close()
print(json.dumps(result))
"""


def _probe(user: str, d: DaemonProcess, shm_name: str) -> dict[str, str]:
    pw = pwd.getpwnam(user)
    groups = [g.gr_gid for g in grp.getgrall() if user in g.gr_mem]
    sock, token = d.runtime_dir / "control.sock", d.runtime_dir / "admin.token"
    arg = json.dumps([pw.pw_uid, pw.pw_gid, groups, str(sock), shm_name, str(token), "iso"])
    out = subprocess.run(
        [sys.executable, "-c", PROBE, arg], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_only_group_members_connect_and_map() -> None:
    _ensure_users()
    d = DaemonProcess(group=GROUP).start()
    try:
        with Scheduler(
            "iso",
            Layout("m", "bf16", 16, 1, False, 4096),
            engine_id="e",
            endpoint=d.endpoint,
            capacity_bytes=1 << 20,
        ) as s:
            assert s.attached is not None
            shm = s.attached.shm_name
            outsider = _probe(OUTSIDER, d, shm)
            member = _probe(MEMBER, d, shm)
            assert s.lookup([b"x"]) == 0  # the pool is still there
        assert outsider == {
            "token": "PermissionError",
            "connect": "PermissionError",
            "shm": "PermissionsError",
        }
        assert member == {
            "token": "PermissionError",
            "connect": "ok",
            "shm": "ok",
            "drop": "WRONG_ROLE",
        }
    finally:
        d.stop()
