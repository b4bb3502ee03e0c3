"""Runs in every kvd process: error codes and the KvdError hierarchy.

Shared by the daemon and the client so a code means the same on both sides of
the wire. Misuse raises a `KvdError` subclass carrying one of these codes;
expected "cannot" outcomes are values (``None``), never exceptions.
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    BAD_REQUEST = "BAD_REQUEST"
    UNSUPPORTED_VERSION = "UNSUPPORTED_VERSION"
    NOT_HELLO = "NOT_HELLO"
    NOT_ATTACHED = "NOT_ATTACHED"
    LAYOUT_MISMATCH = "LAYOUT_MISMATCH"
    MISSING = "MISSING"
    NOT_READY = "NOT_READY"
    NOT_PINNED = "NOT_PINNED"
    NOT_OWNER = "NOT_OWNER"
    NO_SUCH_POOL = "NO_SUCH_POOL"
    WORKERS_MISSING = "WORKERS_MISSING"
    TOO_LARGE = "TOO_LARGE"
    PIN_LIMIT = "PIN_LIMIT"
    WRONG_ROLE = "WRONG_ROLE"
    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"


class KvdError(Exception):
    """A request kvd refuses; `code` says why, the message says what."""

    code: ErrorCode = ErrorCode.BAD_REQUEST

    def __init__(self, detail: str, code: ErrorCode | None = None) -> None:
        super().__init__(detail)
        if code is not None:
            self.code = code
        self.detail = detail

    def __str__(self) -> str:
        return f"{self.code}: {self.detail}"


class BadRequest(KvdError):
    code = ErrorCode.BAD_REQUEST


class MissingKey(KvdError):
    code = ErrorCode.MISSING


class NotReady(KvdError):
    code = ErrorCode.NOT_READY


class NotPinned(KvdError):
    code = ErrorCode.NOT_PINNED


class NotOwner(KvdError):
    code = ErrorCode.NOT_OWNER


class LayoutMismatch(KvdError):
    code = ErrorCode.LAYOUT_MISMATCH


class NoSuchPool(KvdError):
    code = ErrorCode.NO_SUCH_POOL


class WorkersMissing(KvdError):
    code = ErrorCode.WORKERS_MISSING


class TooLarge(KvdError):
    code = ErrorCode.TOO_LARGE


class PinLimit(KvdError):
    code = ErrorCode.PIN_LIMIT


class Unavailable(KvdError):
    """The daemon could not be reached within the client's timeout."""

    code = ErrorCode.UNAVAILABLE


_BY_CODE: dict[ErrorCode, type[KvdError]] = {
    cls.code: cls
    for cls in (
        BadRequest,
        MissingKey,
        NotReady,
        NotPinned,
        NotOwner,
        LayoutMismatch,
        NoSuchPool,
        WorkersMissing,
        TooLarge,
        PinLimit,
        Unavailable,
    )
}


def error_for(code: str, detail: str) -> KvdError:
    """The exception a client raises for an `Error` reply with this code."""
    try:
        known = ErrorCode(code)
    except ValueError:
        return KvdError(detail, ErrorCode.INTERNAL)
    return _BY_CODE.get(known, KvdError)(detail, known)
