"""Runs in the demo's scheduler process: deterministic prompts, as token ids from a seeded RNG.

Multi-turn chat, the pattern prefix caching is for: each turn's prompt is the
conversation so far (system prompt, earlier user turns and replies) plus the
new user turn, and conversations share system prompts:

    conversation A:  [system 0][user 1] -> [system 0][user 1][reply 1][user 2] -> ...
    conversation B:  [system 0][user 1] -> ...     (shares system 0 with A)
    conversation C:  [system 1][user 1] -> ...

Replies are scripted (drawn from the RNG, like a replayed trace), so every
run sends the same prompts whatever the model generates.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Turn:
    conversation: str
    turn: int  # 1-based
    prompt: list[int]

    @property
    def name(self) -> str:
        return f"{self.conversation}{self.turn}"


@dataclass(frozen=True, slots=True)
class Shape:
    """Token counts: system prompts, and (low, high) ranges for user turns and replies."""

    system: tuple[int, ...]
    user: tuple[int, int]
    reply: tuple[int, int]


FULL = Shape(system=(1536, 1024), user=(64, 256), reply=(128, 384))
QUICK = Shape(system=(96, 64), user=(16, 40), reply=(16, 48))

# Which system prompt each conversation uses, and the order turns arrive in.
_SYSTEM_OF = {"A": 0, "B": 0, "C": 1}
BEFORE_RESTART = ("A1", "B1", "A2", "C1", "B2", "A3", "C2")
AFTER_RESTART = ("A4", "C3")


class Conversations:
    """Generates each conversation's turns on demand, all from one seed."""

    def __init__(self, shape: Shape, vocab: int, seed: int = 7) -> None:
        self.shape = shape
        self.vocab = vocab
        self._rng = random.Random(seed)
        self._system = [self._tokens(n) for n in shape.system]
        self._history: dict[str, list[int]] = {}
        self._turns: dict[str, int] = {}

    def _tokens(self, n: int) -> list[int]:
        return [self._rng.randrange(self.vocab) for _ in range(n)]

    def next_turn(self, conversation: str) -> Turn:
        """The conversation's next prompt; its scripted reply joins the history."""
        history = self._history.setdefault(
            conversation, list(self._system[_SYSTEM_OF[conversation]])
        )
        prompt = history + self._tokens(self._rng.randint(*self.shape.user))
        turn = self._turns.get(conversation, 0) + 1
        self._turns[conversation] = turn
        self._history[conversation] = prompt + self._tokens(self._rng.randint(*self.shape.reply))
        return Turn(conversation, turn, prompt)


def chat_workload(quick: bool, vocab: int, seed: int = 7) -> tuple[list[Turn], list[Turn]]:
    """The demo's turns before and after the engine restart, in arrival order."""
    convs = Conversations(QUICK if quick else FULL, vocab, seed)
    before = [convs.next_turn(name[0]) for name in BEFORE_RESTART]
    after = [convs.next_turn(name[0]) for name in AFTER_RESTART]
    return before, after


def random_prompts(num: int, num_tokens: int, vocab: int, seed: int) -> list[list[int]]:
    """`num` unrelated prompts of `num_tokens` tokens (the benchmarks' fixed batch)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(num_tokens)] for _ in range(num)]
