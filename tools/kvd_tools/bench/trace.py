"""Runs in the operator's shell: `kvd bench trace`, hit rates replaying request traces.

For each trace and capacity: every policy of `kvd.core.index.policies.POLICIES`
driven through the real `BlockIndex` (see `kvd_tools.bench.replay`), plus `belady`,
the offline optimum (see `kvd_tools.bench.belady`). The SPEC section 10 goal: ARC >=
LRU, with Belady as the reference.

Then, per policy, the disk tier of SPEC section 16 below RAM of each
capacity, a disk 10x larger, under each admission rule (`always`, `second`;
see `kvd_tools.bench.tier_replay`). These rows start with `tier` (`ram+disk`,
or `ram` for the RAM-only references at the capacity and at 11x it) and
print as a table of their own.

The default trace is the Mooncake synthetic trace in the shared data folder,
`../shared/traces/synthetic_trace.jsonl`, looked up from the current
directory, then from the repository root; it is data, never copied into the
project.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from kvd_tools.bench.belady import belady
from kvd_tools.bench.replay import ReplayStats, load_trace, replay
from kvd_tools.bench.report import Row
from kvd_tools.bench.suites import SuiteError
from kvd_tools.bench.tier_replay import ADMISSIONS, DISK_RATIO, replay_tiers

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
    paths = [Path(p) for p in args.trace] if args.trace else [default_trace()]
    rows: list[Row] = []
    tier_rows: list[Row] = []
    for path in paths:
        requests = load_trace(path)
        if not any(requests):
            raise SuiteError(f"{path}: the trace has no block references")
        for capacity in args.capacity:
            print(f"trace: {path.name}, {capacity} blocks ...", file=sys.stderr, flush=True)
            results = replay_all(requests, capacity)
            for policy, stats in results.items():
                rows.append(
                    {
                        "trace": path.name,
                        "capacity_blocks": capacity,
                        "policy": policy,
                        "hit_rate": round(stats.hit_rate, 4),
                    }
                )
            disk = DISK_RATIO * capacity
            print(f"trace: {path.name}, {capacity} + disk {disk} blocks ...", file=sys.stderr)
            for policy, stats in results.items():
                if policy != BELADY:
                    tier_rows += disk_rows(path.name, requests, capacity, policy, stats)
    if getattr(args, "png", None) is not None:
        plot(rows, args.png)
    return rows + tier_rows


def replay_all(requests: Sequence[Sequence[int]], capacity: int) -> dict[str, ReplayStats]:
    """Every policy's replay at `capacity`, then Belady's optimum."""
    from kvd.core.index.policies import POLICIES

    results = {policy: replay(requests, capacity, policy) for policy in POLICIES}
    results[BELADY] = belady(requests, capacity)
    return results


def disk_rows(
    trace: str, requests: Sequence[Sequence[int]], capacity: int, policy: str, ram: ReplayStats
) -> list[Row]:
    """RAM only at `capacity` (`ram`, already replayed) and at 11x it, then RAM +
    disk under each admission rule."""
    big = (1 + DISK_RATIO) * capacity
    rows = [
        ram_row(trace, capacity, policy, ram),
        ram_row(trace, big, policy, replay(requests, big, policy)),
    ]
    for admit in ADMISSIONS:
        stats = replay_tiers(requests, capacity, policy, admit)
        rows.append(
            {
                "tier": "ram+disk",
                "trace": trace,
                "capacity_blocks": capacity,
                "disk_capacity_blocks": DISK_RATIO * capacity,
                "policy": policy,
                "disk_admit": admit,
                "ram_hit_rate": round(stats.ram_hit_rate, 4),
                "disk_hit_rate": round(stats.disk_hit_rate, 4),
                "hit_rate": round(stats.hit_rate, 4),
                "disk_blocks_written": stats.num_disk_writes,
            }
        )
    return rows


def ram_row(trace: str, capacity: int, policy: str, stats: ReplayStats) -> Row:
    """A RAM-only reference in the disk table's shape (no disk figures)."""
    rate = round(stats.hit_rate, 4)
    return {
        "tier": "ram",
        "trace": trace,
        "capacity_blocks": capacity,
        "disk_capacity_blocks": None,
        "policy": policy,
        "disk_admit": None,
        "ram_hit_rate": rate,
        "disk_hit_rate": None,
        "hit_rate": rate,
        "disk_blocks_written": None,
    }


def plot(rows: list[Row], path: Path) -> None:
    """Hit rate against capacity, one line per policy (Belady dashed), per trace file."""
    from kvd_tools.demo.chart import Series, line_chart

    rows = [r for r in rows if "tier" not in r]
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
    """Per trace and capacity: whether ARC >= LRU, adaptive against both, shares of
    Belady; then the disk tier's lines (`disk_summary`)."""
    table: dict[tuple[str, int], dict[str, float]] = {}
    for row in rows:
        if "tier" in row:
            continue
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
    return lines + disk_summary(rows)


def disk_summary(rows: list[Row]) -> list[str]:
    """Per trace, RAM capacity and policy: the combined hit rate of each admission
    rule against RAM only at the capacity and at 11x it, and the blocks each wrote."""
    ram: dict[tuple[object, object, object], object] = {}
    disk: dict[tuple[object, object, object], list[Row]] = {}
    for row in rows:
        key = (row.get("trace"), row.get("capacity_blocks"), row.get("policy"))
        if row.get("tier") == "ram":
            ram[key] = row["hit_rate"]
        elif row.get("tier") == "ram+disk":
            disk.setdefault(key, []).append(row)
    lines: list[str] = []
    for (trace, capacity, policy), mine in disk.items():
        assert isinstance(capacity, int)
        rates = ", ".join(f"{r['disk_admit']} {r['hit_rate']}" for r in mine)
        big = (1 + DISK_RATIO) * capacity
        alone = ram.get((trace, capacity, policy)), ram.get((trace, big, policy))
        written = ", ".join(f"{r['disk_admit']} {r['disk_blocks_written']}" for r in mine)
        lines.append(
            f"- {trace}, {policy}, ram {capacity} + disk {DISK_RATIO * capacity} blocks: "
            f"hit rate {rates} (ram only {alone[0]}; {big} blocks of ram {alone[1]}); "
            f"blocks written to disk {written}"
        )
    return lines
