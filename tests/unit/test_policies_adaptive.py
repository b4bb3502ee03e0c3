"""The adaptive policy: the doorkeeper, the probation/main rules, the fingerprint map,
the miniatures that choose the behaviour, and hit rates on generated traces.

The traces are generated here with fixed seeds (Mooncake format: each request
is its prefix blocks, equal ids meaning equal prefixes), small enough to
replay in a second: conversation traffic (sessions whose prompts extend the
previous turn's, a shared system prompt, many one-off sessions), tool/agent
traffic (Zipf-popular tool prompts, fast agent loops) and a scan over a hot set.
"""

from __future__ import annotations

import heapq
import math
import random
import tracemalloc
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvd.core.index import BlockIndex, OffloadingEvent
from kvd.core.index.policies import POLICIES, SlotPredicate, make_policy
from kvd.core.index.policies.adaptive import MAX_PENDING_KEYS, AdaptivePolicy
from kvd.core.index.policies.doorkeeper import Doorkeeper
from kvd.core.index.policies.fingerprint_map import FingerprintMap
from kvd.core.index.policies.miniature import EXPERTS, START, Miniature, Miniatures
from kvd.core.index.policies.probation import LONG, SHORT, ProbationCache, fingerprint
from kvd_tools.bench.conversation import conversation
from kvd_tools.bench.replay import load_trace, replay
from tests.unit.policy_blocks import Blocks

SHARED_TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "synthetic_trace.jsonl"
A, B, C, D, E, F = (c.encode() for c in "abcdef")
SA, SB, SC, SD, SE, SF = range(6)


def key_of(slot: int) -> bytes:
    return b"k%d" % slot


def probation(capacity: int, blocks: Blocks, alpha: float, memory: int = LONG) -> ProbationCache:
    return ProbationCache(
        capacity, blocks.is_ready, blocks.is_evictable, alpha, memory, (SHORT, LONG)
    )


def fill(cache: ProbationCache, slots: Sequence[int]) -> None:
    cache.insert(slots, [key_of(slot) for slot in slots])


def request(idx: BlockIndex, keys: Sequence[bytes]) -> int:
    """What an engine does per request: look up, touch the hits, store the rest."""
    hits = idx.lookup(keys)
    assert hits is not None
    idx.touch(keys[:hits])
    out = idx.prepare_store(keys)
    if out is not None and out.keys_to_store:
        idx.complete_store(out.keys_to_store)
    return hits


# -- traces -------------------------------------------------------------------


def tool_trace(seed: int, num_requests: int, num_tools: int = 60) -> list[list[int]]:
    """Agent traffic: a Zipf-popular tool prompt of 4-30 blocks, a short user part,
    and agent loops that come back after a few requests with a step or two more."""
    rng = random.Random(seed)
    next_id = 0
    tools: list[list[int]] = []
    for _ in range(num_tools):
        size = rng.randint(4, 30)
        tools.append(list(range(next_id, next_id + size)))
        next_id += size
    weights = [1 / (rank + 1) ** 1.1 for rank in range(num_tools)]
    pending: list[tuple[float, int, list[int]]] = []
    trace: list[list[int]] = []
    for t in range(num_requests):
        if pending and pending[0][0] <= t:
            ids = heapq.heappop(pending)[2]
            new = 1 + int(rng.expovariate(0.5))
            ids = [*ids[:-1], *range(next_id, next_id + new)]
        else:
            new = max(1, int(rng.lognormvariate(math.log(3), 1.0)))
            ids = [*rng.choices(tools, weights)[0], *range(next_id, next_id + new)]
        next_id += new
        trace.append(ids)
        if rng.random() < 0.8 and len(ids) < 200:
            heapq.heappush(pending, (t + rng.expovariate(1 / 40), next_id, ids))
    return trace


def hit_rates(trace: list[list[int]], capacity: int) -> dict[str, float]:
    return {policy: replay(trace, capacity, policy).hit_rate for policy in POLICIES}


# -- the doorkeeper -------------------------------------------------------------


def test_doorkeeper_remembers_between_half_and_twice_half_additions() -> None:
    door = Doorkeeper(4)
    door.add([1, 2, 3, 4])
    assert all(fp in door for fp in (1, 2, 3, 4)) and 5 not in door
    door.add([5])  # a new generation: 1..4 are old, still remembered
    assert all(fp in door for fp in range(1, 6))
    door.add([6, 7, 8])
    assert all(fp in door for fp in range(1, 9)) and len(door) == 8
    door.add([9])  # the old generation goes: 4 to 8 additions back
    assert not any(fp in door for fp in (1, 2, 3, 4))
    assert all(fp in door for fp in range(5, 10))
    assert door.check() == []


