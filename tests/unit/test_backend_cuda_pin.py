"""The CUDA backend's registration of the pool as pinned memory, against a stub CUDA runtime.

The runtime cannot run here (no GPU); the stub keeps CUDA's per-thread last
error as the runtime does: a failed call leaves it pending until
`cudaGetLastError` reads and clears it. `tests/gpu/` runs the real one.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvd_client.backends import cuda
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
    monkeypatch.setattr(cuda, "_cudart", lambda: stub)
    monkeypatch.setattr(cuda, "_REFUSED", [])
    yield stub


def test_a_refused_registration_clears_the_cuda_error_and_raises(runtime: StubRuntime) -> None:
    runtime.register_codes = [1]  # cudaErrorInvalidValue
    with pytest.raises(KvdError, match="cudaHostRegister of the pool failed: cudaError 1"):
        cuda._register(1 << 20, 4 << 20)
    assert runtime.pending == 0  # torch's next launch check finds nothing
    assert runtime.registered == []


def test_a_refusal_is_kept_for_the_process(runtime: StubRuntime) -> None:
    runtime.register_codes = [cuda._ALREADY_REGISTERED]
    with pytest.raises(KvdError, match="already registered"):
        cuda._register(1 << 20, 4 << 20)
    with pytest.raises(KvdError, match="refused earlier in this process"):
        cuda._register(8 << 20, 4 << 20)
    assert runtime.calls == 1  # the driver was not asked again
    assert runtime.pending == 0


def test_a_registration_and_its_undoing(runtime: StubRuntime) -> None:
    cuda._register(1 << 20, 4 << 20)
    cuda._unregister(1 << 20)
    assert runtime.registered == [(1 << 20, 4 << 20)]
    assert runtime.unregistered == [1 << 20]
    assert runtime.pending == 0


def test_a_failed_unregistration_is_cleared_not_raised(runtime: StubRuntime) -> None:
    runtime.unregister_code = 1
    cuda._unregister(1 << 20)  # close goes on
    assert runtime.pending == 0


def test_the_loaded_runtime_is_found_by_its_file_name() -> None:
    assert cuda._loaded_library("libc") is not None  # libc.so.6, mapped in every process
    assert cuda._loaded_library("libkvd-no-such-library") is None


def test_no_loaded_cuda_runtime_is_a_kvd_error() -> None:
    if cuda._loaded_library("libcudart") is not None:
        pytest.skip("a CUDA runtime is loaded here")
    cuda._cudart.cache_clear()
    with pytest.raises(KvdError, match="no CUDA runtime"):
        cuda._cudart()
