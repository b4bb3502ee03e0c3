"""Runs in the operator's shell: how `kvd bench` shows results (markdown) and keeps them (JSON).

A suite returns rows: flat dicts whose keys are the SPEC section 10 field
names, in column order. The table prints them for a person; the JSON document
`{"suite": NAME, "machine": {...}, "rows": [...]}` keeps them, with full
values, for other tools.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TypedDict

Value = int | float | str | bool | None
Row = dict[str, Value]


class SuiteReport(TypedDict):
    """One suite's JSON document (SPEC section 10)."""

    suite: str
    machine: dict[str, Value]
    rows: list[Row]


def format_cell(value: Value) -> str:
    """A value as a table cell: floats get 3 significant-ish decimals; tiny ones
    (logit differences) an exponent, so 2e-6 does not print as 0.000."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        magnitude = abs(value)
        if magnitude >= 100:
            return f"{value:.1f}"
        if magnitude >= 10:
            return f"{value:.2f}"
        if 0 < magnitude < 1e-3:
            return f"{value:.1e}"
        return f"{value:.3f}"
    return str(value)


def _is_number(value: Value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def markdown_table(rows: Sequence[Row]) -> str:
    """A GitHub markdown table; the columns are the first row's fields, in order,
    numbers right-aligned.

    Fields that only later rows have are appended as further columns, so a row
    never loses a value; a row without a column shows `-`.
    """
    if not rows:
        return "(no rows)"
    columns: list[str] = []
    for row in rows:
        columns.extend(name for name in row if name not in columns)
    cells = [[format_cell(row.get(name)) for name in columns] for row in rows]
    widths = [max(len(name), *(len(line[i]) for line in cells)) for i, name in enumerate(columns)]
    numeric = [
        all(_is_number(row.get(name)) for row in rows if row.get(name) is not None)
        for name in columns
    ]

    def line(values: Sequence[str]) -> str:
        padded = (
            v.rjust(w) if right else v.ljust(w)
            for v, w, right in zip(values, widths, numeric, strict=True)
        )
        return "| " + " | ".join(padded) + " |"

    rule = (
        "|"
        + "|".join(
            ("-" * (w + 1) + ":") if right else ("-" * (w + 2))
            for w, right in zip(widths, numeric, strict=True)
        )
        + "|"
    )
    return "\n".join([line(columns), rule, *(line(c) for c in cells)])


def row_groups(rows: Sequence[Row]) -> list[list[Row]]:
    """Runs of consecutive rows whose first field is the same: a suite with parts
    of different shapes (`kvd bench vllm`) prints one table a part."""
    groups: list[list[Row]] = []
    for row in rows:
        if groups and next(iter(groups[-1][0]), None) == next(iter(row), None):
            groups[-1].append(row)
        else:
            groups.append([row])
    return groups


def render(suite: str, rows: Sequence[Row], summary: Sequence[str] = ()) -> str:
    """The printed section of one suite: a heading, its tables, then its summary lines."""
    parts = [f"### kvd bench {suite}"]
    for group in row_groups(rows) or [[]]:
        parts += ["", markdown_table(group)]
    if summary:
        parts += ["", *summary]
    return "\n".join(parts) + "\n"


def suite_report(suite: str, machine: dict[str, Value], rows: list[Row]) -> SuiteReport:
    return {"suite": suite, "machine": machine, "rows": rows}


def write_json(path: Path, reports: SuiteReport | list[SuiteReport]) -> None:
    """Writes one report (one suite) or a list of them (`kvd bench all`)."""
    path.write_text(json.dumps(reports, indent=2) + "\n", encoding="utf-8")