def test_doorkeeper_adds_a_fingerprint_once_per_generation_and_keeps_zero() -> None:
    door = Doorkeeper(3)
    door.add([7, 7, 0, 1, 7])  # 0 is kept as 1
    assert len(door) == 2 and 0 in door and 1 in door and 7 in door
    door.add([2 + (1 << 32)])  # cut to 32 bits
    assert 2 in door and "2" not in door
    door.clear()
    assert len(door) == 0 and 7 not in door and door.check() == []


def test_doorkeeper_against_a_model_with_colliding_home_cells() -> None:
    rng = random.Random(3)
    door = Doorkeeper(6)
    young: set[int] = set()
    old: set[int] = set()
    universe = [rng.randrange(1, 1 << 32) for _ in range(12)] + [1 << 31, 1, 2, 3]
    for _ in range(3000):
        fp = rng.choice(universe)
        door.add([fp])
        if fp not in young:
            if len(young) == 6:
                old, young = young, set()
            young.add(fp)
        assert all((f in door) == (f in young or f in old) for f in universe)
    assert door.check() == []


def test_doorkeeper_check_finds_a_misplaced_fingerprint() -> None:
    door = Doorkeeper(8)
    door.add([5])
    table = door._young
    cell = table.index(5)
    table[cell], table[(cell + 3) % len(table)] = 0, 5
    assert door.check() != []


# -- the probation/main rules --------------------------------------------------


def test_new_blocks_start_in_probation_and_a_ready_hit_proves_them() -> None:
    blocks = Blocks()
    cache = probation(4, blocks, alpha=0.5)
    fill(cache, [SA, SB])
    assert cache.sizes == (2, 0) and not cache.in_main(SA)
    blocks.not_ready.add(SB)
    cache.touch([SA, SB])  # B is still being stored: it stays in P
    assert cache.in_main(SA) and not cache.in_main(SB)
    assert cache.sizes == (1, 1)
    assert cache.check_invariants() == []


def test_a_key_evicted_lately_comes_back_in_main() -> None:
    blocks = Blocks()
    cache = probation(4, blocks, alpha=1.0)
    cache.insert([SA], [A])
    assert not cache.remembers(A)
    assert cache.evict(1, ()) == [SA]
    assert cache.remembers(A)
    cache.insert([SC], [A])  # another slot, same key
    assert cache.in_main(SC)
    cache.insert([SD], [B])
    cache.remove([SD])  # a failed store leaves no history
    assert not cache.remembers(B)
    cache.clear()
    assert not cache.remembers(A) and len(cache) == 0


def test_the_short_memory_forgets_sooner() -> None:
    blocks = Blocks()
    cache = probation(4, blocks, alpha=0.0, memory=SHORT)
    cache.insert([SA], [A])
    assert cache.evict(1, ()) == [SA]
    for i in range(4):  # 4 more victims: the short memory (2 to 4 of them) lost A
        cache.insert([SB], [b"x%d" % i])
        assert cache.evict(1, ()) == [SB]
    assert not cache.remembers(A)
    cache.memory = LONG  # the long one (8 to 16 victims) still has it
    assert cache.remembers(A)


def test_a_batch_is_stored_tail_first() -> None:
    cache = probation(8, Blocks(), alpha=1.0)
    fill(cache, [SA, SB, SC])  # SA is the prefix, SC its deepest block
    fill(cache, [SD])
    assert cache.evict(4, ()) == [SC, SB, SA, SD]


def test_alpha_zero_evicts_every_unproven_block_first() -> None:
    cache = probation(8, Blocks(), alpha=0.0)
    fill(cache, [SA, SB])
    cache.touch([SB, SA])  # both proven
    fill(cache, [SC, SD])  # newer, unproven
    assert cache.evict(3, ()) == [SD, SC, SB]


def test_alpha_one_is_lru_over_both_segments() -> None:
    """Against a model: LRU whose batches are stored tail first."""
    rng = random.Random(11)
    blocks = Blocks()
    cache = probation(16, blocks, alpha=1.0)
    model: OrderedDict[int, None] = OrderedDict()
    free = list(range(16))
    for step in range(3000):
        roll = rng.random()
        if roll < 0.4 and free:
            slots = [free.pop() for _ in range(min(len(free), rng.randint(1, 4)))]
            cache.insert(slots, [b"s%d-%d" % (step, i) for i in range(len(slots))])
            model.update((slot, None) for slot in reversed(slots))
        elif roll < 0.7 and model:
            slots = rng.sample(list(model), rng.randint(1, min(4, len(model))))
            cache.touch(slots)
            for slot in slots:
                model.move_to_end(slot)
        elif model:
            n = rng.randint(1, min(3, len(model)))
            victims = cache.evict(n, ())
            assert victims == list(model)[:n]
            for slot in victims:
                del model[slot]
            free.extend(victims)
    assert cache.check_invariants() == []


