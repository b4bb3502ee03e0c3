"""Runs in the test process: a real daemon's events for one-group and hybrid engines, read by routers' rules.

An engine attaches with a layout that names its KV cache groups (vLLM's
order, so a group's index is its `group_idx`), stores a block of every group
per offload key (vLLM's 32-byte hash + 4-byte group), and stores again past
the pool's size so the first blocks are evicted. What the daemon published on
its PUB socket then goes through vLLM's own decoder and through the rules of
llm-d's indexer and Dynamo's router (`router_rules`, cited there). A pool
whose layout names no groups (an older client) is the control: without the
kind, both routers drop the events of a group other than 0.
"""

from __future__ import annotations

import socket
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec
import pytest
import zmq

from kvd_client import Layout, Scheduler
from kvd_client.protocol import Group
from kvd_tools.launcher import DaemonProcess
from tests.integration.router_rules import DynamoRouter, LlmdIndex

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch's, while vLLM imports
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
    )
    from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

BLOCK_TOKENS = 16
WINDOW = 32
ENGINES = {
    "one-group": (Group("full_attention", BLOCK_TOKENS),),
    # Sliding first, so the full-attention group is group 1 (Dynamo's rule
    # for a group other than 0 needs the kind).
    "hybrid": (
        Group("sliding_window", BLOCK_TOKENS, WINDOW),
        Group("full_attention", BLOCK_TOKENS),
    ),
    "no-groups": (),  # an older client of the hybrid engine: keys of two groups, no kinds
}
NUM_KEY_GROUPS = {"one-group": 1, "hybrid": 2, "no-groups": 2}
WAIT_S = 5.0
vllm_decode = msgspec.msgpack.Decoder(KVEventBatch).decode
HOST = socket.gethostname()


def block_hash(i: int) -> bytes:
    return bytes([i + 1]) * 32


def published(i: int) -> int:
    """What vLLM publishes for block `i`'s hash (its default int hashes)."""
    h = maybe_convert_block_hash(BlockHash(block_hash(i)))
    assert isinstance(h, int)
    return h


@dataclass
class Phase:
    stored: list[tuple[int, int]]  # (block, group) stored in this phase
    evicted: list[tuple[int, int]]
    messages: list[tuple[bytes, bytes]]  # (topic, payload) on the pool's topic


@pytest.fixture(scope="module")
def runs() -> Iterator[dict[str, list[Phase]]]:
    """Each engine's two phases against one real daemon: blocks 0-1 of every
    group, then blocks 2-3, which evict them (the pool holds two blocks a group)."""
    d = DaemonProcess(policy="lru").start()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(f"ipc://{d.runtime_dir}/events.sock")
    try:
        join(d, sub)
        out = {name: engine_phases(d, sub, name) for name in ENGINES}
    finally:
        sub.close()
        ctx.destroy(linger=0)
        d.stop()
    yield out


def engine_phases(d: DaemonProcess, sub: zmq.Socket[bytes], name: str) -> list[Phase]:
    groups = range(NUM_KEY_GROUPS[name])
    layout = Layout(
        f"routers-{name}@1", "bfloat16", BLOCK_TOKENS, 1, False, 4096, groups=ENGINES[name]
    )
    topic = f"kv@{HOST}@{name}".encode()
    phases = []
    with Scheduler(
        name, layout, engine_id=name, endpoint=d.endpoint, capacity_bytes=2 * len(groups) * 4096
    ) as s:
        for blocks in ((0, 1), (2, 3)):
            stored = [(b, g) for g in groups for b in blocks]
            keys = [block_hash(b) + g.to_bytes(4, "big") for b, g in stored]
            out = s.prepare_store(keys)
            assert out is not None and out.keys_to_store == keys
            evicted = [
                (b, g)
                for b in range(4)
                for g in groups
                if block_hash(b) + g.to_bytes(4, "big") in out.evicted_keys
            ]
            s.complete_store(keys)
            phases.append(Phase(stored, evicted, receive(sub, topic, len(stored), len(evicted))))
    assert [p.evicted for p in phases] == [[], [(b, g) for b in (0, 1) for g in groups]]
    return phases


