"""Runs in the test process: a stand-in for `kvd bench peers`' engine process.

It answers each request as the harness's engine does and records what it was
asked: the order of requests is what the peers unit tests check, not vLLM (the
peers quick test, tests/integration/test_bench_quick.py, runs the same code on
real engines).
"""

from __future__ import annotations

from typing import Any


class Recorder:
    """Each request's TTFT is its position in milliseconds (1, 2, ...), so a test
    can tell which requests a figure was taken from."""

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        self.config = config or {}
        self.prompts: list[list[int]] = []
        self.pinned: set[int] | None = None

    def ask(self, cmd: dict[str, Any], timeout: float = 600) -> Any:
        if cmd.get("metrics"):
            return {"metrics": {}}
        (prompt,) = cmd["prompts"]
        self.prompts.append(prompt)
        n = cmd["max_tokens"]
        ttft = len(self.prompts) / 1000
        return {"tokens": [[1] * n], "timings": [[ttft, 0.005 if n > 1 else None, 0.0, ttft]],
                "seconds": 0.02, "logprobs": [[[[1, -0.1]]] * n]}  # fmt: skip

    def reset_prefix_cache(self) -> None:
        return None

    def pin(self, cpus: set[int]) -> int:
        self.pinned = cpus
        return 1
