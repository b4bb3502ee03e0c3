"""Runs in the operator's shell: `kvd bench rpc`, lookup latency against a bare ZeroMQ echo.

Each run starts its own daemon (a child process) and, in the same run, a bare
pyzmq ROUTER echo server. N client processes then send the same frames to
each: `Scheduler.lookup` of 64 keys (encode, send, daemon decode + index
lookup + encode, receive, decode) versus sending the encoded `Lookup` frame
to the echo server and receiving it back. `ratio` = p50 / echo p50.

By default every lookup is the same 64 keys, which a scheduler polling a
waiting request sends. `--distinct` cycles through 32 different lookups, all
stored, so the adaptive policy's simulations (run by the daemon between
requests) get new work on every lookup.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from multiprocessing.synchronize import Barrier
from typing import Any

from kvd_tools.bench.sizing import max_total_bytes, pool_footprint
from kvd_tools.launcher import PRIVATE_FLAGS, DaemonProcess

NUM_KEYS = 64
LAYOUT_ARGS = ("bench-rpc", "bfloat16", 16, 1, False, 4096)
POOL_BYTES = 16 << 20


# With --distinct, clients cycle through this many different 64-key lookups.
NUM_WINDOWS = 32


def _keys(window: int = 0) -> list[bytes]:
    first = window * NUM_KEYS
    return [i.to_bytes(8, "big") for i in range(first, first + NUM_KEYS)]


def _echo_server(endpoint: str, ready: Any) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoint)
    ready.set()
    while True:
        sock.send_multipart(sock.recv_multipart())


def _client(mode: str, endpoint: str, ops: int, windows: int, barrier: Barrier, out: Any) -> None:
    from kvd_client import Layout, Scheduler
    from kvd_client import protocol as p

    keys = _keys()
    lookups = [_keys(w) for w in range(windows)]
    samples = []
    if mode == "kvd":
        s = Scheduler(  # the round trip itself: `kvd bench lookup` measures the table
            "bench-rpc", Layout(*LAYOUT_ARGS), engine_id="rpc", endpoint=endpoint, use_table=False
        )
        for i in range(200):
            s.lookup(lookups[i % windows])
        barrier.wait()
        t0 = time.monotonic()
        for i in range(ops):
            keys = lookups[i % windows]
            a = time.perf_counter_ns()
            hits = s.lookup(keys)
            samples.append(time.perf_counter_ns() - a)
        t1 = time.monotonic()
        if hits != NUM_KEYS:
            raise RuntimeError(f"expected {NUM_KEYS} hits, got {hits}")
        s.close()
    else:
        import zmq

        frame = p.encoder.encode(p.Lookup(1, keys))
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(endpoint)
        for _ in range(200):
            sock.send(frame)
            sock.recv()
        barrier.wait()
        t0 = time.monotonic()
        for _ in range(ops):
            a = time.perf_counter_ns()
            sock.send(frame)
            sock.recv()
            samples.append(time.perf_counter_ns() - a)
        t1 = time.monotonic()
        sock.close(linger=0)
    out.put((t0, t1, samples))


def _measure(
    mode: str, endpoint: str, clients: int, ops: int, windows: int = 1
) -> tuple[float, float, float]:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(clients)
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_client, args=(mode, endpoint, ops, windows, barrier, out))
        for _ in range(clients)
    ]
    for proc in procs:
        proc.start()
    try:
        results = [out.get(timeout=300) for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    samples = sorted(s for _, _, ss in results for s in ss)
    wall = max(t1 for _, t1, _ in results) - min(t0 for t0, _, _ in results)
    p50 = statistics.median(samples) / 1000
    p99 = samples[int(len(samples) * 0.99) - 1] / 1000
    return p50, p99, len(samples) / wall


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from kvd_client import Layout, Scheduler

    rows = []
    windows = NUM_WINDOWS if args.distinct else 1
    footprint = pool_footprint("bench-rpc", Layout(*LAYOUT_ARGS), POOL_BYTES)
    flags = {**PRIVATE_FLAGS, "max-total-bytes": max_total_bytes([footprint])}
    if args.policy is not None:
        flags["policy"] = args.policy
    with DaemonProcess(base=flags) as daemon:
        with Scheduler(
            "bench-rpc",
            Layout(*LAYOUT_ARGS),
            engine_id="setup",
            endpoint=daemon.endpoint,
            capacity_bytes=POOL_BYTES,
        ) as s:
            for window in range(windows):
                s.prepare_store(_keys(window))
                s.complete_store(_keys(window))
        echo_endpoint = f"ipc://{daemon.runtime_dir / 'echo.sock'}"
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        echo = ctx.Process(target=_echo_server, args=(echo_endpoint, ready), daemon=True)
        echo.start()
        try:
            if not ready.wait(30):
                raise RuntimeError("the echo server did not start")
            for clients in args.clients:
                p50, p99, rate = _measure("kvd", daemon.endpoint, clients, args.ops, windows)
                e50, _, _ = _measure("echo", echo_endpoint, clients, args.ops)
                rows.append(
                    {
                        "clients": clients,
                        "p50_us": round(p50, 1),
                        "p99_us": round(p99, 1),
                        "ops_per_s": round(rate),
                        "echo_p50_us": round(e50, 1),
                        "ratio": round(p50 / e50, 3),
                    }
                )
        finally:
            echo.kill()
            echo.join(timeout=10)
    return rows


def summarize(rows: list[dict[str, Any]]) -> list[str]:
    one = [r for r in rows if r["clients"] == 1]
    if not one:
        return []
    verdict = "meets" if one[0]["ratio"] <= 1.5 else "MISSES"
    return [
        f"p50 at 1 client is {one[0]['ratio']:.2f} x a bare pyzmq echo "
        f"({verdict} the <= 1.5 x goal)."
    ]
