"""`kvd bench`: the command line, the markdown table and the JSON report (SPEC section 10)."""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path

import pytest

import kvd_tools.bench.cli as bench_cli
from kvd.cli import main
from kvd.core.index.policies import POLICIES
from kvd_tools.bench.index import summarize as summarize_index
from kvd_tools.bench.machine import cpu_model, describe_machine
from kvd_tools.bench.report import Row, format_cell, markdown_table, render
from kvd_tools.bench.suites import Suite, SuiteError

MACHINE_FIELDS = {"platform", "python", "num_cpus", "cpu_model", "ram_bytes", "torch", "kvd"}
INDEX_FIELDS = [
    "num_blocks",
    "policy",
    "us_per_key_prepare_store",
    "us_per_key_lookup",
    "bytes_per_block",
    "key_bytes",
    "table_bytes_per_block",
]
TRACE_FIELDS = ["trace", "capacity_blocks", "policy", "hit_rate"]
TIER_FIELDS = [
    "tier",
    "trace",
    "capacity_blocks",
    "disk_capacity_blocks",
    "policy",
    "disk_admit",
    "ram_hit_rate",
    "disk_hit_rate",
    "hit_rate",
    "disk_blocks_written",
]


def test_index_suite_writes_spec_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "index.json"
    argv = ["bench", "index", "--sizes", "1000", "--min-batches", "20", "--min-seconds", "0"]
    assert main([*argv, "--json", str(out)]) == 0

    doc = json.loads(out.read_text())
    assert list(doc) == ["suite", "machine", "rows"]
    assert doc["suite"] == "index"
    assert set(doc["machine"]) == MACHINE_FIELDS
    assert [row["policy"] for row in doc["rows"]] == list(POLICIES)
    for row in doc["rows"]:
        assert list(row) == INDEX_FIELDS
        assert row["num_blocks"] == 1000
        assert row["us_per_key_prepare_store"] > 0
        assert row["us_per_key_lookup"] > 0
        # A 36-byte key object alone is 69 bytes; a block costs more, yet not kilobytes.
        assert row["key_bytes"] == 36
        assert 69 < row["bytes_per_block"] < 2000
        assert row["table_bytes_per_block"] >= 2 * 72  # two buckets of 72 bytes, at least

    printed = capsys.readouterr().out
    assert "### kvd bench index" in printed
    header = next(line for line in printed.splitlines() if line.startswith("| num_blocks"))
    assert [cell.strip() for cell in header.strip("|").split("|")] == INDEX_FIELDS
    assert "one size only" in printed


def test_trace_suite_writes_spec_json(tmp_path: Path) -> None:
    trace = tmp_path / "tiny.jsonl"
    trace.write_text('{"hash_ids": [1, 2]}\n{"hash_ids": [1, 2, 3]}\n')
    out = tmp_path / "trace.json"
    assert (
        main(["bench", "trace", "--trace", str(trace), "--capacity", "2,3", "--json", str(out)])
        == 0
    )

    doc = json.loads(out.read_text())
    assert doc["suite"] == "trace"
    rows = [row for row in doc["rows"] if "tier" not in row]
    assert [list(row) for row in rows] == [TRACE_FIELDS] * (2 * (len(POLICIES) + 1))
    assert [row["policy"] for row in rows] == [*POLICIES, "belady"] * 2
    assert {row["trace"] for row in doc["rows"]} == {"tiny.jsonl"}
    assert [row["capacity_blocks"] for row in rows][:: len(POLICIES) + 1] == [2, 3]
    # Then the disk tier's rows, after every RAM row: per capacity and policy,
    # RAM alone at C and 11 C, then RAM + disk per admission rule.
    tiers = doc["rows"][len(rows) :]
    assert [list(row) for row in tiers] == [TIER_FIELDS] * (2 * len(POLICIES) * 4)
    assert [row["tier"] for row in tiers[:4]] == ["ram", "ram", "ram+disk", "ram+disk"]
    assert [row["capacity_blocks"] for row in tiers[:4]] == [2, 22, 2, 2]
    assert [row["disk_admit"] for row in tiers[:4]] == [None, None, "always", "second"]


def _fake_suite(monkeypatch: pytest.MonkeyPatch, name: str, rows: list[Row] | None) -> str:
    """Registers an importable module `fake_<name>` whose run returns `rows` (None: fails)."""
    module = types.ModuleType(f"fake_{name}")

    def run(args: argparse.Namespace) -> list[Row]:
        if rows is None:
            raise SuiteError("no input")
        return [{**row, "flag": args.flag} for row in rows]

    module.run = run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module.__name__


def _flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--flag", type=int, default=7)


