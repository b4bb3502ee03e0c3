"""Runs in SGLang's scheduler processes: the mapped pool segments and the copies into them.

Each generation of the pool (a cold daemon restart makes a new one) is
mapped once, with one kvd CPU transfer backend over SGLang's host pool
pages (`pages.page_views`) and this rank's slots: a batch of pages is one
`CopyJob`, copied by the backend's torch or native copier, with no Python
loop per page. `slots` is this rank's slots as `[num_blocks, slot_bytes]`
bytes, for SGLang's copying `get` / `set` of flat pages.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

from kvd_client import protocol as p
from kvd_client.backends import CopyJob, TransferBackend, make_backend
from kvd_client.worker import Mapping

KEEP_SEGMENTS = 2  # generations kept mapped: a copy may still run in the one before


class Segment:
    def __init__(self, attached: p.Attached, pages: Sequence[torch.Tensor], rank: int,
                 replicated: bool) -> None:  # fmt: skip
        self.generation = attached.generation
        self.mapping = Mapping(attached, replicated)
        g = self.mapping.geometry
        try:
            self.backend: TransferBackend | None = make_backend(
                "cpu", list(pages), self.mapping.mm, g, rank
            )
            region = torch.frombuffer(self.mapping.mm, dtype=torch.uint8)
            self.slots: torch.Tensor | None = region.as_strided(
                (g.num_blocks, g.slot_bytes), (g.row_bytes, 1), g.slot_index(rank) * g.slot_stride
            )
        except BaseException:
            self.mapping.close()
            raise
        self.lock = threading.Lock()  # SGLang's prefetch and backup threads both copy
        self._ids = itertools.count(1)

    def copy(self, kind: str, pages: Sequence[int], slots: Sequence[int]) -> str | None:
        """Copies host pages to slots ("store") or slots to pages ("load"); why not, or None."""
        with self.lock:
            backend = self.backend
            if backend is None:
                return "segment closed"
            job_id = next(self._ids)
            backend.submit(CopyJob(job_id, kind, pages, slots))
            (result,) = backend.wait([job_id])
        return None if result.ok else (result.error or "copy failed")

    def close(self) -> None:
        with self.lock:
            if self.backend is not None:
                self.backend.close()
            self.backend = None
            self.slots = None  # the views go before the mapping
        self.mapping.close()


class Segments:
    """The segments mapped so far, newest last."""

    def __init__(self, pages: Sequence[torch.Tensor], rank: int, replicated: bool) -> None:
        self._pages = list(pages)
        self._rank = rank
        self._replicated = replicated
        self._lock = threading.Lock()
        self._by_gen: OrderedDict[int, Segment] = OrderedDict()

    def get(self, attached: p.Attached) -> Segment:
        """The segment of `attached`, mapped on first use; raises what stops the mapping."""
        with self._lock:
            seg = self._by_gen.get(attached.generation)
            if seg is None:
                seg = Segment(attached, self._pages, self._rank, self._replicated)
                self._by_gen[attached.generation] = seg
            old = []
            while len(self._by_gen) > KEEP_SEGMENTS:
                old.append(self._by_gen.popitem(last=False)[1])
        for o in old:
            o.close()  # waits for a copy in flight in it (its lock)
        return seg

    def close(self) -> None:
        with self._lock:
            segs = list(self._by_gen.values())
            self._by_gen.clear()
        for s in segs:
            s.close()
