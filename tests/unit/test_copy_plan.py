"""The copy planner: checks, runs, element width, and a byte-level proof that a plan's
strided run copies move exactly the bytes of a naive per-block copy."""

from __future__ import annotations

import ast
from itertools import pairwise
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd_client.copy_plan import (
    CopyPlan,
    Run,
    SlotLayout,
    check_job,
    plan_copy,
    run_starts,
    widest_element,
)
from kvd_client.errors import BadRequest
from kvd_client.geometry import Geometry


def all_runs(plan: CopyPlan) -> list[Run]:
    """Every run of `plan`, in job order (`split` with no minimum keeps them all)."""
    runs, devices, pools = plan.split(1)
    assert not devices and not pools
    return runs


def coalesce(device_ids: list[int], pool_ids: list[int]) -> list[Run]:
    """Consecutive pairs that advance by one on both sides, as runs, in job order."""
    return all_runs(CopyPlan("store", device_ids, pool_ids, run_starts(device_ids, pool_ids)))


# -- element width --------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "width"),
    [
        ((), 8),
        ((0,), 8),
        ((16384, 256, 512), 8),
        ((16384, 12), 4),
        ((6, 8), 2),
        ((3, 8), 1),
        ((8, 8, 1024, 1 << 40), 8),
    ],
)
def test_widest_element_divides_every_value(values: tuple[int, ...], width: int) -> None:
    assert widest_element(*values) == width


# -- layout ---------------------------------------------------------------------


def test_layout_offsets_follow_the_geometry_for_every_rank() -> None:
    geometry = Geometry.plan(
        slot_bytes=3 * 512, world_size=4, replicated=False, capacity_bytes=1 << 20
    )
    for rank in range(4):
        layout = SlotLayout.of(geometry, rank, [512, 512, 512])
        assert layout.layer_offsets == (0, 512, 1024)
        for block in (0, 1, geometry.num_blocks - 1):
            for layer in range(3):
                expected = geometry.slot_offset(block, rank) + 512 * layer
                assert layout.host_offset(block, layer) == expected


def test_replicated_layout_puts_every_rank_in_slot_zero() -> None:
    geometry = Geometry.plan(slot_bytes=1024, world_size=8, replicated=True, capacity_bytes=1 << 16)
    offsets = {SlotLayout.of(geometry, rank, [1024]).slot_offset for rank in range(8)}
    assert offsets == {0}


def test_layout_refuses_pages_that_do_not_fill_the_slot() -> None:
    geometry = Geometry.plan(slot_bytes=1024, world_size=1, replicated=False, capacity_bytes=4096)
    with pytest.raises(BadRequest, match="slot_bytes 1024"):
        SlotLayout.of(geometry, 0, [512, 256])
    with pytest.raises(BadRequest, match="rank 1"):
        SlotLayout.of(geometry, 1, [1024])
    with pytest.raises(BadRequest, match="does not fit"):
        SlotLayout(slot_offset=200, row_bytes=256, page_bytes=(100,), num_pool_blocks=1)
    with pytest.raises(BadRequest, match=">= 1 byte"):
        SlotLayout(slot_offset=0, row_bytes=256, page_bytes=(), num_pool_blocks=1)


# -- runs -----------------------------------------------------------------------


def test_runs_merge_pairs_that_advance_together() -> None:
    assert coalesce([], []) == []
    assert coalesce([5], [9]) == [Run(5, 9, 1)]
    assert coalesce([5, 6, 7, 8], [9, 10, 11, 12]) == [Run(5, 9, 4)]
    assert coalesce([1, 2, 9, 10, 11, 3], [4, 5, 6, 7, 8, 0]) == [
        Run(1, 4, 2),
        Run(9, 6, 3),
        Run(3, 0, 1),
    ]


def test_runs_need_both_sides_to_advance_by_one() -> None:
    # Device side consecutive, pool side not, and the reverse; and descending.
    assert coalesce([1, 2, 3], [7, 3, 9]) == [Run(1, 7, 1), Run(2, 3, 1), Run(3, 9, 1)]
    assert coalesce([7, 3, 9], [1, 2, 3]) == [Run(7, 1, 1), Run(3, 2, 1), Run(9, 3, 1)]
    assert coalesce([3, 2, 1], [3, 2, 1]) == [Run(3, 3, 1), Run(2, 2, 1), Run(1, 1, 1)]
    # Ranges whose ends match but whose middles do not.
    assert run_starts([0, 2, 1, 3], [0, 1, 2, 3]) == [0, 1, 2, 3]


def test_split_keeps_long_runs_and_lists_the_rest_in_job_order() -> None:
    plan = plan_copy("store", [0, 1, 2, 3, 9, 20, 21], [5, 6, 7, 8, 0, 30, 31], 32, 32)
    assert all_runs(plan) == [Run(0, 5, 4), Run(9, 0, 1), Run(20, 30, 2)]
    runs, devices, pools = plan.split(3)
    assert runs == [Run(0, 5, 4)]
    assert (list(devices), list(pools)) == ([9, 20, 21], [0, 30, 31])
    runs, devices, pools = plan.split(1)
    assert runs == all_runs(plan) and not devices and not pools
    runs, devices, pools = plan.split(5)
    assert runs == [] and list(devices) == plan.device_ids


