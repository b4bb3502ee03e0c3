"""Runs on a CUDA host (`tests/gpu/on_device.sh`): the vLLM plug-in's copies on real CUDA tensors.

`kvd_client.vllm.copies` is the plug-in worker's copy path and imports no
vLLM, so it runs where vLLM cannot be installed. The tensors are shaped as
vLLM's canonical KV caches (one `(num_blocks, page_bytes)` int8 tensor a
layer, Llama 3 8B's page: 16 tokens, 8 KV heads of 128, bf16); the pool is
a POSIX shared-memory segment mapped as the worker maps the daemon's.
Checked: bytes round trip (one group, also with the pool pinned in pieces of
3 slots as kvd pins one past 64 GiB, and two groups with two device blocks a
chunk), store and load GB/s against a plain pinned `copy_` of the same
bytes (goal >= 0.9x; the figures, with the number of blocks moved, go to
`$OUT/vllm_copies.json`), and no host synchronization inside `submit`
(behind a busy compute stream it returns before the copy can start).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator

import posix_ipc
import pytest
import torch

from kvd_client import protocol as p
from kvd_client.backends import host_pin
from kvd_client.vllm.copies import Copies

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LAYERS = 32
PAGE = 2 * 8 * 128 * 16 * 2  # K and V, 8 heads of 128, 16 tokens, bf16: 64 KiB
DEVICE_BLOCKS = 1024
GOAL = 0.9


def pool_blocks(slot: int) -> int:
    """Slots that fit in half of /dev/shm's free space, at least 8 and at most 512."""
    return max(8, min(512, shutil.disk_usage("/dev/shm").free // 2 // slot))


def pool_slots(seg: tuple[str, int]) -> int:
    """One-block slots (`LAYERS * PAGE`) the segment holds."""
    return seg[1] // (LAYERS * PAGE)


@pytest.fixture
def segment() -> Iterator[tuple[str, int]]:
    """A POSIX shared-memory segment of `pool_blocks` two-block slots. Its pages are
    taken only when the worker maps it: a segment larger than /dev/shm's free space
    would then end the run with a SIGBUS, so that fails here, plainly."""
    name = f"/kvd-gpu-{uuid.uuid4().hex[:12]}"
    slot = LAYERS * PAGE * 2  # room for two device blocks a slot
    size = pool_blocks(slot) * slot
    free = shutil.disk_usage("/dev/shm").free
    if size > free:
        pytest.fail(
            f"/dev/shm has {free >> 20} MiB free, the segment needs {size >> 20} MiB "
            f"(8 slots of {slot >> 20} MiB at least): give the machine a larger /dev/shm "
            "(docker: --shm-size)",
            pytrace=False,
        )
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=size)
    shm.close_fd()
    try:
        yield name, size
    finally:
        posix_ipc.unlink_shared_memory(name)


def canonical(layers: int = LAYERS) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(1)
    return [torch.randint(-128, 127, (DEVICE_BLOCKS, PAGE), dtype=torch.int8, device="cuda",
                          generator=gen) for _ in range(layers)]  # fmt: skip


def mapped(tensors: list[torch.Tensor], seg: tuple[str, int], chunk: int, groups: int) -> Copies:
    slot = sum(t.shape[1] for t in tensors) * chunk
    copies = Copies(tensors, rank=0, replicated=False, blocks_per_chunk=chunk, num_groups=groups)
    assert copies.mode == "device"
    copies.map(p.Attached(0, seg[0], 1, seg[1] // slot, slot, slot, 1, slot))
    return copies


def run(copies: Copies, job: int, store: bool, dev: list[int], sizes: list[int],
        starts: list[int], slots: list[int]) -> float:  # fmt: skip
    """One job, submitted and waited for; its seconds, submit to done."""
    plan = copies.plan(dev, sizes, starts, slots)
    torch.cuda.synchronize()
    start = time.perf_counter()
    copies.submit(job, store, 1, plan)
    copies.wait({job})
    seconds = time.perf_counter() - start
    done = copies.poll()
    assert [(d.job_id, d.ok) for d in done] == [(job, True)], done
    return seconds


@pytest.mark.parametrize("piece_slots", [0, 3])
def test_one_group_round_trips_bytes(
    segment: tuple[str, int], monkeypatch: pytest.MonkeyPatch, piece_slots: int
) -> None:
    """`piece_slots`: the pool registered in pieces of that many slots (0: in one, as
    under 64 GiB), so stretches of adjacent slots are cut where each piece ends."""
    if piece_slots:
        monkeypatch.setattr(host_pin, "MAX_REGISTER_BYTES", piece_slots * LAYERS * PAGE)
    tensors = canonical()
    copies = mapped(tensors, segment, 1, 1)
    try:
        n = min(64, pool_slots(segment))
        dev = torch.randperm(DEVICE_BLOCKS)[:n].tolist()
        slots = torch.randperm(n).tolist()
        want = [t[dev].clone() for t in tensors]
        run(copies, 1, True, dev, [n], [0], slots)
        back = torch.randperm(DEVICE_BLOCKS)[:n].tolist()
        for t in tensors:
            t[back] = 0
        run(copies, 2, False, back, [n], [0], slots)
        assert all(torch.equal(t[back], w) for t, w in zip(tensors, want, strict=True))
    finally:
        copies.close()


def test_two_groups_of_two_block_chunks_round_trip(segment: tuple[str, int]) -> None:
    tensors = canonical(4)
    copies = mapped(tensors, segment, 2, 2)
    try:
        dev, sizes, starts, slots = [3, 4, 5, 7, 8], [3, 2], [1, 0], [0, 1, 2]
        want = [t[dev].clone() for t in tensors]
        run(copies, 1, True, dev, sizes, starts, slots)
        back = [10, 11, 12, 13, 14]
        for t in tensors:
            t[back] = 0
        run(copies, 2, False, back, sizes, starts, slots)
        assert all(torch.equal(t[back], w) for t, w in zip(tensors, want, strict=True))
    finally:
        copies.close()


def test_store_and_load_speed_against_a_pinned_copy(segment: tuple[str, int]) -> None:
    tensors = canonical()
    copies = mapped(tensors, segment, 1, 1)
    n = min(256, pool_slots(segment))
    nbytes = n * LAYERS * PAGE
    dev = torch.randperm(DEVICE_BLOCKS)[:n].tolist()
    try:
        run(copies, 1, True, dev, [n], [0], list(range(n)))  # warm-up
        store = min(run(copies, 2 + i, True, dev, [n], [0], list(range(n))) for i in range(3))
        load = min(run(copies, 9 + i, False, dev, [n], [0], list(range(n))) for i in range(3))
    finally:
        copies.close()
    src = torch.empty(nbytes, dtype=torch.int8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.int8, pin_memory=True)
    d2h, h2d = [], []
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        host.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        d2h.append(time.perf_counter() - start)
        start = time.perf_counter()
        src.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        h2d.append(time.perf_counter() - start)
    figures = {
        "blocks": n, "block_bytes": LAYERS * PAGE, "bytes": nbytes,
        "store_gbps": nbytes / store / 1e9, "load_gbps": nbytes / load / 1e9,
        "pinned_d2h_gbps": nbytes / min(d2h) / 1e9, "pinned_h2d_gbps": nbytes / min(h2d) / 1e9,
    }  # fmt: skip
    figures["store_ratio"] = figures["store_gbps"] / figures["pinned_d2h_gbps"]
    figures["load_ratio"] = figures["load_gbps"] / figures["pinned_h2d_gbps"]
    print(json.dumps(figures))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "vllm_copies.json"), "w") as f:
            json.dump(figures, f, indent=1)
    assert figures["store_ratio"] >= GOAL and figures["load_ratio"] >= GOAL, figures


def test_submit_does_not_wait_for_the_compute_stream(segment: tuple[str, int]) -> None:
    """A store waits for the compute stream on the device, not on the host: behind
    a kernel that keeps the compute stream busy, `submit` returns long before it
    ends, and the job is not done until it has."""
    tensors = canonical()
    copies = mapped(tensors, segment, 1, 1)
    try:
        plan = copies.plan(list(range(8)), [8], [0], list(range(8)))
        torch.cuda.synchronize()
        busy = time.perf_counter()
        torch.cuda._sleep(2_000_000_000)  # type: ignore[no-untyped-call]  # about a second
        start = time.perf_counter()
        copies.submit(1, True, 1, plan)
        submit_s = time.perf_counter() - start
        assert copies.poll() == []  # still behind the busy stream
        copies.wait({1})
        total_s = time.perf_counter() - busy
        assert [d.ok for d in copies.poll()] == [True]
        assert submit_s < total_s / 20, (submit_s, total_s)
    finally:
        copies.close()
