"""Runs in the daemon: writes a pool's ready table, its ready set in shared memory (SPEC 15).

The layout, the states and the readers are in `kvd_client.ready_table`. The
daemon's event loop is the only writer: the pool's `BlockIndex` tells its
sink (`kvd.core.index.types.ReadySink`, which this class is) of every key
whose state changes (`storing` at `prepare_store`, `ready` at a successful
`complete_store`, `gone` when it is evicted or its store fails) and `reset`
when it is emptied, in the same step as the change, before the daemon
answers anyone. Each bucket is written under its sequence
counter (odd while it changes), so readers never take a lock and the writer
never waits for one.

A deleted key leaves a GONE bucket so that probes for keys further along go
on; when GONE buckets pass a quarter of the table, it is rebuilt in place
under an odd epoch (readers answer from the RPC path meanwhile). The table
is created with the pool's segment mode minus write for the group: readers
map it read-only and cannot change it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from collections.abc import Sequence

import posix_ipc

from kvd.io.region import Manifest
from kvd_client.ready_table import (
    BUCKET,
    BUCKET_BYTES,
    EMPTY,
    EPOCH_OFFSET,
    GONE,
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
        self.nbytes = HEADER_BYTES + self.num_buckets * BUCKET_BYTES
        self._mask = self.num_buckets - 1
        self._gone = 0
        self._live = 0
        try:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=mode, size=self.nbytes)
        except posix_ipc.ExistentialError:
            raise FileExistsError(f"shared memory segment {name} already exists") from None
        manifest.add(name)  # unlinked at the next start if this run dies
        try:
            os.fchmod(shm.fd, mode)  # the umask must not widen or narrow it
            if gid is not None:
                os.fchown(shm.fd, -1, gid)
            self._mm = mmap.mmap(shm.fd, self.nbytes)
        except BaseException:
            shm.close_fd()
            self._unlink()
            raise
        shm.close_fd()
        HEADER.pack_into(self._mm, 0, MAGIC, VERSION, BUCKET_BYTES, self.num_buckets,
                         generation, 0)  # fmt: skip

    # -- the index's sink ---------------------------------------------------

    def storing(self, keys: Sequence[bytes]) -> None:
        self.set_states(keys, STORING)

    def ready(self, keys: Sequence[bytes]) -> None:
        self.set_states(keys, READY)

    def gone(self, keys: Sequence[bytes]) -> None:
        self.set_states(keys, EMPTY)

    # -- writes -------------------------------------------------------------

    def set_states(self, keys: Sequence[bytes], state: int) -> None:
        """Publishes `state` (STORING, READY, or EMPTY: gone) for each key."""
        for key in keys:
            if len(key) > MAX_KEY_BYTES:
                continue  # never published: readers miss it, the RPC path still answers
            self._set(key, state)
        if self._gone > self.num_buckets // 4:
            self._rebuild()

    def _set(self, key: bytes, state: int) -> None:
        mm, mask, head, n = self._mm, self._mask, BUCKET.size, len(key)
        i = bucket_of(key, mask)
        free = -1
        for _ in range(self.num_buckets):
            off = HEADER_BYTES + i * BUCKET_BYTES
            _, old, key_len, _ = BUCKET.unpack_from(mm, off)
            if old == EMPTY:
                break
            if old == GONE:
                if free < 0:
                    free = off
            elif key_len == n and mm[off + head : off + head + n] == key:
                if state == EMPTY:
                    self._write(off, GONE, None)
                    self._live -= 1
                    self._gone += 1
                elif state != old:
                    self._write(off, state, None)
                return
            i = (i + 1) & mask
        else:
            off = -1  # no empty bucket: cannot happen below half full
        if state == EMPTY:
            return  # not published (too long, or never stored): nothing to clear
        if free >= 0:
            self._gone -= 1
            off = free
        if off < 0:
            raise RuntimeError(f"ready table {self.name} is full")
        self._write(off, state, key)
        self._live += 1

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

    def _rebuild(self) -> None:
        """Rewrites the live keys without their GONE buckets, under an odd epoch."""
        mm, head = self._mm, BUCKET.size
        live = []
        for i in range(self.num_buckets):
            off = HEADER_BYTES + i * BUCKET_BYTES
            _, state, key_len, _ = BUCKET.unpack_from(mm, off)
            if state in (STORING, READY):
                live.append((bytes(mm[off + head : off + head + key_len]), state))
        self._rewrite(live)

    def _rewrite(self, live: list[tuple[bytes, int]]) -> None:
        mm = self._mm
        epoch = _EPOCH.unpack_from(mm, EPOCH_OFFSET)[0]
        _EPOCH.pack_into(mm, EPOCH_OFFSET, epoch + 1)  # odd: readers ask the daemon
        for i in range(self.num_buckets):
            off = HEADER_BYTES + i * BUCKET_BYTES
            if mm[off + 4] != EMPTY:
                self._write(off, EMPTY, None)
        self._gone = self._live = 0
        for key, state in live:
            self._set(key, state)
        _EPOCH.pack_into(mm, EPOCH_OFFSET, epoch + 2)

    # -- lifetime -------------------------------------------------------------

    def _unlink(self) -> None:
        with contextlib.suppress(posix_ipc.ExistentialError):  # gone already: a reboot
            posix_ipc.unlink_shared_memory(self.name)
        self._manifest.remove(self.name)

    def close(self) -> None:
        """Unlinks the table. Readers keep what they mapped until they let go, so
        the epoch is left odd first: their lookups go to the daemon from then on."""
        epoch = _EPOCH.unpack_from(self._mm, EPOCH_OFFSET)[0]
        if epoch % 2 == 0:
            _EPOCH.pack_into(self._mm, EPOCH_OFFSET, epoch + 1)
        self._mm.close()
        self._unlink()
