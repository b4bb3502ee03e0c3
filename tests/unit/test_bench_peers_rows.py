"""Runs in the test process: `kvd bench peers`' rows and summary from made-up samples."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

from kvd_tools.bench.peers_rows import Sample, Workload, rows, summarize


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


def test_the_storing_prefill_is_compared_with_the_recompute_and_lmcaches() -> None:
    """`ttft_store`: the request that computes a prompt and offers its blocks, per
    round against the no-connector engine's recompute of the same prompt."""
    samples = []
    # Per round kvd/none 1.0, 1.05, 1.1; LMCache/kvd 1.1, 0.952, 1.091; LMCache/none
    # 1.1, 1.0, 1.2: the medians come from different rounds, and the product of the
    # first two (1.15) is not LMCache's median against none (1.1).
    for r, (kvd, lmcache) in enumerate([(8000.0, 8800.0), (8400.0, 8000.0), (8800.0, 9600.0)]):
        for system, ms in (("kvd", kvd), ("lmcache", lmcache), ("none", 8000.0)):
            samples.append(Sample(r, system, "ttft_store", 8192, ttft_ms=ms, tokens=[[1]]))
    table = rows(samples)
    ratio = [r for r in table if r["system"] == "ratio"]
    assert len(ratio) == 1 and ratio[0]["measure"] == "ttft_store"
    assert round(ratio[0]["ttft_vs_none"], 4) == 1.05  # median of rounds
    assert round(ratio[0]["ttft_ms"], 4) == round(9600.0 / 8800.0, 4)  # LMCache's over kvd's
    assert round(ratio[0]["lmcache_ttft_vs_none"], 4) == 1.1
    line = next(x for x in summarize(table) if x.startswith("ttft_store"))
    assert line == ("ttft_store at 8192 tokens (a prefill whose blocks are offered for "
                    "storing): kvd 1.05x the no-connector engine's recompute, LMCache's 1.10x"), line  # fmt: skip


def test_without_lmcache_the_ratio_rows_keep_kvd_against_no_connector() -> None:
    """LMCache refuses a hybrid model on its CPU path: its rows are missing, and
    the ratio rows still say kvd against the no-connector engine."""
    samples = [s for s in _round(0, 30.0, 0.0, 6000.0, 25.0) if s.system != "lmcache"]
    samples.append(Sample(0, "kvd", "decode_step", 128, step_ms=11.0, tokens=[[1]]))
    samples.append(Sample(0, "none", "decode_step", 128, step_ms=10.0, tokens=[[1]]))
    table = rows(samples)
    assert not [r for r in table if r["system"] == "lmcache"]
    ratio = {r["measure"]: r for r in table if r["system"] == "ratio"}
    assert ratio["ttft_cached"]["ttft_ms"] is None  # LMCache's over kvd's: no LMCache
    assert round(ratio["ttft_cached"]["ttft_vs_none"], 3) == 0.005
    assert round(ratio["decode_step"]["step_vs_none"], 3) == 1.1
    assert ratio["decode_step"]["tokens_equal"] is True
    samples += [Sample(0, name, "multi_turn", 2000, requests_per_s=rps, tokens=[[1]])
                for name, rps in (("kvd", 1.5), ("none", 1.0))]  # fmt: skip
    lines = summarize(rows(samples))
    assert "decode step: kvd 1.10x the no-connector engine's (rounds 1.10 to 1.10; " \
           "goal <= 1.05), LMCache did not run" in lines, lines  # fmt: skip
    assert "multi_turn: kvd 1.50x the no-connector engine's requests/s (goal >= 1.2); " \
           "LMCache did not run" in lines, lines  # fmt: skip


def test_two_engines_turns_alternate_so_each_history_is_the_other_engines() -> None:
    """`two_engines`: a conversation's next turn goes to the other engine and
    extends the prompt that engine computed, so only a shared cache can serve it."""
    args = SimpleNamespace(
        system_tokens=64, conversations=4, turns=3, user_tokens=16, reply_tokens=8,
        prompt_tokens=[128], decode_samples=1, decode_engines=1, trace_block_tokens=4, samples=1,
    )  # fmt: skip
    work = Workload.draw(args, vocab=1000, seed=3)
    assert len(work.chat2) == 4 * 3
    engines = [e for e, _ in work.chat2]
    assert engines.count(0) == engines.count(1) == 6  # the two share the load
    for n in range(4):
        turns = work.chat2[n::4]  # turn-major: conversation n's turns in order
        for (e, prompt), (e_next, prompt_next) in itertools.pairwise(turns):
            assert e_next != e
            assert prompt_next[: len(prompt)] == prompt


