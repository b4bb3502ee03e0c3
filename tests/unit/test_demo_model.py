"""Runs in the test process: the demo model's math and block bookkeeping, no sockets or processes.

The cached-prefix property the demo (and kvd) rely on: prefilling a suffix
over KV blocks that were computed earlier, or copied in from elsewhere,
gives the logits of a full recompute. TP=2 is emulated with two threads and
an in-process all-reduce.
"""

from __future__ import annotations

import struct
import threading
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvd_tools.demo.block_manager import BlockAllocator, block_hashes, blocks_for, root_hash
from kvd_tools.demo.chart import Series, line_chart, nice_ticks
from kvd_tools.demo.model import ModelConfig, ShardedModel, Variant, cache_shape, slot_bytes
from kvd_tools.demo.workload import chat_workload, random_prompts

# Small enough for a unit test, the same code paths as the demo's model.
SMALL = {"vocab": 512, "hidden": 128, "num_layers": 2, "num_heads": 4, "ffn": 256}
TOL = 1e-4


def config(variant: Variant) -> ModelConfig:
    return ModelConfig(variant=variant, head_dim=32, latent_dim=48, rope_dim=8, **SMALL)


def tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.tensor(random_prompts(1, n, 512, seed)[0], dtype=torch.int64)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # As in a demo worker; and bit-identical TP ranks need the same kernels.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("variant", ["mha", "mla"])
@pytest.mark.parametrize("prefix_blocks", [1, 5, 9])
def test_cached_prefix_matches_recompute(variant: Variant, prefix_blocks: int) -> None:
    c = config(variant)
    model = ShardedModel(c)
    seq = tokens(150)
    table = torch.tensor([7, 2, 9, 0, 4, 11, 3, 8, 1, 10])  # scattered, as a pool hands out
    full = model.forward(seq, 0, table, model.make_cache(12))
    cache = model.make_cache(12)
    start = prefix_blocks * c.block_tokens
    model.forward(seq[:start], 0, table, cache)
    cached = model.forward(seq[start:], start, table, cache)
    assert (cached - full).abs().max().item() <= TOL
    assert int(cached.argmax()) == int(full.argmax())


@pytest.mark.parametrize("variant", ["mha", "mla"])
def test_prefix_copied_to_other_blocks_then_decode(variant: Variant) -> None:
    """What a kvd round trip does: blocks leave one cache and land at other ids of another."""
    c = config(variant)
    model = ShardedModel(c)
    seq = tokens(100, seed=1)
    producer, consumer = model.make_cache(8), model.make_cache(16)
    src, dst = torch.arange(7), torch.tensor([15, 3, 8, 1, 12, 5, 9])
    model.forward(seq[:96], 0, src, producer)
    consumer[dst[:6]] = producer[src[:6]]  # the 6 full blocks of the prefix
    cached = model.forward(seq[96:], 96, dst, consumer)
    ref_cache = model.make_cache(8)
    full = model.forward(seq, 0, src, ref_cache)
    assert (cached - full).abs().max().item() <= TOL
    # Greedy decode continues identically from both caches.
    for pos in range(100, 104):
        nxt = full.argmax().reshape(1)
        assert int(nxt) == int(cached.argmax())
        full = model.forward(nxt, pos, src, ref_cache)
        cached = model.forward(nxt, pos, dst, consumer)
        assert (cached - full).abs().max().item() <= TOL


