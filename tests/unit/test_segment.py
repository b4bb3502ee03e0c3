"""The pool segment's header and slot table (SPEC section 13), and the index's adoption.

The table is written on a memfd, as the daemon writes a segment; a "crash"
is a copy of the bytes taken between two writes, which is what a daemon
killed at that instant leaves behind.
"""

from __future__ import annotations

import os
import random
import struct
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.core.index import BlockIndex
from kvd.errors import KvdError
from kvd.io.region import SlotTable
from kvd_client.segment import (
    CRC_OFFSET,
    ENTRY_BYTES,
    FORMAT_VERSION,
    FREE,
    PAGE,
    READY,
    STORING,
    BadSegment,
    SegmentHeader,
    read_header,
    read_segment_header,
)


def header(num_blocks: int = 8, **over: object) -> SegmentHeader:
    fields: dict[str, object] = dict(
        generation=42, num_blocks=num_blocks, row_bytes=512, slot_bytes=300, num_slots=2,
        slot_stride=256, replicated=False, name="pool-a", layout=b"\x93layout", policy="lru",
    )  # fmt: skip
    fields.update(over)
    return SegmentHeader(**fields)  # type: ignore[arg-type]


@pytest.fixture
def fd() -> Iterator[int]:
    fd = os.memfd_create("kvd-test-segment")
    try:
        yield fd
    finally:
        os.close(fd)


def table_on(fd: int, h: SegmentHeader, fresh: bool = True) -> SlotTable:
    os.ftruncate(fd, h.size_bytes)
    return SlotTable(fd, h, fresh=fresh)


def crashed(fd: int, h: SegmentHeader) -> SlotTable:
    """What a new daemon finds: a copy of the segment's bytes as they are now."""
    copy = os.memfd_create("kvd-test-crash")
    os.ftruncate(copy, h.size_bytes)
    os.pwrite(copy, os.pread(fd, h.data_offset, 0), 0)
    return SlotTable(copy, read_segment_header(copy), fresh=False)


def test_the_header_round_trips_and_the_rows_start_on_a_page(fd: int) -> None:
    h = header(1000)
    table_on(fd, h).close()
    back = read_segment_header(fd)
    assert back == h
    assert h.data_offset % PAGE == 0 and h.data_offset >= h.table_offset + 1000 * ENTRY_BYTES
    assert h.size_bytes == h.data_offset + 1000 * 512 == os.fstat(fd).st_size


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda raw: raw.__setitem__(slice(0, 1), b"X"), "bad magic"),
        (lambda raw: raw.__setitem__(slice(30, 31), b"\xff"), "checksum"),
        (lambda raw: raw.__setitem__(slice(CRC_OFFSET, CRC_OFFSET + 1), b"\x00"), "checksum"),
        (
            lambda raw: struct.pack_into("<I", raw, 8, FORMAT_VERSION + 1),
            "format version",
        ),
    ],
    ids=["magic", "field", "crc", "version"],
)
def test_a_damaged_header_is_refused_with_its_reason(damage: object, reason: str) -> None:
    h = header()
    raw = bytearray(h.pack())
    damage(raw)  # type: ignore[operator]
    with pytest.raises(BadSegment, match=reason):
        read_header(bytes(raw), h.size_bytes)


def test_a_truncated_or_grown_segment_is_refused() -> None:
    h = header()
    raw = h.pack()
    with pytest.raises(BadSegment, match="the header says"):
        read_header(raw, h.size_bytes - 512)
    with pytest.raises(BadSegment, match="the header says"):
        read_header(raw, h.size_bytes + PAGE)
    with pytest.raises(BadSegment, match=r"truncated|shorter"):
        read_header(raw[:100], 100)


def test_ready_entries_come_back_oldest_first_and_freed_ones_do_not(fd: int) -> None:
    h = header()
    t = table_on(fd, h)
    t.ready([3, 1], [b"c", b"a"])
    t.ready([5], [b"e"])
    t.freed([1])
    t.ready([1], [b"z"])  # slot 1 reused for another key
    slots, keys, refused = crashed(fd, h).ready_entries()
    assert (slots, keys, refused) == ([3, 5, 1], [b"c", b"e", b"z"], 0)
    t.reset()
    assert crashed(fd, h).ready_entries() == ([], [], 0)


