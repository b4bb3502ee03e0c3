"""Runs in the test process: the fuzzer's Hypothesis strategies, each draw one `Input`.

`inputs` draws real request Structs with hostile values from every peer,
frames outside the schema (hand-built msgpack, random bytes, mutations,
depth bombs, multipart messages) and frames over MAX_FRAME_BYTES.
`ADMIN_TOKEN` holds the running daemon's operator token, set by the test
before any draw.
"""

from __future__ import annotations

import typing
from typing import Any

import msgspec
from hypothesis import strategies as st

from kvd.control.service import POOL_VERBS
from kvd_client import protocol as p
from tests.integration.fuzz_model import FZ, HOMES, MAX_TOTAL, Input

HUGE = [-(1 << 63), -(1 << 31), -1, 0, 1, 255, 1 << 31, 1 << 40, (1 << 63) - 1, (1 << 64) - 1]
hostile_ints = st.sampled_from(HUGE) | st.integers(-(1 << 63), (1 << 64) - 1)
req_ids = st.integers(0, 1 << 20) | hostile_ints
KNOWN = [b"k%03d" % i for i in range(96)]
BIG = {n: [i.to_bytes(8, "big") for i in range(n)] for n in (65_536, 65_537, 100_000)}
BAD_KEYS = [b"", b"x" * 65, b"y" * 1000, b"z" * (1 << 20)]
keys_small = st.lists(
    st.sampled_from(KNOWN) | st.sampled_from(KNOWN) | st.binary(min_size=1, max_size=64),
    max_size=12,
)
keys_bad = st.tuples(keys_small, st.sampled_from(BAD_KEYS)).map(lambda t: [*t[0], t[1]])
keys_big = st.sampled_from(sorted(BIG)).map(BIG.__getitem__)
keys = st.sampled_from([keys_small] * 24 + [keys_bad] * 2 + [keys_big]).flatmap(lambda s: s)
NAMES = ["fz", "fz-b", "fz-c", "fz-b", "fz-c", "nope", "", "a b", "a/b", "x" * 129, "ñame", "٣"]
names = st.sampled_from(NAMES) | st.text(max_size=6)
texts = st.sampled_from(
    [st.text(max_size=10)] * 12 + [st.sampled_from(["e" * 129, "m" * (1 << 20)])]
).flatmap(lambda s: s)
VERB_PEERS = ["sched"] * 6 + ["lonely"] * 2 + ["worker", "admin", "fresh", "attacher"]
ANY_PEER = ["fresh", "hello", *HOMES]


def peer_of(names: list[str]) -> st.SearchStrategy[str]:
    return st.sampled_from(names)


@st.composite
def device_ids(draw: st.DrawFn, n: int) -> list[int]:
    if n > 64 or draw(st.integers(0, 9)) == 0:
        ids = [0] * n if n > 64 else draw(st.lists(st.integers(0, 64), max_size=n + 2))
    else:
        ids = draw(st.lists(st.integers(0, 64), min_size=n, max_size=n))
    if ids and draw(st.integers(0, 14)) == 0:
        ids[draw(st.integers(0, len(ids) - 1))] = draw(st.sampled_from([-1, 1 << 40, HUGE[-1]]))
    return ids


layouts = st.sampled_from(
    [FZ, FZ, p.Layout("b", "bf16", 16, 2, True, 4096), p.Layout("c", "fp8", 32, 4, False, 1000)]
) | st.builds(
    p.Layout,
    texts,
    texts,
    hostile_ints | st.integers(-2, 64),
    hostile_ints | st.sampled_from([0, 1, 2, 1024, 1025]),
    st.booleans(),
    hostile_ints | st.integers(-2, 1 << 16),
    texts,
)
capacities = st.none() | st.sampled_from([1, 255, 256, 4096, 1 << 20, MAX_TOTAL, MAX_TOTAL + 1])
capacities = capacities | hostile_ints


