"""Runs in the test process: a pool's slab and entry table on disk (`kvd.io.disk_slab`, SPEC 16).

Real files in a temporary directory (/tmp: ext4 here, which takes O_DIRECT):
a slab made, a row written and its entry made ready, the slab adopted back
with the same id, row, checksum and entry; each header check refusing a
damaged or foreign slab (the slab then made again, empty, with the reason);
`flock` refusing a second opener; a reservation that fails leaving no file.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import shutil
import struct
import subprocess
import sys
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest

from kvd.io import disk_slab
from kvd.io.disk_slab import (
    ALIGN,
    CRC_OFFSET,
    FORMAT_VERSION,
    SLAB_HEADER,
    Slab,
    SlabError,
    open_slab,
    round_up,
)
from kvd.io.disk_threads import crc32c
from kvd_client.geometry import Geometry
from kvd_client.protocol import Layout
from kvd_client.segment import SegmentHeader

LAYOUT = Layout("m", "bfloat16", 16, 1, False, 8192)
BLOCKS = 8


def wanted(layout: Layout = LAYOUT, blocks: int = BLOCKS, pool: str = "p") -> SegmentHeader:
    """What a pool asks of its slab (its generation is the slab's id, made there)."""
    g = Geometry.plan(slot_bytes=layout.slot_bytes, world_size=layout.world_size,
                      replicated=layout.replicated, capacity_bytes=blocks * layout.slot_bytes)  # fmt: skip
    return SegmentHeader(0, g.num_blocks, g.row_bytes, g.slot_bytes, g.num_slots, g.slot_stride,
                         g.replicated, pool, msgspec.msgpack.encode(layout), "lru")  # fmt: skip


@pytest.fixture
def where(tmp_path: Path) -> Path:
    return tmp_path / "disk"


@pytest.fixture
def opened() -> Iterator[list[Slab]]:
    """Slabs a test opens, closed at the end (their locks with them)."""
    slabs: list[Slab] = []
    yield slabs
    for slab in slabs:
        slab.close()


def aligned(size: int) -> mmap.mmap:
    return mmap.mmap(-1, size)


def row_bytes_of(seed: int, size: int) -> bytes:
    return bytes((seed * 31 + i * 7) % 251 for i in range(size))


def put(slab: Slab, slot: int, key: bytes, seed: int) -> bytes:
    """Writes a row as the write-behind does: the row, its checksum, then its entry."""
    data = row_bytes_of(seed, slab.row_bytes)
    buf = aligned(slab.disk_row_bytes)
    try:
        buf[: slab.row_bytes] = data
        assert slab.write_row(slot, memoryview(buf)) == slab.disk_row_bytes
    finally:
        buf.close()
    slab.table.storing([slot])
    slab.crcs[slot] = crc32c(data, crc32c(key))
    slab.table.ready([slot], [key])
    return data


def get(slab: Slab, slot: int) -> bytes:
    buf = aligned(slab.disk_row_bytes)
    try:
        n = slab.read_row(slot, memoryview(buf))
        return bytes(buf[: min(n, slab.row_bytes)])
    finally:
        buf.close()


def made(where: Path, **kw: object) -> Slab:
    """A new slab with one row (slot 3, key b"k3"), closed again."""
    slab, reason = open_slab(str(where), wanted(**kw), adopt=True)  # type: ignore[arg-type]
    assert slab.created and reason == ""
    put(slab, 3, b"k3", seed=3)
    slab.close()
    return slab


def reopen(where: Path, opened: list[Slab], **kw: object) -> tuple[Slab, str]:
    slab, reason = open_slab(str(where), wanted(**kw), adopt=True)  # type: ignore[arg-type]
    opened.append(slab)
    return slab, reason


# -- made and adopted ------------------------------------------------------------------


def test_a_slab_made_then_adopted_holds_its_rows_checksums_and_entries(
    where: Path, opened: list[Slab]
) -> None:
    slab, reason = open_slab(str(where), wanted(), adopt=True)
    assert slab.created and reason == ""
    slab_id = slab.header.generation
    row = slab.row_bytes
    assert slab.disk_row_bytes == round_up(row) and slab.num_blocks == BLOCKS
    assert (where / "p.slab").stat().st_size == ALIGN + BLOCKS * round_up(row)
    # Reserved when made: every block of both files is there.
    for name in ("p.slab", "p.entries"):
        st = (where / name).stat()
        assert st.st_blocks * 512 >= st.st_size, f"{name} was not given its space"
    data = {slot: put(slab, slot, f"k{slot}".encode(), seed=slot) for slot in (0, 3, 7)}
    crcs = {slot: slab.crcs[slot] for slot in data}
    slab.close()

    again, reason = reopen(where, opened)
    assert not again.created and reason == ""
    assert again.header.generation == slab_id
    slots, keys, refused, _ = again.table.ready_map()
    assert dict(zip(keys, slots, strict=True)) == {b"k0": 0, b"k3": 3, b"k7": 7}
    assert refused == 0
    for slot, want in data.items():
        assert again.crcs[slot] == crcs[slot]
        assert get(again, slot) == want
        assert crc32c(get(again, slot), crc32c(f"k{slot}".encode())) == crcs[slot]


def test_restart_cold_makes_the_slab_again_empty(where: Path, opened: list[Slab]) -> None:
    old = made(where)
    slab, reason = open_slab(str(where), wanted(), adopt=False)
    opened.append(slab)
    assert slab.created and reason == ""  # not adopted, and not a refusal either
    assert slab.header.generation != old.header.generation
    assert slab.table.ready_map()[1] == []


# -- each header check -----------------------------------------------------------------


def _rewrite_slab_header(path: Path, at: int, fmt: str, value: int) -> None:
    """Changes one field of the slab header and recomputes its checksum."""
    fd = os.open(path, os.O_RDWR)
    try:
        raw = bytearray(os.pread(fd, SLAB_HEADER.size, 0))
        struct.pack_into(fmt, raw, at, value)
        struct.pack_into("<I", raw, CRC_OFFSET, 0)
        struct.pack_into("<I", raw, CRC_OFFSET, zlib.crc32(raw))
        os.pwrite(fd, bytes(raw), 0)
    finally:
        os.close(fd)


def _write(path: Path, at: int, data: bytes) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, data, at)
    finally:
        os.close(fd)