def test_alpha_weighs_the_wait_of_the_oldest_unproven_block() -> None:
    def victim(alpha: float, waited: int) -> int:
        cache = probation(16, Blocks(), alpha)
        fill(cache, [SA])
        cache.touch([SA])  # M head, clock 2
        fill(cache, [SB])  # P head, clock 3
        for i in range(waited):  # time passes on other blocks
            cache.insert([6 + i], [b"t%d" % i])
            cache.touch([6 + i])
        victims = cache.evict(1, {6 + i for i in range(waited)})
        assert victims is not None
        return victims[0]

    # Ages at the eviction, with `waited` blocks between: M head 2 + 2w, P head 1 + 2w.
    assert victim(0.5, 0) == SB  # 1 >= 0.5 * 2
    assert victim(0.5, 3) == SB  # 7 >= 0.5 * 8
    assert victim(0.9, 3) == SA  # 7 < 0.9 * 8
    assert victim(0.85, 3) == SB  # 7 >= 0.85 * 8 = 6.8
    assert victim(1.0, 0) == SA  # plain LRU: A is older


def test_eviction_falls_back_and_is_atomic() -> None:
    blocks = Blocks()
    cache = probation(6, blocks, alpha=0.0)
    fill(cache, [SA, SB, SC])
    cache.touch([SA])  # P [C, B] (tail first), M [A]
    blocks.pinned.update({SB, SC})
    assert cache.evict(1, ()) == [SA]  # P has no evictable block: M gives one
    before = (cache.sizes, list(cache.slots()))
    assert cache.evict(1, ()) is None
    assert cache.evict(0, ()) == []
    assert (cache.sizes, list(cache.slots())) == before
    blocks.pinned.clear()
    assert cache.evict(1, {SC}) == [SB]
    assert cache.check_invariants() == []


def test_eviction_skips_pinned_blocks_once_not_once_per_victim() -> None:
    blocks = Blocks()
    cache = probation(3000, blocks, alpha=0.15)
    pinned, rest = list(range(1000)), list(range(1000, 2000))
    blocks.pinned.update(pinned)
    for slot in pinned + rest:
        fill(cache, [slot])
    blocks.num_checks = 0
    assert cache.evict(100, ()) == rest[:100]
    assert blocks.num_checks <= len(pinned) + 101


def test_check_finds_a_stamp_out_of_order() -> None:
    cache = probation(4, Blocks(), alpha=0.5)
    fill(cache, [SA])
    fill(cache, [SB])
    cache._stamp[SA] = 99
    assert cache.check_invariants() != []


# -- through the index: what the shared scenarios leave to the LRU order ---------------


def test_index_evicts_the_tail_of_a_stored_request_first() -> None:
    idx = BlockIndex(3, "adaptive", block_tokens=8)
    out = idx.prepare_store([A, B, C])
    assert out is not None and out.store_spec.slots == [0, 1, 2]
    idx.complete_store([A, B, C])
    idx.take_events()
    out = idx.prepare_store([D, E])
    assert out is not None and out.evicted_keys == [C, B]
    assert out.store_spec.slots == [1, 2]  # freed C (2) then B (1): LIFO
    assert idx.take_events() == [OffloadingEvent([C, B], 8, "CPU", removed=True)]
    assert idx.lookup([A]) == 1 and idx.check_invariants() == []


def test_lookups_choose_the_behaviour() -> None:
    idx = BlockIndex(64, "adaptive")
    policy = idx.policy
    assert isinstance(policy, AdaptivePolicy)
    assert (policy.alpha, policy.memory) == EXPERTS[START]
    hot = [b"h%d" % i for i in range(32)]
    for i in range(400):  # a hot set under a scan: only the filter keeps it
        request(idx, hot[(i % 4) * 8 : (i % 4) * 8 + 8])
        request(idx, [b"s%d-%d" % (i, j) for j in range(16)])
    assert policy.alpha == 0.0
    assert (policy.alpha, policy.memory) == EXPERTS[policy.miniatures.choice]
    assert idx.check_invariants() == []
    idx.reset()
    assert (policy.alpha, policy.memory) == EXPERTS[START]
    assert policy.miniatures.scores == [0.0] * len(EXPERTS)


