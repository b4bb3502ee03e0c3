"""Runs in every kvd process: where the daemon listens by default (SPEC section 9)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def default_runtime_dir(env: Mapping[str, str] | None = None) -> Path:
    """`$XDG_RUNTIME_DIR/kvd` when set, else `/tmp/kvd-<uid>`."""
    env = os.environ if env is None else env
    xdg = env.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "kvd"
    return Path(f"/tmp/kvd-{os.getuid()}")


# The daemon's operator token, readable by the service user and root only;
# `DropPool` must carry it.
ADMIN_TOKEN_FILE = "admin.token"


def control_endpoint(runtime_dir: str | Path) -> str:
    return f"ipc://{Path(runtime_dir) / 'control.sock'}"


def runtime_dir_of(endpoint: str) -> Path | None:
    """The runtime dir of an `ipc://<dir>/control.sock` endpoint; None for others."""
    path = Path(endpoint.removeprefix("ipc://"))
    if not endpoint.startswith("ipc://") or path.name != "control.sock":
        return None
    return path.parent


def read_admin_token(runtime_dir: str | Path) -> str:
    """The daemon's operator token; "" when this user may not read it (or no daemon wrote it)."""
    try:
        return (Path(runtime_dir) / ADMIN_TOKEN_FILE).read_text().strip()
    except (FileNotFoundError, PermissionError):
        return ""


def default_endpoint(env: Mapping[str, str] | None = None) -> str:
    """`KVD_ENDPOINT` when set, else the control socket of the default runtime dir."""
    env = os.environ if env is None else env
    return env.get("KVD_ENDPOINT") or control_endpoint(default_runtime_dir(env))
