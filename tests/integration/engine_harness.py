"""Runs in spawned test processes: a TP worker rank driven over a pipe by the test.

Each process hosts one `kvd_client.Worker` at a time, over a KV cache it
creates itself (one contiguous tensor, or per-layer tensors), and answers
commands from the test: open, fill, zero, digest, wait, poll, close.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

CTX = mp.get_context("spawn")


@dataclass(frozen=True)
class CacheSpec:
    layout: str  # "contiguous" or "per_layer"
    slot_bytes: int
    num_device_blocks: int
    num_layers: int = 4


def make_caches(spec: CacheSpec) -> Any:
    import torch

    if spec.layout == "contiguous":
        return torch.zeros(spec.num_device_blocks, spec.slot_bytes // 2, dtype=torch.bfloat16)
    per_layer = spec.slot_bytes // spec.num_layers
    assert per_layer * spec.num_layers == spec.slot_bytes
    # [blocks, 2 (K and V), heads, elems] per layer, as an engine would hold it
    return [
        torch.zeros(spec.num_device_blocks, 2, 4, per_layer // 16, dtype=torch.float16)
        for _ in range(spec.num_layers)
    ]


def _blocks(caches: Any) -> list[Any]:
    return caches if isinstance(caches, list) else [caches]


def digest(caches: Any, block: int) -> str:
    h = hashlib.sha256()
    for t in _blocks(caches):
        h.update(t[block].contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()


def worker_main(
    rank: int, world_size: int, endpoint: str, conn: Connection, env: dict[str, str]
) -> None:
    import os

    os.environ.update(env)
    import torch

    from kvd_client import Layout, Worker

    worker: Worker | None = None
    caches: Any = None
    while True:
        cmd, args = conn.recv()
        try:
            if cmd == "open":
                pool, layout_args, spec = args
                if worker is not None:
                    worker.close()
                caches = make_caches(spec)
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
                for t in _blocks(caches):
                    t.view(torch.int16).copy_(
                        torch.randint(-(2**15), 2**15, t.shape, dtype=torch.int16, generator=gen)
                    )
                conn.send(("ok", None))
            elif cmd == "zero":
                for t in _blocks(caches):
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
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(
            target=worker_main,
            args=(rank, world_size, endpoint, child, dict(env or {})),
            daemon=True,
        )
        self.proc.start()

    def send(self, cmd: str, args: Any = None) -> None:
        self.conn.send((cmd, args))

    def result(self, timeout: float = 60) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"rank {self.rank} did not answer")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"rank {self.rank}: {value}")
        return value

    def call(self, cmd: str, args: Any = None, timeout: float = 60) -> Any:
        self.send(cmd, args)
        return self.result(timeout)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=10)


def all_ranks(ranks: list[Rank], cmd: str, args: Any = None, timeout: float = 60) -> list[Any]:
    for r in ranks:
        r.send(cmd, args)
    return [r.result(timeout) for r in ranks]
