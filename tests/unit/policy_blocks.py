"""Runs in the test process: a stand-in for the index's read-only slot callbacks."""

from __future__ import annotations


class Blocks:
    """Stand-in for the index's read-only callbacks on slots, with a call counter."""

    def __init__(self) -> None:
        self.not_ready: set[int] = set()
        self.pinned: set[int] = set()
        self.num_checks = 0

    def is_ready(self, slot: int) -> bool:
        return slot not in self.not_ready

    def is_evictable(self, slot: int) -> bool:
        self.num_checks += 1
        return slot not in self.not_ready and slot not in self.pinned
