"""Runs in the test process: a Hypothesis fuzzer over every request type of the control channel.

Each input is one frame from one of seven peers, raw ZeroMQ DEALER sockets:

    fresh     never says Hello: every well-formed request is NOT_HELLO
    hello     Hello with hostile versions, roles, ranks and engine ids
    admin     an admin attached nowhere: pool verbs NOT_ATTACHED, JobDone WRONG_ROLE
    sched     scheduler of engine "fz" on pool "fz"; `worker` acks its jobs
    lonely    scheduler of engine "lonely" on pool "fz", no worker: WORKERS_MISSING
    worker    rank 0 of engine "fz" on pool "fz": pool verbs WRONG_ROLE
    attacher  a scheduler attached nowhere: Attach with hostile names, layouts, capacities

Frames are real Structs with hostile values (negative and huge numbers, empty
and 100,000-key lists, 1 MB keys, unknown pools), hand-built msgpack outside
the schema, random bytes, mutated and truncated frames, multipart messages,
and frames over MAX_FRAME_BYTES (on throwaway sockets: dropped, no reply).

The expected answer is computed by a model: the frame decoded with the shared
schema (a violation is BAD_REQUEST echoing the req_id when the envelope holds
a valid one, else 0), then the session, role, pool and job rules of SPEC
sections 3 to 7 over the pure core the daemon runs (`OwnedIndex` over
`BlockIndex`). Normal replies must equal the model's field for field; errors
must carry the model's code. CheckInvariants runs every 500 inputs and at the
end; the daemon must stay up. KVD_FUZZ_EXAMPLES inputs (100,000 in the long run).
"""

from __future__ import annotations

import os
import typing

import msgspec
import zmq
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvd_client import protocol as p
from kvd_tools.launcher import DaemonProcess
from tests.integration.fuzz_model import FLAGS, FZ, Fuzz, Input
from tests.integration.fuzz_strategies import ADMIN_TOKEN, inputs

NUM_INPUTS = int(os.environ.get("KVD_FUZZ_EXAMPLES", "10000"))
BATCH = 8


def test_fuzz_every_request_type() -> None:
    daemon = DaemonProcess(base=FLAGS).start()
    fuzz = Fuzz(daemon)
    ADMIN_TOKEN[0] = fuzz.model.admin_token = daemon.admin_token
    try:
        fuzz.home()
        fuzz.count_outside_sessions()

        def run_examples(num_examples: int) -> None:
            @settings(
                max_examples=num_examples,
                # Same inputs on every run (CI included) unless asked otherwise,
                # so the coverage assertions below cannot flake.
                derandomize=os.environ.get("KVD_FUZZ_RANDOM") is None,
                deadline=None,
                database=None,
                phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            @given(st.lists(inputs, min_size=BATCH, max_size=BATCH))
            def run(batch: list[Input]) -> None:
                for inp in batch:
                    fuzz.feed(inp)

            run()

        # Hypothesis may stop a run short (examples it discards); top it up.
        for _ in range(5):
            if fuzz.count >= NUM_INPUTS:
                break
            run_examples(max(1, -(-(NUM_INPUTS - fuzz.count) // BATCH)))
        fuzz.checkpoint()
        every = set(typing.get_args(p.Request))
        print(f"\nfuzz: {fuzz.count} inputs; error codes {dict(sorted(fuzz.codes.items()))}")
        assert fuzz.count >= NUM_INPUTS
        if NUM_INPUTS >= 2000:
            assert fuzz.seen == every, f"never sent: {every - fuzz.seen}"
        if NUM_INPUTS >= 10_000:  # these come at least a few times per thousand inputs
            wanted = {"BAD_REQUEST", "NOT_HELLO", "NOT_ATTACHED", "WRONG_ROLE", "NOT_OWNER",
                      "MISSING", "NO_SUCH_POOL", "WORKERS_MISSING", "LAYOUT_MISMATCH",
                      "UNSUPPORTED_VERSION"}  # fmt: skip
            assert wanted <= set(fuzz.codes), f"never answered: {wanted - set(fuzz.codes)}"
        assert daemon.proc is not None and daemon.proc.poll() is None
    finally:
        fuzz.close()
        daemon.stop()


def test_what_the_fuzzer_found() -> None:
    """Regressions, each once found by the fuzzer (kvd/control/service.py, kvd/core/ownership.py)."""
    daemon = DaemonProcess(base=FLAGS).start()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    socks: list[zmq.Socket[bytes]] = []

    def peer() -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(daemon.endpoint)
        socks.append(sock)
        return sock

    def ask(sock: zmq.Socket[bytes], frame: bytes | p.Request) -> p.Reply:
        sock.send(frame if isinstance(frame, bytes) else p.encoder.encode(frame))
        assert sock.poll(5000), "no reply"
        return p.reply_decoder.decode(sock.recv())  # every reply must decode

    def code(reply: p.Reply) -> str:
        return reply.code if isinstance(reply, p.Error) else type(reply).__name__

    try:
        a, w, admin = peer(), peer(), peer()
        # A frame nested 100,000 deep got no reply (RecursionError escaped the handler).
        assert code(ask(a, b"\x91" * 100_000 + b"\xc0")) == "BAD_REQUEST"
        # A bool req_id was echoed back as a bool: a reply no client could decode.
        reply = ask(a, msgspec.msgpack.encode(["Lookup", True, []]))
        assert isinstance(reply, p.Error) and reply.req_id == 0
        assert code(ask(a, p.Hello(1, 1, "scheduler", "e"))) == "Welcome"
        assert code(ask(w, p.Hello(1, 1, "worker", "e"))) == "Welcome"
        assert code(ask(admin, p.Hello(1, 1, "admin"))) == "Welcome"
        # Non-ASCII letters and digits made pool (and segment) names.
        assert code(ask(a, p.Attach(2, "ñame", FZ, 4096))) == "BAD_REQUEST"
        assert code(ask(a, p.Attach(3, "x", FZ, 4096))) == "Attached"
        assert code(ask(w, p.Attach(2, "x", FZ, None))) == "Attached"
        # An empty CompleteLoad from a session holding no pins was INTERNAL.
        assert ask(a, p.CompleteLoad(4, [])) == p.Ok(4)
        assert code(ask(admin, p.DropPool(2, "x", daemon.admin_token))) == "Ok"
        # An idle worker on a dropped pool heard nothing and kept getting jobs.
        assert code(ask(w, p.Heartbeat(3))) == "NO_SUCH_POOL"
        assert code(ask(a, p.Attach(5, "x", FZ, 4096))) == "Attached"  # re-created
        assert code(ask(a, p.Store(6, [b"k"], [0]))) == "WORKERS_MISSING"
        assert not w.poll(200), "a job went to a worker of the dropped pool"
        # Re-attaching to the re-created pool did not count the session (0, then -1).
        pools = ask(admin, p.Pools(3))
        assert isinstance(pools, p.PoolsResult) and [pi.sessions for pi in pools.pools] == [1]
        assert ask(a, p.Goodbye(7)) == p.Ok(7)
        pools = ask(admin, p.Pools(4))
        assert isinstance(pools, p.PoolsResult) and [pi.sessions for pi in pools.pools] == [0]
        inv = ask(admin, p.CheckInvariants(5, daemon.admin_token))
        assert isinstance(inv, p.InvariantsResult) and inv.problems == []
    finally:
        for sock in socks:
            sock.close()
        daemon.stop()
