"""Runs in the test process: `kvd bench peers`' rows and summary from made-up samples."""

from __future__ import annotations

from kvd_tools.bench.peers_rows import Sample, rows, summarize


def _round(r: int, kvd: float, lmcache: float, none: float, floor: float) -> list[Sample]:
    out = []
    for system, served in (("kvd", kvd), ("lmcache", lmcache), ("none", none)):
        out.append(Sample(r, system, "ttft_cached", 8192, ttft_ms=served, tokens=[[1]]))
        out.append(Sample(r, system, "ttft_vllm_cache", 8192, ttft_ms=floor, tokens=[[1]]))
    return out


def test_the_summary_says_what_loading_a_whole_prompt_costs_each_cache() -> None:
    table = rows(_round(0, 34.0, 44.0, 7600.0, 28.0) + _round(1, 36.0, 48.0, 7700.0, 27.0)
                 + _round(2, 35.0, 40.0, 7650.0, 29.0))  # fmt: skip
    ratio = [r for r in table if r["system"] == "ratio" and r["measure"] == "ttft_cached"]
    assert ratio and round(ratio[0]["ttft_ms"], 3) == round(44.0 / 34.0, 3)  # median of rounds
    lines = summarize(table)
    assert "ttft_cached at 8192 tokens over a request vLLM's own cache served but its last " \
           "block (what loading the rest costs): kvd +7.0 ms, LMCache +16.0 ms" in lines, lines  # fmt: skip
    assert any(
        line.startswith("ttft_cached at 8192 tokens: LMCache's TTFT is 1.29x") for line in lines
    )