def test_lookups_wait_for_the_next_store_and_decide_the_same() -> None:
    """A lookup only queues its keys; the miniatures replay them before the next
    insert or eviction, when the daemon is idle, or once too many keys wait:
    same choice, cheap lookups."""
    idx = BlockIndex(64, "adaptive")
    policy = idx.policy
    assert isinstance(policy, AdaptivePolicy)
    direct = Miniatures(64)
    hot = [b"h%d" % i for i in range(32)]
    for i in range(300):
        for keys in (hot[(i % 4) * 8 : (i % 4) * 8 + 8], [b"s%d-%d" % (i, j) for j in range(16)]):
            before = policy.miniatures.scores
            hits = idx.lookup(keys)
            assert policy.miniatures.scores == before  # nothing replayed yet
            direct.observe(keys)
            assert hits is not None
            idx.touch(keys[:hits])
            out = idx.prepare_store(keys)  # replays the pending lookup first
            if out is not None and out.keys_to_store:
                idx.complete_store(out.keys_to_store)
            assert policy.miniatures.scores == direct.scores
            assert policy.miniatures.choice == direct.choice
    assert policy.alpha == 0.0
    # Lookups alone (a different one each time): they wait, up to a bound.
    polls = [hot[i:] + hot[:i] for i in range(len(hot))]
    bound = MAX_PENDING_KEYS // len(hot)
    for i in range(bound):
        idx.lookup(polls[i % len(polls)])
    assert policy.miniatures.scores == direct.scores
    assert idx.check_invariants() == []
    idx.lookup(polls[bound % len(polls)])  # one too many: all are replayed
    for i in range(bound + 1):
        direct.observe(polls[i % len(polls)])
    assert policy.miniatures.scores == direct.scores
    for i in range(1, 4):  # the daemon's idle hook replays them one by one
        idx.lookup(polls[i])
        direct.observe(polls[i])
    assert policy.miniatures.scores != direct.scores
    assert [idx.settle() for _ in range(4)] == [True, True, False, False]
    assert policy.miniatures.scores == direct.scores
    assert idx.check_invariants() == []


def test_a_lookup_asked_again_counts_once_until_something_is_inserted() -> None:
    """A scheduler asks about a waiting request again each step: one request."""
    idx = BlockIndex(64, "adaptive")
    policy = idx.policy
    assert isinstance(policy, AdaptivePolicy)
    direct = Miniatures(64)
    keys = [b"w%d" % i for i in range(40)]
    assert not idx.has_idle_work()
    for _ in range(5):
        idx.lookup(keys)
    assert idx.has_idle_work()
    direct.observe(keys)
    assert not idx.settle() and not idx.has_idle_work()
    assert policy.miniatures.scores == direct.scores
    out = idx.prepare_store(keys)
    assert out is not None
    idx.complete_store(out.keys_to_store)
    idx.lookup(keys)  # after an insert: a request again
    direct.observe(keys)
    idx.lookup(keys[:39])  # different keys: another request
    direct.observe(keys[:39])
    assert [idx.settle() for _ in range(3)] == [True, False, False]
    assert policy.miniatures.scores == direct.scores
    assert policy.miniatures.scores != [0.0] * len(EXPERTS)


# -- the fingerprint map --------------------------------------------------------------


def test_fingerprint_map_against_a_dict_with_colliding_home_cells() -> None:
    rng = random.Random(9)
    fps = array("I", bytes(4 * 8))
    fmap = FingerprintMap(8, fps)
    model: dict[int, int] = {}
    universe = [rng.randrange(1 << 32) for _ in range(20)]
    free = list(range(8))
    for _ in range(4000):
        fp = rng.choice(universe)
        if fp in model:
            node = model.pop(fp)
            fmap.remove(node)
            free.append(node)
        elif free:
            node = free.pop()
            fps[node] = fp
            fmap.put(node)
            model[fp] = node
        assert all(fmap.get(f) == model.get(f, -1) for f in universe)
        probe = rng.sample(universe, 3)
        leading: list[int] = []
        for f in probe:
            if f not in model:
                break
            leading.append(model[f])
        assert fmap.leading(probe) == leading
    assert fmap.check() == [] and fmap.num_entries == len(model)


# -- the miniatures ---------------------------------------------------------------


