"""Runs in the operator's shell (`kvd bench peers`): its prompts, and its rows from the samples.

Each round draws fresh prompts from its own seed, the same for the three
systems of the round (so tokens compare against the no-connector engine's)
and different from every other round's (so no system hits what an earlier
round stored). The multi-turn workload is chat: conversations that share one
system prompt, turns arriving round robin, each prompt the conversation so
far (scripted replies, as `kvd_tools.demo.workload`, so every system gets the
same prompts whatever the model says) plus a new user turn.

A `Sample` is one system's figures for one measure in one round. `rows`
turns them into the SPEC section 10 rows: per system the median over the
rounds, with the lowest and highest round (`spread_min`, `spread_max`, of
the measure's headline figure: TTFT, ms per decode step, requests/s), and
per measure a `ratio` row, the median over rounds of the ratio taken within
each round (noise that hits a round hits all three systems in it).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# `kvd-off` (only where `--systems` names it): kvd's connector with no daemon, so
# vLLM with an offloading connector's KV layout and kvd's hooks, nothing cached.
SYSTEMS = ("kvd", "lmcache", "none", "kvd-off")
CACHES = ("kvd", "lmcache")  # the systems that store and serve; the others recompute
MEASURES = (
    "ttft_store", "ttft_cached", "ttft_vllm_cache", "ttft_new_engine", "decode_step", "multi_turn",
    "two_engines", "trace_replay",
)  # fmt: skip
SERVING = ("multi_turn", "two_engines", "trace_replay")  # measures of requests/s
DECODE_PROMPT_TOKENS = 128


@dataclass
class Workload:
    """One round's prompts, drawn from `seed`."""

    ttft: dict[int, list[int]]  # prompt length -> a prompt
    decode: list[list[int]]  # `decode_engines` runs of `decode_samples` prompts
    warmup: list[int]
    chat: list[list[int]]  # multi-turn prompts in arrival order
    # Other conversations, for two engines at once: (engine 0 or 1, prompt), in order.
    chat2: list[tuple[int, list[int]]] = field(default_factory=list)
    trace: list[list[int]] = field(default_factory=list)  # trace requests' prompts
    # More prompts of each length, for the storing prefill's samples: each a miss.
    stores: dict[int, list[list[int]]] = field(default_factory=dict)

    @classmethod
    def draw(
        cls, args: Any, vocab: int, seed: int, trace: list[list[int]] | None = None
    ) -> Workload:
        """`trace`: the replayed requests' prefix block ids (`trace_prompts`)."""
        rng = random.Random(seed)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(vocab) for _ in range(n)]

        def conversations() -> list[tuple[int, list[int]]]:
            system = tokens(args.system_tokens)
            history = [list(system) for _ in range(args.conversations)]
            out = []
            for turn in range(args.turns):
                for n, conv in enumerate(history):
                    conv.extend(tokens(args.user_tokens))
                    # For `two_engines`: a conversation's turns alternate between the
                    # engines, as a router without prefix affinity sends them.
                    out.append(((n + turn) % 2, list(conv)))
                    conv.extend(tokens(args.reply_tokens))  # the scripted reply
            return out

        ttft = {n: tokens(n) for n in args.prompt_tokens}
        # Each decode engine of a system its own prompts (`decode_samples` each), the
        # same for every system: no engine hits what another of its system stored.
        decode = [tokens(DECODE_PROMPT_TOKENS)
                  for _ in range(args.decode_samples * args.decode_engines)]  # fmt: skip
        warmup = tokens(64)
        chat = [prompt for _, prompt in conversations()]
        chat2 = conversations()
        prompts = trace_prompts(trace or [], args.trace_block_tokens, vocab, seed)
        # Drawn last: the prompts above stay what they were for a given seed.
        stores = {n: [tokens(n) for _ in range(args.samples - 1)] for n in args.prompt_tokens}
        return cls(ttft, decode, warmup, chat, chat2, prompts, stores)

    @property
    def longest_chat(self) -> int:
        return max(len(q) for q in [*self.chat, *(q for _, q in self.chat2), *self.trace])


def trace_prompts(
    requests: list[list[int]], block_tokens: int, vocab: int, seed: int
) -> list[list[int]]:
    """Token ids for trace requests given as their prefix block ids (the Mooncake
    trace's `hash_ids`): each id stands for the same `block_tokens` tokens wherever
    it appears, drawn from `seed` and the id, so equal ids make equal prefixes and
    each round (seed) gets tokens no other round has."""
    blocks: dict[int, list[int]] = {}
    out = []
    for ids in requests:
        prompt: list[int] = []
        for i in ids:
            if i not in blocks:
                rng = random.Random(seed * 1_000_003 + i)
                blocks[i] = [rng.randrange(vocab) for _ in range(block_tokens)]
            prompt.extend(blocks[i])
        out.append(prompt)
    return out


