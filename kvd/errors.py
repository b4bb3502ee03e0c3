"""Runs in the daemon: the error types of the pure core, shared with the client.

They are defined once in `kvd_client.errors` so that a code means the same on
both sides of the wire; this module is their public name on the daemon side.
"""

from kvd_client.errors import (
    BadRequest,
    ErrorCode,
    KvdError,
    LayoutMismatch,
    MissingKey,
    NoSuchPool,
    NotOwner,
    NotPinned,
    NotReady,
    PinLimit,
    TooLarge,
    Unavailable,
    WorkersMissing,
    error_for,
)

__all__ = [
    "BadRequest",
    "ErrorCode",
    "KvdError",
    "LayoutMismatch",
    "MissingKey",
    "NoSuchPool",
    "NotOwner",
    "NotPinned",
    "NotReady",
    "PinLimit",
    "TooLarge",
    "Unavailable",
    "WorkersMissing",
    "error_for",
]
