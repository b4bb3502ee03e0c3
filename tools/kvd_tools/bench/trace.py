"""Runs in the operator's shell: `kvd bench trace`, hit rates replaying request traces.

For each trace and capacity: every policy of `kvd.core.index.policies.POLICIES`
driven through the real `BlockIndex` (see `kvd_tools.bench.replay`), plus `belady`,
the offline optimum (see `kvd_tools.bench.belady`). The SPEC section 10 goal: ARC >=
LRU, with Belady as the reference.

The default trace is the Mooncake synthetic trace in the shared data folder,
`../shared/traces/synthetic_trace.jsonl`, looked up from the current
directory, then from the repository root; it is data, never copied into the
project.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvd_tools.bench.belady import belady
from kvd_tools.bench.replay import load_trace, replay
from kvd_tools.bench.report import Row
from kvd_tools.bench.suites import SuiteError

DEFAULT_TRACE = Path("..", "shared", "traces", "synthetic_trace.jsonl")
BELADY = "belady"


def repo_root() -> Path | None:
    """The source checkout holding this package (the folder with pyproject.toml), if any."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() else None


def default_trace() -> Path:
    """The shared synthetic trace, from the current directory or the repository root."""
    candidates = [Path.cwd() / DEFAULT_TRACE]
    root = repo_root()
    if root is not None:
        candidates.append(root / DEFAULT_TRACE)
    for path in candidates:
        if path.is_file():
            return path
    tried = ", ".join(str(p) for p in candidates)
    raise SuiteError(f"no trace found (tried {tried}); pass --trace PATH")


def run(args: argparse.Namespace) -> list[Row]:
    from kvd.core.index.policies import POLICIES

    paths = [Path(p) for p in args.trace] if args.trace else [default_trace()]
    rows: list[Row] = []
    for path in paths:
        requests = load_trace(path)
        if not any(requests):
            raise SuiteError(f"{path}: the trace has no block references")
        for capacity in args.capacity:
            print(f"trace: {path.name}, {capacity} blocks ...", file=sys.stderr, flush=True)
            results = {policy: replay(requests, capacity, policy) for policy in POLICIES}
            results[BELADY] = belady(requests, capacity)
            for policy, stats in results.items():
                rows.append(
                    {
                        "trace": path.name,
                        "capacity_blocks": capacity,
                        "policy": policy,
                        "hit_rate": round(stats.hit_rate, 4),
                    }
                )
    if getattr(args, "png", None) is not None:
        plot(rows, args.png)
    return rows


def plot(rows: list[Row], path: Path) -> None:
    """Hit rate against capacity, one line per policy (Belady dashed), per trace file."""
    from kvd_tools.demo.chart import Series, line_chart

    for trace in dict.fromkeys(str(r["trace"]) for r in rows):
        mine = [r for r in rows if r["trace"] == trace]
        series = []
        for i, policy in enumerate(dict.fromkeys(str(r["policy"]) for r in mine)):
            points = [
                (float(r["capacity_blocks"]), float(r["hit_rate"]))  # type: ignore[arg-type]
                for r in mine
                if r["policy"] == policy
            ]
            series.append(Series(policy, points, policy == BELADY, color=i))
        out = path if len(rows) == len(mine) else path.with_stem(f"{path.stem}-{trace}")
        line_chart(out, f"hit rate, {trace}", "capacity (blocks)", "hit rate", series)


def summarize(rows: list[Row]) -> list[str]:
    """Per trace and capacity: whether ARC >= LRU, adaptive against both, shares of Belady."""
    table: dict[tuple[str, int], dict[str, float]] = {}
    for row in rows:
        capacity, rate = row["capacity_blocks"], row["hit_rate"]
        assert isinstance(capacity, int) and isinstance(rate, float | int)
        table.setdefault((str(row["trace"]), capacity), {})[str(row["policy"])] = float(rate)
    lines: list[str] = []
    for (trace, capacity), rates in table.items():
        parts: list[str] = []
        if "arc" in rates and "lru" in rates:
            verdict = "met" if rates["arc"] >= rates["lru"] else "NOT met"
            parts.append(f"arc >= lru: {verdict}")
            best = max(rates["arc"], rates["lru"])
            if "adaptive" in rates and best > 0:
                # The adaptive policy's bar: never below the better of the two
                # by more than 0.005, and well above it where admission pays.
                verdict = "met" if rates["adaptive"] >= best - 0.005 else "NOT met"
                parts.append(
                    f"adaptive {rates['adaptive'] / best:.2f}x the better of arc and lru "
                    f"(>= it - 0.005: {verdict})"
                )
        optimum = rates.get(BELADY)
        if optimum:
            shares = ", ".join(
                f"{policy} {rate / optimum:.0%}"
                for policy, rate in rates.items()
                if policy != BELADY
            )
            parts.append(f"of belady: {shares}")
        lines.append(f"- {trace} at {capacity} blocks: " + "; ".join(parts))
    return lines