@pytest.mark.parametrize("expert", range(len(EXPERTS)))
def test_a_full_size_miniature_replays_like_the_index(
    expert: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At sample rate 1 a miniature counts exactly the hits of the real cache."""
    alpha, memory = EXPERTS[expert]

    class Fixed(ProbationCache):
        def __init__(
            self, capacity: int, is_ready: SlotPredicate, is_evictable: SlotPredicate
        ) -> None:
            super().__init__(capacity, is_ready, is_evictable, alpha, memory, (memory,))

    monkeypatch.setitem(POLICIES, "fixed", Fixed)
    trace = conversation(seed=5, num_requests=400, gap_median=40.0)
    capacity = 300
    mini = Miniature(capacity, alpha, memory)
    hits = sum(mini.request([fingerprint(i.to_bytes(8, "big")) for i in ids]) for ids in trace)
    assert hits == replay(trace, capacity, "fixed").num_hits
    assert mini.check() == []


def test_sampling_is_deterministic_and_close_to_its_rate() -> None:
    minis = Miniatures(100_000)
    assert minis.rate == pytest.approx(1 / 16, rel=0.01)
    keys = [bytes([i % 256, i // 256 % 256, 7]) for i in range(20_000)]
    before = [m.cache.sizes for m in minis.minis]
    minis.observe(keys)
    stored = sum(minis.minis[0].cache.sizes)
    assert before[0] == (0, 0) and 20_000 / 16 * 0.9 < stored < 20_000 / 16 * 1.1
    again = Miniatures(100_000)
    again.observe(keys)
    assert sorted(again.minis[0].cache.slots()) == sorted(minis.minis[0].cache.slots())


def test_the_choice_moves_only_on_evidence() -> None:
    minis = Miniatures(64)
    for i in range(500):  # one-off keys: every miniature misses everything
        minis.observe([b"o%d-%d" % (i, j) for j in range(8)])
    assert minis.choice == START and minis.scores == [0.0] * len(EXPERTS)
    # Blocks that come back once, soon: only LRU and the mild filters hit them.
    for i in range(2000):
        keys = [b"t%d-%d" % (i, j) for j in range(4)]
        minis.observe(keys)
        minis.observe(keys)
        minis.observe([b"x%d-%d" % (i, j) for j in range(6)])
    assert EXPERTS[minis.choice][0] >= 0.6
    assert minis.check() == []


# -- hit rates ------------------------------------------------------------------------


def test_conversation_traffic_small_capacity_gains_over_lru_and_arc() -> None:
    """The issue's bar on conversation traffic: 1.3x the better of LRU and ARC at
    2,000 blocks (on the trace shaped after Mooncake's conversation trace)."""
    rates = hit_rates(conversation(seed=1, num_requests=6000), 2000)
    assert rates["adaptive"] >= 1.3 * max(rates["lru"], rates["arc"]), rates


@pytest.mark.parametrize("capacity", [4000, 8000])
def test_conversation_traffic_large_capacity_loses_nothing(capacity: int) -> None:
    """Turns that come back soon, a cache that holds most of them: admit everything."""
    rates = hit_rates(conversation(seed=2, num_requests=4000, gap_median=100.0), capacity)
    assert rates["adaptive"] >= max(rates["lru"], rates["arc"]) - 0.005, rates


@pytest.mark.parametrize(("capacity", "gain"), [(400, 0.01), (3000, -0.005)])
def test_tool_traffic(capacity: int, gain: float) -> None:
    rates = hit_rates(tool_trace(seed=3, num_requests=3000), capacity)
    assert rates["adaptive"] >= max(rates["lru"], rates["arc"]) + gain, rates


@pytest.mark.skipif(not SHARED_TRACE.is_file(), reason="no ../shared/traces in this checkout")
def test_mooncake_trace_at_the_issue_capacities() -> None:
    trace = load_trace(SHARED_TRACE)
    for capacity in (2000, 6000, 29_000):
        rates = hit_rates(trace, capacity)
        assert rates["adaptive"] >= max(rates["lru"], rates["arc"]) - 0.005, (capacity, rates)


# -- memory -----------------------------------------------------------------------------


def test_metadata_per_slot_is_bounded() -> None:
    """The per-slot arrays and both doorkeepers, allocated up front, plus miniatures
    of 1/16 of the capacity: well under the 300 bytes a block may cost in all."""
    capacity = 250_000
    tracemalloc.start()
    try:
        policy = make_policy("adaptive", capacity, bool, bool)
        size = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert isinstance(policy, AdaptivePolicy)
    assert size / capacity < 100, size / capacity