def _shorten(path: Path, by: int) -> None:
    os.truncate(path, path.stat().st_size - by)


def _foreign_entries(where: Path) -> None:
    """The entry table of another slab of the same pool and geometry."""
    other = where.parent / "other"
    slab, _ = open_slab(str(other), wanted(), adopt=True)
    slab.close()
    shutil.copyfile(other / "p.entries", where / "p.entries")


DAMAGES: dict[str, tuple[Callable[[Path], None], dict[str, object], str]] = {
    "magic": (lambda w: _write(w / "p.slab", 0, b"NOTASLAB"), {}, "bad magic"),
    "version": (
        lambda w: _rewrite_slab_header(w / "p.slab", 8, "<I", FORMAT_VERSION + 1),
        {},
        f"slab format version {FORMAT_VERSION + 1}",
    ),
    "checksum": (lambda w: _write(w / "p.slab", 20, b"\xff"), {}, "checksum mismatch"),
    "short header": (lambda w: os.truncate(w / "p.slab", 10), {}, "shorter than its header"),
    "layout": (
        lambda w: None,
        {"layout": Layout("another-model", "bfloat16", 16, 1, False, 8192)},
        "made for another layout",
    ),
    "more rows than the share": (
        lambda w: None,
        {"blocks": BLOCKS // 2},
        f"slab holds {BLOCKS} rows, more than the {BLOCKS // 2} its share leaves",
    ),
    "another row size": (
        lambda w: None,
        {"layout": Layout("m", "bfloat16", 16, 1, False, 4096)},
        "slab holds rows of 8192 bytes, the pool's are 4096",
    ),
    "geometry in the header": (
        lambda w: _rewrite_slab_header(w / "p.slab", 48, "<Q", 2 * ALIGN),  # rows_offset
        {},
        "geometry is inconsistent",
    ),
    "slab truncated": (lambda w: _shorten(w / "p.slab", ALIGN), {}, "slab truncated"),
    "entries of another slab": (_foreign_entries, {}, "entry table belongs to another slab"),
    "entries truncated": (lambda w: _shorten(w / "p.entries", ALIGN), {}, "entry table truncated"),
    "entries missing": (lambda w: (w / "p.entries").unlink(), {}, "its entry table is missing"),
    "slab missing": (lambda w: (w / "p.slab").unlink(), {}, "its slab is missing"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_slab_that_fails_a_check_is_made_again_empty_with_the_reason(
    damage: str, where: Path, opened: list[Slab]
) -> None:
    do, asked, reason_says = DAMAGES[damage]
    old = made(where)
    do(where)
    slab, reason = reopen(where, opened, **asked)
    assert reason_says in reason, reason
    assert slab.created
    assert slab.header.generation != old.header.generation
    assert slab.table.ready_map()[1] == []  # empty
    # Whole again: a later start adopts it.
    want = wanted(**asked)  # type: ignore[arg-type]
    assert (where / "p.slab").stat().st_size == ALIGN + want.num_blocks * round_up(want.row_bytes)
    slab.close()
    again, reason = reopen(where, opened, **asked)
    assert not again.created and reason == ""
    assert again.header.generation == slab.header.generation


def test_a_slab_smaller_than_the_share_is_kept_at_its_size(where: Path, opened: list[Slab]) -> None:
    """The share grew (more RAM, more disk_bytes, disk_bytes = 0 on a filesystem
    that filled): the slab is adopted as it is, its rows with it."""
    old = made(where)
    slab, reason = reopen(where, opened, blocks=2 * BLOCKS)
    assert reason == "" and not slab.created
    assert slab.num_blocks == BLOCKS and slab.header.generation == old.header.generation
    assert slab.table.ready_map()[1] == [b"k3"]


def test_rows_of_any_size_move_whole_with_o_direct(where: Path, opened: list[Slab]) -> None:
    """A row that is not a multiple of 4 KiB (an MLA row, say): the slab keeps
    O_DIRECT (whole padded rows from aligned buffers) and its lock."""
    layout = Layout("mla", "bfloat16", 16, 1, True, 6000)
    slab, _ = reopen(where, opened, layout=layout)
    assert slab.direct and slab.row_bytes % 4096 and slab.disk_row_bytes == 8192
    data = put(slab, 2, b"k2", seed=2)
    assert get(slab, 2) == data
    with pytest.raises(SlabError):
        open_slab(str(where), wanted(layout=layout), adopt=True)


# -- flock -----------------------------------------------------------------------------


def test_a_second_opener_of_a_slab_is_refused_and_the_first_keeps_it_whole(
    where: Path, opened: list[Slab]
) -> None:
    first, _ = reopen(where, opened)
    data = put(first, 5, b"k5", seed=5)
    size = (where / "p.slab").stat().st_size
    for adopt in (True, False):  # a warm start adopts, a cold one would make it again
        with pytest.raises(SlabError) as refused:
            open_slab(str(where), wanted(), adopt=adopt)
        assert refused.value.errno == errno.EBUSY
        assert "in use by another kvd daemon" in str(refused.value)
    assert (where / "p.slab").stat().st_size == size
    assert get(first, 5) == data and first.table.ready_map()[1] == [b"k5"]
    first.close()
    opened.clear()
    again, reason = reopen(where, opened)  # the lock went with the first
    assert not again.created and reason == "" and get(again, 5) == data


def test_a_lock_taken_while_a_slab_is_made_is_a_refusal_that_removes_nothing(
    where: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another daemon takes the lock between the two opens of `_create` (the first
    makes the file, the second opens it with O_DIRECT): SlabError, and that
    daemon's files stay."""
    holder: list[int] = []
    real = disk_slab._open_direct

    def open_after_the_other(path: Path) -> tuple[int, bool]:
        if not holder:
            fd = os.open(path, os.O_RDWR)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            holder.append(fd)
        return real(path)

    monkeypatch.setattr(disk_slab, "_open_direct", open_after_the_other)
    try:
        with pytest.raises(SlabError) as refused:
            open_slab(str(where), wanted(), adopt=False)
        assert refused.value.errno == errno.EBUSY
        assert (where / "p.slab").exists()  # the other daemon's: not unlinked
    finally:
        for fd in holder:
            os.close(fd)


# -- a reservation that fails ----------------------------------------------------------

RESERVE_FAILS = """
import os, resource, signal, sys
from kvd.io.disk_slab import SlabError, open_slab
sys.path.insert(0, {tests!r})
from tests.unit.test_disk_slab import wanted
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal
resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, resource.RLIM_INFINITY))
try:
    open_slab({where!r}, wanted(), adopt=True)
except SlabError as exc:
    print("SlabError", exc.errno, exc)
else:
    print("made")
"""


def test_a_reservation_that_fails_leaves_no_file(where: Path) -> None:
    """posix_fallocate past the process's file size limit (RLIMIT_FSIZE, a real
    EFBIG from the filesystem): SlabError, and neither file is left."""
    tests = str(Path(__file__).parents[2])
    code = RESERVE_FAILS.format(tests=tests, limit=ALIGN, where=str(where))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=False, cwd=tests)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"SlabError {errno.EFBIG} "), out.stdout
    assert "cannot reserve" in out.stdout and "p.slab" in out.stdout, out.stdout
    assert list(where.iterdir()) == []


def test_no_room_for_the_entry_table_removes_the_slab_too(tmp_path: Path) -> None:
    """A tmpfs that holds the slab but not its entry table (root only): ENOSPC at
    the second reservation, and the first file goes too."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs takes root")
    want = wanted()
    slab_bytes = ALIGN + want.num_blocks * round_up(want.row_bytes)
    where = tmp_path / "small"
    where.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={slab_bytes + ALIGN}", "tmpfs",
                          str(where)], capture_output=True, text=True, check=False)  # fmt: skip
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip() or out.returncode}")
    try:
        with pytest.raises(SlabError) as refused:
            open_slab(str(where), want, adopt=True)
        assert refused.value.errno == errno.ENOSPC
        assert "p.entries" in str(refused.value)  # the slab's own reservation passed
        assert list(where.iterdir()) == []
    finally:
        subprocess.run(["umount", str(where)], check=True)


# -- the fault seam --------------------------------------------------------------------


def test_the_fault_seam_fails_row_io(
    where: Path, opened: list[Slab], monkeypatch: pytest.MonkeyPatch
) -> None:
    made(where)
    monkeypatch.setenv("KVD_DISK_FAULTS", "read_eio,write_eio")
    slab, _ = reopen(where, opened)
    buf = memoryview(aligned(slab.disk_row_bytes))
    with pytest.raises(OSError) as failed:
        slab.read_row(3, buf)
    assert failed.value.errno == errno.EIO
    with pytest.raises(OSError) as failed:
        slab.write_row(3, buf)
    assert failed.value.errno == errno.EIO
    slab.close()
    monkeypatch.setenv("KVD_DISK_FAULTS", "read_short")
    slab, _ = reopen(where, opened)
    assert slab.read_row(3, buf) == slab.disk_row_bytes // 2
    slab.close()
    monkeypatch.setenv("KVD_DISK_FAULTS", "read_eoi")
    with pytest.raises(ValueError, match="unknown"):
        open_slab(str(where), wanted(), adopt=True)


def test_a_filesystem_without_o_direct_moves_rows_buffered(
    where: Path, opened: list[Slab], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where open(O_DIRECT) fails with EINVAL (some filesystems), rows move
    buffered, byte for byte, each dropped from the page cache after."""
    from kvd.io import disk_slab

    real_open = os.open

    def no_direct(path: object, flags: int, *args: int) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT refused (this test's filesystem)")
        return real_open(path, flags, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(disk_slab.os, "open", no_direct)
    slab, _ = reopen(where, opened)
    assert not slab.direct
    data = put(slab, 4, b"k4", seed=4)
    assert get(slab, 4) == data
    slab.sync()