def join(d: DaemonProcess, sub: zmq.Socket[bytes]) -> None:
    """Stores blocks in a scratch pool until one event arrives: the SUB is joined."""
    layout = Layout("routers-warm@1", "bfloat16", BLOCK_TOKENS, 1, False, 4096)
    with Scheduler("warm", layout, engine_id="warm", endpoint=d.endpoint) as s:
        for i in range(100):
            key = (10_000 + i).to_bytes(8, "big")
            s.prepare_store([key])
            s.complete_store([key])
            if sub.poll(100):
                break
        else:
            pytest.fail("no event reached the subscriber")
    while sub.poll(200):
        sub.recv_multipart()


def receive(
    sub: zmq.Socket[bytes], topic: bytes, num_stored: int, num_removed: int
) -> list[tuple[bytes, bytes]]:
    got: list[tuple[bytes, bytes]] = []
    counts = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}
    deadline = time.monotonic() + WAIT_S
    while (counts["BlockStored"], counts["BlockRemoved"]) != (num_stored, num_removed):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out with {counts}; got {got}")
        if sub.poll(50):
            t, _, payload = sub.recv_multipart()
            if t == topic:
                got.append((t, payload))
                for ev in msgspec.msgpack.decode(payload)[1]:
                    counts[ev["type"]] += len(ev.get("block_hashes", []))
    return got


# -- vLLM's decoder --------------------------------------------------------------


@pytest.mark.parametrize("name", list(ENGINES))
def test_vllms_decoder_reads_each_groups_kind_window_and_tier(
    runs: dict[str, list[Phase]], name: str
) -> None:
    groups = ENGINES[name]
    seen: dict[str, list[tuple[int, int]]] = {"BlockStored": [], "BlockRemoved": []}
    for phase in runs[name]:
        for _, payload in phase.messages:
            for ev in vllm_decode(payload).events:
                if isinstance(ev, AllBlocksCleared):  # the new pool's topic starts clean
                    continue
                assert isinstance(ev, BlockStored | BlockRemoved)
                assert ev.group_idx is not None
                kind = groups[ev.group_idx].kind if groups else None
                window = groups[ev.group_idx].sliding_window if groups else None
                if isinstance(ev, BlockStored):
                    assert (ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window) == (
                        kind,
                        window,
                    )
                    assert (ev.block_size, ev.token_ids, ev.parent_block_hash) == (
                        BLOCK_TOKENS,
                        [],
                        None,
                    )
                # vLLM's OffloadingConnector's CPU tier: medium CPU, no locality, no ownership.
                assert (ev.medium, ev.locality, ev.ownership) == ("CPU", None, None)
                seen[type(ev).__name__] += [(h, ev.group_idx) for h in ev.block_hashes]
    phases = runs[name]
    assert sorted(seen["BlockStored"]) == sorted(
        (published(b), g) for p in phases for b, g in p.stored
    )
    assert sorted(seen["BlockRemoved"]) == sorted(
        (published(b), g) for p in phases for b, g in p.evicted
    )


# -- llm-d's indexer -------------------------------------------------------------


def engine_gpu_events(groups: tuple[Group, ...], num_key_groups: int) -> bytes:
    """The engine's own GPU-tier stores of blocks 0-3 as vLLM publishes them: tokens,
    parent chain, and each group's kind. They teach llm-d the engine-to-request keys
    that kvd's token-less CPU stores resolve against (`handleDeviceTierUpdate`)."""
    events = []
    for g in range(num_key_groups):
        for b in range(4):
            tokens = list(range(b * BLOCK_TOKENS, (b + 1) * BLOCK_TOKENS))
            parent = published(b - 1) if b else None
            kind = groups[g].kind if groups else "full_attention"
            window = groups[g].sliding_window if groups else None
            events.append(BlockStored([published(b)], parent, tokens, BLOCK_TOKENS, None, "GPU", None,
                                      group_idx=g, kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window))  # fmt: skip
    return msgspec.msgpack.encode(KVEventBatch(1.0, events))


