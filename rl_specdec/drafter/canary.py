"""The acceptance canary: a drafter that was wiped or corrupted never goes unnoticed.

A drafter that stops predicting the policy costs speed, never correctness,
so nothing else would notice: the run just gets slower. The canary watches
the acceptance rate of each generation step that follows a refit. When it
falls below ``min_ratio`` times the running median of the last ``window``
healthy steps, it trips: the step logs ``spec_decode/canary = 1`` and the
loop warns with the likely causes, turns speculation off, or stops
(``policy.generation.acceptance_canary.action``: warn | disable | fail).
Tripped steps do not enter the median, so one collapse does not teach the
canary that collapse is normal. A rate is judged only over at least
``min_drafts`` draft tokens: a step that drafted fewer (run-time k drafts
only in a step's tail, sometimes 2 tokens) is pooled with the next ones, so
two rejected tokens are not taken for a collapse.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

LIKELY_CAUSES = (
    "the drafter was refit with wrong or untrained weights (drafter_training, a checkpoint from another run); "
    "a target refit overwrote weights that the drafter shares with the target (EAGLE/MTP heads); "
    "the drafter no longer matches the policy's tokenizer or chat format; "
    "the policy moved far from a frozen drafter (enable policy.generation.drafter_training)"
)


@dataclass
class AcceptanceCanary:
    min_ratio: float = 0.5
    window: int = 20
    min_history: int = 3  # healthy steps needed before it can trip
    min_drafts: int = 32  # draft tokens a judged rate is taken over (steps with fewer are pooled)
    history: deque = field(default_factory=deque)
    pooled: list[float] = field(default_factory=lambda: [0.0, 0.0])  # accepted, drafted: not judged yet

    def observe_counts(self, accepted: float, drafted: float) -> tuple[float, bool] | None:
        """Add a step's accepted and drafted tokens; once ``min_drafts`` are pooled, judge their rate:
        ``(rate, tripped)``. None while fewer are pooled."""
        self.pooled[0] += accepted
        self.pooled[1] += drafted
        if self.pooled[1] < self.min_drafts:
            return None
        rate = self.pooled[0] / self.pooled[1]
        self.pooled = [0.0, 0.0]
        return rate, self.observe(rate)

    def observe(self, acceptance_rate: float) -> bool:
        """Record one step's acceptance rate; True if it collapsed (the canary trips)."""
        if len(self.history) >= self.min_history and acceptance_rate < self.min_ratio * statistics.median(self.history):
            return True
        self.history.append(acceptance_rate)
        while len(self.history) > self.window:
            self.history.popleft()
        return False

    def message(self, acceptance_rate: float) -> str:
        return (
            f"spec_decode canary: the acceptance rate fell to {acceptance_rate:.3f}, below {self.min_ratio:g} x its "
            f"running median {statistics.median(self.history):.3f}, right after a refit. Likely causes: "
            f"{LIKELY_CAUSES}."
        )