@dataclass
class Sample:
    """One system's figures for one measure in one round; `tokens` what it generated,
    compared with the no-connector engine's for the same prompts."""

    round: int
    system: str
    measure: str
    prompt_tokens: int
    ttft_ms: float | None = None
    step_ms: float | None = None
    requests_per_s: float | None = None
    hit_rate: float | None = None
    ttft_p99_ms: float | None = None
    tokens: list[list[int]] = field(default_factory=list)
    # Per prompt, per generated token, the top (id, logprob) pairs: `matches`.
    logprobs: list[list[list[tuple[int, float]]]] = field(default_factory=list)
    # Where the TTFT went (medians of the requests), by vLLM's engine-core timestamps:
    # queued to first scheduled (a connector's asynchronous load waits there), and
    # from then to the first token (the step that computes what was not served).
    wait_ms: float | None = None
    forward_ms: float | None = None

    @property
    def key(self) -> tuple[str, int]:
        return self.measure, self.prompt_tokens


def headline(measure: str) -> str:
    """The figure a measure is about: its spread is reported."""
    if measure in SERVING:
        return "requests_per_s"
    return "step_ms" if measure == "decode_step" else "ttft_ms"


def matches(got: Sample, want: Sample) -> bool:
    """`got` generated what `want` (the no-connector engine) did: the same greedy
    tokens, or tokens that part only where `want`'s two likeliest ids were within
    the harness's tolerance (`differences` with ties), every top logprob close.
    Exact equality is too strict here: with any KV connector vLLM's CPU build
    computes a decode step's logits a few hundredths apart from none (measured,
    no cache hit involved), which flips near-ties of the seeded model."""
    from kvd_tools.vllm_harness.driver import Output, differences

    if got.tokens == want.tokens:
        return True
    if len(got.logprobs) != len(got.tokens) or len(want.logprobs) != len(want.tokens):
        return False  # no logprobs to tell a near-tie from a wrong token

    def outputs(s: Sample) -> list[Output]:
        return [Output(t, [[(int(i), float(lp)) for i, lp in top] for top in tops])
                for t, tops in zip(s.tokens, s.logprobs, strict=True)]  # fmt: skip

    return not differences(outputs(got), outputs(want), ties=True)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# The ratio row's figures, as SPEC section 10 defines them: above 1, kvd is ahead;
# `step_vs_none` is kvd's step over the no-connector engine's (its goal: <= 1.05).
def _of(samples: dict[str, Sample], system: str, figure: str) -> float | None:
    """A system's figure in one round; None where the system did not run (LMCache
    refuses a hybrid model on its CPU path: the kvd-over-none ratios remain)."""
    sample = samples.get(system)
    return getattr(sample, figure) if sample is not None else None


RATIOS: dict[str, Callable[[dict[str, Sample]], float | None]] = {
    "ttft_ms": lambda s: _ratio(_of(s, "lmcache", "ttft_ms"), _of(s, "kvd", "ttft_ms")),
    "step_ms": lambda s: _ratio(_of(s, "lmcache", "step_ms"), _of(s, "kvd", "step_ms")),
    "requests_per_s": lambda s: _ratio(
        _of(s, "kvd", "requests_per_s"), _of(s, "lmcache", "requests_per_s")
    ),
    "step_vs_none": lambda s: _ratio(_of(s, "kvd", "step_ms"), _of(s, "none", "step_ms")),
    "ttft_vs_none": lambda s: _ratio(_of(s, "kvd", "ttft_ms"), _of(s, "none", "ttft_ms")),
    # LMCache against the no-connector engine, within each round as kvd's are.
    "lmcache_step_vs_none": lambda s: _ratio(
        _of(s, "lmcache", "step_ms"), _of(s, "none", "step_ms")
    ),
    "lmcache_ttft_vs_none": lambda s: _ratio(
        _of(s, "lmcache", "ttft_ms"), _of(s, "none", "ttft_ms")
    ),
    "rps_vs_none": lambda s: _ratio(
        _of(s, "kvd", "requests_per_s"), _of(s, "none", "requests_per_s")
    ),
    # kvd's connector with no daemon against the no-connector engine (`kvd-off`).
    "off_step_vs_none": lambda s: _ratio(_of(s, "kvd-off", "step_ms"), _of(s, "none", "step_ms")),
    "off_ttft_vs_none": lambda s: _ratio(_of(s, "kvd-off", "ttft_ms"), _of(s, "none", "ttft_ms")),
}


