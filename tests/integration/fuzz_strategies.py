"""Runs in the test process: the fuzzer's Hypothesis strategies, each draw one `Input`.

`inputs` draws real request Structs with hostile values from every peer
(numbers and strings on both sides of each schema bound), frames outside the
schema (hand-built msgpack, random bytes, mutations, depth bombs, multipart
messages), frames over MAX_FRAME_BYTES, and steps the driver resolves when
it sends them: a `JobDone` for a job that is live then (hostile numbers and
strings, from the right and the wrong sessions) and a second worker session
taking rank 0 of the fuzzed engine (a reconnect of the same process, or
another). `ADMIN_TOKEN` holds the running daemon's operator token, set by
the test before any draw; tokens are drawn as it, near misses of it, or text.
"""

from __future__ import annotations

import math
import typing
from typing import Any

import msgspec
from hypothesis import strategies as st

from kvd.control.service import POOL_VERBS
from kvd_client import protocol as p
from tests.integration.fuzz_model import FZ, HOMES, MAX_TOTAL, Ack, Input

HUGE = [-(1 << 63), -(1 << 31), -1, 0, 1, 255, 1 << 31, 1 << 40, (1 << 63) - 1, 1 << 63]
HUGE += [(1 << 64) - 1]
hostile_ints = st.sampled_from(HUGE) | st.integers(-(1 << 63), (1 << 64) - 1)
# Mostly valid: a req_id outside the schema hides the rest of the request.
req_ids = st.sampled_from([st.integers(0, 1 << 20)] * 7 + [hostile_ints]).flatmap(lambda s: s)
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
NAMES += ["x" * 1024, "x" * 1025]
names = st.sampled_from(NAMES) | st.text(max_size=6)
LONG = ["e" * 64, "e" * 65, "e" * 128, "e" * 129, "e" * 256, "e" * 257, "é" * 1000]
LONG += ["e" * 1001, "e" * 1024, "e" * 1025, "m" * (1 << 20)]
texts = st.sampled_from([st.text(max_size=10)] * 12 + [st.sampled_from(LONG)]).flatmap(lambda s: s)
VERB_PEERS = ["sched"] * 6 + ["lonely"] * 2 + ["worker", "admin", "fresh", "attacher", "impostor"]
ANY_PEER = ["fresh", "hello", *HOMES]
acks: st.SearchStrategy[Ack] = st.sampled_from(["ok"] * 5 + ["fail"] * 2 + ["later"] * 3)
# The fake worker's own acknowledgements: within the schema, at its edges.
dones = st.tuples(
    st.sampled_from([0, 0, 1, 4096, 1 << 40]),
    st.sampled_from([0.0, 0.0, -0.0, 5e-324, 0.25, 1e6]),
    st.sampled_from(["", "", "copy failed", "d" * 1000, "é" * 1000]),
)
# ... and hostile ones, for a live job: either side of each bound.
NBYTES = [0, 1, (1 << 40) - 1, 1 << 40, (1 << 40) + 1, -1, -(1 << 63), (1 << 63) - 1]
NBYTES += [(1 << 64) - 1]
SECONDS = [0.0, -0.0, 5e-324, 1e6, math.nextafter(1e6, math.inf), -5e-324, -1.0]
SECONDS += [math.nan, math.inf, -math.inf]
DETAILS = ["", "why", "d" * 999, "d" * 1000, "é" * 1000, "d" * 1001, "m" * (1 << 20)]
RANKS = [0, 0, 0, 0, 1, (1 << 31) - 1, 1 << 31, -1]


def peer_of(names: list[str]) -> st.SearchStrategy[str]:
    return st.sampled_from(names)


def token_variant(i: int) -> str:
    """The operator token (i < 3) or a near miss of it."""
    t = ADMIN_TOKEN[0]
    return [t, t, t, "", t[:-1], t + "x", t[::-1], t.swapcase(), "t" * 256, t + "t" * 257][i]


tokens = st.integers(0, 9).map(token_variant) | texts


@st.composite
def device_ids(draw: st.DrawFn, n: int) -> list[int]:
    if n > 64 or draw(st.integers(0, 9)) == 0:
        ids = [0] * n if n > 64 else draw(st.lists(st.integers(0, 64), max_size=n + 2))
    else:
        ids = draw(st.lists(st.integers(0, 64), min_size=n, max_size=n))
    if ids and draw(st.integers(0, 14)) == 0:
        ids[draw(st.integers(0, len(ids) - 1))] = draw(
            st.sampled_from([-1, (1 << 40) - 1, 1 << 40, HUGE[-1]])
        )
    return ids


