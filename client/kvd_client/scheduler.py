"""Runs in the engine's scheduler process: the index verbs and transfer jobs, over the wire.

`Scheduler` mirrors `kvd.core.index.BlockIndex` verb for verb (same names, same
return types; one round trip per batch) and adds `store`, `load` and
`finished` for engines whose TP workers use `kvd_client.Worker`.

`lookup` costs no round trip where the daemon publishes the pool's ready table
(SPEC section 15) and this process can map it: it reads the table, and reports
its lookups to the daemon in batches (`kvd_client.observe`), so the admission
policy still learns. A table that cannot be mapped (an older daemon, another
host, no permission), a reset racing the read, or `use_table=False` take the
round trip. `prepare_load` is always a round trip, and authoritative: a block
evicted since the lookup is refused there. A `prepare_store` of keys the table
shows all ready takes none either (the daemon would skip them all).

When the daemon cannot be reached nothing raises into the engine's hot path:
`lookup` answers 0 hits, `prepare_store` and `store` answer `None` (but a
`prepare_store` the table answers, until it is stale), `touch` and the
completions do nothing (the daemon already rolled the session back), and jobs
in flight are reported failed by `finished()` so the engine recomputes. The
keeper thread reconnects and re-attaches meanwhile.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Sequence

from kvd_client import protocol as p
from kvd_client.connection import Connection
from kvd_client.errors import KvdError, Unavailable
from kvd_client.keys import PART_KEYS, KeyLike, as_keys, parts
from kvd_client.observe import LookupReports
from kvd_client.paths import default_endpoint, read_admin_token, runtime_dir_of
from kvd_client.ready_table import MappedTable, TableChanged, supported
from kvd_client.types import LoadStoreSpec, PrepareStoreOutput, StoreTicket

log = logging.getLogger("kvd_client")


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
        use_table: bool = True,
    ) -> None:
        self.pool = pool
        self.use_table = use_table and supported()
        # The mapped ready table of the attached generation; the one before stays
        # mapped too, since a lookup may still be reading it when a reconnect swaps.
        self.table: MappedTable | None = None
        self._old_table: MappedTable | None = None
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
        self._observed = LookupReports(functools.partial(self._conn.post, p.Observe))
        self._conn.start()

    def _attach(self, conn: Connection) -> None:
        reply = conn.call(p.Attach, self.pool, self.layout, self.capacity_bytes)
        assert isinstance(reply, p.Attached)
        if self.attached is not None and reply.generation != self.attached.generation:
            log.warning("kvd pool %s was re-created (generation %d -> %d); the cache is cold",
                        self.pool, self.attached.generation, reply.generation)  # fmt: skip
        self.attached = reply
        self._map_table(reply)
        self.epoch += 1
        conn.tag = self.epoch

    def _map_table(self, reply: p.Attached) -> None:
        table = None
        if self.use_table and reply.ready_table:
            try:
                table = MappedTable(reply.ready_table)
                if table.generation != reply.generation:
                    raise ValueError(f"generation {table.generation}, not {reply.generation}")
            except (OSError, ValueError) as exc:  # gone, not ours to read, not a table
                log.info("kvd pool %s: lookups take the round trip: ready table %s: %s",
                         self.pool, reply.ready_table, exc)  # fmt: skip
                table = None
        self._old_table, self.table = self.table, table

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

    @property
    def lease_s(self) -> float:
        """The daemon's lease (SPEC 7); 10 s until a daemon said otherwise."""
        welcome = self._conn.welcome
        return welcome.lease_ms / 1000 if welcome is not None else 10.0

    def alive_since(self) -> tuple[int, float]:
        """`(epoch, t)`: session `epoch` was alive at monotonic time t (the daemon
        answered a request sent then), so it and what it holds outlive t by a lease."""
        return self._conn.acked

    def _call(self, cls: type, *args: object) -> p.Reply:
        if self._observed:  # the daemon learns of earlier lookups first, in order
            self.flush_observed()
        return self._conn.call(cls, *args)

    # -- the index verbs -------------------------------------------------------

    def lookup(self, keys: Sequence[KeyLike]) -> int | None:
        """Leading keys present and ready; `None` = retry later; 0 when disconnected
        or refused (never raises: the engine's hot path). Keys past the daemon's
        bound per request are looked up in several round trips where the table
        cannot answer."""
        if not self.connected:
            return 0
        table = self.table
        if table is not None:
            ks = as_keys(keys)
            try:
                hits = table.lookup(ks)
            except TableChanged:
                pass  # a reset or rebuild raced the read: ask the daemon
            else:
                attached = self.attached
                if not (hits is not None and hits < len(ks) and attached and attached.remote):
                    self._observed.add(ks, hits)
                    return hits
                # A miss where the daemon has a remote tier: it may fetch the rest.
        try:
            hits, _ = self._lookup_rpc(as_keys(keys), False)
        except Unavailable:
            return 0
        except KvdError as exc:  # a lookup is advice: the daemon refusing it is a miss
            log.warning("kvd lookup of %d keys answered as a miss: %s", len(keys), exc)
            return 0
        return hits

    def lookup_and_pin(self, keys: Sequence[KeyLike]) -> tuple[int | None, LoadStoreSpec]:
        """`lookup`, and `prepare_load` of the leading hits, in one round trip: the
        hits are pinned until `complete_load` of them. `(0, [])` when disconnected."""
        if not self.connected:
            return 0, LoadStoreSpec([])
        try:
            hits, slots = self._lookup_rpc(as_keys(keys), True)
        except Unavailable:
            return 0, LoadStoreSpec([])
        return hits, LoadStoreSpec(slots)

    def _lookup_rpc(self, keys: list[bytes], pin: bool) -> tuple[int | None, list[int]]:
        """`Lookup` in requests of at most PART_KEYS keys (one round trip unless
        longer), each after the one before hit all its keys. A part that
        answers None (a key being stored) makes the whole None, and its pins go."""
        if len(keys) <= PART_KEYS:
            reply = self._call(p.Lookup, keys, pin)
            assert isinstance(reply, p.LookupResult)
            return reply.hits, reply.slots
        hits, slots = 0, list[int]()
        try:
            for part in parts(keys):
                reply = self._call(p.Lookup, part, pin)
                assert isinstance(reply, p.LookupResult)
                if reply.hits is None:
                    self._release(keys[: len(slots)])
                    return None, []
                hits += reply.hits
                slots += reply.slots
                if reply.hits < len(part):
                    break
        except KvdError:
            self._release(keys[: len(slots)])
            raise
        return hits, slots

    def _release(self, keys: list[bytes]) -> None:
        """Drops pins taken by the first parts of a split request that failed."""
        if keys:
            with contextlib.suppress(KvdError):
                self.complete_load(keys)

    def flush_observed(self) -> int:
        """Sends the table lookups not reported yet (as its thread does); how many."""
        return self._observed.flush()

    def prepare_load(self, keys: Sequence[KeyLike]) -> LoadStoreSpec:
        """Pins keys; raises `MissingKey`/`NotReady`, or `Unavailable` when disconnected.
        More than PART_KEYS keys go in several requests: all pinned, or none."""
        ks = as_keys(keys)
        slots: list[int] = []
        try:
            for part in parts(ks):
                reply = self._call(p.PrepareLoad, part)
                assert isinstance(reply, p.SlotsResult)
                slots += reply.slots
        except KvdError:
            self._release(ks[: len(slots)])
            raise
        return LoadStoreSpec(slots)

    def touch(self, keys: Sequence[KeyLike], *, wait: bool = True) -> None:
        """`wait=False`: sent without waiting for the reply (`_send`)."""
        send = self._quiet if wait else self._send
        for part in parts(as_keys(keys)):
            send(p.Touch, part)

    def complete_load(self, keys: Sequence[KeyLike], *, wait: bool = True) -> None:
        """Releases the load references of `keys`; raises what the daemon refuses
        (`NOT_OWNER`, ...). `wait=False` (the vLLM connector, when a load is done):
        sent without waiting for the reply, so the step goes on at once; the daemon
        takes it before anything this session asks next, and a refusal is logged,
        not raised (`_send`)."""
        send = self._quiet if wait else self._send
        for part in parts(as_keys(keys)):
            send(p.CompleteLoad, part)

    def prepare_store(self, keys: Sequence[KeyLike]) -> PrepareStoreOutput | None:
        """Allocates slots; `None` when nothing fits or the daemon is unreachable.
        More than PART_KEYS keys go in several requests, until one does not fit:
        the output is what the ones before it allocated. Keys the ready table
        shows all ready cost no round trip: the daemon would skip them all."""
        if not self.connected:
            return None
        ks = as_keys(keys)
        if ks and self._all_ready(ks):
            return PrepareStoreOutput([], LoadStoreSpec([]), [])
        stored: list[bytes] = []
        slots: list[int] = []
        evicted: list[bytes] = []
        fits = False
        try:
            for part in parts(ks):
                reply = self._call(p.PrepareStore, part)
                assert isinstance(reply, p.PrepareStoreResult)
                if not reply.fits:
                    break
                fits = True
                stored += reply.keys_to_store
                slots += reply.slots
                evicted += reply.evicted_keys
        except Unavailable:
            return None  # the daemon rolls back what the session prepared
        except KvdError:
            if stored:
                self.complete_store(stored, False)
            raise
        if not fits:
            return None
        return PrepareStoreOutput(stored, LoadStoreSpec(slots), evicted)

    def _all_ready(self, keys: list[bytes]) -> bool:
        """Whether the ready table shows every key ready (SPEC: `prepare_store`
        skips keys already present, so its answer would store nothing). A key
        evicted since is then not stored this time: a later miss, never a
        wrong block."""
        table = self.table
        if table is None:
            return False
        try:
            return table.lookup(keys) == len(keys)
        except TableChanged:
            return False

    def complete_store(self, keys: Sequence[KeyLike], success: bool = True) -> bool:
        """Whether the daemon took the completion (False when disconnected: the
        daemon rolls the session's stores back, and the blocks never become ready)."""
        return all([self._quiet(p.CompleteStore, part, success) for part in parts(as_keys(keys))])

    def _send(self, cls: type, *args: object) -> bool:
        """A request nothing waits on, sent without waiting for its reply (a
        refusal is logged by the connection); a call when the socket's queue is
        full, so it is never dropped."""
        if not self.connected:
            return False
        if self._observed:  # in order, as `_call`
            self.flush_observed()
        return self._conn.post(cls, *args) or self._quiet(cls, *args)

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

    def reset(self) -> None:
        """Empties the pool, for every engine attached to it (`Reset`, allowed to a
        session attached to the pool); raises `KvdError`, `Unavailable` when down."""
        self._call(p.Reset, self.pool)

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
        self._observed.stop()
        if self._observed and self.connected:
            self.flush_observed()
        self._conn.close()

    def __enter__(self) -> Scheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["KvdError", "Scheduler", "as_keys"]
