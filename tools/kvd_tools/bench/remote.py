"""Runs in the operator's shell: `kvd bench remote`, the remote tier on a real Redis (SPEC 14).

A private `redis-server` on a free localhost port (or `--remote-url`) and
two private daemons on it, A and B, stand for two hosts.

Fetch rows (`value_bytes`, `fetch_gbps`, `bare_get_gbps`, `ratio`): A stores
`--fetch-mib` of blocks of that size (bytes written through this process's
mapping of the rows) and writes them behind. Then, in turns, a bare redis-py
client (with hiredis, reading 1 MiB at a time as the daemon's client does)
fetches the same values with pipelined GETs of 16 MiB, as kvd's fetch thread
does, and daemon B fetches them into local slots of an
empty pool: from B's first lookup (None) to the lookup that hits every key.
Each figure is the median of `--rounds` turns; `ratio` = fetch / bare GET
(SPEC goal >= 0.8).

Latency rows (`lookup_keys`, `local_hit_us`, `remote_hit_ms`, `remote_miss_ms`):
the p50 of a lookup that hits locally, of the time from a lookup that goes
remote to the one that hits (blocks A stored, 64 KiB each), and of a lookup
of absent keys to its count.

Trace rows (`trace`, `hosts`, `remote`, `hit_rate`): the conversation trace
(`kvd_tools.bench.conversation`, or `--trace`), each request on one of the two
daemons at random (seeded): look up its blocks, then store the blocks it
missed; hit rate = leading hits / blocks, with each host's pool alone
(`remote` False) and with the remote tier (True); and the same requests on
one host, for reference. The private redis-server has no memory limit: the
remote tier holds every block written.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from kvd_tools.bench.sizing import max_total_bytes, pool_footprint
from kvd_tools.launcher import PRIVATE_FLAGS, DaemonProcess
from kvd_tools.redis_launcher import RedisServer, available

CHUNK_BYTES = 16 << 20
LATENCY_POOL_BYTES = 256 << 20


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _fetch_layout(value_bytes: int) -> Any:
    from kvd_client import Layout

    return Layout(f"bench-remote-{value_bytes}", "bfloat16", 16, 1, False, value_bytes)


def _fetch_capacity(value_bytes: int, args: argparse.Namespace) -> tuple[int, int]:
    """Blocks fetched of `value_bytes`, and the capacity of a pool that holds them
    (the write-behind pins at most half a pool)."""
    n = max(1, (args.fetch_mib << 20) // value_bytes)
    return n, 2 * n * value_bytes + (1 << 20)


def _trace_layout() -> Any:
    from kvd_client import Layout

    return Layout("bench-remote-trace", "bfloat16", 512, 1, False, 4096)


def _latency_layout() -> Any:
    from kvd_client import Layout

    return Layout("bench-remote-latency", "bfloat16", 16, 1, False, 64 << 10)


def _host_bytes(args: argparse.Namespace) -> str:
    """`max_total_bytes` of A and B: B holds `--rounds` fetch pools of a size at
    once (A one), and both the latency pool; or a replay host's one pool."""
    fetch = max(
        args.rounds * pool_footprint("fetch0", _fetch_layout(v), _fetch_capacity(v, args)[1])
        for v in args.value_bytes
    )
    latency = pool_footprint("lat", _latency_layout(), LATENCY_POOL_BYTES)
    trace = pool_footprint("trace", _trace_layout(), args.capacity * 4096)
    return max_total_bytes([max(fetch + latency, trace)])


def _daemon(url: str | None, total: str, **flags: str) -> DaemonProcess:
    base = {**PRIVATE_FLAGS, "max-total-bytes": total}
    if url:
        base.update({"remote-url": url, "remote-write-max-bytes": "2GiB",
                     "remote-fetch-max-bytes": "2GiB", "remote-timeout-ms": "5000"})  # fmt: skip
    base.update(flags)
    daemon = DaemonProcess(base=base)
    try:
        return daemon.start()
    except BaseException:
        daemon.stop()  # one that did not answer in time still runs
        raise


