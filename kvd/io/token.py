"""Runs in the daemon: the operator token's file, written fresh at every start (SPEC 11)."""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path


def write_admin_token(path: Path) -> str:
    """A fresh operator token in `path`, readable by this user (and root) only."""
    token = secrets.token_hex(16)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # never reuse a file someone else may have made
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token