@pytest.mark.parametrize("name", ["one-group", "hybrid"])
def test_llmd_indexes_every_stored_prefix_block_and_applies_every_removal(
    runs: dict[str, list[Phase]], name: str
) -> None:
    groups = ENGINES[name]
    index = LlmdIndex(BLOCK_TOKENS)
    index.feed(b"kv@engine-pod@model", engine_gpu_events(groups, len(groups)))
    index.skipped.clear()  # the engine's own sliding-window stores: llm-d skips them too
    prefix = {g for g, grp in enumerate(groups) if grp.kind == "full_attention"}
    first, second = runs[name]
    for _, payload in first.messages:
        index.feed(f"kv@{HOST}@{name}".encode(), payload)
    for b, g in first.stored:  # every block of a prefix group: kvd's pod holds it in "cpu"
        assert ((HOST, "cpu", g) in index.holders(published(b))) == (g in prefix)
    for _, payload in second.messages:
        index.feed(f"kv@{HOST}@{name}".encode(), payload)
    for b, g in second.stored:
        assert ((HOST, "cpu", g) in index.holders(published(b))) == (g in prefix)
    for b, _ in second.evicted:  # removed: only the engine's GPU entry is left
        assert index.holders(published(b)) == {("engine-pod", "gpu", p) for p in prefix}
    # The kind was learned for each group; a sliding-window group is skipped by
    # llm-d's own rule for that kind (as vLLM's own events of it are), never as unknown.
    assert {g: index.catalog[(HOST, g)] for g in range(len(groups))} == {
        g: (grp.kind, grp.sliding_window) for g, grp in enumerate(groups)
    }
    sliding = [g for g in range(len(groups)) if g not in prefix]
    assert index.skipped == (
        {("store", "sliding_window", "unsupported_cache_kind"): 4, ("remove", "sliding_window", "unsupported_cache_kind"): 2}
        if sliding else {}
    )  # fmt: skip


def test_llmd_drops_every_event_of_a_layout_without_kinds(runs: dict[str, list[Phase]]) -> None:
    """The control: the same hybrid keys from a layout that names no groups."""
    index = LlmdIndex(BLOCK_TOKENS)
    index.feed(b"kv@engine-pod@model", engine_gpu_events((), 2))
    for phase in runs["no-groups"]:
        for _, payload in phase.messages:
            index.feed(f"kv@{HOST}@no-groups".encode(), payload)
    assert not any(e[0] == HOST for b in range(4) for e in index.holders(published(b)))
    assert index.skipped == {
        ("store", "unknown", "unsupported_cache_kind"): 8,
        ("remove", "unknown", "unknown_group"): 4,
    }


# -- Dynamo's router -------------------------------------------------------------


@pytest.mark.parametrize("name", ["one-group", "hybrid", "no-groups"])
def test_dynamo_keeps_every_main_attention_event(runs: dict[str, list[Phase]], name: str) -> None:
    groups = ENGINES[name]
    router = DynamoRouter(BLOCK_TOKENS)
    for phase in runs[name]:
        for _, payload in phase.messages:
            router.feed(payload)
    main = {g for g, grp in enumerate(groups) if grp.kind == "full_attention"} if groups else {0}
    phases = runs[name]
    kept = sorted((tag, h, g) for tag, hashes, g in router.passed for h in hashes)
    assert kept == sorted(
        [("BlockStored", published(b), g) for p in phases for b, g in p.stored if g in main]
        + [("BlockRemoved", published(b), g) for p in phases for b, g in p.evicted if g in main]
    )
    # Every removal of a kept group reaches the index, under medium "CPU"
    # (Dynamo's HostPinned tier).
    assert sorted(router.removed.get("CPU", [])) == sorted(
        published(b) for b, g in phases[1].evicted if g in main
    )
    # What it drops, and why: a sliding-window group by its kind; without
    # kinds, group 1 as a group it never learned.
    reason = "non_main_attention_kind" if groups else "unlearned_group_idx"
    two_groups = {("BlockStored", reason): 4, ("BlockRemoved", reason): 2}
    assert router.filtered == ({} if name == "one-group" else two_groups)
    # Dynamo publishes a stored block only with its tokens (`create_stored_blocks`
    # hashes them), which the daemon never sees: kvd's stores pass the filter but
    # add no block, as vLLM's own token-less CPU events (its placeholders) do.
    assert router.stored.get("CPU", set()) == set()
