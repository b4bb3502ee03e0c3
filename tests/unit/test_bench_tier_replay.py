"""Runs in the test process: `kvd bench trace`'s RAM + disk replay
(`kvd_tools.bench.tier_replay`), by hand and against an unlimited cache."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.core.index.policies import POLICIES
from kvd_tools.bench import trace as trace_suite
from kvd_tools.bench.report import Row
from kvd_tools.bench.suites import SuiteError
from kvd_tools.bench.tier_replay import DISK_RATIO, Admission, TierStats, replay_tiers


@pytest.mark.parametrize("policy", POLICIES)
def test_a_block_ram_evicted_is_read_back_from_disk(policy: str) -> None:
    # RAM holds 1 block, the disk 10: 1 and 2 are written behind as they are
    # stored; the third request finds 1 on disk only.
    stats = replay_tiers([[1], [2], [1]], 1, policy, "always")
    assert stats == TierStats(num_ram_hits=0, num_disk_hits=1, num_refs=3, num_disk_writes=2)
    assert stats.hit_rate == stats.disk_hit_rate == 1 / 3


def test_blocks_read_from_disk_are_not_written_again() -> None:
    stats = replay_tiers([[1], [2], [1], [2], [1]], 1, "lru", "always")
    assert stats == TierStats(num_ram_hits=0, num_disk_hits=3, num_refs=5, num_disk_writes=2)


def test_the_disk_serves_the_run_after_the_ram_hits() -> None:
    # LRU, 2 blocks of RAM: the third request evicts 1; the fourth hits 3 in
    # RAM, then 1 on disk.
    stats = replay_tiers([[1], [2], [3], [3, 1]], 2, "lru", "always")
    assert stats == TierStats(num_ram_hits=1, num_disk_hits=1, num_refs=5, num_disk_writes=3)


def test_the_disk_run_stops_at_a_miss_and_a_block_on_disk_is_not_rewritten() -> None:
    # 5 is nowhere, so 2 (on disk) is no hit; storing 5, 2 writes 5 only.
    stats = replay_tiers([[1, 2], [3, 4], [5, 2]], 2, "lru", "always")
    assert stats == TierStats(num_ram_hits=0, num_disk_hits=0, num_refs=6, num_disk_writes=5)


def test_second_writes_a_block_on_its_second_store_only() -> None:
    stats = replay_tiers([[1], [2], [1], [2], [1]], 1, "lru", "second")
    # 1 and 2 are written when RAM stores them again (requests 3 and 4); the
    # fifth finds 1 on disk.
    assert stats == TierStats(num_ram_hits=0, num_disk_hits=1, num_refs=5, num_disk_writes=2)


def test_admission_remembers_a_bounded_set_of_blocks_seen_once() -> None:
    always = Admission("always", 2)
    assert always.admit([b"a", b"b"]) == [b"a", b"b"]
    second = Admission("second", 2)
    assert second.admit([b"a", b"b", b"c"]) == []  # a is forgotten: 2 remembered
    assert second.admit([b"c", b"b", b"a"]) == [b"c", b"b"]
    assert second.admit([b"c"]) == []  # admitted once: counted afresh
    with pytest.raises(SuiteError, match="one of always, second"):
        Admission("third", 2)


@st.composite
def small_traces(draw: st.DrawFn) -> tuple[list[list[int]], int]:
    """Requests of distinct blocks, each fitting in RAM, from at most
    `DISK_RATIO` x capacity blocks in all: the disk never evicts."""
    capacity = draw(st.integers(1, 6))
    ids = st.integers(0, DISK_RATIO * capacity - 1)
    request = st.lists(ids, max_size=capacity, unique=True)
    return draw(st.lists(request, min_size=1, max_size=30)), capacity


@settings(max_examples=200, deadline=None)
@given(small_traces(), st.sampled_from(list(POLICIES)))
def test_a_disk_that_keeps_every_block_hits_every_repeat(
    case: tuple[list[list[int]], int], policy: str
) -> None:
    requests, capacity = case
    seen: set[int] = set()
    expected = 0
    for ids in requests:
        run = 0
        while run < len(ids) and ids[run] in seen:
            run += 1
        expected += run
        seen.update(ids)
    stats = replay_tiers(requests, capacity, policy, "always")
    assert stats.num_ram_hits + stats.num_disk_hits == expected
    assert stats.num_disk_writes == len(seen)
    second = replay_tiers(requests, capacity, policy, "second")
    assert second.num_ram_hits + second.num_disk_hits <= expected


def test_summary_of_the_disk_rows() -> None:
    def row(tier: str, capacity: int, admit: str | None, rate: float, written: int | None) -> Row:
        return {
            "tier": tier,
            "trace": "t",
            "capacity_blocks": capacity,
            "policy": "lru",
            "disk_admit": admit,
            "hit_rate": rate,
            "disk_blocks_written": written,
        }

    rows = [
        row("ram", 10, None, 0.1, None),
        row("ram", 110, None, 0.5, None),
        row("ram+disk", 10, "always", 0.4, 900),
        row("ram+disk", 10, "second", 0.3, 300),
    ]
    assert trace_suite.summarize(rows) == [
        "- t, lru, ram 10 + disk 100 blocks: hit rate always 0.4, second 0.3 "
        "(ram only 0.1; 110 blocks of ram 0.5); blocks written to disk always 900, second 300"
    ]