@st.composite
def struct_frames(draw: st.DrawFn) -> tuple[str, p.Request, bool]:
    """A real Struct of any request type, hostile values included, and the peer sending it."""
    rid = draw(req_ids)
    kind = draw(st.sampled_from(typing.get_args(p.Request)))
    ack_ok = draw(st.integers(0, 4)) > 0
    if kind in (p.Store, p.Load):
        ks = draw(keys)
        return draw(peer_of(VERB_PEERS)), kind(rid, ks, draw(device_ids(len(ks)))), ack_ok
    if kind is p.CompleteStore:
        return (
            draw(peer_of(VERB_PEERS)),
            p.CompleteStore(rid, draw(keys), draw(st.booleans())),
            ack_ok,
        )
    if kind in POOL_VERBS:
        return draw(peer_of(VERB_PEERS)), kind(rid, draw(keys)), ack_ok
    if kind is p.Hello:
        version = draw(st.sampled_from([1, 1, 1, 1, 0, 2, -1, (1 << 64) - 1]))
        role: p.Role = draw(st.sampled_from(["scheduler", "worker", "admin"]))
        rank = draw(st.integers(-2, 4) | hostile_ints)
        world = draw(st.integers(-1, 4) | st.sampled_from([1024, 1025]) | hostile_ints)
        hello = p.Hello(rid, version, role, draw(texts), rank, world, draw(hostile_ints))
        return "hello", hello, ack_ok
    if kind is p.Attach:
        peer = draw(peer_of(["attacher"] * 6 + ["sched", "admin", "worker", "fresh"]))
        return peer, p.Attach(rid, draw(names), draw(layouts), draw(capacities)), ack_ok
    if kind is p.JobDone:
        msg = p.JobDone(
            rid,
            draw(hostile_ints),
            draw(st.integers(-2, 3) | hostile_ints),
            draw(st.booleans()),
            draw(hostile_ints),
            draw(st.floats(allow_nan=True, allow_infinity=True)),
            draw(texts),
        )
        return draw(peer_of(["worker"] * 4 + ["sched", "admin", "fresh"])), msg, ack_ok
    if kind in (p.DropPool, p.Reset):
        pool = draw(st.sampled_from(["fz"]) if draw(st.integers(0, 40)) == 0 else names)
        peer = draw(peer_of(["admin", "admin", "sched", "worker", "fresh"]))
        if kind is p.Reset:
            return peer, p.Reset(rid, pool), ack_ok
        # The real operator token (known once the daemon runs) half the time.
        token = draw(st.just(None).map(lambda _: ADMIN_TOKEN[0]) | texts)
        return peer, p.DropPool(rid, pool, token), ack_ok
    return draw(peer_of(ANY_PEER)), kind(rid), ack_ok


def _outside_schema(rid: int) -> list[Any]:
    layout = {f: getattr(FZ, f) for f in FZ.__struct_fields__}
    return [
        ["Lookup", rid, [1, 2]],
        ["Lookup", rid, "x"],
        ["Lookup", rid],
        ["NoSuchTag", rid],
        ["Heartbeat"],
        ["Heartbeat", rid, "extra"],
        ["Hello", rid, 1, "root"],
        ["Store", rid, [b"k"], [1.5]],
        ["CompleteStore", rid, [b"k"], "yes"],
        ["Attach", rid, "fz", {**layout, "junk": 1}, None],
        ["Attach", rid, "fz", [1, 2, 3], None],
        {"type": "Lookup", "req_id": rid},
        [True, rid],
        ["Lookup", True, []],
        ["Lookup", 1.5, []],
        ["JobDone", rid, "1", 0, True],
        None,
        "Lookup",
        [],
    ]


@st.composite
def raw_frames(draw: st.DrawFn) -> Input:
    """Frames outside the schema: hand-built msgpack, random bytes, mutations, depth bombs."""
    peer = draw(peer_of(ANY_PEER))
    how = draw(st.integers(0, 99))
    if how < 30:
        rid = draw(req_ids)
        obj = draw(st.sampled_from(_outside_schema(rid)))
        return Input(peer, msgspec.msgpack.encode(obj))
    if how < 45:
        return Input(peer, draw(st.binary(max_size=64)))
    if how < 50:
        depth = draw(st.sampled_from([10, 1000, 100_000]))
        return Input(peer, b"\x91" * depth + b"\xc0")
    if how < 52:
        return Input(peer, (b"a", draw(st.binary(max_size=8))))
    _, msg, ack_ok = draw(struct_frames())
    frame = bytearray(p.encoder.encode(msg))
    for op, pos, val in draw(
        st.lists(
            st.tuples(st.integers(0, 3), st.integers(0, 1 << 20), st.integers(0, 255)),
            min_size=1,
            max_size=3,
        )
    ):
        if not frame:
            break
        i = pos % len(frame)
        if op == 0:
            frame[i] = val
        elif op == 1:
            del frame[i:]
        elif op == 2:
            frame.insert(i, val)
        else:
            del frame[i]
    return Input(peer, bytes(frame), ack_ok)


ADMIN_TOKEN = [""]  # the running daemon's, set by the test before any draw

OVERSIZED = Input("fresh", b"\x00" * (p.MAX_FRAME_BYTES + 1), oversized=True)
inputs = st.sampled_from(
    [struct_frames().map(lambda t: Input(t[0], p.encoder.encode(t[1]), t[2]))] * 12
    + [raw_frames()] * 4
    + [
        st.integers(0, 400).map(
            lambda i: OVERSIZED if i == 0 else Input("admin", p.encoder.encode(p.Heartbeat(i)))
        )
    ]
).flatmap(lambda s: s)
