"""Runs in the bench: `kvd bench disk`'s row of a row size from its rounds, and its summary.

A row holds the SPEC 10 fields (medians over the rounds; `ratio` and
`store_ratio` are kvd's median over the bare median, as in `kvd bench
remote`), kvd's ratios to a file per block, CPU seconds per GB moved (the
daemon's for kvd, the bench's own for the baselines), each GB/s figure's
min and max over the rounds and the per-round ratios' min and max (the
spread), and what the rounds checked: rows compared byte for byte, bad
rows and I/O errors the daemon counted, the load average when the size began.
"""

from __future__ import annotations

import statistics
from typing import Any

GBPS = ("fetch_gbps", "bare_read_gbps", "files_load_gbps",
        "store_gbps", "bare_write_gbps", "files_store_gbps")  # fmt: skip
# (field, what it compares, goal): issue 27's goals; fetch >= 0.9x bare at 2 MiB.
GOALS = (("ratio", "fetch vs a bare O_DIRECT read", 0.8),
         ("store_ratio", "store vs a bare O_DIRECT write", 0.8),
         ("files_store_ratio", "store vs a file per block", 3.0),
         ("files_load_ratio", "fetch vs a file per block", 1.0))  # fmt: skip
PAIRS = {"ratio": ("fetch_gbps", "bare_read_gbps"),
         "store_ratio": ("store_gbps", "bare_write_gbps")}  # fmt: skip


def _median(rounds: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rounds)


def _total(rounds: list[dict[str, float]], key: str) -> int:
    return sum(int(r[key]) for r in rounds)


def row_of(row_bytes: int, queue_depth: int, blocks: int, rounds: list[dict[str, float]],
           load: float) -> dict[str, Any]:  # fmt: skip
    m = {k: _median(rounds, k) for k in rounds[0]}
    row: dict[str, Any] = {
        "row_bytes": row_bytes, "queue_depth": queue_depth,
        "fetch_gbps": m["fetch_gbps"], "bare_read_gbps": m["bare_read_gbps"],
        "ratio": m["fetch_gbps"] / m["bare_read_gbps"],
        "store_gbps": m["store_gbps"], "bare_write_gbps": m["bare_write_gbps"],
        "store_ratio": m["store_gbps"] / m["bare_write_gbps"],
        "files_store_gbps": m["files_store_gbps"], "files_load_gbps": m["files_load_gbps"],
        "files_store_ratio": m["store_gbps"] / m["files_store_gbps"],
        "files_load_ratio": m["fetch_gbps"] / m["files_load_gbps"],
    }  # fmt: skip
    row |= {k: m[k] for k in sorted(m) if "_cpu_s_per_gb_" in k}
    for k in GBPS:
        row[f"{k}_min"] = min(r[k] for r in rounds)
        row[f"{k}_max"] = max(r[k] for r in rounds)
    for k, (a, b) in PAIRS.items():
        row[f"{k}_min"] = min(r[a] / r[b] for r in rounds)
        row[f"{k}_max"] = max(r[a] / r[b] for r in rounds)
    row |= {"blocks": blocks, "rounds": len(rounds),
            "blocks_checked": _total(rounds, "blocks_checked"),
            "blocks_verified": _total(rounds, "blocks_verified"),
            "disk_bad_rows": _total(rounds, "disk.bad_rows"),
            "disk_errors": _total(rounds, "disk.errors"), "load_avg_1m": load}  # fmt: skip
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}


def goal(field: str, row: dict[str, Any], default: float) -> float:
    return 0.9 if field == "ratio" and row["row_bytes"] >= 2 << 20 else default


def summarize(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in rows:
        spread = ", ".join(f"{k.removesuffix('_gbps')} {r[k]} ({r[k + '_min']}-{r[k + '_max']})"
                           for k in GBPS)  # fmt: skip
        out.append(f"{r['row_bytes']} B rows, queue depth {r['queue_depth']}, median of "
                   f"{r['rounds']} rounds (min-max), GB/s: {spread}")  # fmt: skip
        goals = []
        for field, what, default in GOALS:
            want = goal(field, r, default)
            met = "met" if r[field] >= want else "MISSED"
            per_round = (f", per round {r[field + '_min']}-{r[field + '_max']}"
                         if field in PAIRS else "")  # fmt: skip
            goals.append(f"{what} {r[field]}x{per_round} (goal >= {want}: {met})")
        out.append(f"{r['row_bytes']} B rows: " + "; ".join(goals))
    return out
