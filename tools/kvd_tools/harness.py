"""Runs in an engine's processes (demo, soak, tests): its rank processes, their pipes, CPU caches.

The hand-written TP engines (`kvd_tools.demo`, `kvd_tools.soak`, the
integration tests' ranks and torn-read engine) share these pieces:

    engine process                              rank process r (spawned)
      RankProcess(r, main, args) -- spawn -->     main(r, *args, conn)
        .send(command)           -- pipe --->     for command in commands(conn):
        .receive(timeout_s)      <-- pipe ---         conn.send(answer)
      close_ranks(ranks, goodbye) ----------->    leaves its loop; killed if it lingers

`receive` raises `RankSilent` (a `TimeoutError`) when no answer comes in
time and `RankExited` (an `EOFError`) when the rank is gone; each engine
says what that means for it. What travels on the pipes is each engine's
own: dataclasses in the demo, tuples in the soak and the tests.

torch is imported only where a cache is built, so an engine process that
never touches a tensor (the soak's scheduler, a test) does not load it.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# No fork: torch and zmq threads do not survive it.
CTX = mp.get_context("spawn")
JOIN_S = 10.0  # how long a rank may take to exit before it is killed
TAG_STEP = 7919  # between tags: blocks of two tags differ in every element


class RankSilent(TimeoutError):
    """A rank kept its pipe open but did not answer in time."""


class RankExited(EOFError):
    """A rank's end of the pipe closed: the process is gone."""


class RankProcess:
    """One spawned rank process and the engine's end of its pipe; `stop` ends both."""

    def __init__(
        self,
        rank: int,
        main: Callable[..., None],
        args: tuple[object, ...] = (),
        *,
        name: str | None = None,
    ) -> None:
        self.rank = rank
        ours, theirs = CTX.Pipe()
        self.proc = CTX.Process(target=main, args=(rank, *args, theirs), daemon=True, name=name)
        self.proc.start()
        theirs.close()  # so that the rank's death reads as EOF here
        self.conn = ours

    @property
    def pid(self) -> int:
        return self.proc.pid or 0

    def alive(self) -> bool:
        return self.proc.is_alive()

    def send(self, command: object) -> None:
        """Raises OSError when the rank is gone (or `stop` closed the pipe)."""
        self.conn.send(command)

    def receive(self, timeout_s: float) -> Any:
        """The rank's next answer, whatever it sent; raises RankSilent or RankExited."""
        try:
            if self.conn.poll(timeout_s):
                return self.conn.recv()
        except (EOFError, OSError):
            raise RankExited(f"rank {self.rank} exited") from None
        # Raised outside the try: a TimeoutError is an OSError too.
        raise RankSilent(f"rank {self.rank} did not answer within {timeout_s:.0f} s")

    def stop(self, *, kill: bool = False) -> None:
        """Waits for the process to exit (killing it first with `kill`, or when it lingers)."""
        if kill and self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=JOIN_S)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=JOIN_S)
        self.conn.close()


def close_ranks(ranks: Iterable[RankProcess], goodbye: object) -> None:
    """Sends `goodbye` to every rank, then stops each; safe after any failure."""
    ranks = list(ranks)
    for rank in ranks:
        with contextlib.suppress(OSError):  # already gone
            rank.send(goodbye)
    for rank in ranks:
        rank.stop()


def commands(conn: Connection, parent_pid: int | None = None, poll_s: float = 0.5) -> Iterator[Any]:
    """In a rank: each command the engine sends, until the engine's end of the pipe closes.

    With `parent_pid` it also ends once that process is no longer the rank's
    parent (the engine died and the rank was re-parented), checked every
    `poll_s` while the pipe is quiet: a rank never outlives its engine.
    """
    while True:
        if parent_pid is not None and not conn.poll(poll_s):
            if os.getppid() != parent_pid:
                return
            continue
        try:
            command = conn.recv()
        except EOFError:
            return
        yield command


# -- CPU "device" caches ---------------------------------------------------------------
#
#   contiguous   one tensor  [num_device_blocks, slot_bytes / itemsize]
#                block b = row b: one rank's whole slot
#   per_layer    num_layers tensors, each [num_device_blocks, 2 (K, V), 4 heads, elems]
#                block b = row b of every layer, slot_bytes / num_layers each


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """A rank's KV cache: `num_device_blocks` blocks of `slot_bytes`, in one of two layouts."""

    layout: str  # "contiguous" (bfloat16) or "per_layer" (float16)
    slot_bytes: int
    num_device_blocks: int
    num_layers: int = 4


def contiguous_cache(num_device_blocks: int, slot_bytes: int, dtype: str) -> torch.Tensor:
    """A zeroed cache of one row of `slot_bytes` per block; `dtype` as a Layout spells it."""
    import torch

    kind = getattr(torch, dtype)
    return torch.zeros(num_device_blocks, slot_bytes // kind.itemsize, dtype=kind)


def make_cache(spec: CacheSpec) -> torch.Tensor | list[torch.Tensor]:
    """A zeroed cache of `spec`'s layout, as an engine would hold it."""
    import torch

    if spec.layout == "contiguous":
        return contiguous_cache(spec.num_device_blocks, spec.slot_bytes, "bfloat16")
    per_layer = spec.slot_bytes // spec.num_layers
    if per_layer * spec.num_layers != spec.slot_bytes:
        raise ValueError(f"{spec.slot_bytes} bytes do not split into {spec.num_layers} layers")
    return [
        torch.zeros(spec.num_device_blocks, 2, 4, per_layer // 16, dtype=torch.float16)
        for _ in range(spec.num_layers)
    ]


def cache_tensors(cache: torch.Tensor | list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors of a cache of either layout, each indexed by block first."""
    return cache if isinstance(cache, list) else [cache]


def block_content(tag: int, num_elems: int) -> torch.Tensor:
    """The int64 content of a block made from `tag` (>= 0): never zero, distinct per tag."""
    import torch

    return torch.arange(num_elems, dtype=torch.int64) * 1_000_003 + tag * TAG_STEP + 1


def content_tag(block: torch.Tensor) -> float:
    """The tag `block_content` made `block` from: not a whole number when none did."""
    return (int(block[0]) - 1) / TAG_STEP
