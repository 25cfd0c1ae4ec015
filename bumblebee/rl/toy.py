"""Built-in verifiable tasks for the embedded GRPO run (``bumblebee rl``).

Byte-level, so the tiny presets' vocabulary (bytes + a few spare ids) covers them,
and checkable by a few lines of Python, so the reward is exact (a "verifiable
reward", as in RL on maths problems):

- ``add``: ``"47+385="`` -> ``"432\\n"`` (operands of 1..``digits`` digits);
- ``reverse``: ``"cabd>"`` -> ``"dbac\\n"`` (1..``digits`` + 1 letters from a..e).

The reward is 1 for the exact answer followed by the end token ``"\\n"``; otherwise
``partial`` (default 0) times the fraction of answer characters right in place, a
denser signal for very small budgets. Problems are drawn from an explicit
``torch.Generator``, so a seed fixes the whole run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bumblebee.rl.batch import RLBatch, pack_sequences

EOS = ord("\n")


def encode(text: str) -> list[int]:
    return list(text.encode())


def decode(tokens: list[int]) -> str:
    return bytes(t for t in tokens if t < 256).decode(errors="replace")


@dataclass(frozen=True)
class Problem:
    prompt: list[int]
    answer: list[int]  # target completion, ending with EOS


class Task:
    name = ""

    def __init__(self, digits: int, partial: float = 0.0):
        if digits < 1:
            raise ValueError(f"digits must be >= 1, got {digits}")
        self.digits, self.partial = digits, partial

    def make(self, g: torch.Generator) -> tuple[str, str]:
        raise NotImplementedError

    def sample(self, n: int, g: torch.Generator) -> list[Problem]:
        out = []
        for _ in range(n):
            prompt, answer = self.make(g)
            out.append(Problem(encode(prompt), encode(answer) + [EOS]))
        return out

    def reward(self, problem: Problem, completion: list[int]) -> float:
        if completion == problem.answer:
            return 1.0
        if not self.partial:
            return 0.0
        right = sum(a == b for a, b in zip(completion, problem.answer))
        return self.partial * right / max(len(problem.answer), len(completion))


def _randint(lo: int, hi: int, g: torch.Generator) -> int:
    return int(torch.randint(lo, hi, (1,), generator=g))


class Addition(Task):
    name = "add"
    max_digits = 18  # operands are drawn as int64

    @staticmethod
    def longest(digits: int) -> tuple[int, int]:
        """(prompt, answer with its end token) lengths of the longest problem."""
        return 2 * digits + 2, digits + 2

    def make(self, g):
        a, b = (_randint(0, 10 ** _randint(1, self.digits + 1, g), g) for _ in range(2))
        return f"{a}+{b}=", str(a + b)


class Reverse(Task):
    name = "reverse"
    max_digits = 10_000

    @staticmethod
    def longest(digits: int) -> tuple[int, int]:
        return digits + 2, digits + 2

    def make(self, g):
        n = _randint(1, self.digits + 2, g)
        s = "".join("abcde"[_randint(0, 5, g)] for _ in range(n))
        return f"{s}>", s[::-1]


TASKS = {t.name: t for t in (Addition, Reverse)}


def make_task(name: str, digits: int, partial: float = 0.0) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid: {', '.join(TASKS)}")
    return TASKS[name](digits, partial)


def supervised_batch(problems: list[Problem], seq_len: int) -> RLBatch:
    """Prompt + answer per problem, trained on the answer (the warm-up before RL)."""
    tokens = [p.prompt + p.answer for p in problems]
    masks = [[False] * len(p.prompt) + [True] * len(p.answer) for p in problems]
    return pack_sequences(tokens, masks, seq_len)


def rollout_batch(
    prompts: list[list[int]], completions: list[list[int]], seq_len: int, **per_sequence
) -> RLBatch:
    """Prompt + completion per rollout, trained on the completion."""
    tokens = [p + c for p, c in zip(prompts, completions)]
    masks = [[False] * len(p) + [True] * len(c) for p, c in zip(prompts, completions)]
    return pack_sequences(tokens, masks, seq_len, **per_sequence)
