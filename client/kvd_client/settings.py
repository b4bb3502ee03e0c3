"""Runs in engine processes: the client library's settings, read from the environment once.

`Worker` builds one `ClientSettings` when it starts (or takes one from its
caller) and passes the values down; nothing deeper in the library reads the
environment.

- `KVD_ENDPOINT`: the daemon's control endpoint (default: the control socket
  of the default runtime dir, SPEC section 9)
- `KVD_NATIVE_MIN_BYTES`: the job size from which the CPU backend copies with
  the native copier (0 sends every job native; unset: a quarter of the
  last-level cache, `kvd_client.backends.native`)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from kvd_client.errors import BadRequest
from kvd_client.paths import default_endpoint

NATIVE_MIN_BYTES_ENV = "KVD_NATIVE_MIN_BYTES"


@dataclass(frozen=True, slots=True)
class ClientSettings:
    endpoint: str
    native_min_bytes: int | None = None  # None: the backend's default

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ClientSettings:
        """The settings of this process; `BadRequest` for a value that is not one."""
        env = os.environ if env is None else env
        return cls(default_endpoint(env), _native_min_bytes(env))


def _native_min_bytes(env: Mapping[str, str]) -> int | None:
    setting = env.get(NATIVE_MIN_BYTES_ENV, "").strip()
    if not setting:
        return None
    try:
        value = int(setting)
    except ValueError:
        value = -1
    if value < 0:
        raise BadRequest(
            f"{NATIVE_MIN_BYTES_ENV}={setting!r}: want a whole number of bytes (0 or more)"
        )
    return value