def test_kvd_off_is_the_baseline_for_what_kvds_own_work_costs() -> None:
    """`kvd-off` (kvd's connector, no daemon): its own rows, and per round its
    figure over the no-connector engine's beside kvd's, so that vLLM's layout
    under an offloading connector is told from kvd's stores and loads."""
    samples = []
    for r, (kvd, off, none) in enumerate([(6800.0, 6500.0, 6600.0), (6500.0, 6400.0, 6300.0)]):
        for system, ms in (("kvd", kvd), ("kvd-off", off), ("none", none)):
            samples.append(Sample(r, system, "ttft_store", 8192, ttft_ms=ms, tokens=[[1]]))
        for system, step in (("kvd", 10.0), ("kvd-off", 10.5 + r), ("none", 10.0)):
            samples.append(Sample(r, system, "decode_step", 128, step_ms=step, tokens=[[1]]))
    table = rows(samples)
    off = [r for r in table if r["system"] == "kvd-off"]
    assert [r["measure"] for r in off] == ["ttft_store", "decode_step"]
    assert off[0]["tokens_equal"] is True and off[0]["ttft_ms"] == 6450.0
    ratio = {r["measure"]: r for r in table if r["system"] == "ratio"}
    want = (6500.0 / 6600.0 + 6400.0 / 6300.0) / 2  # the median of two rounds
    assert round(ratio["ttft_store"]["off_ttft_vs_none"], 4) == round(want, 4)
    assert round(ratio["decode_step"]["off_step_vs_none"], 4) == 1.1  # 1.05 and 1.15
    lines = summarize(table)
    assert any(line.startswith("ttft_store") and line.endswith(
        f"kvd's connector with no daemon {want:.2f}x") for line in lines), lines  # fmt: skip
    assert any(line.startswith("decode step") and line.endswith(
        "kvd's connector with no daemon 1.10x") for line in lines), lines  # fmt: skip
    # kvd-off and the no-connector engine alone still get their ratio.
    alone = rows([s for s in samples if s.system != "kvd"])
    ratio = {r["measure"]: r for r in alone if r["system"] == "ratio"}
    assert round(ratio["ttft_store"]["off_ttft_vs_none"], 4) == round(want, 4)
    assert ratio["ttft_store"]["ttft_vs_none"] is None
    # Without it, nothing of it: the ratio rows hold None and the summary says nothing.
    plain = rows([s for s in samples if s.system != "kvd-off"])
    assert all(r.get("off_ttft_vs_none") is None for r in plain)
    assert not any("no daemon" in line for line in summarize(plain))


def test_the_summary_says_where_each_caches_ttft_went() -> None:
    """`wait_ms` (queued to scheduled: an asynchronous load's wait) and `forward_ms`
    (scheduled to the first token), medians over the rounds, in the system rows
    and the summary."""
    samples = []
    for r, (kvd_wait, lmcache_wait) in enumerate([(10.0, 30.0), (12.0, 29.0), (8.0, 31.0)]):
        for system, wait, forward, ttft in (("kvd", kvd_wait, 19.0 + r, 33.0),
                                            ("lmcache", lmcache_wait, 18.0, 52.0),
                                            ("none", 0.1, 8000.0, 8000.0)):  # fmt: skip
            samples.append(Sample(r, system, "ttft_new_engine", 8192, ttft_ms=ttft, tokens=[[1]],
                                  wait_ms=wait, forward_ms=forward))  # fmt: skip
    table = rows(samples)
    kvd = next(x for x in table if x["system"] == "kvd")
    assert (kvd["wait_ms"], kvd["forward_ms"]) == (10.0, 20.0)
    line = next(x for x in summarize(table) if "where the TTFT went" in x)
    assert line == ("ttft_new_engine at 8192 tokens, where the TTFT went (medians): queued to "
                    "scheduled (the load's wait) kvd 10.0 ms, LMCache 30.0 ms; scheduled to the "
                    "first token kvd 20.0 ms, LMCache 18.0 ms"), line  # fmt: skip
    # Without LMCache's timings (a dump from before them, or vLLM without stats)
    # the summary leaves the line out and keeps the ratio line.
    for s in samples:
        if s.system == "lmcache":
            s.wait_ms = s.forward_ms = None
    lines = summarize(rows(samples))
    assert not [x for x in lines if "where the TTFT went" in x]
    assert any(x.startswith("ttft_new_engine at 8192 tokens: LMCache's TTFT") for x in lines)