def test_split_of_all_single_pairs_hands_back_the_ids() -> None:
    plan = plan_copy("load", [4, 1, 7], [2, 0, 5], 8, 8)
    assert plan.split(2) == ([], [4, 1, 7], [2, 0, 5])


# -- checks ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "device", "pool", "message"),
    [
        ("store", [0, 1], [0], "2 device block ids but 1 pool"),
        ("store", [0, 8], [0, 1], "device block id 8 is outside \\[0, 8\\)"),
        ("load", [-1], [0], "device block id -1"),
        ("store", [0], [4], "pool block id 4 is outside \\[0, 4\\)"),
        ("load", [0], [-3], "pool block id -3"),
        ("store", [0, 1], [2, 2], "store writes pool block 2 twice"),
        ("load", [3, 3], [0, 1], "load writes device block 3 twice"),
        ("copy", [0], [0], "kind must be"),
    ],
)
def test_check_refuses_what_it_cannot_copy(
    kind: str, device: list[int], pool: list[int], message: str
) -> None:
    with pytest.raises(BadRequest, match=message):
        check_job(kind, device, pool, 8, 4)


@pytest.mark.parametrize(
    ("kind", "device", "pool", "runs"),
    [
        # One device block into two slots: two runs, one per destination.
        ("store", [1, 1], [0, 1], [Run(1, 0, 1), Run(1, 1, 1)]),
        # One slot into two device blocks: the pool side stands still, no run.
        ("load", [0, 1], [2, 2], [Run(0, 2, 1), Run(1, 2, 1)]),
        # A run named twice: each copy keeps its own destinations.
        ("store", [3, 4, 3, 4], [0, 1, 2, 3], [Run(3, 0, 2), Run(3, 2, 2)]),
        ("store", [], [], []),
    ],
)
def test_a_source_named_twice_is_copied_to_each_destination(
    kind: str, device: list[int], pool: list[int], runs: list[Run]
) -> None:
    check_job(kind, device, pool, 8, 4)
    plan = plan_copy(kind, device, pool, 8, 4)
    assert (plan.kind, list(plan.device_ids), list(plan.pool_ids)) == (kind, device, pool)
    assert all_runs(plan) == runs
    # Applied as a backend does, short runs pair by pair or not: every
    # destination holds its source's bytes, nothing else changed.
    pages = [8, 16]
    probe = Geometry.plan(slot_bytes=24, world_size=1, replicated=False, capacity_bytes=1 << 20)
    geometry = Geometry.plan(
        slot_bytes=24, world_size=1, replicated=False, capacity_bytes=4 * probe.row_bytes
    )
    layout = SlotLayout.of(geometry, 0, pages)
    for min_count in (1, 2, 3):
        host = bytearray(i % 251 for i in range(geometry.size_bytes))
        devices = [
            bytearray((7 * n + i) % 253 for i in range(8 * page)) for n, page in enumerate(pages)
        ]
        host_before, devices_before = bytes(host), [bytes(d) for d in devices]
        plan_apply(plan, layout, min_count, devices, host)
        expected_host = bytearray(host_before)
        expected_devices = [bytearray(d) for d in devices_before]
        for d, p in zip(device, pool, strict=True):
            for layer, page in enumerate(pages):
                h = layout.host_offset(p, layer)
                if kind == "store":
                    expected_host[h : h + page] = devices_before[layer][d * page : (d + 1) * page]
                else:
                    expected_devices[layer][d * page : (d + 1) * page] = host_before[h : h + page]
        assert host == expected_host, f"min_count {min_count}"
        assert devices == expected_devices, f"min_count {min_count}"


# -- byte-level equivalence -----------------------------------------------------


def naive_copy(
    kind: str,
    device_ids: list[int],
    pool_ids: list[int],
    geometry: Geometry,
    rank: int,
    pages: list[int],
    device: list[bytearray],
    host: bytearray,
) -> None:
    """Per block, per layer, offsets straight from the geometry (SPEC section 3)."""
    for d, p in zip(device_ids, pool_ids, strict=True):
        offset = geometry.slot_offset(p, rank)
        for layer, page in enumerate(pages):
            h = slice(offset, offset + page)
            v = slice(d * page, (d + 1) * page)
            if kind == "store":
                host[h] = device[layer][v]
            else:
                device[layer][v] = host[h]
            offset += page


def strided_copy(
    dst: bytearray,
    dst_start: int,
    dst_stride: int,
    src: bytearray,
    src_start: int,
    src_stride: int,
    rows: int,
    width: int,
    elem: int,
) -> None:
    """One 2-D copy, `rows` x `width` bytes, moved in elements of `elem` bytes."""
    for r in range(rows):
        s, d = src_start + r * src_stride, dst_start + r * dst_stride
        for e in range(0, width, elem):
            dst[d + e : d + e + elem] = src[s + e : s + e + elem]