layouts = st.sampled_from(
    [FZ, FZ, p.Layout("b", "bf16", 16, 2, True, 4096), p.Layout("c", "fp8", 32, 4, False, 1000)]
) | st.builds(
    p.Layout,
    texts,
    texts,
    hostile_ints | st.sampled_from([-2, 0, 1, 16, 64, (1 << 31) - 1, 1 << 31]),
    hostile_ints | st.sampled_from([0, 1, 2, 1024, 1025, (1 << 31) - 1, 1 << 31]),
    st.booleans(),
    hostile_ints | st.integers(-2, 1 << 16) | st.sampled_from([1 << 40, (1 << 40) + 1]),
    texts,
)
capacities = st.none() | st.sampled_from([1, 255, 256, 4096, 1 << 20, MAX_TOTAL, MAX_TOTAL + 1])
capacities = capacities | st.sampled_from([1 << 50, (1 << 50) + 1]) | hostile_ints


@st.composite
def struct_frames(draw: st.DrawFn) -> tuple[str, p.Request, Ack, tuple[int, float, str]]:
    """A real Struct of any request type, hostile values included, the peer sending
    it, and how the fake worker answers a job it starts."""
    rid = draw(req_ids)
    kind = draw(st.sampled_from(typing.get_args(p.Request)))
    ack, done = draw(acks), draw(dones)
    if kind in (p.Store, p.Load):
        ks = draw(keys)
        return draw(peer_of(VERB_PEERS)), kind(rid, ks, draw(device_ids(len(ks)))), ack, done
    if kind is p.CompleteStore:
        msg: p.Request = p.CompleteStore(rid, draw(keys), draw(st.booleans()))
        return draw(peer_of(VERB_PEERS)), msg, ack, done
    if kind is p.Observe:  # table lookups reported: their keys, and hostile counts
        lookups = draw(st.lists(keys, max_size=3))
        counts = draw(st.lists(st.integers(0, 70) | hostile_ints, max_size=4))
        return draw(peer_of(VERB_PEERS)), p.Observe(rid, lookups, counts), ack, done
    if kind in POOL_VERBS:
        return draw(peer_of(VERB_PEERS)), kind(rid, draw(keys)), ack, done
    if kind is p.Hello:
        version = draw(st.sampled_from([1, 1, 1, 1, 0, 2, -1, (1 << 31) - 1, 1 << 31]))
        role: p.Role = draw(st.sampled_from(["scheduler", "worker", "admin"]))
        rank = draw(st.integers(-2, 4) | hostile_ints)
        world = draw(st.integers(-1, 4) | st.sampled_from([1024, 1025]) | hostile_ints)
        pid = draw(hostile_ints | st.sampled_from([0, (1 << 32) - 1, 1 << 32]))
        hello = p.Hello(rid, version, role, draw(texts), rank, world, pid, draw(texts))
        return "hello", hello, ack, done
    if kind is p.Attach:
        peer = draw(peer_of(["attacher"] * 6 + ["sched", "admin", "worker", "fresh"]))
        return peer, p.Attach(rid, draw(names), draw(layouts), draw(capacities)), ack, done
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
        return (
            draw(peer_of(["worker"] * 4 + ["sched", "admin", "fresh", "impostor"])),
            msg,
            ack,
            done,
        )
    if kind is p.DropPool:
        # The real operator token (known once the daemon runs) a third of the time.
        pool = draw(st.sampled_from(["fz"]) if draw(st.integers(0, 40)) == 0 else names)
        peer = draw(peer_of(["admin", "admin", "sched", "worker", "fresh", "impostor"]))
        return peer, p.DropPool(rid, pool, draw(tokens)), ack, done
    if kind is p.Reset:
        # Allowed with the token or from a session on the pool: sched, lonely and
        # the worker are on fz; admin, attacher and impostor on none.
        pool = draw(st.sampled_from(["fz"]) if draw(st.integers(0, 3)) == 0 else names)
        peer = draw(
            peer_of(["admin", "attacher", "impostor", "sched", "lonely", "worker", "fresh"])
        )
        token = draw(st.just("") if draw(st.integers(0, 2)) == 0 else tokens)
        return peer, p.Reset(rid, pool, token), ack, done
    if kind is p.CheckInvariants:
        return draw(peer_of(ANY_PEER)), p.CheckInvariants(rid, draw(tokens)), ack, done
    return draw(peer_of(ANY_PEER)), kind(rid), ack, done


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
        ["Hello", rid, 1, "worker", "fz", 0, 1, 0, "i", "extra"],
        ["Store", rid, [b"k"], [1.5]],
        ["CompleteStore", rid, [b"k"], "yes"],
        ["Attach", rid, "fz", {**layout, "junk": 1}, None],
        ["Attach", rid, "fz", [1, 2, 3], None],
        {"type": "Lookup", "req_id": rid},
        [True, rid],
        ["Lookup", True, []],
        ["Lookup", 1.5, []],
        ["JobDone", rid, "1", 0, True],
        ["JobDone", rid, 1, 0, True, 0, "0.5"],
        ["Reset", rid, "fz", 0],
        ["CheckInvariants", rid, None],
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
    _, msg, ack, done = draw(struct_frames())
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
    return Input(peer, bytes(frame), ack, done)


