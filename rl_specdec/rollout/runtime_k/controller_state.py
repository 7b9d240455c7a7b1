"""The adaptive controller's records: what it measured per (bucket, k), and the burst it runs.

Plain data for :mod:`.controller`: one :class:`Cell` per (bucket, k) holds decayed sums over that bucket's
steps at that k; a :class:`Burst` runs one k for a few steps to measure it.
"""

from __future__ import annotations

from dataclasses import dataclass

MEASURED_DECAY = 0.95  # per step counted for a (bucket, k): direct measurements forget over ~20 steps


@dataclass
class Cell:
    """Decayed sums over one bucket's steps at one k; each sum forgets by ``MEASURED_DECAY`` per step counted."""

    emitted: float = 0.0  # tokens the requests kept
    seconds: float = 0.0  # wall time
    steps: float = 0.0  # steps counted
    request_steps: float = 0.0  # running requests, summed over the steps (a rate's weight: see the controller)
    expected_length: float = 0.0  # E[L(k)] when each step was counted, summed over the steps

    def add(self, emitted: float, seconds: float, requests: float, expected_length: float) -> None:
        """Count one step of ``requests`` running requests: every sum forgets, then takes the step's share."""
        self.emitted = self.emitted * MEASURED_DECAY + emitted
        self.seconds = self.seconds * MEASURED_DECAY + seconds
        self.steps = self.steps * MEASURED_DECAY + 1.0
        self.request_steps = self.request_steps * MEASURED_DECAY + requests
        self.expected_length = self.expected_length * MEASURED_DECAY + expected_length


@dataclass
class Burst:
    """A run of one k for a few steps, in one bucket or (the warm-up) in every bucket."""

    bucket: int | None  # the bucket's index; None: every bucket
    k: int  # the k it runs
    steps_left: int  # steps it still runs, counting the one starting now

    def covers(self, j: int) -> bool:
        """Whether it runs its k in bucket j."""
        return self.bucket is None or self.bucket == j
