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


def control_endpoint(runtime_dir: str | Path) -> str:
    return f"ipc://{Path(runtime_dir) / 'control.sock'}"


def default_endpoint(env: Mapping[str, str] | None = None) -> str:
    """`KVD_ENDPOINT` when set, else the control socket of the default runtime dir."""
    env = os.environ if env is None else env
    return env.get("KVD_ENDPOINT") or control_endpoint(default_runtime_dir(env))
