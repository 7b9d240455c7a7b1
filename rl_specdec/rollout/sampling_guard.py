"""Start-up guard: are the sampled tokens distributed as the policy says?

A correct sampler at temperature 1 emits a token of rank r (by the policy's
probability at that position) with probability p_r. So over many positions,
the count of emitted rank-r tokens should be close to the sum of p_r. vLLM
returns the sampled token's log-prob and the top-K log-probs of the *target*
model at each position, speculation or not, so the check needs no second
engine, no reference model and works at any vocabulary size:

    bins: rank 1, rank 2, ..., rank K, "outside the top K"
    observed_b = #positions whose emitted token fell in bin b
    expected_b = sum over positions of the policy's probability of bin b
    Pearson chi^2 on (observed, expected), K degrees of freedom

A sampler that favours drafted tokens (greedy drafts accepted too often),
or emits garbage on rejection (the CPU expand bug), moves mass between bins
and fails with a tiny p-value; a correct one passes. Bins with an expected
count below 5 are merged into their neighbour, as usual for chi-square.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class CalibrationReport:
    observed: list[float]
    expected: list[float]
    chi2: float
    dof: int
    p_value: float
    num_tokens: int

    def summary(self) -> str:
        obs = ", ".join(f"{o:.0f}" for o in self.observed)
        exp = ", ".join(f"{e:.1f}" for e in self.expected)
        return (
            f"{self.num_tokens} tokens; observed by rank bin [{obs}] vs expected [{exp}]; "
            f"chi2={self.chi2:.1f}, dof={self.dof}, p={self.p_value:.3g}"
        )


def chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for X ~ chi^2(dof), via the regularized upper incomplete gamma."""
    if dof <= 0:
        return 1.0
    return float(
        torch.special.gammaincc(
            torch.tensor(dof / 2.0, dtype=torch.float64), torch.tensor(x / 2.0, dtype=torch.float64)
        )
    )


def _merge_small(obs: list[float], exp: list[float], min_expected: float = 5.0):
    o, e = list(obs), list(exp)
    i = 0
    while i < len(e) and len(e) > 1:
        if e[i] < min_expected:
            j = i - 1 if i > 0 else i + 1
            e[j] += e[i]
            o[j] += o[i]
            del e[i], o[i]
            i = max(i - 1, 0)
        else:
            i += 1
    return o, e


def calibration_report(
    token_ids: list[list[int]], top_logprobs: list[list[dict[int, float]]] | None, top_k: int
) -> CalibrationReport:
    """Compare emitted ranks with the policy's own rank probabilities.

    ``token_ids`` and ``top_logprobs`` as in ``GenerationOutput``, from a call made
    with ``logprobs=top_k``.
    """
    if top_logprobs is None:
        raise ValueError("calibration_report needs a generation made with logprobs=top_k > 0")
    observed = [0.0] * (top_k + 1)
    expected = [0.0] * (top_k + 1)
    n = 0
    for ids, steps in zip(token_ids, top_logprobs):
        for tok, step in zip(ids, steps):
            # vLLM adds the sampled token to the top-K dict when it is outside the top K.
            ranked = sorted(step.items(), key=lambda kv: -kv[1])[:top_k]
            probs = [math.exp(lp) for _, lp in ranked]
            for r, p in enumerate(probs):
                expected[r] += p
            expected[top_k] += max(0.0, 1.0 - sum(probs))
            rank = next((r for r, (t, _) in enumerate(ranked) if t == tok), top_k)
            observed[rank] += 1
            n += 1
    o, e = _merge_small(observed, expected)
    chi2 = sum((oi - ei) ** 2 / ei for oi, ei in zip(o, e) if ei > 0)
    dof = len(e) - 1
    return CalibrationReport(o, e, chi2, dof, chi2_sf(chi2, dof), n)
