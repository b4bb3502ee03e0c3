"""The synthetic conversation trace (kvd_tools.bench.conversation): its shape, its file."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvd_tools.bench.conversation import conversation, main
from kvd_tools.bench.replay import load_trace


def test_requests_extend_earlier_turns_with_fresh_blocks() -> None:
    trace = conversation(seed=3, num_requests=3000)
    assert trace == conversation(seed=3, num_requests=3000)  # seeded
    assert trace != conversation(seed=4, num_requests=3000)
    seen: set[tuple[int, ...]] = set()
    highest = 0
    continued = 0
    for ids in trace:
        assert ids[0] == 0 and len(ids) >= 2
        # Some earlier request is this one's history, and the rest is new.
        cut = next(i for i in range(len(ids), 0, -1) if i == 1 or tuple(ids[:i]) in seen)
        assert ids[cut:] == list(range(highest + 1, highest + 1 + len(ids) - cut))
        highest = ids[-1]
        continued += cut > 1
        seen.add(tuple(ids))
    # About 40 % of requests continue a conversation, as in the real trace.
    assert 0.3 < continued / len(trace) < 0.6


def test_the_written_file_is_a_mooncake_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "conv.jsonl"
    assert main([str(out), "--seed", "2", "--requests", "500"]) == 0
    assert load_trace(out) == conversation(seed=2, num_requests=500)
    assert "500 requests" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([str(out), "--requests", "0"])
