"""What the adaptive controller learns from each engine step: the step's cost and the drafts' acceptance.

:class:`CostModel` fits a step's wall time as a linear function of its
:func:`features` (ridge least squares on relative errors, each kind of step
forgetting over its own last ``memory`` steps); :class:`AcceptanceModel`
keeps P_i, the chance that the first i drafts are all accepted and kept, and
E[L(k)] = 1 + P_1 + ... + P_k. See :mod:`.controller` for how they are used.
"""

from __future__ import annotations

import math

import numpy as np

READY_K0_STEPS, READY_K_STEPS = 3.0, 2.0  # steady steps at k=0, and at each of two k>0, before the model fits


def features(b: float, ctx: float, kv: float, kn: float, pre: float = 0.0) -> np.ndarray:
    """The cost model's features of a step: b requests, ctx context tokens, kv drafts verified and kn
    drafted per request, pre prompt tokens prefilled beyond one per request (the target's, and the
    drafter's too when it drafts)."""
    B, C, P = b / 64.0, ctx / 16384.0, pre / 1024.0
    sv, sn = float(kv > 0), float(kn > 0)
    return np.array([1.0, B, C, P, sv, sv * B, kv * B, kv * C, sn, sn * B, sn * P, kn, kn * B, kn * C])


class CostModel:
    """Step wall time, linear in :func:`features`, by ridge least squares on relative errors, with forgetting.

    Each kind of step, (k verified, k drafted), keeps its own statistics and
    forgets only as new steps of its kind arrive (horizon ``memory`` steps), so
    the rarely explored k keep their last measurements while the common k
    stay fresh.
    """

    def __init__(self, memory: int):
        self.n = len(features(1, 1, 1, 1))
        self.decay = 1.0 - 1.0 / max(memory, 2)
        self.stats: dict[tuple[int, int], list] = {}  # (k verified, k drafted) -> [A, y, weight]
        self.theta = None

    def observe(self, x: np.ndarray, t: float, k_next: int, k_verify: float) -> None:
        st = self.stats.setdefault((round(k_verify), int(k_next)), [np.zeros((self.n, self.n)), np.zeros(self.n), 0.0])
        w2 = 1.0 / max(t, 1e-6) ** 2  # relative errors: a 1 ms step weighs as much as a 100 ms one
        st[0] *= self.decay
        st[1] *= self.decay
        st[0] += w2 * np.outer(x, x)
        st[1] += w2 * x * t
        st[2] = st[2] * self.decay + 1.0

    def seen(self, k: int) -> float:
        """Steady steps seen at k (decayed)."""
        st = self.stats.get((k, k))
        return st[2] if st else 0.0

    def ready(self, cap: int) -> bool:
        distinct = sum(1 for k in range(1, cap + 1) if self.seen(k) >= READY_K_STEPS)
        return self.seen(0) >= READY_K0_STEPS and distinct >= min(2, cap)

    def fit(self) -> None:
        A = sum(st[0] for st in self.stats.values())
        y = sum(st[1] for st in self.stats.values())
        ridge = 1e-4 * max(np.trace(A) / self.n, 1e-12)
        self.theta = np.linalg.solve(A + ridge * np.eye(self.n), y)

    def predict(self, x: np.ndarray) -> float | None:
        return None if self.theta is None else float(self.theta @ x)


class AcceptanceModel:
    """P_i = P(the first i drafts are all accepted), i = 1..k_max, with forgetting over ``memory`` drafts."""

    def __init__(self, k_max: int, memory: int, prior: float = 0.7, prior_weight: float = 20.0):
        self.memory = float(max(memory, 1))
        self.drafted = [prior_weight] * k_max
        self.accepted = [prior_weight * prior ** (i + 1) for i in range(k_max)]
        self._lengths: list[float] | None = None

    def observe(self, drafted_pp: list[int], accepted_pp: list[int]) -> None:
        self._lengths = None
        keep = math.exp(-drafted_pp[0] / self.memory) if drafted_pp else 1.0
        for i in range(len(self.drafted)):
            self.drafted[i] *= keep
            self.accepted[i] *= keep
            if i < len(drafted_pp):
                self.drafted[i] += drafted_pp[i]
                self.accepted[i] += accepted_pp[i]

    def probs(self) -> list[float]:
        out, last = [], 1.0
        for d, a in zip(self.drafted, self.accepted):
            last = min(last, a / d if d > 0 else 0.0)  # P_i can only fall with i
            out.append(last)
        return out

    def expected_length(self, k: int) -> float:
        """E[L(k)]: tokens a request emits per step when it drafts k."""
        if self._lengths is None:
            self._lengths = [1.0]
            for p in self.probs():
                self._lengths.append(self._lengths[-1] + p)
        return self._lengths[min(k, len(self._lengths) - 1)]
