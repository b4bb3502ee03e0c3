"""Runs in a TP worker: the interface every transfer backend implements.

A backend owns the copies between one rank's device KV cache and that rank's
slots of the mapped pool. The `Worker` turns each wire `TransferJob` into a
`CopyJob`, submits it, and acknowledges each `CopyResult` to the daemon.

    kv_caches (device)                         region (mmap of the pool)
    one tensor [num_device_blocks, page]   <->  row p: | slot 0 | slot 1 | ...
    or per-layer tensors [num_device_blocks, ...]        ^ this rank's slot

Built once per mapping: a backend makes its views of the region (and, on
CUDA, registers it as pinned memory) in its constructor, and gives them up in
`close()`. Cleanup order: close the backend, then unmap the region.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType


@dataclass(frozen=True, slots=True)
class CopyJob:
    """One rank's part of a transfer job.

    `kind` "store" copies device -> pool and "load" pool -> device, pairing
    `device_block_ids[i]` with `pool_block_ids[i]` (any other kind fails the
    job). `writer` is False on the ranks of a replicated pool that must not
    store: rank 0 writes the one shared copy.
    """

    job_id: int
    kind: str
    device_block_ids: Sequence[int]
    pool_block_ids: Sequence[int]
    writer: bool = True


@dataclass(frozen=True, slots=True)
class CopyResult:
    """How a job ended on this rank: `nbytes` copied in `seconds`; `error` says why not ok."""

    job_id: int
    ok: bool
    nbytes: int
    seconds: float
    error: str | None = None


class TransferBackend(ABC):
    """Copies KV blocks between one rank's device cache and its slots of the pool."""

    @abstractmethod
    def submit(self, job: CopyJob) -> None:
        """Starts `job`; its result comes later from `poll` or `wait`.

        Returns once the copy is queued (CUDA) or done (CPU). Every id is
        checked before anything is copied: a job that cannot be copied (ids
        out of range, lists of different lengths, a destination block named
        twice, an unknown kind) finishes with `ok=False`, an error, and no
        byte moved; `submit` itself does not raise for it. A copy that fails
        midway also ends `ok=False`; the daemon then frees the slots, so no
        reader sees a torn block.

        A store with `writer=False` copies nothing and ends `ok=True`,
        `nbytes=0`. A load always copies. A store reads device memory only
        after the device work already issued when it is submitted (on CUDA:
        the current stream), so submit it after the forward pass that wrote
        the blocks. A load's blocks are ready once its result is out: wait for
        it before the forward pass that reads them.

        Raises `BadRequest` if `job.job_id` is still in flight or the backend
        is closed.
        """

    @abstractmethod
    def poll(self) -> list[CopyResult]:
        """Results of jobs that finished since they were last reported; never blocks.

        Each result is reported exactly once, by `poll` or by `wait`.
        """

    @abstractmethod
    def wait(self, job_ids: Iterable[int]) -> list[CopyResult]:
        """Blocks until none of `job_ids` is in flight; returns their unreported results.

        Results come in the order of `job_ids`. An id with neither a job in
        flight nor an unreported result (reported before, or never submitted)
        is skipped.
        """

    @abstractmethod
    def close(self) -> None:
        """Waits for jobs in flight, then releases streams, registrations and views.

        Idempotent. Unreported results are dropped. The region must stay
        mapped until `close` returns; afterwards nothing references it.
        """

    def __enter__(self) -> TransferBackend:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