def rows(samples: list[Sample]) -> list[dict[str, Any]]:
    """SPEC section 10 `peers` rows: per measure (and prompt length), one row a
    system and one `ratio` row."""
    by: dict[tuple[str, int], dict[str, dict[int, Sample]]] = {}
    for s in samples:
        by.setdefault(s.key, {}).setdefault(s.system, {})[s.round] = s
    order = {m: i for i, m in enumerate(MEASURES)}
    out: list[dict[str, Any]] = []
    for key in sorted(by, key=lambda k: (order[k[0]], k[1])):
        measure, prompt_tokens = key
        systems = by[key]
        reference = systems.get("none", {})
        top = headline(measure)
        for system in SYSTEMS:
            rounds = systems.get(system, {})
            if not rounds:
                continue
            figures = [getattr(s, top) for s in rounds.values() if getattr(s, top) is not None]
            equal = [matches(s, reference[r]) for r, s in rounds.items() if r in reference]
            exact = [s.tokens == reference[r].tokens for r, s in rounds.items() if r in reference]
            out.append({
                "system": system,
                "measure": measure,
                "prompt_tokens": prompt_tokens,
                "ttft_ms": _median([s.ttft_ms for s in rounds.values()]),
                "step_ms": _median([s.step_ms for s in rounds.values()]),
                "requests_per_s": _median([s.requests_per_s for s in rounds.values()]),
                "hit_rate": _median([s.hit_rate for s in rounds.values()]),
                "tokens_equal": all(equal) if equal else None,
                "tokens_exact": all(exact) if exact else None,
                "ttft_p99_ms": _median([s.ttft_p99_ms for s in rounds.values()]),
                "wait_ms": _median([s.wait_ms for s in rounds.values()]),
                "forward_ms": _median([s.forward_ms for s in rounds.values()]),
                "rounds": len(rounds),
                "spread_min": min(figures) if figures else None,
                "spread_max": max(figures) if figures else None,
            })  # fmt: skip
        # Rounds with kvd (or kvd-off) and the no-connector engine; LMCache's where it ran.
        common = (set(systems.get("kvd", {})) | set(systems.get("kvd-off", {}))) & set(reference)
        if not common:
            continue
        present = [n for n in SYSTEMS if n in systems]
        per_round = {name: [fn({n: systems[n][r] for n in present if r in systems[n]})
                            for r in sorted(common)]
                     for name, fn in RATIOS.items()}  # fmt: skip
        spread_of = "step_vs_none" if measure == "decode_step" else top
        spread = [v for v in per_round[spread_of] if v is not None]
        out.append({
            "system": "ratio",
            "measure": measure,
            "prompt_tokens": prompt_tokens,
            **{name: _median(list(values)) for name, values in per_round.items()
               if name in ("ttft_ms", "step_ms", "requests_per_s")},
            "hit_rate": None,
            # kvd's and LMCache's tokens both equal to the no-connector engine's
            "tokens_equal": all(matches(systems[n][r], systems["none"][r])
                                for n in ("kvd", "lmcache") for r in common
                                if r in systems.get(n, {})),
            "step_vs_none": _median(list(per_round["step_vs_none"])),
            "ttft_vs_none": _median(list(per_round["ttft_vs_none"])),
            "lmcache_step_vs_none": _median(list(per_round["lmcache_step_vs_none"])),
            "lmcache_ttft_vs_none": _median(list(per_round["lmcache_ttft_vs_none"])),
            "rps_vs_none": _median(list(per_round["rps_vs_none"])),
            "off_step_vs_none": _median(list(per_round["off_step_vs_none"])),
            "off_ttft_vs_none": _median(list(per_round["off_ttft_vs_none"])),
            "rounds": len(common),
            "spread_min": min(spread) if spread else None,
            "spread_max": max(spread) if spread else None,
        })  # fmt: skip
    return out


def _off(ratio: dict[str, Any], figure: str) -> str:
    """The summary's words for `kvd-off` (kvd's connector, no daemon), where it ran."""
    value = ratio.get(figure)
    return "" if value is None else f", kvd's connector with no daemon {value:.2f}x"


