"""Runs in a TP worker: the pool's region pinned for DMA, for the CUDA backend (`cuda`).

Backends over one region (the parts of slots holding several device blocks,
`SlotLayout.of`) share its registration: the first registers it, the last
to close unregisters it. It is registered in pieces of at most
`MAX_REGISTER_BYTES` (64 GiB), each a whole number of rows and of pages, as
vLLM registers its offload region (`MAX_HOST_REGISTER_CHUNK_BYTES = 64 *
1024**3` and `pin_mmap_region` in `vllm/v1/kv_offload/cpu/gpu_worker.py`,
"to avoid driver limits on large host allocations"); a piece refused undoes
the ones before it. The backend cuts its copies where a piece ends
(`piece_bytes`).

A registration the driver refuses (a sandbox such as gVisor that cannot pin
a shared mapping, a pool past what the driver will lock) raises KvdError
from the backend's constructor: the vLLM worker logs "kvd offloading off" at
its start, and every job after fails at once (a load recomputed, a store not
completed; one log line a kind at most every 30 s,
`kvd_client.vllm.boundary`). A failed `cudaHostRegister` leaves its error
pending on the calling thread, and torch's next launch check
(`cudaGetLastError` after each kernel) would report it as that kernel's
failure: vLLM's next forward pass would crash the engine. So the failure is
cleared at once with `cudaGetLastError`, as vLLM's own `host_register` does
(`vllm/v1/kv_offload/cpu/host_register.py`). torch's `torch.cuda.cudart()`
has `cudaHostRegister` but no `cudaGetLastError`, and the error must be
cleared in the runtime that recorded it, so registering, unregistering and
clearing all go through the CUDA runtime library torch loaded (found in
`/proc/self/maps`, as vLLM's `find_loaded_library` finds it), called with
ctypes. A refusal is kept for the process: later backends raise it again
without asking the driver, so a worker that maps the pool again for each job
does not pin (and unpin) up to the whole pool on every one.

Why raise rather than copy through pageable memory: see `cuda`.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import threading
from typing import Any

from kvd_client.errors import ErrorCode, KvdError

_HOST_REGISTER_DEFAULT = 0
ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered
MAX_REGISTER_BYTES = 64 << 30  # one cudaHostRegister call at most (module docstring)
# (host pointer, bytes) -> (backends of this process holding that registration,
# the addresses of its pieces)
_PINNED: dict[tuple[int, int], tuple[int, list[int]]] = {}
_PINNED_LOCK = threading.Lock()  # a worker's keeper thread builds backends too
_REFUSED: list[str] = []  # why the driver refused a registration in this process


def loaded_library(prefix: str) -> str | None:
    """The path of the loaded library `prefix`.so[...] (or `prefix`-<hash>.so), if any."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line[line.find("/") :].strip() if "/" in line else ""
            if path.rsplit("/", 1)[-1].startswith((f"{prefix}.", f"{prefix}-")):
                return path
    return None


@functools.cache
def cudart() -> Any:
    """The CUDA runtime torch loaded, with the three calls kvd makes (module docstring)."""
    path = loaded_library("libcudart")
    if path is None:
        raise KvdError("no CUDA runtime (libcudart) is loaded here: cannot pin the pool",
                       ErrorCode.INTERNAL)  # fmt: skip
    lib = ctypes.CDLL(path)
    lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
    lib.cudaGetLastError.argtypes = []
    for call in (lib.cudaHostRegister, lib.cudaHostUnregister, lib.cudaGetLastError):
        call.restype = ctypes.c_int
    return lib


def piece_bytes(row_bytes: int) -> int:
    """Bytes of a registration piece: whole rows and whole pages (so no page is
    in two pieces), at most `MAX_REGISTER_BYTES` unless one such unit is more."""
    unit = math.lcm(row_bytes, mmap.PAGESIZE)
    return max(1, MAX_REGISTER_BYTES // unit) * unit


def register(ptr: int, nbytes: int, row_bytes: int) -> list[int]:
    """Registers `nbytes` at `ptr` as pinned memory, piece by piece (`piece_bytes`);
    the pieces' addresses. KvdError, with the CUDA error cleared and the pieces
    before it undone, if the driver refuses one (now or earlier in this process)."""
    if _REFUSED:
        raise KvdError(f"{_REFUSED[0]} (refused earlier in this process)", ErrorCode.INTERNAL)
    runtime = cudart()
    piece = piece_bytes(row_bytes)
    done: list[int] = []
    for offset in range(0, nbytes, piece):
        code = int(runtime.cudaHostRegister(ptr + offset, min(piece, nbytes - offset),
                                           _HOST_REGISTER_DEFAULT))  # fmt: skip
        if code == 0:
            done.append(ptr + offset)
            continue
        runtime.cudaGetLastError()  # else torch's next launch check fails the next kernel
        unregister(done)
        hint = " (already registered: close the other backend first)" * (code == ALREADY_REGISTERED)
        _REFUSED.append(f"cudaHostRegister of the pool failed at byte {offset} of {nbytes}: "
                        f"cudaError {code}{hint}")  # fmt: skip
        raise KvdError(_REFUSED[0], ErrorCode.INTERNAL)
    return done


def unregister(pieces: list[int]) -> None:
    """Unregisters the pieces `register` pinned, last first; a failure is cleared,
    not raised (close goes on)."""
    runtime = cudart()
    for address in reversed(pieces):
        if int(runtime.cudaHostUnregister(address)) != 0:
            runtime.cudaGetLastError()


def hold(ptr: int, nbytes: int, row_bytes: int) -> None:
    """One more backend over the region at `ptr`: the first registers it (`register`)."""
    with _PINNED_LOCK:
        holders, pieces = _PINNED.get((ptr, nbytes), (0, []))
        if not holders:
            pieces = register(ptr, nbytes, row_bytes)
        _PINNED[ptr, nbytes] = (holders + 1, pieces)


def release(ptr: int, nbytes: int) -> None:
    """One backend fewer over the region (a `hold` given back): the last unregisters it."""
    with _PINNED_LOCK:
        holders, pieces = _PINNED.pop((ptr, nbytes))
        if holders > 1:
            _PINNED[ptr, nbytes] = (holders - 1, pieces)
        else:
            unregister(pieces)
