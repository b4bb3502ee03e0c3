"""The CUDA backend's registration of the pool as pinned memory, against a stub CUDA runtime.

The runtime cannot run here (no GPU); the stub keeps CUDA's per-thread last
error as the runtime does: a failed call leaves it pending until
`cudaGetLastError` reads and clears it. `tests/gpu/` runs the real one
(`test_vllm_copies_cuda.py` with pieces of a few MiB). Also the cutting of
a job's stretches of adjacent pool blocks where a piece or a staging chunk
ends (plain torch on the CPU).
"""

from __future__ import annotations

import itertools
import mmap
import random
from collections.abc import Iterator

import pytest
import torch

from kvd_client.backends import cuda, host_pin
from kvd_client.errors import KvdError


class StubRuntime:
    """cudaHostRegister / cudaHostUnregister / cudaGetLastError, with the codes they return."""

    def __init__(self, register: list[int] | None = None, unregister: int = 0) -> None:
        self.register_codes = list(register or [])  # one code a call, then 0
        self.unregister_code = unregister
        self.pending = 0  # the thread's last error, as the runtime keeps it
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.calls = 0

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.calls += 1
        code = self.register_codes.pop(0) if self.register_codes else 0
        if code:
            self.pending = code
        else:
            self.registered.append((ptr, size))
        return code

    def cudaHostUnregister(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        if self.unregister_code:
            self.pending = self.unregister_code
        return self.unregister_code

    def cudaGetLastError(self) -> int:
        code, self.pending = self.pending, 0
        return code


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> Iterator[StubRuntime]:
    stub = StubRuntime()
    monkeypatch.setattr(host_pin, "cudart", lambda: stub)
    monkeypatch.setattr(host_pin, "_REFUSED", [])
    yield stub


def test_a_refused_registration_clears_the_cuda_error_and_raises(runtime: StubRuntime) -> None:
    runtime.register_codes = [1]  # cudaErrorInvalidValue
    with pytest.raises(
        KvdError, match="cudaHostRegister of the pool failed at byte 0 of 4194304: cudaError 1"
    ):
        host_pin.register(1 << 20, 4 << 20, 4096)
    assert runtime.pending == 0  # torch's next launch check finds nothing
    assert runtime.registered == []


def test_a_refusal_is_kept_for_the_process(runtime: StubRuntime) -> None:
    runtime.register_codes = [host_pin.ALREADY_REGISTERED]
    with pytest.raises(KvdError, match="already registered"):
        host_pin.register(1 << 20, 4 << 20, 4096)
    with pytest.raises(KvdError, match="refused earlier in this process"):
        host_pin.register(8 << 20, 4 << 20, 4096)
    assert runtime.calls == 1  # the driver was not asked again
    assert runtime.pending == 0


def test_a_registration_and_its_undoing(runtime: StubRuntime) -> None:
    pieces = host_pin.register(1 << 20, 4 << 20, 4096)
    host_pin.unregister(pieces)
    assert runtime.registered == [(1 << 20, 4 << 20)]  # under 64 GiB: one call
    assert runtime.unregistered == [1 << 20]
    assert runtime.pending == 0


def test_a_failed_unregistration_is_cleared_not_raised(runtime: StubRuntime) -> None:
    runtime.unregister_code = 1
    host_pin.unregister([1 << 20, 2 << 20])  # close goes on, to every piece
    assert runtime.unregistered == [2 << 20, 1 << 20]
    assert runtime.pending == 0


def test_the_pool_is_registered_in_pieces_of_whole_rows(
    runtime: StubRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As vLLM does past 64 GiB; here with a limit of 1 MiB and 256 KiB rows."""
    monkeypatch.setattr(host_pin, "MAX_REGISTER_BYTES", 1 << 20)
    base, row = 1 << 30, 256 << 10
    pieces = host_pin.register(base, 18 * row, row)
    assert runtime.registered == [(base + i * (1 << 20), 1 << 20) for i in range(4)] + [
        (base + (4 << 20), 2 * row)
    ]
    assert pieces == [base + i * (1 << 20) for i in range(5)]
    host_pin.unregister(pieces)
    assert runtime.unregistered == pieces[::-1]


@pytest.mark.parametrize("row", [256, 6144, 4096 * 3 + 256, 1 << 20])
def test_pieces_end_on_rows_and_pages_within_the_limit(
    runtime: StubRuntime, monkeypatch: pytest.MonkeyPatch, row: int
) -> None:
    """A row is a multiple of 256 bytes, not of a page: a piece ends where both
    do, so no page is in two registrations (the second would be refused)."""
    limit = 8 << 20
    monkeypatch.setattr(host_pin, "MAX_REGISTER_BYTES", limit)
    base, nbytes = 1 << 30, (3 * (limit // row) + 7) * row  # 4 pieces or more
    host_pin.register(base, nbytes, row)
    assert len(runtime.registered) >= 4
    ends = [ptr - base + size for ptr, size in runtime.registered]
    assert ends[-1] == nbytes
    assert all(end % row == 0 and end % mmap.PAGESIZE == 0 for end in ends[:-1])
    assert all(size <= limit for _, size in runtime.registered)
    assert [ptr - base for ptr, _ in runtime.registered] == [0, *ends[:-1]]


def test_a_refused_piece_undoes_the_ones_before_it(
    runtime: StubRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(host_pin, "MAX_REGISTER_BYTES", 1 << 20)
    runtime.register_codes = [0, 0, 2]  # the third piece: cudaErrorMemoryAllocation
    with pytest.raises(KvdError, match=f"at byte {2 << 20} of {5 << 20}: cudaError 2"):
        host_pin.register(1 << 30, 5 << 20, 1 << 20)
    assert runtime.unregistered == [(1 << 30) + (1 << 20), 1 << 30]
    assert runtime.pending == 0


def test_the_loaded_runtime_is_found_by_its_file_name() -> None:
    assert host_pin.loaded_library("libc") is not None  # libc.so.6, mapped in every process
    assert host_pin.loaded_library("libkvd-no-such-library") is None


def test_no_loaded_cuda_runtime_is_a_kvd_error() -> None:
    if host_pin.loaded_library("libcudart") is not None:
        pytest.skip("a CUDA runtime is loaded here")
    host_pin.cudart.cache_clear()
    with pytest.raises(KvdError, match="no CUDA runtime"):
        host_pin.cudart()


def test_stretches_are_cut_where_a_chunk_or_a_piece_ends() -> None:
    pool = torch.tensor([3, 4, 5, 6, 7, 8, 9, 10, 20, 21])
    assert cuda._chunks(pool, 4, 4) == [
        (0, [(3, 0, 1), (4, 1, 4)]),  # pool 3 | 4 5 6: a piece ends after 3
        (4, [(7, 4, 5), (8, 5, 8)]),  # a chunk ends after 6, a piece after 7
        (8, [(20, 8, 10)]),
    ]
    assert cuda._chunks(pool, 64, 1 << 20) == [(0, [(3, 0, 8), (20, 8, 10)])]


@pytest.mark.parametrize("seed", range(20))
def test_stretches_stay_in_one_chunk_and_one_piece(seed: int) -> None:
    rnd = random.Random(seed)
    n, rows, piece_rows = rnd.randint(1, 300), rnd.randint(1, 40), rnd.randint(1, 40)
    pool = torch.tensor(sorted(rnd.sample(range(4 * n), n)))
    chunks = cuda._chunks(pool, rows, piece_rows)
    assert [start for start, _ in chunks] == list(range(0, n, rows))
    stretches = [s for _, pieces in chunks for s in pieces]
    assert [a for _, a, _ in stretches] == [0] + [end for _, _, end in stretches[:-1]]
    assert stretches[-1][2] == n
    for start, pieces in chunks:
        for first, a, end in pieces:
            assert start <= a < end <= start + rows  # in its chunk
            assert pool[a:end].tolist() == list(range(first, first + end - a))
            assert first // piece_rows == (first + end - a - 1) // piece_rows  # one piece
    for (first, a, end), (nxt, b, _) in itertools.pairwise(stretches):
        # cut only where it must be: a gap, a chunk's end or a piece's end
        assert nxt != first + end - a or b % rows == 0 or nxt % piece_rows == 0
