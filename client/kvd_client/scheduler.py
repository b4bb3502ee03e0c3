"""Runs in the engine's scheduler process: the index verbs and transfer jobs, over the wire.

`Scheduler` mirrors `kvd.core.index.BlockIndex` verb for verb (same names, same
return types; one round trip per batch) and adds `store`, `load` and
`finished` for engines whose TP workers use `kvd_client.Worker`.

When the daemon cannot be reached nothing raises into the engine's hot path:
`lookup` answers 0 hits, `prepare_store` and `store` answer `None`, `touch`
and the completions do nothing (the daemon already rolled the session back),
and jobs in flight are reported failed by `finished()` so the engine
recomputes. The keeper thread reconnects and re-attaches meanwhile.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from kvd_client import protocol as p
from kvd_client.connection import Connection
from kvd_client.errors import KvdError, Unavailable
from kvd_client.paths import default_endpoint, read_admin_token, runtime_dir_of
from kvd_client.types import LoadStoreSpec, PrepareStoreOutput, StoreTicket

log = logging.getLogger("kvd_client")
KeyLike = bytes | int


def as_keys(keys: Sequence[KeyLike]) -> list[bytes]:
    """Block hashes as bytes; ints are sent as 8-byte big-endian (SPEC section 3).

    A list that starts with bytes is sent as it is (the hot path); the daemon's
    schema rejects a wrong element with BAD_REQUEST.
    """
    if type(keys) is list and keys and type(keys[0]) is bytes:
        return keys
    return [
        k if isinstance(k, bytes) else (k & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "big") for k in keys
    ]


class Scheduler:
    def __init__(
        self,
        pool: str,
        layout: p.Layout,
        *,
        engine_id: str,
        endpoint: str | None = None,
        capacity_bytes: int | None = None,
        timeout_ms: int = 1000,
    ) -> None:
        self.pool = pool
        self.layout = layout
        self.engine_id = engine_id
        self.capacity_bytes = capacity_bytes
        self.attached: p.Attached | None = None
        self._results_lock = threading.Lock()
        self._outstanding: set[int] = set()
        self._lost: list[p.JobResult] = []
        # Sessions attached so far: what a session holds (pins, prepared stores)
        # is gone with it, and a restarted daemon numbers its sessions afresh.
        self.epoch = 0
        self._conn = Connection(
            endpoint or default_endpoint(),
            role="scheduler",
            engine_id=engine_id,
            rank=0,
            world_size=layout.world_size,
            timeout_ms=timeout_ms,
            on_connect=self._attach,
        )
        self._conn.on_disconnect = self._lose_jobs
        self._conn.start()

    def _attach(self, conn: Connection) -> None:
        reply = conn.call(p.Attach, self.pool, self.layout, self.capacity_bytes)
        assert isinstance(reply, p.Attached)
        if self.attached is not None and reply.generation != self.attached.generation:
            log.warning(
                "kvd pool %s was re-created (generation %d -> %d); the cache is cold",
                self.pool,
                self.attached.generation,
                reply.generation,
            )
        self.attached = reply
        self.epoch += 1

    def _lose_jobs(self) -> None:
        with self._results_lock:
            for job_id in sorted(self._outstanding):
                self._lost.append(p.JobResult(job_id, False, 0, 0.0, "daemon connection lost"))
            self._outstanding.clear()

    @property
    def connected(self) -> bool:
        """Whether a session with the daemon is up right now."""
        return self._conn.connected

    @property
    def session_id(self) -> int | None:
        return self._conn.welcome.session_id if self._conn.welcome else None

    def _call(self, cls: type, *args: object) -> p.Reply:
        return self._conn.call(cls, *args)

    # -- the index verbs -------------------------------------------------------

    def lookup(self, keys: Sequence[KeyLike]) -> int | None:
        """Leading keys present and ready; `None` = retry later; 0 when disconnected."""
        if not self.connected:
            return 0
        try:
            reply = self._call(p.Lookup, as_keys(keys))
        except Unavailable:
            return 0
        assert isinstance(reply, p.LookupResult)
        return reply.hits

    def lookup_and_pin(self, keys: Sequence[KeyLike]) -> tuple[int | None, LoadStoreSpec]:
        """`lookup`, and `prepare_load` of the leading hits, in one round trip: the
        hits are pinned until `complete_load` of them. `(0, [])` when disconnected."""
        if not self.connected:
            return 0, LoadStoreSpec([])
        try:
            reply = self._call(p.Lookup, as_keys(keys), True)
        except Unavailable:
            return 0, LoadStoreSpec([])
        assert isinstance(reply, p.LookupResult)
        return reply.hits, LoadStoreSpec(reply.slots)

    def prepare_load(self, keys: Sequence[KeyLike]) -> LoadStoreSpec:
        """Pins keys; raises `MissingKey`/`NotReady`, or `Unavailable` when disconnected."""
        reply = self._call(p.PrepareLoad, as_keys(keys))
        assert isinstance(reply, p.SlotsResult)
        return LoadStoreSpec(reply.slots)

    def touch(self, keys: Sequence[KeyLike]) -> None:
        self._quiet(p.Touch, as_keys(keys))

    def complete_load(self, keys: Sequence[KeyLike]) -> None:
        self._quiet(p.CompleteLoad, as_keys(keys))

    def prepare_store(self, keys: Sequence[KeyLike]) -> PrepareStoreOutput | None:
        """Allocates slots; `None` when nothing fits or the daemon is unreachable."""
        if not self.connected:
            return None
        try:
            reply = self._call(p.PrepareStore, as_keys(keys))
        except Unavailable:
            return None
        assert isinstance(reply, p.PrepareStoreResult)
        if not reply.fits:
            return None
        return PrepareStoreOutput(
            reply.keys_to_store, LoadStoreSpec(reply.slots), reply.evicted_keys
        )

    def complete_store(self, keys: Sequence[KeyLike], success: bool = True) -> bool:
        """Whether the daemon took the completion (False when disconnected: the
        daemon rolls the session's stores back, and the blocks never become ready)."""
        return self._quiet(p.CompleteStore, as_keys(keys), success)

    def _quiet(self, cls: type, *args: object) -> bool:
        # Disconnected: the daemon rolled the session back already; nothing to do.
        if not self.connected:
            return False
        try:
            self._call(cls, *args)
        except Unavailable:
            return False
        return True

    # -- transfer jobs ---------------------------------------------------------

    def store(self, keys: Sequence[KeyLike], device_block_ids: Sequence[int]) -> StoreTicket | None:
        """Stores blocks through the engine's workers; `None` when nothing fits or disconnected."""
        if not self.connected:
            return None
        try:
            reply = self._call(p.Store, as_keys(keys), list(device_block_ids))
        except Unavailable:
            return None
        assert isinstance(reply, p.StoreTicket)
        if not reply.fits:
            return None
        if reply.job_id is not None:
            with self._results_lock:
                self._outstanding.add(reply.job_id)
        return StoreTicket(reply.job_id, reply.keys_to_store, reply.evicted_keys)

    def load(self, keys: Sequence[KeyLike], device_block_ids: Sequence[int]) -> int:
        """Starts a load job and returns its id; raises `KvdError` when it cannot start."""
        reply = self._call(p.Load, as_keys(keys), list(device_block_ids))
        assert isinstance(reply, p.LoadTicket)
        with self._results_lock:
            self._outstanding.add(reply.job_id)
        return reply.job_id

    def finished(self) -> list[p.JobResult]:
        """Jobs that completed (or failed) since the last call."""
        results: list[p.JobResult] = []
        if self.connected:
            try:
                reply = self._call(p.Finished)
                assert isinstance(reply, p.FinishedResult)
                results = reply.results
            except Unavailable:
                pass  # the connection dropped: its jobs are in self._lost below
        with self._results_lock:
            for r in results:
                self._outstanding.discard(r.job_id)
            results = self._lost + results
            self._lost = []
        return results

    # -- admin -----------------------------------------------------------------

    def stats(self) -> p.StatsResult:
        reply = self._call(p.Stats)
        assert isinstance(reply, p.StatsResult)
        return reply

    def check_invariants(self, token: str | None = None) -> list[str]:
        """The daemon's invariant check of every pool; needs the operator token
        (`token`, else read from the endpoint's runtime dir where this user may)."""
        if token is None:
            runtime = runtime_dir_of(self._conn.endpoint)
            token = read_admin_token(runtime) if runtime is not None else ""
        reply = self._call(p.CheckInvariants, token)
        assert isinstance(reply, p.InvariantsResult)
        return reply.problems

    def close(self) -> None:
        """Ends the session (the daemon rolls back what it still holds)."""
        self._conn.close()

    def __enter__(self) -> Scheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["KvdError", "Scheduler", "as_keys"]