def _where(table: list[dict[str, Any]], measure: str, n: int) -> list[str]:
    """Where kvd's and LMCache's TTFT went: the wait to be scheduled (the load) and
    the step to the first token, where both rows carry them."""
    got = {r["system"]: r for r in table if (r["measure"], r["prompt_tokens"]) == (measure, n)}
    if any(got.get(name, {}).get(figure) is None
           for name in ("kvd", "lmcache") for figure in ("wait_ms", "forward_ms")):  # fmt: skip
        return []
    kvd, lmcache = got["kvd"], got["lmcache"]
    return [
        f"{measure} at {n} tokens, where the TTFT went (medians): queued to scheduled (the "
        f"load's wait) kvd {kvd['wait_ms']:.1f} ms, LMCache {lmcache['wait_ms']:.1f} ms; "
        f"scheduled to the first token kvd {kvd['forward_ms']:.1f} ms, "
        f"LMCache {lmcache['forward_ms']:.1f} ms"
    ]


def summarize(table: list[dict[str, Any]]) -> list[str]:
    """One line a measure: where kvd stands against LMCache and the goals of issue 25."""
    ratio = {(r["measure"], r["prompt_tokens"]): r for r in table if r["system"] == "ratio"}
    lines = []
    for (measure, n), r in ratio.items():
        if measure in ("ttft_cached", "ttft_new_engine") and r["ttft_ms"] is not None:
            goal = 1 / 0.7 if measure == "ttft_cached" else 2.0
            lines.append(
                f"{measure} at {n} tokens: LMCache's TTFT is {r['ttft_ms']:.2f}x kvd's "
                f"(rounds {r['spread_min']:.2f} to {r['spread_max']:.2f}; goal >= {goal:.2f}): "
                + ("kvd ahead" if r["ttft_ms"] >= goal else "goal missed")
            )
            lines += _where(table, measure, n)
        elif measure == "ttft_store" and r["ttft_vs_none"] is not None:
            against = r["lmcache_ttft_vs_none"]
            lmcache = f"LMCache's {against:.2f}x" if against is not None else "LMCache did not run"
            lines.append(
                f"ttft_store at {n} tokens (a prefill whose blocks are offered for storing): "
                f"kvd {r['ttft_vs_none']:.2f}x the no-connector engine's recompute, {lmcache}"
                + _off(r, "off_ttft_vs_none")
            )
        elif measure == "ttft_vllm_cache" and r["ttft_ms"] is not None:
            floor = {x["system"]: x["ttft_ms"] for x in table
                     if (x["measure"], x["prompt_tokens"]) == (measure, n)}  # fmt: skip
            served = {x["system"]: x["ttft_ms"] for x in table
                      if (x["measure"], x["prompt_tokens"]) == ("ttft_cached", n)}  # fmt: skip
            above = {name: served[name] - floor[name] for name in ("kvd", "lmcache")
                     if served.get(name) is not None and floor.get(name) is not None}  # fmt: skip
            if len(above) == 2:
                lines.append(
                    f"ttft_cached at {n} tokens over a request vLLM's own cache served but "
                    f"its last block (what loading the rest costs): "
                    f"kvd +{above['kvd']:.1f} ms, LMCache +{above['lmcache']:.1f} ms"
                )
        elif measure == "decode_step" and r["step_vs_none"] is not None:
            lines.append(
                f"decode step: kvd {r['step_vs_none']:.2f}x the no-connector engine's (rounds "
                f"{r['spread_min']:.2f} to {r['spread_max']:.2f}; goal <= 1.05), "
                + (
                    f"LMCache's {r['lmcache_step_vs_none']:.2f}x"
                    if r["lmcache_step_vs_none"] is not None
                    else "LMCache did not run"
                )
                + _off(r, "off_step_vs_none")
            )
        elif measure in SERVING and r["requests_per_s"] is None and r["rps_vs_none"]:
            lines.append(
                f"{measure}: kvd {r['rps_vs_none']:.2f}x the no-connector engine's "
                "requests/s (goal >= 1.2); LMCache did not run"
            )
        elif measure in SERVING and r["requests_per_s"] is not None:
            lines.append(
                f"{measure}: kvd {r['requests_per_s']:.2f}x LMCache's requests/s (rounds "
                f"{r['spread_min']:.2f} to {r['spread_max']:.2f}; goal >= 1.1), "
                f"{r['rps_vs_none'] or 0:.2f}x the no-connector engine's (goal >= 1.2)"
            )
    unequal = [f"{r['system']} {r['measure']} {r['prompt_tokens']}" for r in table
               if r["tokens_equal"] is False]  # fmt: skip
    lines.append("tokens equal to the no-connector engine's: " + (
        "every row" if not unequal else "NOT in " + ", ".join(unequal)))  # fmt: skip
    return lines
