"""The embedded default task: sort a string of digits.

A prompt is ``"<digits>="`` and the correct response is the same digits in
ascending order followed by EOS, e.g. ``"3141=" -> "1134<eos>"``. The task is
verifiable, and its response length follows the prompt length, so a batch
holds short and long rollouts: the long tail that dominates generation time
in real RL shows up here too.

Reward: 1.0 for an exact answer that ends with EOS, else 0.0. A binary reward
gives a group whose samples all fail (the hardest prompts, early on) an
advantage of exactly zero, so only groups with a mix of right and wrong
answers teach, and they teach exactly what "right" means. (A partial credit
for a right prefix was tried: it paid the policy for rambling past the answer
and, with std-normalised advantages, turned tiny reward differences on
hopeless prompts into full-size updates; greedy accuracy fell.)

Held-out split: a problem belongs to the validation split when the CRC32 of
its answer (the sorted digits) is divisible by ``holdout_every``. Training
problems (``make_batch``, the pool) are drawn only outside that split and
validation problems only inside it, so no validation problem, nor any other
problem with the same answer, is ever trained on, whatever the seeds.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

from rl_specdec.tasks.base import Sample, TaskReward

DIGITS = "0123456789"


@dataclass
class SortingTask:
    """Digit-sorting prompts and their verifier.

    ``min_len``/``max_len`` bound the number of digits in a prompt.
    """

    min_len: int = 4
    max_len: int = 8  # the default run's range; the toy policy's SFT saw 4-24 digits
    # Size of the fixed training set (0: a fresh random problem every time). Like a
    # real RL dataset, a finite pool is seen for several epochs; validation uses
    # make_batch with its own seed outside the pool (see ``pool_seed``).
    dataset_size: int = 0
    pool_seed: int = 12345
    holdout_every: int = 8  # 1 answer in holdout_every is reserved for validation (see module doc)

    def sample_problem(self, rng: random.Random, length: int | None = None) -> Sample:
        n = rng.randint(self.min_len, self.max_len) if length is None else length
        digits = "".join(rng.choice(DIGITS) for _ in range(n))
        return Sample(prompt=digits + "=", answer="".join(sorted(digits)))

    def is_held_out(self, sample: Sample) -> bool:
        """Whether ``sample`` is in the validation split (never trained on)."""
        return zlib.crc32(sample.answer.encode()) % self.holdout_every == 0

    def make_batch(self, seed: int, n: int) -> list[Sample]:
        """n training problems for this seed, deterministically, none from the validation split.

        With ``dataset_size`` > 0 they are drawn (without replacement) from the
        fixed training pool; otherwise they are fresh problems whose lengths are
        spread evenly over [min_len, max_len] (in random order). Stratifying the
        lengths gives every batch the same difficulty mix, so the per-step
        reward tracks the policy rather than the luck of the draw.
        """
        if self.dataset_size:
            pool = self.pool()
            return random.Random(seed).sample(pool, min(n, len(pool)))
        return self._fresh(seed, n, held_out=False)

    def pool(self) -> list[Sample]:
        """The fixed training set (stratified lengths, from ``pool_seed``)."""
        if getattr(self, "_pool", None) is None:
            self._pool = self._fresh(self.pool_seed, self.dataset_size, held_out=False)
        return self._pool

    def validation_batch(self, seed: int, n: int) -> list[Sample]:
        """n problems from the validation split: how well the skill generalises to unseen problems."""
        return self._fresh(seed, n, held_out=True)

    def _fresh(self, seed: int, n: int, held_out: bool) -> list[Sample]:
        if self.holdout_every < 2:
            raise ValueError(
                f"holdout_every={self.holdout_every} must be >= 2 (1 in holdout_every answers is held out)"
            )
        rng = random.Random(seed)
        span = self.max_len - self.min_len + 1
        lengths = [self.min_len + (i * span) // n for i in range(n)]
        rng.shuffle(lengths)
        return [self.draw(rng, k, held_out) for k in lengths]

    def draw(
        self, rng: random.Random, length: int | None = None, held_out: bool = False, max_tries: int = 10_000
    ) -> Sample:
        """A random problem (of this length, else of a random one) from the training or the validation split."""
        length = rng.randint(self.min_len, self.max_len) if length is None else length
        for _ in range(max_tries):
            s = self.sample_problem(rng, length)
            if self.is_held_out(s) == held_out:
                return s
        split = "validation" if held_out else "training"
        raise ValueError(
            f"no {split} problem of length {length} found in {max_tries} draws; use longer strings (min_len) or "
            "change holdout_every"
        )

    def score(self, response: str, answer: str, finished: bool) -> TaskReward:
        """Score one decoded response (EOS stripped) against the answer."""
        correct = finished and response == answer
        return TaskReward(reward=float(correct), correct=correct)