@st.composite
def live_job_dones(draw: st.DrawFn) -> Input:
    """A JobDone for a job live when it is sent: from its worker, from another
    session of the same engine and rank, from non-workers; half of them with one
    hostile number or string (either side of its schema bound)."""
    peer = draw(peer_of(["worker"] * 6 + ["impostor"] * 3 + ["sched", "admin", "fresh"]))
    fields = [0, draw(st.booleans()), draw(st.sampled_from(NBYTES[:4]))]
    fields += [draw(st.sampled_from(SECONDS[:4])), draw(st.sampled_from(DETAILS[:5]))]
    if draw(st.booleans()):
        i = draw(st.sampled_from([0, 2, 3, 4]))
        fields[i] = draw(st.sampled_from([RANKS, [], NBYTES, SECONDS, DETAILS][i]))
    msg = p.JobDone(draw(req_ids), 0, *fields)  # job_id 0: filled in when sent
    return Input(peer, live=(draw(st.integers(0, 7)), msg))


@st.composite
def transfers(draw: st.DrawFn) -> Input:
    """A well-formed Store (of known and new keys) or Load (of keys ready in pool fz
    when it is sent; or a Lookup, PrepareLoad or Touch of them), mostly from the
    scheduler with a worker: the jobs that live JobDones, resets and reconnects
    then meet."""
    ack, done = draw(acks), draw(dones)
    peer = draw(peer_of(["sched"] * 8 + ["lonely", "attacher"]))
    rid = draw(st.integers(0, 1 << 20))
    if draw(st.booleans()):
        kinds = ["Load"] * 3 + ["Lookup"] * 2 + ["LookupPin", "PrepareLoad", "Touch"]
        kind = draw(st.sampled_from(kinds))
        return Input(peer, ack=ack, done=done, ready=(kind, draw(st.integers(1, 4)), rid))
    ks = draw(st.lists(st.sampled_from(KNOWN[:12]), min_size=1, max_size=4))
    fresh = st.integers(0, (1 << 64) - 1).map(lambda i: i.to_bytes(8, "big"))
    ks += draw(st.lists(fresh, min_size=1, max_size=4))  # so that a store has something to copy
    if draw(st.integers(0, 3)) == 0:  # the scheduler's own store, to complete (or not)
        return Input(peer, p.encoder.encode(p.PrepareStore(rid, ks)))
    ids = draw(st.lists(st.integers(0, 64), min_size=len(ks), max_size=len(ks)))
    return Input(peer, p.encoder.encode(p.Store(rid, ks, ids)), ack, done)


completions = st.builds(
    lambda peer, rid, success: Input(peer, complete=(rid, success)),
    peer_of(["sched"] * 4 + ["lonely"]),
    st.integers(0, 1 << 20),
    st.booleans(),
)
# Resets of the fuzzed pool, by sessions with and without authority over it.
resets = st.builds(
    lambda peer, rid, token: Input(peer, p.encoder.encode(p.Reset(rid, "fz", token))),
    peer_of(["sched", "sched", "lonely", "worker", "admin", "attacher", "impostor"]),
    st.integers(0, 1 << 20),
    st.just("") | tokens,
)
# The scheduler collects its results; sessions end while they hold slots and jobs.
finished = st.integers(0, 1 << 20).map(
    lambda rid: Input("sched", p.encoder.encode(p.Finished(rid)))
)
goodbyes = st.builds(
    lambda peer, rid: Input(peer, p.encoder.encode(p.Goodbye(rid))),
    peer_of(["sched", "sched", "lonely", "worker", "attacher", "impostor"]),
    st.integers(0, 1 << 20),
)
rejoins = st.tuples(
    st.sampled_from(["same"] * 3 + ["back"] * 2 + ["none", "other"]), st.booleans()
).map(lambda t: Input("rejoin", ack="later", rejoin=t))
ADMIN_TOKEN = [""]  # the running daemon's, set by the test before any draw

OVERSIZED = Input("fresh", b"\x00" * (p.MAX_FRAME_BYTES + 1), oversized=True)
inputs = st.sampled_from(
    [struct_frames().map(lambda t: Input(t[0], p.encoder.encode(t[1]), t[2], t[3]))] * 24
    + [raw_frames()] * 8
    + [transfers()] * 4
    + [live_job_dones()] * 3
    + [completions, resets, finished, finished, goodbyes]
    + [rejoins]
    + [
        st.integers(0, 400).map(
            lambda i: OVERSIZED if i == 0 else Input("admin", p.encoder.encode(p.Heartbeat(i)))
        )
    ]
    * 2
).flatmap(lambda s: s)
