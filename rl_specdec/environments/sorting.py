"""The embedded default task: sort a string of digits.

A prompt is ``"<digits>="`` and the correct response is the same digits in
ascending order followed by EOS, e.g. ``"3141=" -> "1134<eos>"``. The task is
verifiable, and its response length follows the prompt length, so a batch
holds short and long rollouts: the long tail that dominates generation time
in real RL shows up here too.

Reward (in [0, 1]): 1.0 for an exact answer, otherwise half the fraction of
the answer's leading characters that are right, so partial progress gives a
learning signal. ``accuracy`` counts exact answers only.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from rl_specdec.environments.base import Sample, TaskReward

DIGITS = "0123456789"


@dataclass
class SortingTask:
    """Digit-sorting prompts and their verifier.

    ``min_len``/``max_len`` bound the number of digits in a prompt.
    """

    min_len: int = 4
    max_len: int = 24

    def sample_problem(self, rng: random.Random) -> Sample:
        n = rng.randint(self.min_len, self.max_len)
        digits = "".join(rng.choice(DIGITS) for _ in range(n))
        return Sample(prompt=digits + "=", answer="".join(sorted(digits)))

    def make_batch(self, seed: int, n: int) -> list[Sample]:
        rng = random.Random(seed)
        return [self.sample_problem(rng) for _ in range(n)]

    def score(self, response: str, answer: str, finished: bool) -> TaskReward:
        """Score one decoded response (EOS stripped) against the answer."""
        if finished and response == answer:
            return TaskReward(reward=1.0, correct=True)
        prefix = 0
        for got, want in zip(response, answer):
            if got != want:
                break
            prefix += 1
        return TaskReward(reward=0.5 * prefix / max(len(answer), 1), correct=False)