def _run_tp2(
    c: ModelConfig, step: Callable[[ShardedModel, torch.Tensor], torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Runs `step(model, cache)` on two ranks in threads; an in-process all-reduce joins them."""
    barrier = threading.Barrier(2)
    partials: list[torch.Tensor | None] = [None, None]

    def make_all_reduce(rank: int) -> Callable[[torch.Tensor], None]:
        def all_reduce(t: torch.Tensor) -> None:
            partials[rank] = t.clone()
            barrier.wait()
            a, b = partials
            assert a is not None and b is not None
            t.copy_(a + b)  # the same order on both ranks: identical sums, as gloo gives
            barrier.wait()

        return all_reduce

    results: list[tuple[torch.Tensor, torch.Tensor] | None] = [None, None]

    def rank_main(rank: int) -> None:
        model = ShardedModel(c, rank, 2, make_all_reduce(rank))
        cache = model.make_cache(8)
        results[rank] = (step(model, cache), cache)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(r is not None for r in results)
    return [r for r in results if r is not None]


@pytest.mark.parametrize("variant", ["mha", "mla"])
def test_tp2_matches_tp1(variant: Variant) -> None:
    c = config(variant)
    seq, table = tokens(90, seed=2), torch.arange(6)
    single = ShardedModel(c)
    ref = single.forward(seq, 0, table, single.make_cache(8))

    def step(model: ShardedModel, cache: torch.Tensor) -> torch.Tensor:
        model.forward(seq[:64], 0, table, cache)
        return model.forward(seq[64:], 64, table, cache)

    (logits0, cache0), (logits1, cache1) = _run_tp2(c, step)
    assert (logits0 - ref).abs().max().item() <= TOL
    assert torch.equal(logits0, logits1)
    if variant == "mla":
        # The latent is replicated: bit-identical on every rank, so one copy serves all.
        assert torch.equal(cache0, cache1)
    else:
        assert not torch.equal(cache0, cache1)  # each rank holds its own heads


def test_slot_bytes() -> None:
    mha, mla = config("mha"), config("mla")
    assert slot_bytes(mha, 2) * 2 == slot_bytes(mha, 1)  # sharded: each rank half the heads
    assert slot_bytes(mla, 2) == slot_bytes(mla, 1)  # replicated: the whole latent per rank
    assert slot_bytes(mla, 1) == mla.num_layers * mla.block_tokens * (48 + 8) * 4
    assert cache_shape(mha, 2, 5) == (5, 2, 2, 16, 2, 32)


def test_block_hashes_chain_the_prefix() -> None:
    root = root_hash("model-a")
    seq = list(range(100))
    keys = block_hashes(seq, 16, root)
    assert len(keys) == 6  # the partial 7th block gets no key
    assert all(len(k) == 16 for k in keys)
    assert len(set(keys)) == 6
    assert block_hashes(seq[:64], 16, root) == keys[:4]  # a prefix shares its keys
    changed = [*seq[:40], 999, *seq[41:]]  # a token in block 2 changes keys 2..
    other = block_hashes(changed, 16, root)
    assert other[:2] == keys[:2]
    assert all(a != b for a, b in zip(other[2:], keys[2:], strict=True))
    assert set(block_hashes(seq, 16, root_hash("model-b"))).isdisjoint(keys)
    assert set(block_hashes(seq, 16, root_hash("model-a", b"salt"))).isdisjoint(keys)
    # Same tokens in another block position, after another prefix: another key.
    assert block_hashes(seq[16:32], 16, root)[0] != keys[1]


def test_block_allocator() -> None:
    alloc = BlockAllocator(5)
    a = alloc.allocate(3)
    assert a == [0, 1, 2]
    assert alloc.allocate(3) is None  # too few free: takes none
    assert alloc.num_free == 2
    alloc.free(a)
    with pytest.raises(ValueError):
        alloc.free([1])
    assert alloc.allocate(5) == [0, 1, 2, 3, 4]
    assert blocks_for(33, 16) == 3
    assert blocks_for(32, 16) == 2


def test_chat_workload_shares_prefixes() -> None:
    before, after = chat_workload(quick=True, vocab=512)
    assert [t.name for t in before] == ["A1", "B1", "A2", "C1", "B2", "A3", "C2"]
    assert [t.name for t in after] == ["A4", "C3"]
    turns = {t.name: t.prompt for t in before + after}
    assert turns["A2"][: len(turns["A1"])] == turns["A1"]
    assert turns["A4"][: len(turns["A3"])] == turns["A3"]
    assert turns["B1"][:96] == turns["A1"][:96]  # the shared system prompt
    assert turns["C1"][:64] != turns["A1"][:64]
    again, _ = chat_workload(quick=True, vocab=512)
    assert [t.prompt for t in again] == [t.prompt for t in before]


def test_chart_writes_a_png(tmp_path: Path) -> None:
    path = tmp_path / "chart.png"
    line_chart(path, "ttft", "tokens", "ms", [Series("a", [(1, 2.0), (4, 9.5)], dashed=True)])
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    width, height = struct.unpack(">II", data[16:24])
    idat = data.index(b"IDAT")
    (length,) = struct.unpack(">I", data[idat - 4 : idat])
    raw = zlib.decompress(data[idat + 4 : idat + 4 + length])
    assert len(raw) == height * (1 + 3 * width)
    assert nice_ticks(0, 9.5) == [0, 2, 4, 6, 8, 10]
