"""Runs in the daemon: the control socket, a ZeroMQ ROUTER bound on `ipc://` (SPEC section 7).

Its options bound what one peer can queue or send (`MAX_FRAME_BYTES`, high
water marks); the socket file is the daemon's group's, mode 0660, and one
left by a killed daemon is replaced.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import zmq

from kvd_client.protocol import MAX_FRAME_BYTES

# Plain ints for the hot path's socket calls: an enum flag costs a Python-level
# `|` or conversion on every call.
NOBLOCK = int(zmq.NOBLOCK)
SNDMORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)
RCVMORE = int(zmq.RCVMORE)
EVENTS = int(zmq.EVENTS)
POLLIN = int(zmq.POLLIN)
UNDECODABLE = b"\xc1"  # never-valid msgpack: a message not of two frames -> BAD_REQUEST


def bind_control(
    ctx: zmq.Context[zmq.Socket[bytes]], path: Path, gid: int | None
) -> zmq.Socket[bytes]:
    """The daemon's ROUTER, bound at `path` and owned by group `gid` where given."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # a socket file left by a killed daemon
    sock.bind(f"ipc://{path}")
    os.chmod(path, 0o660)
    if gid is not None:
        os.chown(path, -1, gid)
    return sock
