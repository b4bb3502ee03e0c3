"""Runs in spawned test processes: a TP worker rank driven over a pipe by the test.

Each process hosts one `kvd_client.Worker` at a time, over a KV cache it
creates itself (one contiguous tensor, or per-layer tensors), and answers
commands from the test: open, fill, zero, digest, wait, poll, close.
"""

from __future__ import annotations

import hashlib
from multiprocessing.connection import Connection
from typing import Any

from kvd_tools.harness import CacheSpec, RankProcess, cache_tensors, commands, make_cache

__all__ = ["CacheSpec", "Rank", "all_ranks"]  # CacheSpec: the tests build it


def digest(caches: Any, block: int) -> str:
    h = hashlib.sha256()
    for t in cache_tensors(caches):
        h.update(t[block].contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()


def worker_main(
    rank: int, world_size: int, endpoint: str, env: dict[str, str], conn: Connection
) -> None:
    import os

    os.environ.update(env)
    import torch

    from kvd_client import Layout, Worker

    worker: Worker | None = None
    caches: Any = None
    for cmd, args in commands(conn):
        try:
            if cmd == "open":
                pool, layout_args, spec = args
                if worker is not None:
                    worker.close()
                caches = make_cache(spec)
                worker = Worker(
                    rank,
                    world_size,
                    caches,
                    pool=pool,
                    layout=Layout(*layout_args),
                    engine_id=layout_args[0] + "-engine",
                    endpoint=endpoint,
                )
                conn.send(("ok", worker.connected))
            elif cmd == "fill":
                gen = torch.Generator().manual_seed(args * 1000 + rank)
                for t in cache_tensors(caches):
                    t.view(torch.int16).copy_(
                        torch.randint(-(2**15), 2**15, t.shape, dtype=torch.int16, generator=gen)
                    )
                conn.send(("ok", None))
            elif cmd == "zero":
                for t in cache_tensors(caches):
                    t.zero_()
                conn.send(("ok", None))
            elif cmd == "digest":
                conn.send(("ok", [digest(caches, b) for b in args]))
            elif cmd == "wait":
                assert worker is not None
                conn.send(("ok", worker.wait(args, timeout_s=30)))
            elif cmd == "poll":
                assert worker is not None
                conn.send(("ok", worker.poll(args)))
            elif cmd == "native_min_bytes":  # the setting this rank's Worker reads
                from kvd_client.backends.native import available
                from kvd_client.settings import ClientSettings

                conn.send(
                    ("ok", ClientSettings.from_env().native_min_bytes if available() else None)
                )
            elif cmd == "bytes":
                assert worker is not None
                conn.send(("ok", worker.bytes_copied))
            elif cmd == "close":
                if worker is not None:
                    worker.close()
                conn.send(("ok", None))
                return
            else:
                conn.send(("error", f"unknown command {cmd}"))
        except Exception as exc:  # report to the test instead of dying silently
            conn.send(("error", repr(exc)))


class Rank:
    """The test's handle on one worker process."""

    def __init__(
        self, rank: int, world_size: int, endpoint: str, env: dict[str, str] | None = None
    ) -> None:
        self.rank = rank
        self.process = RankProcess(rank, worker_main, (world_size, endpoint, dict(env or {})))

    def send(self, cmd: str, args: Any = None) -> None:
        self.process.send((cmd, args))

    def result(self, timeout: float = 60) -> Any:
        status, value = self.process.receive(timeout)  # RankSilent is a TimeoutError
        if status != "ok":
            raise RuntimeError(f"rank {self.rank}: {value}")
        return value

    def call(self, cmd: str, args: Any = None, timeout: float = 60) -> Any:
        self.send(cmd, args)
        return self.result(timeout)

    def kill(self) -> None:
        self.process.stop(kill=True)


def all_ranks(ranks: list[Rank], cmd: str, args: Any = None, timeout: float = 60) -> list[Any]:
    for r in ranks:
        r.send(cmd, args)
    return [r.result(timeout) for r in ranks]