def test_a_crash_between_any_two_writes_leaves_only_whole_ready_entries(fd: int) -> None:
    """Between "slot cleared" and "slot written", and within the write of an entry."""
    h = header()
    t = table_on(fd, h)
    t.ready([2], [b"old"])
    t.freed([2])  # evicted: the slot is handed out again
    assert crashed(fd, h).ready_entries()[1] == []  # cleared, not yet written
    # Written whole but its state byte not yet set: not ready.
    at = h.table_offset + 2 * ENTRY_BYTES
    t.ready([2], [b"new"])
    t._mm[at] = 0
    assert crashed(fd, h).ready_entries()[1] == []
    t._mm[at] = READY
    assert crashed(fd, h).ready_entries()[1] == [b"new"]
    # A ready state over an entry that does not check out (a torn entry) is refused.
    t._mm[at + 17] ^= 0xFF  # a byte of the key
    after = crashed(fd, h)
    assert after.ready_entries() == ([], [], 1)
    assert after.ready_entries() == ([], [], 0)  # and freed


def test_a_key_ready_twice_keeps_its_newest_slot(fd: int) -> None:
    h = header()
    t = table_on(fd, h)
    t.ready([0], [b"k"])
    t.ready([4], [b"k"])  # cannot happen in one run; a table must still not serve both
    slots, keys, refused = crashed(fd, h).ready_entries()
    assert (slots, keys, refused) == ([4], [b"k"], 1)


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["store", "fail", "reset"]),
                              st.lists(st.integers(0, 30), min_size=1, max_size=6)),
                    max_size=40))  # fmt: skip
def test_the_table_holds_what_the_index_holds_ready(ops: list[tuple[str, list[int]]]) -> None:
    h = header(8)
    fd = os.memfd_create("kvd-test-prop")
    try:
        t = table_on(fd, h)
        index = BlockIndex(8, "lru")
        index.slot_sink = t
        for op, ids in ops:
            keys = [i.to_bytes(2, "big") for i in ids]
            if op == "reset":
                index.reset()
                continue
            out = index.prepare_store(keys)
            if out is not None and out.keys_to_store:
                index.complete_store(out.keys_to_store, success=op == "store")
        slots, keys, _ = crashed(fd, h).ready_entries()
        assert {k: index.slot_of(k) for k in keys} == dict(zip(keys, slots, strict=True))
        assert set(keys) == {k for k in map(index.key_at, range(8)) if k and index.is_ready(k)}
        # A new index adopts them and answers the same.
        again = BlockIndex(8, "lru")
        again.adopt(slots, keys)
        assert again.check_invariants() == []
        for k in keys:
            assert again.lookup([k]) == 1 and again.slot_of(k) == index.slot_of(k)
        assert again.num_free == 8 - len(keys)
    finally:
        os.close(fd)


@settings(max_examples=80, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["prepare", "complete", "fail", "pin", "unpin",
                                               "reset"]),
                              st.lists(st.integers(0, 20), min_size=1, max_size=5)),
                    max_size=40))  # fmt: skip
def test_the_table_names_what_jobs_may_still_touch(ops: list[tuple[str, list[int]]]) -> None:
    """At any instant the table's STORING slots are the index's in-flight ones and
    its pinned slots the ready blocks with load references; a new index that
    adopts the table hands out none of the STORING slots until `release_held`."""
    h = header(8)
    fd = os.memfd_create("kvd-test-in-use")
    try:
        t = table_on(fd, h)
        index = BlockIndex(8, "lru")
        index.slot_sink = t
        pending: list[bytes] = []
        pins: list[bytes] = []
        for op, ids in ops:
            keys = [i.to_bytes(2, "big") for i in ids]
            if op == "reset":
                index.reset()
                pending, pins = [], []
            elif op == "prepare":
                out = index.prepare_store(keys)
                if out is not None:
                    pending.extend(out.keys_to_store)
            elif op in ("complete", "fail") and pending:
                done, pending = pending[: len(ids)], pending[len(ids) :]
                index.complete_store(done, success=op == "complete")
            elif op == "pin":
                ready = [k for k in keys if k in index and index.is_ready(k)]
                index.prepare_load(ready)
                pins.extend(ready)
            elif op == "unpin" and pins:
                index.complete_load([pins.pop()])
        crash = crashed(fd, h)
        slots, keys, _ = crash.ready_entries()
        storing, pinned = crash.in_use()
        in_flight = {index.slot_of(k) for k in index_keys(index) if not index.is_ready(k)}
        assert set(storing) == in_flight
        assert set(pinned) == {index.slot_of(k) for k in set(pins)}
        assert set(keys) == {k for k in index_keys(index) if index.is_ready(k)}
        again = BlockIndex(8, "lru")
        again.adopt(slots, keys, held=storing)
        assert again.check_invariants() == [] and again.num_held == len(storing)
        out = again.prepare_store([b"new" + bytes([i]) for i in range(8 - len(storing))])
        assert out is not None and not set(out.store_spec.slots) & set(storing)
        again.reset()  # a reset keeps them held
        assert again.num_held == len(storing) and again.check_invariants() == []
        out = again.prepare_store([b"x" + bytes([i]) for i in range(8 - len(storing))])
        assert out is not None and not set(out.store_spec.slots) & set(storing)
        assert again.prepare_store([b"one more"]) is None or not storing
        assert again.release_held() == len(storing) and again.num_held == 0
        assert again.check_invariants() == []
    finally:
        os.close(fd)


