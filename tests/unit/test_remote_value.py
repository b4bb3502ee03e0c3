"""Runs in the test process: the remote tier's value format, checksum and URL (no sockets)."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvd.config import ConfigError, load_config, parse_remote_url
from kvd.io import remote_value as rv
from kvd_client.geometry import Geometry
from kvd_client.protocol import Layout

LAYOUT = Layout("m", "bfloat16", 16, 2, False, 4096, "")


def geometry(layout: Layout) -> Geometry:
    return Geometry.plan(slot_bytes=layout.slot_bytes, world_size=layout.world_size,
                         replicated=layout.replicated, capacity_bytes=1 << 24)  # fmt: skip


def test_crc32c_check_value() -> None:
    # The CRC-32C check value (RFC 3720 B.4; the "123456789" of every CRC catalogue).
    assert rv.crc32c_python(b"123456789") == 0xE3069283
    assert rv.crc32c(b"123456789") == 0xE3069283
    assert rv.crc32c(b"") == 0


@pytest.mark.skipif(not rv.NATIVE_CRC, reason="kvd_client._crc32c is not built")
@given(st.binary(max_size=40_000), st.integers(0, 7), st.integers(0, 2**32 - 1))
def test_the_native_crc_is_the_reference(data: bytes, offset: int, start: int) -> None:
    view = memoryview(b"\0" * offset + data)[offset:]  # unaligned starts too
    assert rv.crc32c(view, start) == rv.crc32c_python(data, start)
    cut = len(data) // 3
    assert rv.crc32c(data[cut:], rv.crc32c(data[:cut])) == rv.crc32c_python(data)


@pytest.mark.skipif(not rv.NATIVE_CRC, reason="kvd_client._crc32c is not built")
@pytest.mark.parametrize("size", [3 * 4096 - 1, 3 * 4096, 3 * 4096 + 1, 7 * 4096 + 13, 65_536])
def test_the_native_crc_across_its_stripes(size: int) -> None:
    data = bytes((i * 7 + 3) & 0xFF for i in range(size))
    assert rv.crc32c(data) == rv.crc32c_python(data)


@pytest.mark.skipif(not rv.NATIVE_CRC, reason="kvd_client._crc32c is not built")
@given(st.binary(max_size=200_000), st.integers(0, 2**32 - 1))
def test_the_fused_copy_copies_and_checksums(data: bytes, start: int) -> None:
    from kvd_client._crc32c import copy_crc32c

    dst = bytearray(len(data) + 16)
    view = memoryview(dst)[8 : 8 + len(data)]
    assert copy_crc32c(view, data, start) == rv.crc32c_python(data, start)
    assert bytes(view) == data and dst[:8] == bytes(8) and dst[-8:] == bytes(8)
    with pytest.raises(ValueError):
        copy_crc32c(memoryview(dst)[:3], b"abcd")


def test_copy_value_fills_the_slot_and_refuses_a_bad_row() -> None:
    row = bytes(range(256)) * 16
    slot = bytearray(len(row))
    rv.copy_value(memoryview(slot), bytes(rv.encode_value(b"k", row)), b"k", len(row))
    assert bytes(slot) == row
    bad = bytearray(rv.encode_value(b"k", row))
    bad[-5] ^= 1
    with pytest.raises(rv.BadValue, match="checksum"):
        rv.copy_value(memoryview(bytearray(len(row))), bytes(bad), b"k", len(row))


def test_a_value_round_trips() -> None:
    row = bytes(range(256)) * 32
    value = bytes(rv.encode_value(b"block-1", row))
    assert len(value) == rv.HEADER_BYTES + len(b"block-1") + len(row)
    assert bytes(rv.decode_value(value, b"block-1", len(row))) == row


def _refused(value: bytes, key: bytes = b"k", row_bytes: int = 512) -> str:
    with pytest.raises(rv.BadValue) as info:
        rv.decode_value(value, key, row_bytes)
    return str(info.value)


def test_every_bad_value_is_refused() -> None:
    row = bytes(512)
    good = bytes(rv.encode_value(b"k", row))
    assert "shorter" in _refused(good[:10])
    assert "bytes" in _refused(good[:-1])  # truncated row
    assert "bytes" in _refused(good + b"x")  # trailing bytes
    assert "magic" in _refused(b"XXXX" + good[4:])
    assert "version" in _refused(good[:4] + struct.pack("<H", 2) + good[6:])
    assert "another block" in _refused(bytes(rv.encode_value(b"j", row)))
    assert "rows are 512" in _refused(bytes(rv.encode_value(b"k", bytes(256))))
    flipped = bytearray(good)
    flipped[-1] ^= 0x80
    assert "checksum" in _refused(bytes(flipped))
    header_flip = bytearray(good)
    header_flip[16] ^= 1  # the crc field itself
    assert "checksum" in _refused(bytes(header_flip))


@given(st.binary(max_size=600))
def test_random_bytes_are_never_a_block(junk: bytes) -> None:
    with pytest.raises(rv.BadValue):
        rv.decode_value(junk, b"k", 512)


def test_the_fingerprint_names_the_layout_not_the_pool() -> None:
    fp = rv.layout_fingerprint(LAYOUT, geometry(LAYOUT))
    same = Layout("m", "bfloat16", 16, 2, False, 4096, "")  # an equal layout, any pool
    assert fp == rv.layout_fingerprint(same, geometry(same))
    for other in (
        Layout("m2", "bfloat16", 16, 2, False, 4096, ""),
        Layout("m", "float16", 16, 2, False, 4096, ""),
        Layout("m", "bfloat16", 32, 2, False, 4096, ""),
        Layout("m", "bfloat16", 16, 4, False, 4096, ""),
        Layout("m", "bfloat16", 16, 2, True, 4096, ""),
        Layout("m", "bfloat16", 16, 2, False, 8192, ""),
        Layout("m", "bfloat16", 16, 2, False, 4096, "per_layer"),
    ):
        assert rv.layout_fingerprint(other, geometry(other)) != fp, other
    key = rv.remote_key("kvd", fp, b"\x01\xff")
    assert key == f"kvd:{fp}:01ff".encode()


def test_remote_urls() -> None:
    t = parse_remote_url("redis://10.0.0.5:6380/2")
    assert (t.cluster, t.nodes, t.db, t.tls) == (False, [("10.0.0.5", 6380)], 2, False)
    t = parse_remote_url("rediss://user:secret@cache.example:6379")
    assert (t.tls, t.username, t.password, t.nodes) == (
        True,
        "user",
        "secret",
        [("cache.example", 6379)],
    )
    t = parse_remote_url("redis+cluster://a:7000,b:7001, c:7002")
    assert t.cluster and t.nodes == [("a", 7000), ("b", 7001), ("c", 7002)]
    assert parse_remote_url("redis://host").nodes == [("host", 6379)]
    for bad in ("http://x:1", "redis://", "redis://a:1,b:2", "redis://a:99999",
                "redis://a:1/x", "redis+cluster://a:1/3", "a:1"):  # fmt: skip
        with pytest.raises(ValueError):
            parse_remote_url(bad)


def test_credentials_never_show_in_errors_and_may_be_percent_encoded() -> None:
    with pytest.raises(ValueError) as info:
        parse_remote_url("redis://user:hunter2@cache:99999")
    assert "hunter2" not in str(info.value) and "***@cache:99999" in str(info.value)
    with pytest.raises(ConfigError) as cfg_info:
        load_config(None, {"remote_url": "redis://:hunter2@cache:x", "runtime_dir": "/tmp/x"})
    assert "hunter2" not in str(cfg_info.value)
    assert parse_remote_url("redis://u%40x:p%3Aw@h:1").password == "p:w"
    assert parse_remote_url("redis://u%40x:p%3Aw@h:1").username == "u@x"


def test_a_bad_remote_url_is_one_config_error_naming_the_key() -> None:
    with pytest.raises(ConfigError, match="remote_url"):
        load_config(None, {"remote_url": "memcached://x:1", "runtime_dir": "/tmp/x"})
    with pytest.raises(ConfigError, match="remote_prefix"):
        load_config(None, {"remote_url": "redis://x:1", "remote_prefix": "a b",
                           "runtime_dir": "/tmp/x"})  # fmt: skip
    cfg = load_config(None, {"remote_url": "redis://x:1", "remote_timeout_ms": "250",
                             "runtime_dir": "/tmp/x"})  # fmt: skip
    assert cfg.remote_timeout_ms == 250 and cfg.remote_write_max_bytes >= 64 << 20