def _wait(what: str, check: Any, timeout: float = 300.0, poll: float = 0.001) -> float:
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            from kvd_tools.bench.suites import SuiteError

            raise SuiteError(f"timed out waiting for {what}")
        time.sleep(poll)
    return time.monotonic() - start


def _counter(s: Any, name: str) -> int:
    return int(s.stats().counters.get(name, 0))


def _wait_written(s: Any, at_least: int) -> None:
    """Until the write-behind wrote `at_least` blocks in all; SuiteError if it skipped any."""
    from kvd_tools.bench.suites import SuiteError

    skipped = _counter(s, "remote.writes_skipped")
    _wait("the write-behind", lambda: _counter(s, "remote.blocks_written") >= at_least
          or _counter(s, "remote.writes_skipped") > skipped, timeout=120, poll=0.02)  # fmt: skip
    if _counter(s, "remote.writes_skipped") > skipped:
        raise SuiteError("the write-behind skipped blocks (see remote.writes_skipped)")


def _wait_hits(s: Any, keys: list[bytes], hits: int, poll: float = 0.001) -> None:
    _wait(f"{hits} hits", lambda: s.lookup(keys) == hits, poll=poll)


def _store(s: Any, keys: list[bytes], fill: bool = True) -> None:
    """prepare_store, the bytes into the slots through our own mapping, complete_store."""
    from kvd_client.worker import Mapping

    assert s.attached is not None
    mapping = Mapping(s.attached, replicated=False) if fill else None
    row = s.attached.row_bytes
    step = max(1, min(4096, CHUNK_BYTES // row))
    for first in range(0, len(keys), step):
        batch = keys[first : first + step]
        out = s.prepare_store(batch)
        if out is None and not fill:
            return  # a replayed request longer than the pool: not stored, as an engine would
        if out is None:
            from kvd_tools.bench.suites import SuiteError

            raise SuiteError("the pool did not take the blocks")
        if mapping is not None:
            for k, slot in zip(out.keys_to_store, out.store_spec.slots, strict=True):
                mapping.mm[slot * row : slot * row + len(k)] = k  # a mark of the block
        s.complete_store(out.keys_to_store)
    if mapping is not None:
        mapping.close()


def _fetch_rows(
    url: str, a: DaemonProcess, b: DaemonProcess, args: argparse.Namespace
) -> list[dict[str, Any]]:
    import redis

    from kvd.io.remote_value import layout_fingerprint, remote_key
    from kvd_client import Scheduler
    from kvd_client.geometry import Geometry

    host, _, port = url.removeprefix("redis://").partition(":")
    # The bare client reads as the daemon's does (1 MiB a read; redis-py's default
    # of 32 KiB is slower), so that the ratio is kvd's own cost.
    client = redis.Redis(host=host, port=int(port.split("/")[0]), socket_read_size=1 << 20)
    rows = []
    for value_bytes in args.value_bytes:
        n, cap = _fetch_capacity(value_bytes, args)
        layout = _fetch_layout(value_bytes)
        keys = [f"fetch/{value_bytes}/{i}".encode() for i in range(n)]
        _log(f"remote: {n} blocks of {value_bytes} bytes stored on A ...")
        with Scheduler("fetch", layout, engine_id="bench-a", endpoint=a.endpoint,
                       capacity_bytes=cap, timeout_ms=60_000) as sa:  # fmt: skip
            base = _counter(sa, "remote.blocks_written")
            _store(sa, keys)
            _wait_written(sa, base + n)
            assert sa.attached is not None
            g = Geometry(sa.attached.num_blocks, sa.attached.row_bytes, sa.attached.slot_bytes,
                         sa.attached.num_slots, sa.attached.slot_stride, False)  # fmt: skip
        names = [remote_key("kvd", layout_fingerprint(layout, g), k) for k in keys]
        per_pipe = max(1, CHUNK_BYTES // value_bytes)
        # B's pools are made first and left to prefault: a pool in service has
        # its pages; a fetch into fresh pages would time the page faults.
        pools = [Scheduler(f"fetch{rnd}", layout, engine_id="bench-b", endpoint=b.endpoint,
                           capacity_bytes=cap, timeout_ms=60_000)
                 for rnd in range(args.rounds)]  # fmt: skip
        time.sleep(1.0 + args.rounds * cap / 1e9)
        bare, fetch = [], []
        for rnd, sb in enumerate(pools):
            t0 = time.perf_counter()
            got = 0
            for first in range(0, n, per_pipe):
                pipe = client.pipeline(transaction=False)
                for name in names[first : first + per_pipe]:
                    pipe.get(name)
                got += sum(len(v) for v in pipe.execute())
            bare.append(got / (time.perf_counter() - t0) / 1e9)
            t0 = time.perf_counter()
            if sb.lookup(keys) is not None:
                from kvd_tools.bench.suites import SuiteError

                raise SuiteError("B's first lookup did not go to the remote tier")
            _wait_hits(sb, keys, n, poll=0.005)  # an engine looks once a step, not more
            fetch.append(got / (time.perf_counter() - t0) / 1e9)
            sb.close()
            b.drop_pool(f"fetch{rnd}")
            _log(f"remote: {value_bytes} B round {rnd}: bare {bare[-1]:.2f} GB/s, "
                 f"kvd {fetch[-1]:.2f} GB/s")  # fmt: skip
        a.drop_pool("fetch")
        fetch_gbps, bare_gbps = statistics.median(fetch), statistics.median(bare)
        rows.append({"value_bytes": value_bytes, "blocks": n, "fetch_gbps": round(fetch_gbps, 3),
                     "bare_get_gbps": round(bare_gbps, 3),
                     "ratio": round(fetch_gbps / bare_gbps, 3)})  # fmt: skip
    client.close()
    return rows


def _latency_rows(
    a: DaemonProcess, b: DaemonProcess, args: argparse.Namespace
) -> list[dict[str, Any]]:
    from kvd_client import Scheduler

    layout = _latency_layout()
    rows = []
    with Scheduler("lat", layout, engine_id="bench-a", endpoint=a.endpoint,
                   capacity_bytes=LATENCY_POOL_BYTES) as sa, Scheduler(
        "lat", layout, engine_id="bench-b", endpoint=b.endpoint, capacity_bytes=LATENCY_POOL_BYTES
    ) as sb:  # fmt: skip
        for nkeys in args.lookup_keys:
            local, remote, miss = [], [], []
            for t in range(args.trials):
                keys = [f"lat/{nkeys}/{t}/{i}".encode() for i in range(nkeys)]
                base = _counter(sa, "remote.blocks_written")
                _store(sa, keys)
                _wait_written(sa, base + nkeys)
                t0 = time.perf_counter()
                assert sa.lookup(keys) == nkeys
                local.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                first = sb.lookup(keys)
                _wait_hits(sb, keys, nkeys, poll=0.0002)
                if first is None:
                    remote.append(time.perf_counter() - t0)
                absent = [f"absent/{nkeys}/{t}/{i}".encode() for i in range(nkeys)]
                t0 = time.perf_counter()
                _wait_hits(sb, absent, 0, poll=0.0002)
                miss.append(time.perf_counter() - t0)
            rows.append({"lookup_keys": nkeys,
                         "local_hit_us": round(statistics.median(local) * 1e6, 1),
                         "remote_hit_ms": round(statistics.median(remote) * 1e3, 3),
                         "remote_miss_ms": round(statistics.median(miss) * 1e3, 3)})  # fmt: skip
    return rows


def _replay(requests: list[list[int]], hosts: list[DaemonProcess], capacity: int,
            seed: int) -> float:  # fmt: skip
    from kvd_client import Scheduler

    layout = _trace_layout()
    rng = random.Random(seed)
    scheds = [Scheduler("trace", layout, engine_id=f"bench-{i}", endpoint=h.endpoint,
                        capacity_bytes=capacity * 4096, timeout_ms=60_000)
              for i, h in enumerate(hosts)]  # fmt: skip
    hits = total = 0
    try:
        for ids in requests:
            s = scheds[rng.randrange(len(scheds))]
            keys = [i.to_bytes(8, "big") for i in ids]
            found: int | None = None
            deadline = time.monotonic() + 10
            while found is None and time.monotonic() < deadline:
                found = s.lookup(keys)
                if found is None:
                    time.sleep(0.0005)
            found = found or 0
            hits += found
            total += len(keys)
            if found < len(keys):
                _store(s, keys[found:], fill=False)
    finally:
        for s in scheds:
            s.close()
    return hits / max(1, total)


def _trace_rows(url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    from kvd_tools.bench.conversation import conversation
    from kvd_tools.bench.replay import load_trace

    if args.trace:
        requests, name = load_trace(Path(args.trace)), Path(args.trace).name
    else:
        requests, name = conversation(seed=1, num_requests=args.requests), "conversation"
    requests = requests[: args.requests]
    rows = []
    # One host with every request: the hit rate two hosts lose by splitting them.
    for num_hosts, remote in ((1, False), (2, False), (2, True)):
        hosts: list[DaemonProcess] = []
        try:
            for _ in range(num_hosts):
                hosts.append(_daemon(url if remote else None, _host_bytes(args)))
            _log(f"remote: replaying {len(requests)} requests on {num_hosts} host(s), "
                 f"remote tier {remote}")  # fmt: skip
            rate = _replay(requests, hosts, args.capacity, seed=7)
        finally:
            for h in hosts:
                h.stop()
        rows.append({"trace": name, "hosts": num_hosts, "capacity_blocks": args.capacity,
                     "remote": remote, "hit_rate": round(rate, 4)})  # fmt: skip
    return rows


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from kvd_tools.bench.suites import SuiteError

    server = None
    url = args.remote_url
    if not url:
        if not available():
            raise SuiteError("redis-server is not installed: apt-get install redis-server, "
                             "or pass --remote-url redis://host:port")  # fmt: skip
        server = RedisServer(None, "--maxmemory", "0")
        url = server.url
    try:
        if server is not None:
            server.start()
        rows: list[dict[str, Any]] = []
        a = _daemon(url, _host_bytes(args))
        try:
            b = _daemon(url, _host_bytes(args))
            try:
                rows += _fetch_rows(url, a, b, args)
                rows += _latency_rows(a, b, args)
            finally:
                b.stop()
        finally:
            a.stop()
        if server is not None:
            server.cli("flushall")
        rows += _trace_rows(url, args)
        return rows
    finally:
        if server is not None:
            server.stop()


def summarize(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in rows:
        if "fetch_gbps" in r:
            out.append(f"{r['value_bytes']} B values: kvd fetches {r['fetch_gbps']} GB/s into "
                       f"local slots, a bare GET {r['bare_get_gbps']} GB/s: {r['ratio']}x "
                       "(goal >= 0.8)")  # fmt: skip
        elif "remote_hit_ms" in r:
            out.append(f"{r['lookup_keys']} keys: a local hit {r['local_hit_us']} us; from a "
                       f"lookup that goes remote to the hit {r['remote_hit_ms']} ms; "
                       f"a remote miss {r['remote_miss_ms']} ms")  # fmt: skip
    trace = {(r["hosts"], r["remote"]): r["hit_rate"] for r in rows if "hit_rate" in r}
    if len(trace) == 3:
        out.append(f"trace hit rate: one host {trace[1, False]}; two hosts, each alone "
                   f"{trace[2, False]}, with the remote tier {trace[2, True]}")  # fmt: skip
    return out