def plan_apply(
    plan: CopyPlan,
    layout: SlotLayout,
    min_count: int,
    device: list[bytearray],
    host: bytearray,
) -> None:
    """What a backend does: one strided copy per layer per long run, the rest pair by
    pair, every copy in elements of the plan's widest width."""
    elem = widest_element(*layout.alignment_values())
    assert all(v % elem == 0 for v in layout.alignment_values())
    long_runs, devices, pools = plan.split(min_count)
    runs = long_runs + [Run(d, p, 1) for d, p in zip(devices, pools, strict=True)]
    for run in runs:
        for layer, page in enumerate(layout.page_bytes):
            h = layout.host_offset(run.pool_start, layer)
            v = run.device_start * page
            if plan.kind == "store":
                strided_copy(
                    host, h, layout.row_bytes, device[layer], v, page, run.count, page, elem
                )
            else:
                strided_copy(
                    device[layer], v, page, host, h, layout.row_bytes, run.count, page, elem
                )


@st.composite
def jobs(draw: st.DrawFn) -> tuple[str, Geometry, int, list[int], list[int], list[int], int]:
    pages = draw(st.lists(st.integers(1, 48), min_size=1, max_size=4))
    world = draw(st.integers(1, 3))
    replicated = draw(st.booleans())
    num_blocks = draw(st.integers(1, 12))
    probe = Geometry.plan(
        slot_bytes=sum(pages), world_size=world, replicated=replicated, capacity_bytes=1 << 30
    )
    geometry = Geometry.plan(
        slot_bytes=sum(pages),
        world_size=world,
        replicated=replicated,
        capacity_bytes=num_blocks * probe.row_bytes,
    )
    rank = draw(st.integers(0, world - 1))
    num_device = draw(st.integers(1, 12))
    n = draw(st.integers(0, min(num_device, num_blocks)))
    kind = draw(st.sampled_from(["store", "load"]))
    # Destinations distinct (as the checks demand); sources may repeat.
    if kind == "store":
        pool = draw(st.permutations(range(num_blocks)))[:n]
        device = draw(st.lists(st.integers(0, num_device - 1), min_size=n, max_size=n))
    else:
        device = draw(st.permutations(range(num_device)))[:n]
        pool = draw(st.lists(st.integers(0, num_blocks - 1), min_size=n, max_size=n))
    # Often make runs: sort both sides, or shift a run in.
    if draw(st.booleans()):
        device, pool = sorted(device), sorted(pool)
    min_count = draw(st.integers(1, 4))
    return kind, geometry, rank, pages, device, pool, min_count


@settings(max_examples=300, deadline=None)
@given(jobs())
def test_plan_moves_the_same_bytes_as_a_naive_copy(
    job: tuple[str, Geometry, int, list[int], list[int], list[int], int],
) -> None:
    kind, geometry, rank, pages, device_ids, pool_ids, min_count = job
    layout = SlotLayout.of(geometry, rank, pages)
    num_device = max(device_ids, default=0) + 1
    seed = bytes(range(256)) * (1 + (geometry.size_bytes + sum(pages) * num_device) // 256)
    host = bytearray(seed[: geometry.size_bytes])
    device = [bytearray(seed[7 * i : 7 * i + page * num_device]) for i, page in enumerate(pages)]
    expected_host, expected_device = bytearray(host), [bytearray(d) for d in device]

    naive_copy(kind, device_ids, pool_ids, geometry, rank, pages, expected_device, expected_host)
    plan = plan_copy(kind, device_ids, pool_ids, num_device, geometry.num_blocks)
    plan_apply(plan, layout, min_count, device, host)

    assert host == expected_host
    assert device == expected_device
    # The runs cover every pair, in job order.
    expanded = [
        (r.device_start + i, r.pool_start + i) for r in all_runs(plan) for i in range(r.count)
    ]
    assert expanded == list(zip(device_ids, pool_ids, strict=True))


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), max_size=40))
def test_runs_are_maximal(pairs: list[tuple[int, int]]) -> None:
    runs = coalesce([d for d, _ in pairs], [p for _, p in pairs])
    assert sum(r.count for r in runs) == len(pairs)
    for a, b in pairwise(runs):
        last = (a.device_start + a.count - 1, a.pool_start + a.count - 1)
        assert (b.device_start, b.pool_start) != (last[0] + 1, last[1] + 1)


# -- purity ---------------------------------------------------------------------

ALLOWED = {
    "__future__",
    "collections.abc",
    "dataclasses",
    "itertools",
    "operator",
    "typing",
    "kvd_client.errors",
    "kvd_client.geometry",
    "kvd_client.types",
}


def test_the_planner_imports_nothing_but_pure_modules() -> None:
    import kvd_client.copy_plan as module

    tree = ast.parse(Path(module.__file__ or "").read_text(encoding="utf-8"))
    imported = {
        name
        for node in ast.walk(tree)
        for name in (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom)
            else []
        )
    }
    assert imported <= ALLOWED
