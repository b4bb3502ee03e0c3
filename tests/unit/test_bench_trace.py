"""`kvd bench trace`: replay semantics, Belady's optimum, trace loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.core.index.policies import POLICIES
from kvd_tools.bench import trace as trace_suite
from kvd_tools.bench.belady import belady, next_uses
from kvd_tools.bench.replay import ReplayStats, load_trace, replay
from kvd_tools.bench.report import Row
from kvd_tools.bench.suites import SuiteError

SHARED_TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "synthetic_trace.jsonl"

# Capacity 3. LRU, oldest first after each request:
#   [1, 2]     0 hits  store 1, 2            -> 1 2
#   [1, 2, 3]  2 hits  touch 2, 1; store 3   -> 2 1 3
#   [4]        0 hits  evict 2, store 4      -> 1 3 4
#   [1, 2]     1 hit   touch 1; evict 3      -> 4 1 2
# Belady evicts 3 for 4 (never used again) and keeps 1, 2: the last request hits both.
HAND_TRACE = [[1, 2], [1, 2, 3], [4], [1, 2]]


def _write(path: Path, requests: list[list[int]]) -> Path:
    path.write_text("".join(json.dumps({"timestamp": 0, "hash_ids": r}) + "\n" for r in requests))
    return path


def test_lru_replay_by_hand() -> None:
    assert replay(HAND_TRACE, 3, "lru") == ReplayStats(num_hits=3, num_refs=8)
    assert replay(HAND_TRACE, 3, "lru").hit_rate == 3 / 8


def test_belady_by_hand() -> None:
    assert belady(HAND_TRACE, 3) == ReplayStats(num_hits=4, num_refs=8)


@pytest.mark.parametrize("policy", [*POLICIES, "belady"])
def test_only_leading_hits_count(policy: str) -> None:
    # Block 2 is cached but follows a miss (5): the prefix run stops at 5.
    requests = [[1, 2], [5, 2], [1, 2, 5]]
    stats = belady(requests, 10) if policy == "belady" else replay(requests, 10, policy)
    assert stats == ReplayStats(num_hits=3, num_refs=7)


@pytest.mark.parametrize("policy", [*POLICIES, "belady"])
def test_request_larger_than_the_cache_skips_its_store(policy: str) -> None:
    requests = [[1], [2, 3, 4], [1]]
    stats = belady(requests, 2) if policy == "belady" else replay(requests, 2, policy)
    assert stats == ReplayStats(num_hits=1, num_refs=5, num_skipped_stores=1)


def test_next_uses() -> None:
    assert next_uses([[1, 2], [1], [], [2, 1]]) == [2, 3, 4, 5, 5]


@st.composite
def prefix_traces(draw: st.DrawFn) -> tuple[list[list[int]], int]:
    """Requests that are root-to-node paths of a small prefix tree (as in Mooncake
    traces, equal ids mean equal prefixes), each fitting in the cache."""
    capacity = draw(st.integers(1, 8))
    fanout = draw(st.integers(1, 3))
    paths = st.lists(st.integers(1, fanout), max_size=capacity)
    requests: list[list[int]] = []
    for path in draw(st.lists(paths, min_size=1, max_size=25)):
        node, ids = 0, []
        for branch in path:
            node = node * 4 + branch
            ids.append(node)
        requests.append(ids)
    return requests, capacity


@settings(max_examples=300, deadline=None)
@given(prefix_traces())
def test_belady_is_at_least_every_policy(case: tuple[list[list[int]], int]) -> None:
    requests, capacity = case
    optimum = belady(requests, capacity)
    for policy in POLICIES:
        stats = replay(requests, capacity, policy)
        assert stats.num_refs == optimum.num_refs
        assert stats.num_hits <= optimum.num_hits, policy


@settings(max_examples=100, deadline=None)
@given(prefix_traces())
def test_unlimited_cache_hits_every_repeat(case: tuple[list[list[int]], int]) -> None:
    requests, _ = case
    seen: set[int] = set()
    expected = 0
    for ids in requests:
        run = 0
        while run < len(ids) and ids[run] in seen:
            run += 1
        expected += run
        seen.update(ids)
    big = max(len(seen), 1)
    assert belady(requests, big).num_hits == expected
    for policy in POLICIES:
        assert replay(requests, big, policy).num_hits == expected


def test_load_trace(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.jsonl", [[1, 2], [], [2**64 - 1]])
    path.write_text(path.read_text() + "\n")  # a blank line is skipped
    assert load_trace(path) == [[1, 2], [], [2**64 - 1]]


@pytest.mark.parametrize(
    "line", ['{"hash_ids": [1, -2]}', '{"hash_ids": "12"}', '{"ids": [1]}', "not json", "[1]"]
)
def test_load_trace_rejects_bad_lines(tmp_path: Path, line: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"hash_ids": [1]}\n' + line + "\n")
    with pytest.raises(SuiteError, match=r"bad\.jsonl:2"):
        load_trace(path)


def test_missing_trace_file(tmp_path: Path) -> None:
    with pytest.raises(SuiteError, match="cannot read trace"):
        load_trace(tmp_path / "absent.jsonl")


def test_default_trace_not_found_says_pass_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(trace_suite, "repo_root", lambda: None)
    with pytest.raises(SuiteError, match="pass --trace"):
        trace_suite.default_trace()


def test_default_trace_found_from_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    traces = tmp_path / "shared" / "traces"
    traces.mkdir(parents=True)
    _write(traces / "synthetic_trace.jsonl", [[1]])
    monkeypatch.chdir(work)
    assert trace_suite.default_trace().resolve() == (traces / "synthetic_trace.jsonl").resolve()


def test_summary_flags_arc_below_lru() -> None:
    rows: list[Row] = [
        {"trace": "t", "capacity_blocks": 10, "policy": "lru", "hit_rate": 0.5},
        {"trace": "t", "capacity_blocks": 10, "policy": "arc", "hit_rate": 0.4},
        {"trace": "t", "capacity_blocks": 10, "policy": "belady", "hit_rate": 0.8},
    ]
    assert trace_suite.summarize(rows) == [
        "- t at 10 blocks: arc >= lru: NOT met; of belady: lru 62%, arc 50%"
    ]


@pytest.mark.parametrize(("adaptive", "verdict"), [(0.596, "met"), (0.594, "NOT met")])
def test_summary_holds_adaptive_to_the_better_of_lru_and_arc(adaptive: float, verdict: str) -> None:
    rows: list[Row] = [
        {"trace": "t", "capacity_blocks": 10, "policy": "lru", "hit_rate": 0.5},
        {"trace": "t", "capacity_blocks": 10, "policy": "arc", "hit_rate": 0.6},
        {"trace": "t", "capacity_blocks": 10, "policy": "adaptive", "hit_rate": adaptive},
    ]
    assert trace_suite.summarize(rows) == [
        f"- t at 10 blocks: arc >= lru: met; adaptive {adaptive / 0.6:.2f}x the better of "
        f"arc and lru (>= it - 0.005: {verdict})"
    ]


@pytest.mark.skipif(not SHARED_TRACE.is_file(), reason="no ../shared/traces in this checkout")
def test_mooncake_trace_with_an_unlimited_cache() -> None:
    requests = load_trace(SHARED_TRACE)
    assert len(requests) == 3993
    stats = replay(requests, 43_924, "lru")
    assert stats.num_refs == 121_877
    assert stats.hit_rate == pytest.approx(0.640, abs=0.001)
    assert belady(requests, 43_924).num_hits == stats.num_hits
