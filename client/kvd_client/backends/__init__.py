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
    part: int = 0,
    parts: int = 1,
    loads_wait: bool = False,
) -> TransferBackend:
    """The backend for `device` ("cpu", "cuda", "cuda:N"; None: where `kv_caches` live).

    `native_min_bytes` is the CPU backend's switch to its native copier
    (`kvd_client.settings`; None: its default). `part` of `parts`: the
    backend of that device block of slots holding several (`SlotLayout.of`;
    on CUDA each part's staging is 1/`parts` of the default). `loads_wait`:
    on CUDA, loads wait for the current stream too (`cuda`).

    `BadRequest` for another device or for caches that do not fit the geometry.
    """
    if device is None:
        first = kv_caches if hasattr(kv_caches, "device") else next(iter(kv_caches), None)
        device = str(getattr(first, "device", "cpu"))
    kind = device.split(":", 1)[0]
    if kind == "cpu":
        from kvd_client.backends.cpu import CpuBackend

        return CpuBackend(kv_caches, region, geometry, rank,
                          native_min_bytes=native_min_bytes, part=part, parts=parts)  # fmt: skip
    if kind == "cuda":
        from kvd_client.backends.cuda import STAGING_BYTES, CudaBackend

        return CudaBackend(kv_caches, region, geometry, rank, part=part, parts=parts,
                           staging_bytes=STAGING_BYTES // parts, loads_wait=loads_wait)  # fmt: skip
    raise BadRequest(f"no transfer backend for device {device!r} (cpu or cuda)")
