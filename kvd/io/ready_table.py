"""Runs in the daemon: writes a pool's ready table, its ready set in shared memory (SPEC 15).

The layout, the states and the readers are in `kvd_client.ready_table`. The
daemon's event loop writes it: the pool's `BlockIndex` tells its
sink (`kvd.core.index.types.ReadySink`, which this class is) of every key
whose state changes (`storing` at `prepare_store`, `ready` at a successful
`complete_store`, `gone` when it is evicted or its store fails) and `reset`
when it is emptied, in the same step as the change, before the daemon
answers anyone. The one other writer is a warm restart's fill (`adopted`),
on a thread of its own while the loop goes on, under an odd epoch: readers
ask the daemon until it is done, and the loop's own writes to the table
wait for it (a join on the loop: a few tenths of a second at 1M blocks, and
only if a write comes that early). Each bucket is written under its sequence
counter (odd while it changes), so readers never take a lock and the writer
never waits for one.

A deleted key's bucket is emptied and the rest of its cluster shifted back
(no tombstones, so no rebuild ever stalls the loop; at most half the buckets
are used, so clusters stay short). A reset empties every bucket under an odd
epoch, as does a pool whose reset waits for its copies (`begin_reset`):
readers answer from the RPC path meanwhile. The table
is created with the pool's segment mode minus write for the group: readers
map it read-only and cannot change it.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import mmap
import os
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

import posix_ipc

from kvd.io.region import Manifest
from kvd_client.ready_table import (
    ALIVE_OFFSET,
    BUCKET,
    BUCKET_BYTES,
    EMPTY,
    EPOCH_OFFSET,
    HEADER,
    HEADER_BYTES,
    MAGIC,
    MAX_KEY_BYTES,
    READY,
    STORING,
    VERSION,
    bucket_of,
    num_buckets_for,
)

_warmstart: Any
try:  # a warm restart's fill in C, built with the package where a compiler was there
    _warmstart = importlib.import_module("kvd_client._warmstart")
except ImportError:  # pragma: no cover - depends on the install
    _warmstart = None

log = logging.getLogger(__name__)

_SEQ = struct.Struct("<I")
_EPOCH = struct.Struct("<Q")


class ReadyTableWriter:
    def __init__(
        self, name: str, num_blocks: int, generation: int, *, gid: int | None, manifest: Manifest
    ) -> None:
        mode = 0o640 if gid is not None else 0o600  # readable by the group, never writable
        self.name = name
        self._manifest = manifest
        self.num_buckets = num_buckets_for(num_blocks)
        self.nbytes = self.size_for(num_blocks)
        self._mask = self.num_buckets - 1
        self._live = 0
        self._filling: threading.Thread | None = None  # a warm restart's fill, until joined
        self._fill_failed = False
        try:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=mode, size=self.nbytes)
        except posix_ipc.ExistentialError:
            raise FileExistsError(f"shared memory segment {name} already exists") from None
        manifest.add(name)  # unlinked at the next start if this run dies
        try:
            os.fchmod(shm.fd, mode)  # the umask must not widen or narrow it
            if gid is not None:
                os.fchown(shm.fd, -1, gid)
            # Every page now: a full /dev/shm is an error here, not a SIGBUS later.
            os.posix_fallocate(shm.fd, 0, self.nbytes)
            self._mm = mmap.mmap(shm.fd, self.nbytes)
        except BaseException:
            shm.close_fd()
            self._unlink()
            raise
        shm.close_fd()
        HEADER.pack_into(self._mm, 0, MAGIC, VERSION, BUCKET_BYTES, self.num_buckets,
                         generation, 0)  # fmt: skip
        self.beat()

    @staticmethod
    def size_for(num_blocks: int) -> int:
        """The bytes of shared memory a table for `num_blocks` blocks holds."""
        return HEADER_BYTES + num_buckets_for(num_blocks) * BUCKET_BYTES

    def beat(self) -> None:
        """Says the daemon is alive (`alive_ns`); the daemon calls it every tick."""
        _EPOCH.pack_into(self._mm, ALIVE_OFFSET, time.monotonic_ns())

    # -- the index's sink ---------------------------------------------------

    def storing(self, keys: Sequence[bytes]) -> None:
        self.set_states(keys, STORING)

    def ready(self, keys: Sequence[bytes]) -> None:
        self.set_states(keys, READY)

    def gone(self, keys: Sequence[bytes]) -> None:
        self.set_states(keys, EMPTY)

    def adopted(self, keys: Sequence[bytes]) -> None:
        """`keys` (distinct) READY in this table while it is still empty: a warm
        restart's blocks. In C (`kvd_client._warmstart.fill`, without the GIL) on
        a thread of its own while the daemon goes on starting and serving, under
        an odd epoch: until it is done, readers ask the daemon. Every other write
        to the table first waits for it (`wait_filled`)."""
        if self._live or self._filling is not None:
            raise RuntimeError("adopted() needs an empty ready table")
        if _warmstart is None:
            self.set_states(keys, READY)
            return
        self.begin_reset()  # odd: readers ask the daemon meanwhile
        # The C reads the list without the GIL: one nothing changes (the index's
        # adopted keys are never changed; a copy of 1M touches 1M objects).
        batch = keys if isinstance(keys, list) else list(keys)
        self._filling = threading.Thread(
            target=self._fill, args=(batch,), name=f"kvd-fill-{self.name}", daemon=True
        )
        self._filling.start()

    def _fill(self, keys: list[bytes]) -> None:
        try:
            self._live = _warmstart.fill(self._mm, keys, self._mask)
        except Exception as exc:  # a bug, not a state: the epoch stays odd, lookups take the RPC
            self._fill_failed = True
            log.error("event=ready_table_fill_failed shm=%s error=%r", self.name, exc)
            return
        self._end_reset()
        log.info("event=ready_table_filled shm=%s keys=%d", self.name, self._live)

    def wait_filled(self) -> None:
        """Returns once a warm restart's fill (`adopted`) is done."""
        if self._filling is not None:
            self._filling.join()
            self._filling = None

    # -- writes -------------------------------------------------------------

    def set_states(self, keys: Sequence[bytes], state: int) -> None:
        """Publishes `state` (STORING, READY, or EMPTY: gone) for each key."""
        if self._filling is not None:
            self.wait_filled()
        for key in keys:
            if len(key) <= MAX_KEY_BYTES:  # the protocol admits no longer key
                self._set(key, state)

    def _find(self, key: bytes) -> tuple[int, bool]:
        """The bucket holding `key` (True), or the empty bucket ending its probe (False)."""
        mm, mask, head, n = self._mm, self._mask, BUCKET.size, len(key)
        i = bucket_of(key, mask)
        while True:  # at most half full: an empty bucket always ends the probe
            off = HEADER_BYTES + i * BUCKET_BYTES
            state, key_len = mm[off + 4], mm[off + 5]
            if state == EMPTY:
                return i, False
            if key_len == n and mm[off + head : off + head + n] == key:
                return i, True
            i = (i + 1) & mask

    def _set(self, key: bytes, state: int) -> None:
        i, found = self._find(key)
        off = HEADER_BYTES + i * BUCKET_BYTES
        if state == EMPTY:
            if found:
                self._delete(i)
        elif not found:
            self._write(off, state, key)
            self._live += 1
        elif self._mm[off + 4] != state:
            self._write(off, state, None)

    def _delete(self, i: int) -> None:
        """Empties bucket `i` and shifts the rest of its cluster back, so that no
        tombstone is left and every probe still ends at an empty bucket (Knuth's
        algorithm R). A reader racing a shift may miss a moving key; a copy is
        written before its original is overwritten, so it never sees a wrong one."""
        mm, mask, head = self._mm, self._mask, BUCKET.size
        j = i
        while True:
            j = (j + 1) & mask
            off_j = HEADER_BYTES + j * BUCKET_BYTES
            state = mm[off_j + 4]
            if state == EMPTY:
                break
            key = bytes(mm[off_j + head : off_j + head + mm[off_j + 5]])
            home = bucket_of(key, mask)
            stays = (i < home <= j) if i <= j else (home > i or home <= j)
            if not stays:  # its probe passes through i: move it there
                self._write(HEADER_BYTES + i * BUCKET_BYTES, state, key)
                i = j
        self._write(HEADER_BYTES + i * BUCKET_BYTES, EMPTY, None)
        self._live -= 1

    def _write(self, off: int, state: int, key: bytes | None) -> None:
        """One bucket under its sequence counter: odd, change, even."""
        mm = self._mm
        seq = _SEQ.unpack_from(mm, off)[0]
        _SEQ.pack_into(mm, off, (seq + 1) & 0xFFFFFFFF)
        if key is None:
            mm[off + 4] = state
        else:
            head = BUCKET.size
            mm[off + head : off + head + len(key)] = key
            mm[off + 4] = state
            mm[off + 5] = len(key)
        _SEQ.pack_into(mm, off, (seq + 2) & 0xFFFFFFFF)

    def reset(self) -> None:
        """Every key gone (the pool was reset), under an odd epoch."""
        self._rewrite([])

    def begin_reset(self) -> None:
        """The pool is being reset (it empties once its copies end): until `reset`,
        the epoch is odd and readers ask the daemon, which answers no hits."""
        self.wait_filled()
        epoch = _EPOCH.unpack_from(self._mm, EPOCH_OFFSET)[0]
        if epoch % 2 == 0:
            _EPOCH.pack_into(self._mm, EPOCH_OFFSET, epoch + 1)

    def _rewrite(self, live: list[tuple[bytes, int]]) -> None:
        mm = self._mm
        self.begin_reset()  # odd: readers ask the daemon
        self._fill_failed = False  # every bucket is written again: the table is whole
        for i in range(self.num_buckets):
            off = HEADER_BYTES + i * BUCKET_BYTES
            if mm[off + 4] != EMPTY:
                self._write(off, EMPTY, None)
        self._live = 0
        for key, state in live:
            self._set(key, state)
        self._end_reset()

    def _end_reset(self) -> None:
        """The epoch even again: readers answer from the table (never after a failed fill)."""
        if self._fill_failed:
            return
        epoch = _EPOCH.unpack_from(self._mm, EPOCH_OFFSET)[0]
        _EPOCH.pack_into(self._mm, EPOCH_OFFSET, epoch + 1)

    # -- lifetime -------------------------------------------------------------

    def _unlink(self) -> None:
        with contextlib.suppress(posix_ipc.ExistentialError):  # gone already: a reboot
            posix_ipc.unlink_shared_memory(self.name)
        self._manifest.remove(self.name)

    def close(self) -> None:
        """Unlinks the table. Readers keep what they mapped until they let go, so
        the epoch is left odd first: their lookups go to the daemon from then on."""
        self.wait_filled()
        epoch = _EPOCH.unpack_from(self._mm, EPOCH_OFFSET)[0]
        if epoch % 2 == 0:
            _EPOCH.pack_into(self._mm, EPOCH_OFFSET, epoch + 1)
        self._mm.close()
        self._unlink()
