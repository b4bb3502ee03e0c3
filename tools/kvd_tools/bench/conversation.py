"""Runs in the operator's shell: writes a synthetic conversation trace in Mooncake format.

No real conversation trace ships with kvd, so this generates one shaped after
the public Mooncake conversation trace (kvcache-ai/Mooncake,
`FAST25-release/traces/conversation_trace.jsonl`, 512-token blocks), from
its published figures (12,031 requests over about an hour, a block hit ratio
of about 40 % with an unbounded cache, one system-prompt block shared by
every request) and from excerpts of it read by hand: about 12 new blocks per
request, a first turn of median 7 blocks with a heavy tail, a later turn
adding median 2 blocks, and a conversation coming back after a median of
about 5,000 new blocks (1,200 to 24,000 seen), about 400 requests later.

    request = [0] + (previous turn of its conversation, if any) + new blocks
    new conversation: lognormal(median 7, sigma 1.5) blocks, at most 250
    continues: p_first after the first turn, p_later after later ones
    next turn: lognormal(median gap_median, sigma 0.8) requests later

Replay it with `kvd bench trace --trace PATH`:

    python -m kvd_tools.bench.conversation /tmp/conversation.jsonl
    kvd bench trace --trace /tmp/conversation.jsonl

It is a stand-in with the right shape, not the real trace: figures from it
are labelled synthetic.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
from collections.abc import Sequence
from pathlib import Path


def conversation(
    seed: int = 1,
    num_requests: int = 12_000,
    *,
    p_first: float = 0.4,
    p_later: float = 0.55,
    gap_median: float = 400.0,
    gap_sigma: float = 0.8,
    first_median: float = 7.0,
    first_sigma: float = 1.5,
    add_median: float = 2.0,
    add_sigma: float = 1.2,
    max_new: int = 250,
    max_blocks: int = 400,
) -> list[list[int]]:
    """The block ids of each request, in arrival order (see the module doc)."""
    if num_requests < 0:
        raise ValueError("num_requests must be >= 0")
    rng = random.Random(seed)
    next_id = 1  # 0 is the shared system prompt
    waiting: list[tuple[float, int, list[int], int]] = []  # (due, seq, ids, turn)
    out: list[list[int]] = []
    seq = 0
    for t in range(1, 1 << 62):
        if len(out) >= num_requests:
            break
        if waiting and waiting[0][0] <= t:
            _, _, history, turn = heapq.heappop(waiting)
            median, sigma = add_median, add_sigma
        else:
            history, turn = [0], 0
            median, sigma = first_median, first_sigma
        n = min(max_new, max(1, int(rng.lognormvariate(math.log(median), sigma))))
        ids = history + list(range(next_id, next_id + n))
        next_id += n
        out.append(ids)
        if rng.random() < (p_first if turn == 0 else p_later) and len(ids) < max_blocks:
            seq += 1
            due = t + rng.lognormvariate(math.log(gap_median), gap_sigma)
            heapq.heappush(waiting, (due, seq, ids, turn + 1))
    return out


def write_trace(path: Path, requests: Sequence[Sequence[int]], block_tokens: int = 512) -> None:
    """Mooncake JSONL: one request per line, one second apart every 4 requests."""
    with path.open("w") as f:
        for i, ids in enumerate(requests):
            row = {
                "timestamp": i * 250,
                "input_length": len(ids) * block_tokens,
                "output_length": 1,
                "hash_ids": list(ids),
            }
            f.write(json.dumps(row) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvd_tools.bench.conversation",
        description="write a synthetic conversation trace in Mooncake format",
    )
    parser.add_argument("out", type=Path, help="the JSONL file to write")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--requests", type=int, default=12_000)
    parser.add_argument(
        "--gap-median", type=float, default=400.0, help="requests between turns (median)"
    )
    args = parser.parse_args(argv)
    if args.requests < 1 or args.gap_median <= 0:
        parser.error("--requests and --gap-median must be positive")
    requests = conversation(args.seed, args.requests, gap_median=args.gap_median)
    write_trace(args.out, requests)
    print(f"{args.out}: {len(requests)} requests, {sum(map(len, requests))} block references")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
