"""Model pairs with their acceptance, and the rollout lengths of a GRPO generation phase.

**Acceptance.** Per draft position i the conditional acceptance is
``alpha_i = alpha_1 * decay**(i-1)`` (the chance draft i is accepted once drafts
1..i-1 were), so P_i = alpha_1 ... alpha_i and E[L(k)] = 1 + P_1 + ... + P_k.
Each pair states where alpha_1 and the decay come from. Within a step each
draft slot's own acceptance probability is spread as Beta(kappa alpha_i,
kappa (1 - alpha_i)) around it (kappa = 2), which leaves these means unchanged
and is what a per-request confidence (vLLM's adaptive verification) can see.

**Lengths.** A lognormal with a reasoning-RL tail, capped at max_new_tokens
(a capped rollout is truncated at the cap, as RL does), or the lengths of a
real run rebuilt from its metrics.jsonl (:func:`lengths_from_metrics`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

from benchmarks.whatif import models as M

KAPPA = 2.0  # Beta concentration of the per-slot acceptance (assumption: an informative confidence)


@dataclass(frozen=True)
class Pair:
    key: str
    target: M.ModelConfig
    drafter: M.ModelConfig
    method: str  # draft_model | eagle3 | mtp
    alpha1: float
    decay: float
    acceptance_source: str
    catch_up: bool  # k=0 through rl_specdec's fast path, the drafter caught up later (draft_model only)
    tp: int | None = None  # tensor parallel; None: the smallest that fits (costmodel.choose_tp)

    def alphas(self, k: int) -> np.ndarray:
        return np.clip(self.alpha1 * self.decay ** np.arange(k), 0.0, 1.0)

    def probs(self, k: int) -> np.ndarray:
        """P_i, i = 1..k: the first i drafts all accepted."""
        return np.cumprod(self.alphas(k))

    def expected_length(self, k: int) -> float:
        return 1.0 + float(self.probs(k).sum())

    def pmf(self, k: int) -> np.ndarray:
        """P(accepted drafts = j), j = 0..k."""
        p = np.concatenate(([1.0], self.probs(k)))
        out = p.copy()
        out[:-1] -= p[1:]
        return out


NEMO = "NeMo-RL study (arXiv 2604.26779): EAGLE-3 on Qwen3-8B, k=3, acceptance length 2.05 and 2.47 in two RL workloads"
PAIRS = {
    "8B+0.6B": Pair(
        "8B+0.6B",
        M.QWEN3_8B,
        M.QWEN3_06B,
        "draft_model",
        0.70,
        0.97,
        "assumption: alpha_1 0.70, flat-ish (decay 0.97) as a full drafter keeps its own context; E[L(4)] = 2.69, "
        "below the 2.75-3.02 a public greedy k=4 benchmark of this pair reports, as temperature 1 accepts less",
        catch_up=True,
    ),
    "8B+EAGLE3": Pair(
        "8B+EAGLE3",
        M.QWEN3_8B,
        M.EAGLE3_8B,
        "eagle3",
        0.65,
        0.93,
        f"fitted to the {NEMO}: alpha_1 0.65, decay 0.93 give E[L(3)] = 2.26, their midpoint",
        catch_up=False,
    ),
    "8B+MTP": Pair(
        "8B+MTP",
        M.QWEN3_8B,
        M.MTP_8B,
        "mtp",
        0.85,
        0.90,
        "alpha_1 0.85: DeepSeek-V3 report's 85-90% acceptance of the MTP token; decay 0.90 for reusing one layer "
        "(assumption); E[L(4)] = 3.23 against SkyRL's 3.32",
        catch_up=False,
    ),
    "32B+1.7B": Pair(
        "32B+1.7B",
        M.QWEN3_32B,
        M.QWEN3_17B,
        "draft_model",
        0.72,
        0.97,
        "assumption: as 8B+0.6B, a little higher for the larger drafter",
        catch_up=True,
    ),
}
GPU_PAIRS = tuple(PAIRS)


def toy_pair(key: str, target: M.ModelConfig, drafter: M.ModelConfig, alpha1: float = 0.8, decay: float = 1.0) -> Pair:
    """A CPU toy pair (draft_model with rl_specdec's fast path); acceptance from its run (alpha_1, decay)."""
    return Pair(
        key, target, drafter, "draft_model", alpha1, decay, "from the run's measured acceptance length", True, tp=1
    )


TOY_PAIRS = {
    "toy": toy_pair("toy", M.TOY_POLICY, M.TOY_DRAFTER),
    "longtail": toy_pair("longtail", M.TOY_LT_POLICY, M.TOY_LT_DRAFTER),
    "wide": toy_pair("wide", M.TOY_WIDE_POLICY, M.TOY_WIDE_DRAFTER),
}


def alpha_for_length(length: float, k: int, decay: float = 1.0) -> float:
    """alpha_1 whose E[L(k)] is ``length`` (bisection), for a measured acceptance length at k."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        e = 1.0 + sum(np.cumprod(mid * decay ** np.arange(k)))
        lo, hi = (mid, hi) if e < length else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class LengthDist:
    """Lognormal response lengths, capped at ``cap`` (max_new_tokens).

    Default: median 1,000 tokens, sigma 1.0, cap 8,192. sigma 1.0 puts the 99th
    percentile at ~10x the median, the ratio a typical reasoning-RL run shows
    (median ~500, p99 ~5,000: jiahuanglin.xyz RL lesson 22b, 'long-tail
    rollouts'); our long-tail toy measured its longest rollout at 12.7x the
    median (docs/lab/run_time_k.md, "The long-tail workload"). The median and the cap are
    illustrative choices for an 8B reasoning run (2% of rollouts hit the cap):
    replace them (--length-median, --length-sigma, --max-new-tokens) or use a
    run's own lengths (--lengths-from metrics.jsonl).
    """

    median: float = 1000.0
    sigma: float = 1.0
    cap: int = 8192

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        x = rng.lognormal(math.log(self.median), self.sigma, size=n)
        return np.clip(np.rint(x), 1, self.cap).astype(np.int64)


@dataclass(frozen=True)
class Workload:
    lengths: np.ndarray  # response tokens per sequence (one engine's share of a GRPO step), in submission order
    prompt_len: int
    max_seqs: int | None = None  # vLLM's max_num_seqs (None: all run at once)

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())


def lengths_from_row(row: dict, engines: int = 1) -> np.ndarray:
    """One engine's response lengths rebuilt from a metrics.jsonl row, which keeps only their mean, median,
    max and total: n = num_tokens / mean rollouts, lognormal through the median and the mean, the longest set
    to the max, then scaled so they sum to num_tokens exactly. Engines share the rollouts evenly."""
    total = float(row["generation/num_tokens"])
    mean = float(row["generation/response_length_mean"])
    med = float(row.get("generation/response_length_median") or mean)
    mx = float(row.get("generation/response_length_max") or 4 * mean)
    n = max(int(round(total / mean)), 1)
    sigma = math.sqrt(max(2 * math.log(max(mean, 1e-9) / max(med, 1e-9)), 0.0))
    q = (np.arange(n) + 0.5) / n
    from statistics import NormalDist

    z = np.array([NormalDist().inv_cdf(float(v)) for v in q])
    x = np.minimum(med * np.exp(sigma * z), mx)
    x[-1] = mx
    if n > 1:
        x[:-1] *= (total - mx) / max(x[:-1].sum(), 1e-9)
    x = np.rint(x).astype(np.int64)
    x[:-1] = np.clip(x[:-1], 1, int(mx))
    diff = int(total) - int(x.sum())  # rounding: +-1 on the longest of the others, so the total is exact
    if n > 1 and diff:
        x[np.argsort(x[:-1])[::-1][: abs(diff)]] += int(np.sign(diff))
    x = np.sort(x)[:: max(engines, 1)] if engines > 1 else x
    return np.random.default_rng(0).permutation(x)  # submission order is not sorted by length


def read_metrics(path: str) -> list[dict]:
    """The training rows (step >= 1 with a generation phase) of a metrics.jsonl."""
    rows = []
    for line in open(path):
        line = line.strip()
        if line:
            r = json.loads(line)
            if r.get("step", 0) >= 1 and r.get("timing/generation") and r.get("generation/num_tokens"):
                rows.append(r)
    return rows
