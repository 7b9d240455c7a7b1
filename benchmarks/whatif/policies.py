"""The policies that choose k each step.

Static (k from the batch size and the request; :func:`.simulate.simulate_static`):

* ``none``: no drafter at all;
* ``k=K``: vLLM's fixed ``num_speculative_tokens``;
* ``vLLM schedule``: ``num_speculative_tokens_per_batch_size``, default [[1,16,5],[17,64,3],[65,1024,2]];
* ``FastGRPO``: speculate (k) only while fewer than ``threshold`` requests run (its concurrency-aware rule,
  FastGRPO arXiv 2509.21792, reduced to its threshold on running requests);
* ``DAS``: a per-trajectory budget from the predicted length (DAS arXiv 2511.13841: longer trajectories get
  more aggressive drafts). Our reading: k_r = ceil(K pred_r / max pred), at least 1, with the predicted
  length the true one times exp(N(0, 0.5^2)) (DAS predicts from the prompt's past rollouts; the noise is our
  assumption).

Step by step (:func:`.simulate.simulate_feedback`):

* ``vLLM adaptive verification``: from vLLM's ``AdaptiveVerificationManager`` (v1/worker/gpu/spec_decode/
  adaptive_verification.py): every request drafts K; each (request, slot) is scored by its survival
  probability (the running product of its per-slot confidences) and the step verifies the ``budget`` best
  slots, the budget maximising (requests + sum of admitted scores) / (draft cost(requests) + verify
  cost(tokens)). Assumed: its cost tables are this model's own times at the step's context (vLLM profiles
  them at start-up at 8,192 tokens of context), and the confidences are the slots' true acceptance
  probabilities (calibrated: an upper bound on it). An autoregressive drafter pays all K passes whatever the
  budget; vLLM 0.32 ships it for ``dspark`` only.
* ``controller``: the package's Controller (:mod:`.adapter`), fed a StepRecord per step whose wall time is
  the simulated one; the lookup it pushes sets k.
"""

from __future__ import annotations

import numpy as np

from benchmarks.whatif.adapter import controller_api
from benchmarks.whatif.costmodel import _fwd
from benchmarks.whatif.workload import KAPPA

STATIC_SCHEDULE = [[1, 16, 5], [17, 64, 3], [65, 1024, 2]]


class Policy:
    name = "policy"
    spec = True  # an engine with a drafter
    static = True

    def start_phase(self, wl, rng) -> None:
        pass

    def k_next(self, b: int, idx: np.ndarray, st) -> np.ndarray:
        raise NotImplementedError

    # step-by-step hooks
    def before_step(self, b: int) -> None:
        pass

    def admitter(self, pricer, pair, rng):
        return None

    def after_step(self, s, t: float) -> None:
        pass

    def end_phase(self) -> None:
        pass

    def summary(self) -> dict:
        return {}


class NoSpec(Policy):
    name, spec = "none", False

    def k_next(self, b, idx, st):
        return np.zeros(len(idx), np.int64)


class Fixed(Policy):
    def __init__(self, k: int):
        self.k, self.name = k, f"k={k}"

    def k_next(self, b, idx, st):
        return np.full(len(idx), self.k, np.int64)


class Schedule(Policy):
    def __init__(self, ranges=STATIC_SCHEDULE, name: str = "vLLM schedule"):
        self.ranges, self.name = ranges, name

    def k_next(self, b, idx, st):
        k = next((k for lo, hi, k in self.ranges if lo <= b <= hi), 0)
        return np.full(len(idx), k, np.int64)


class FastGRPO(Policy):
    def __init__(self, threshold: int = 32, k: int = 3):
        self.threshold, self.k = threshold, k
        self.name = f"FastGRPO (b<{threshold}: k={k})"

    def k_next(self, b, idx, st):
        return np.full(len(idx), self.k if b < self.threshold else 0, np.int64)


class DAS(Policy):
    def __init__(self, k_max: int = 5, sigma: float = 0.5):
        self.k_max, self.sigma = k_max, sigma
        self.name = f"DAS (k 1-{k_max} by length)"

    def start_phase(self, wl, rng):
        pred = wl.lengths * np.exp(self.sigma * rng.standard_normal(len(wl.lengths)))
        self.k = np.clip(np.ceil(self.k_max * pred / pred.max()), 1, self.k_max).astype(np.int64)

    def k_next(self, b, idx, st):
        return self.k[idx]


