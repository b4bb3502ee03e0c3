"""Runs in a TP worker: transfer backends, device KV cache <-> the rank's pool slots.

`make_backend` picks one; the CPU and CUDA modules (and torch) are imported
only when a backend is made, so importing this package stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvd_client.backends.base import CopyJob, CopyResult, TransferBackend
from kvd_client.errors import BadRequest
from kvd_client.geometry import Geometry

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["CopyJob", "CopyResult", "TransferBackend", "make_backend"]


def make_backend(
    device: str | None,
    kv_caches: Any,
    region: Buffer,
    geometry: Geometry,
    rank: int,
    *,
    native_min_bytes: int | None = None,
) -> TransferBackend:
    """The backend for `device` ("cpu", "cuda", "cuda:N"; None: where `kv_caches` live).

    `native_min_bytes` is the CPU backend's switch to its native copier
    (`kvd_client.settings`; None: its default).

    `BadRequest` for another device or for caches that do not fit the geometry.
    """
    if device is None:
        first = kv_caches if hasattr(kv_caches, "device") else next(iter(kv_caches), None)
        device = str(getattr(first, "device", "cpu"))
    kind = device.split(":", 1)[0]
    if kind == "cpu":
        from kvd_client.backends.cpu import CpuBackend

        return CpuBackend(kv_caches, region, geometry, rank, native_min_bytes=native_min_bytes)
    if kind == "cuda":
        from kvd_client.backends.cuda import CudaBackend

        return CudaBackend(kv_caches, region, geometry, rank)
    raise BadRequest(f"no transfer backend for device {device!r} (cpu or cuda)")