def test_all_runs_every_suite_with_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    suites = {
        "one": Suite(_fake_suite(monkeypatch, "one", [{"a": 1}]), "first", _flag),
        "broken": Suite(_fake_suite(monkeypatch, "broken", None), "fails", _flag),
        "two": Suite(_fake_suite(monkeypatch, "two", [{"b": 0.5}, {"b": 1.5}]), "second", _flag),
    }
    monkeypatch.setattr(bench_cli, "SUITES", suites)
    out = tmp_path / "all.json"

    assert main(["bench", "all", "--json", str(out)]) == 2  # "broken" failed, the rest ran

    docs = json.loads(out.read_text())
    assert [doc["suite"] for doc in docs] == ["one", "two"]
    assert all(list(doc) == ["suite", "machine", "rows"] for doc in docs)
    assert docs[0]["rows"] == [{"a": 1, "flag": 7}]
    assert docs[1]["rows"] == [{"b": 0.5, "flag": 7}, {"b": 1.5, "flag": 7}]
    captured = capsys.readouterr()
    assert "kvd bench broken: error: no input" in captured.err
    assert "### kvd bench two" in captured.out


def test_a_suite_whose_verdict_fails_exits_1_with_its_table_and_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A suite with `passed(rows)` (the soak: violations) that fails: still its table
    and JSON, then exit status 1 and one line on stderr; a pass exits 0."""
    name = _fake_suite(monkeypatch, "verdict", [{"violations": 2}])
    sys.modules[name].passed = lambda rows: all(r["violations"] == 0 for r in rows)  # type: ignore[attr-defined]
    monkeypatch.setattr(bench_cli, "SUITES", {"verdict": Suite(name, "judged", _flag)})
    out = tmp_path / "v.json"
    assert main(["bench", "verdict", "--json", str(out)]) == 1
    assert json.loads(out.read_text())["rows"] == [{"violations": 2, "flag": 7}]
    captured = capsys.readouterr()
    assert "kvd bench verdict: FAIL" in captured.err and "### kvd bench verdict" in captured.out
    sys.modules[name].run = lambda args: [{"violations": 0}]  # type: ignore[attr-defined]
    assert main(["bench", "verdict"]) == 0


def test_unknown_suite_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "nosuch"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice" in err
    assert "'index'" in err and "'trace'" in err and "'all'" in err


def test_suite_flags_show_in_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "index", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "--sizes" in text and "--json" in text


@pytest.mark.parametrize("sizes", ["0", "ten", "10,-1", ","])
def test_bad_sizes_are_usage_errors(sizes: str) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "index", "--sizes", sizes])
    assert exc.value.code == 2


def test_markdown_table_columns_and_alignment() -> None:
    rows: list[Row] = [{"name": "lru", "rate": 0.14444, "n": 2000}, {"name": "arc", "extra": True}]
    assert markdown_table(rows).splitlines() == [
        "| name |  rate |    n | extra |",
        "|------|------:|-----:|-------|",
        "| lru  | 0.144 | 2000 | -     |",
        "| arc  |     - |    - | yes   |",
    ]
    assert markdown_table([]) == "(no rows)"
    assert render("x", [{"a": 1}], ["footer"]).endswith("| 1 |\n\nfooter\n")
    # Parts whose rows start with another field get a table each; extra fields do not split.
    two = render("x", [{"a": 1}, {"a": 2, "b": 3}, {"c": 4}]).split("\n\n")
    assert [t.splitlines()[0] for t in two[1:]] == ["| a | b |", "| c |"]


@pytest.mark.parametrize(
    ("value", "cell"),
    [
        (None, "-"),
        (False, "no"),
        (3, "3"),
        (0.12345, "0.123"),
        (12.345, "12.35"),
        (1234.5, "1234.5"),
    ],
)
def test_format_cell(value: float | bool | None, cell: str) -> None:
    assert format_cell(value) == cell


def test_machine_description(tmp_path: Path) -> None:
    machine = describe_machine()
    assert set(machine) == MACHINE_FIELDS
    assert isinstance(machine["num_cpus"], int)
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Example CPU @ 3.0GHz\n")
    assert cpu_model(cpuinfo) == "Example CPU @ 3.0GHz"


def _index_row(num_blocks: int, policy: str, us: float, size: float) -> Row:
    return dict(zip(INDEX_FIELDS, [num_blocks, policy, us, us, size, 36, 144.0], strict=True))


def test_index_summary_states_the_bars() -> None:
    rows = [
        _index_row(10_000, "lru", 1.0, 200.0),
        _index_row(1_000_000, "lru", 1.5, 250.0),
        _index_row(10_000, "arc", 1.0, 200.0),
        _index_row(1_000_000, "arc", 2.5, 350.0),
    ]
    lines = summarize_index(rows)
    assert "lru: per-key cost at 1000000 vs 10000 blocks: prepare_store 1.50x" in lines[0]
    assert lines[0].endswith(": met")
    assert lines[1].endswith(": met")
    assert lines[2].endswith("NOT met") and lines[3].endswith("NOT met")
    assert lines[-1] == "Bars NOT all met."