class AdaptiveVerification(Policy):
    static = False

    def __init__(self, K: int = 3):
        self.K, self.name = K, f"vLLM adaptive verif. (K={K})"
        self.admitted = self.offered = 0

    def k_next(self, b, idx, st):
        return np.full(len(idx), self.K, np.int64)

    def admitter(self, pricer, pair, rng):
        return lambda st, idx, kv: self.admit(st, idx, kv, pricer, pair, rng)

    def admit(self, st, idx, kv, pricer, pair, rng):
        """(admitted drafts per request, the slots' confidences): the budget vLLM's rule picks."""
        b, K = len(idx), int(kv.max())
        if K == 0:
            return kv, None
        alpha = pair.alphas(K)
        q = rng.beta(KAPPA * alpha, KAPPA * (1 - alpha), size=(b, K))
        surv = np.where(np.arange(K) < kv[:, None], np.cumprod(q, axis=1), -np.inf)
        scores = np.sort(surv[np.isfinite(surv)])[::-1]
        dev, ctx = pricer.dev, float(st.ctx[idx].sum())
        per = ctx / b
        n = b + np.arange(len(scores) + 1.0)
        verify = dev.t_step + dev.t_spec + dev.t_req * b + _fwd(pricer.T, n, ctx, n * per, n)
        draft = K * (dev.t_pass + dev.t_req_draft * b + _fwd(pricer.D, b, ctx, b * per, b, max))
        gain = b + np.concatenate(([0.0], np.cumsum(scores)))
        budget = int(np.argmax(gain / (draft + verify)))
        a = np.zeros(b, np.int64) if budget == 0 else np.minimum((surv >= scores[budget - 1]).sum(1), kv)
        self.admitted, self.offered = self.admitted + int(a.sum()), self.offered + int(kv.sum())
        return a, q

    def summary(self):
        return {"admitted_fraction": self.admitted / max(self.offered, 1)}


class ControllerPolicy(Policy):
    """The package's controller in the loop: it sees each step's record one step later (as in the engine,
    where a step's period is known when the next one starts) and its lookup sets the next k."""

    static = False

    def __init__(self, k_max: int = 5, max_batch: int = 256, seed: int = 0, **config):
        make, self.StepRecord, self.where = controller_api()
        self.k_max, self.name = k_max, f"controller (k 0-{k_max})"
        self.lookup = [0] + [k_max] * max_batch  # the engine starts with num_speculative_tokens = k_max
        self.ctl = make(k_max, max_batch, self.lookup, seed, **config)
        self.pending = None
        self.explore_steps = self.timed_steps = 0

    def before_step(self, b):
        if self.pending is not None:
            new = self.ctl.step(self.pending, b)
            if new is not None:
                self.lookup = list(new)
            self.pending = None

    def k_next(self, b, idx, st):
        return np.full(len(idx), int(self.lookup[min(b, len(self.lookup) - 1)]), np.int64)

    def after_step(self, s, t):
        self.pending = self.StepRecord(
            b=s.b,
            tokens=int(s.vt),
            drafts=s.drafts,
            k_verify=s.k_verify,
            k_next=s.k_next,
            ctx=int(s.ctx),
            plain=s.plain,
            continuing=s.continuing,
            catch_up=int(s.cu),
            emitted=s.emitted,
            drafted_pp=s.drafted_pp,
            accepted_pp=s.accepted_pp,
            period_s=t,
        )

    def end_phase(self):
        if self.pending is not None:
            self.pending.period_s = None  # the gap to the next call is not a step's time

    def summary(self):
        r = self.ctl.report()
        return {"buckets": r["buckets"], "report": r}


def gpu_policies(k_fixed=range(1, 7)) -> list:
    """The static policies of the GPU tables, the baseline first."""
    return [NoSpec(), *[Fixed(k) for k in k_fixed], Schedule(), FastGRPO(), DAS()]