def index_keys(index: BlockIndex) -> list[bytes]:
    return [k for k in map(index.key_at, range(index.num_blocks)) if k is not None]


def test_a_store_writes_one_state_byte_before_its_job_and_a_failure_frees_it(fd: int) -> None:
    """STORING from `prepare_store` (a ready victim's slot too, in one write),
    READY only from `complete_store`, FREE from a failed one; pins as a byte."""
    h = header(2)
    t = table_on(fd, h)
    index = BlockIndex(2, "lru")
    index.slot_sink = t
    states = lambda: bytes(t._mm[h.table_offset :: ENTRY_BYTES][:2])  # noqa: E731
    out = index.prepare_store([b"a", b"b"])
    assert out is not None and states() == bytes([STORING, STORING])
    index.complete_store([b"a"])
    index.complete_store([b"b"], success=False)
    assert states() == bytes([READY, FREE])
    index.prepare_load([b"a"])
    assert crashed(fd, h).in_use() == ([], [0])
    index.complete_load([b"a"])
    assert crashed(fd, h).in_use() == ([], [])
    index.prepare_store([b"c", b"d"])  # evicts a: its slot goes READY -> STORING
    assert states() == bytes([STORING, STORING]) and crashed(fd, h).ready_entries()[1] == []


def test_adopt_refuses_bad_input_and_changes_nothing() -> None:
    index = BlockIndex(4, "adaptive")
    for slots, keys in (([0, 0], [b"a", b"b"]), ([0, 1], [b"a", b"a"]), ([9], [b"a"]),
                        ([0], [b""]), ([0, 1], [b"a"])):  # fmt: skip
        with pytest.raises(KvdError):
            index.adopt(slots, keys)
        assert len(index) == 0 and index.num_free == 4
    index.adopt([2, 0], [b"b", b"a"])
    assert index.check_invariants() == [] and index.lookup([b"b", b"a"]) == 2
    ev = index.take_events()
    assert len(ev) == 1 and ev[0].keys == [b"b", b"a"] and not ev[0].removed
    # The free slots are handed out, and the adopted blocks are evictable.
    out = index.prepare_store([b"x", b"y", b"z"])
    assert out is not None and len(out.evicted_keys) == 1
    assert sorted(out.store_spec.slots) == sorted([1, 3, 2 if out.evicted_keys == [b"b"] else 0])
    with pytest.raises(KvdError):
        index.adopt([1], [b"q"])  # only an empty index adopts


# -- the C loops of a warm restart (`kvd_client._warmstart`) against the Python ------

warmstart = pytest.importorskip("kvd_client._warmstart")


def assert_the_scans_agree(t: SlotTable, h: SegmentHeader) -> int:
    """The C scan's answer is the Python one's (and its map the keys' and slots');
    returns the number of entries refused."""
    slots, keys, refused, last, slot_of = warmstart.scan(t._mm, h.table_offset, h.num_blocks)
    py_slots, py_keys, py_refused, py_last = t._scan(h.table_offset, h.num_blocks)
    assert (slots, keys, last) == (py_slots, py_keys, py_last)
    assert slot_of == dict(zip(keys, slots, strict=True))
    assert sorted(refused) == sorted(py_refused)
    return len(refused)


