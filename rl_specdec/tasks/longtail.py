"""The long-tail task: sort digits after a countdown whose length the policy samples.

Reasoning RL has rollouts many times longer than the median one: the step
waits for them while a few requests run at a small batch, which is where
speculation pays. This task has that shape on the char-level toy. The
response is a countdown, then the answer::

    "3141=" -> "<6><5><4><3><2><1><0>|1134<eos>"

The first token ``<N>`` is a *budget* that the policy samples: its SFT data
draws N per example from a truncated Pareto law (tail index ~1, minimum 8,
capped at :data:`BUDGET_MAX`), so each rollout draws its own length as a
reasoning trace does, and the 8 samples of one prompt differ. Each number
token is followed by the next lower one down to ``<0>``, then ``|`` and the
sorted digits: the countdown is deterministic, so a distilled drafter
predicts it almost always (high acceptance in the tail).

Reward: 1.0 when the response is a well-formed countdown from its budget to
``<0>``, then ``|``, then the exact answer, ending with EOS; else 0.0. The
validation split and the training draws are :class:`SortingTask`'s.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from rl_specdec.tasks.base import TaskReward
from rl_specdec.tasks.sorting import SortingTask

BUDGET_MIN = 8  # the Pareto law's minimum budget
BUDGET_MAX = 400  # the cap: at most BUDGET_MAX + 1 countdown tokens
TAIL_INDEX = 1.0  # Pareto alpha: P(N > x) = (BUDGET_MIN / x) ** alpha
_RESPONSE = re.compile(r"^((?:<\d+>)+)\|(\d*)$")


def number_token(n: int) -> str:
    return f"<{n}>"


def draw_budget(rng: random.Random) -> int:
    """A countdown budget N from the truncated Pareto law (median ~16, 1 in 50 at the cap)."""
    u = 1.0 - rng.random()  # (0, 1]
    return min(int(BUDGET_MIN / u ** (1.0 / TAIL_INDEX)), BUDGET_MAX)


def countdown(n: int) -> str:
    """``<n><n-1>...<0>``"""
    return "".join(number_token(i) for i in range(n, -1, -1))


def reference_response(answer: str, n: int) -> str:
    """The response the SFT teaches for budget n (EOS not included)."""
    return countdown(n) + "|" + answer


@dataclass
class LongTailSortTask(SortingTask):
    """Digit sorting with a sampled-length countdown before the answer (prompts and splits as :class:`SortingTask`)."""

    min_len: int = 4
    max_len: int = 8

    def score(self, response: str, answer: str, finished: bool) -> TaskReward:
        m = _RESPONSE.match(response)
        ok = finished and m is not None and m.group(2) == answer
        if ok:
            numbers = [int(x) for x in re.findall(r"<(\d+)>", m.group(1))]
            ok = numbers == list(range(numbers[0], -1, -1))
        return TaskReward(reward=float(ok), correct=ok)