entries = st.lists(
    st.tuples(
        st.integers(0, 15),  # slot
        st.sampled_from([b"a", b"b", b"c", b"k" * 64, b"d" * 7]),  # key
        st.integers(1, 6),  # seq (ties happen)
        st.sampled_from(["ok", "bad_crc", "bad_len", "not_ready"]),
    ),
    max_size=24,
)


@settings(max_examples=200, deadline=None)
@given(written=entries)
def test_the_c_scan_answers_as_the_python_one(written: list[tuple[int, bytes, int, str]]) -> None:
    """Duplicates, ties of seq, torn crcs, bad key lengths: the same answer."""
    h = header(num_blocks=16)
    fd = os.memfd_create("kvd-test-scan")
    try:
        t = table_on(fd, h)
        for slot, key, seq, damage in written:
            at = h.table_offset + slot * ENTRY_BYTES
            t.seq = seq - 1
            t.ready([slot], [key])
            if damage == "bad_crc":
                t._mm[at + 4] ^= 0x01
            elif damage == "bad_len":
                t._mm[at + 1] = 65
            elif damage == "not_ready":
                t._mm[at] = 0
        assert_the_scans_agree(t, h)
    finally:
        os.close(fd)


@settings(max_examples=50, deadline=None)
@given(
    seqs=st.lists(
        st.one_of(st.integers(1, 70_000), st.integers(2**32 - 5, 2**32 + 5), st.integers(1, 2**63)),
        min_size=1,
        max_size=40,
    )
)
def test_the_c_scan_orders_any_seqs_as_the_python_one(seqs: list[int]) -> None:
    """Seqs past 16, 32 and 48 bits (every pass of the C's radix sort), in any
    slot order, ties and duplicate keys included: the same answer."""
    h = header(num_blocks=len(seqs))
    fd = os.memfd_create("kvd-test-scan-seqs")
    try:
        t = table_on(fd, h)
        for slot, seq in enumerate(seqs):
            t.seq = seq - 1
            t.ready([slot], [b"key%d" % (seq % 7)])
        assert_the_scans_agree(t, h)
    finally:
        os.close(fd)


def test_the_c_scan_of_a_big_table_on_threads_answers_as_the_python_one() -> None:
    """Past 65,536 entries the C's checks run on threads, each on a slot range:
    damage, duplicates across ranges and empty entries give the same answer."""
    n = 3 * 65536 + 7
    h = header(num_blocks=n)
    fd = os.memfd_create("kvd-test-scan-big")
    rng = random.Random(5)
    try:
        t = table_on(fd, h)
        for slot in range(n):
            if slot % 11 == 3:
                continue  # never written
            t.seq = rng.randrange(1 << 40)
            t.ready([slot], [b"k%d" % rng.randrange(n)])  # some keys twice, anywhere
            if slot % 97 == 5:
                t._mm[h.table_offset + slot * ENTRY_BYTES + 4] ^= 0x10  # a torn crc
        refused = assert_the_scans_agree(t, h)
        assert refused > n // 97
    finally:
        os.close(fd)


def test_an_adoption_refuses_a_map_that_is_not_its_keys_and_slots() -> None:
    index = BlockIndex(8)
    with pytest.raises(KvdError, match="not the keys"):
        index.adopt([1, 2], [b"a", b"b"], slot_of={b"a": 2, b"b": 1})
    with pytest.raises(KvdError, match="twice"):
        index.adopt([3, 2, 3], [b"a", b"b", b"a"], slot_of={b"a": 3, b"b": 2})
    index.adopt([1, 2], [b"a", b"b"], slot_of={b"a": 1, b"b": 2})
    assert index.lookup([b"a", b"b"]) == 2 and index.check_invariants() == []


def test_the_c_scan_refuses_a_table_outside_its_buffer() -> None:
    with pytest.raises(ValueError, match="outside the buffer"):
        warmstart.scan(bytes(ENTRY_BYTES * 4), 0, 5)


@pytest.mark.parametrize("policy", ["lru", "arc", "adaptive"])
def test_an_adopted_index_evicts_the_oldest_stores_first(policy: str) -> None:
    """Policy order after a warm restart is store order: oldest first out."""
    index = BlockIndex(4, policy)
    index.adopt([2, 0, 3, 1], [b"k0", b"k1", b"k2", b"k3"])  # k0 stored first
    out = index.prepare_store([b"new0", b"new1"])
    assert out is not None
    assert sorted(out.evicted_keys) == [b"k0", b"k1"]
    assert index.check_invariants() == []
