"""The adaptive speculation controller: which k in 0..K keeps the most tokens per second, per batch-size bucket.

Pure logic (numpy, no vLLM): fed one :class:`~rl_specdec.vllm_ext.model_runner.StepRecord` per step, it
answers with the k lookup.

**What it measures.** Per (bucket, k), a :class:`~.controller_state.Cell` of
decayed sums over the bucket's steps at that k (:meth:`Controller._measure`):
the tokens the requests kept (not those accepted past a stop token or
``max_tokens``), the wall time, the request-steps (running requests summed
over the steps) and the E[L(k)] of the time. A step counts for the k it holds,
the k it enters from k=0 (the drafter catch-up is that k's cost) and the k it
leaves for k=0 (its verification earns that k's tokens); a call's first step
counts for none.

**What it models.**

* *Step cost*: wall time, linear in the step's features, by ridge least squares
  on relative errors; each kind of step (k verified, k drafted) forgets over
  its own last ``memory_steps``::

      t = a + c_b b + c_C C + c_P P + [k_v>0](s + s_b b) + k_v (v_b b + v_C C)
            + [k_n>0](d + d_b b + d_P P) + k_n (e + e_b b + e_C C)

  with b the scheduled requests, C their context, P the prompt tokens
  prefilled beyond one per request, k_v the drafts verified per request and
  k_n the drafts made. Transition steps are as informative as steady ones, so
  a few explored k price every k; predicted times are non-decreasing in k.
* *Acceptance*: P_i (the first i drafts all accepted and kept), forgetting over
  ``acceptance_memory`` drafts; E[L(k)] = 1 + P_1 + ... + P_k.

**What it decides.** For bucket j (mean batch b_j) each k is rated by its
measured rate, repriced by E[L(k)] now against when measured and moved from the
cell's mean batch to b_j by the model's ratio of times, shrunk towards the
model's ``b_j E[L(k)] / t(b_j, k, k)`` (calibrated on k=0's measurement) as if
the model were ``MODEL_REQUEST_STEPS`` request-steps (a step of one request says
little: the tail's steps are shrunk most). It picks the best k in 0..cap, but k=0
unless a k>0 measured there (``MIN_MEASURED`` steps) is rated ``min_gain`` better, and keeps a k>0 unless
another is ``SWITCH_GAIN`` better. Decisions start at k=0, without the warm-up's cells, once the cost model
has seen k=0 and two k>0 (one if cap is 1).

**How it explores.** Until ready it warms up (unless ``explore`` is 0): every
step belongs to a :class:`~.controller_state.Burst` of the k seen least, over every bucket. Then a bucket
at k=0 starts a burst at its next step (:meth:`Controller.unproven`) of the
k>0 the model rates best there, if no k>0 has been measured there yet, or if
that k is rated ``min_gain`` above k=0 and has not been measured there for
``MIN_MEASURED`` steps: the model is fitted where the steps were (the
warm-up's at the first call's batch), the gate above needs a measurement in
the bucket, and a bucket visited a few steps a call would otherwise wait many
calls for a random draw (not after a schedule, which states a k for every
bucket). Otherwise a step in
bucket j starts a burst of ``explore_steps`` steps with probability ``explore /
explore_steps``, at a k drawn from k=0 and the k rated within
``EXPLORE_WITHIN`` of the bucket's best (a burst up from k=0 costs a catch-up),
but only where it could pay and only while it can afford it:

* a bucket at k=0 is not explored where the cost model says no k>0 could beat
  k=0 by ``min_gain`` even with acceptance ``EXPLORE_HEADROOM`` better than
  measured (:meth:`Controller.could_win`): at a large batch, where verification
  is dear, exploring only costs;
* a budget bounds what exploring loses: every step earns ``explore`` of its
  time, every exploring step spends its time less the time the bucket's choice
  would take for the same tokens, and a burst starts only with budget left. So
  exploration costs at most about ``explore`` of the time.

**Starting from a schedule** (``start: schedule``): the buckets are split where
the schedule's k changes (:func:`buckets_for`), each starts at the initial
lookup's k (speculative_config's schedule) and keeps it until that k has
been measured there (``MIN_MEASURED`` steps); then the rules above hold, except
that where the schedule drafts a k>0 needs no ``min_gain`` over k=0 (the
schedule is the evidence). The warm-up's bursts come out of the exploration
budget (whole steps counted lost), k=0 first, while the schedule runs.

With ``draft_below`` set (a concurrency threshold) it never drafts, nor
explores, from that many running requests up: its lookup is 0 there.
"""

from __future__ import annotations

import bisect
import math
import random

import numpy as np

from rl_specdec.config.generation import SpeculationControlConfig
from rl_specdec.rollout.runtime_k.controller_state import Burst, Cell
from rl_specdec.rollout.runtime_k.metrics import Tally
from rl_specdec.rollout.runtime_k.models import READY_K0_STEPS, AcceptanceModel, CostModel, features

REFIT_EVERY = 8  # observations between refits of the cost model
MIN_MEASURED = 2.5  # steps of a (bucket, k) before they calibrate the model (k=0) or k may be chosen (k>0)
MODEL_REQUEST_STEPS = 32.0  # a measured rate is shrunk towards the model's as if the model were this many request-steps
SWITCH_GAIN = 0.03  # a k>0 in force gives way to another k>0 rated this much better (no catch-up between them)
EXPLORE_WITHIN = 0.1  # once ready, a burst tries only a k rated within this fraction of the bucket's best
# A bucket at k=0 is explored only if some k>0 could win there with acceptance this much better than measured
# (accepted drafts x (1 + headroom), at most k): where the cost model says no k>0 can pay, exploring only costs.
EXPLORE_HEADROOM = 0.25
BUDGET_BURSTS = 2.0  # the exploration budget saves up for at most this many bursts of the current step time
CLIP = 4.0  # an observed step time is clipped to [predicted / CLIP, predicted * CLIP] (descheduled steps)


def bucket_ranges(buckets, max_batch: int) -> list[tuple[int, int]]:
    """[(lo, hi), ...] inclusive batch-size ranges; the last one ends at ``max_batch``."""
    los = [b for b in buckets if b <= max_batch]
    return [(lo, (los[i + 1] - 1) if i + 1 < len(los) else max_batch) for i, lo in enumerate(los)]


def buckets_for(config: SpeculationControlConfig, lookup: list[int]) -> list[int]:
    """The buckets' lower bounds: ``config.buckets``, and from a schedule (``start: schedule``) also every batch
    size where its k changes, so that each bucket starts at one k of it."""
    if config.start != "schedule":
        return list(config.buckets)
    return sorted(set(config.buckets) | {b for b in range(2, len(lookup)) if lookup[b] != lookup[b - 1]})


def lookup_from(ranges: list[tuple[int, int]], ks: list[int]) -> list[int]:
    """The scheduler's dense lookup (index 0 unused) with k = ks[j] over bucket j."""
    out = [0]
    for (lo, hi), k in zip(ranges, ks):
        out += [int(k)] * (hi - lo + 1)
    return out


def below(lookup: list[int], draft_below: int | None) -> list[int]:
    """``lookup`` (index: running requests) with k=0 from ``draft_below`` running requests up (unchanged if None)."""
    if draft_below is None:
        return list(lookup)
    return [k if b < draft_below else 0 for b, k in enumerate(lookup)]


def ks_of(ranges: list[tuple[int, int]], lookup: list[int]) -> list[float]:
    """Each bucket's k in a lookup (its mean, where the lookup is not uniform over the bucket)."""
    return [sum(lookup[lo : hi + 1]) / (hi - lo + 1) for lo, hi in ranges]


class Controller:
    """One engine's controller: feed it :meth:`step` once per engine step; it returns a new lookup when k changes."""

    def __init__(
        self, config: SpeculationControlConfig, k_max: int, max_batch: int, initial_lookup: list[int], seed: int = 0
    ):
        """``config``: the run's ``speculation_control``; ``k_max``: the engine's largest k; ``max_batch``: its
        max_num_seqs (the lookup has ``max_batch + 1`` entries); ``initial_lookup``: the scheduler's lookup now."""
        self.config = config
        self.ranges = bucket_ranges(buckets_for(config, initial_lookup), max_batch)
        self.los = [lo for lo, _ in self.ranges]
        self.choice = [int(round(k)) for k in ks_of(self.ranges, initial_lookup)]
        # start: schedule: each bucket's k from the initial lookup, kept until measured there (None: from k=0)
        self.schedule = list(self.choice) if config.start == "schedule" else None
        self.cap = k_max
        self.cost, self.acc = CostModel(config.memory_steps), AcceptanceModel(k_max, config.acceptance_memory)
        self.b_mean = [math.sqrt(lo * hi) for lo, hi in self.ranges]
        self.ctx_per_req = [64.0] * len(self.ranges)
        self.pre_per_step = [0.0] * len(self.ranges)
        self.cells: dict[tuple[int, int], Cell] = {}  # (bucket, k) -> what its steps measured
        self.burst: Burst | None = None
        self.rng = random.Random(seed)
        self.tally = Tally()
        self.pushed = list(initial_lookup)
        self._since_fit, self.warming = 0, True
        self.ratings: list[list[float] | None] = [None] * len(self.ranges)  # each bucket's, at the last decide
        self.budget = 0.0  # seconds exploring may still lose (earns ``explore`` x each step's time)
        self.explored = [0] * len(self.ranges)  # exploring steps per bucket, once ready

    def bucket(self, b: int) -> int:
        return max(bisect.bisect_right(self.los, b) - 1, 0)

    # ---- learning ----------------------------------------------------------------------
    def observe(self, rec) -> None:
        """Learn from one finished step."""
        if rec.drafted_pp:
            self.acc.observe(rec.drafted_pp, rec.accepted_pp)
        # the step ran a burst's k if the burst covers its bucket (a burst in the tail of one call outlives it)
        exploring = self.burst is not None and self.burst.covers(self.bucket(rec.b))
        if rec.b > 0 and rec.period_s is not None:
            self._measure(rec)
            self._account(self.bucket(rec.b), rec, exploring)  # catch-up steps too: a burst up from k=0 pays one
        if rec.b <= 0 or rec.period_s is None or rec.catch_up:
            self.tally.add(rec, None, exploring)
            return
        j = self.bucket(rec.b)
        prefilled = max(rec.tokens - rec.b - rec.drafts, 0)  # prompt tokens beyond one per request
        self.b_mean[j] += 0.05 * (rec.b - self.b_mean[j])
        self.ctx_per_req[j] += 0.05 * (rec.ctx / rec.b - self.ctx_per_req[j])
        self.pre_per_step[j] += 0.05 * (prefilled - self.pre_per_step[j])
        verified_pp = rec.drafts / rec.b  # drafts verified per request, over all of them (admitted ones too)
        x = features(rec.b, rec.ctx, verified_pp, rec.k_next, prefilled)
        t, predicted = rec.period_s, None
        if self.cost.ready(self.cap):
            t_hat = self.cost.predict(x)
            if t_hat is not None and t_hat > 0:
                t = min(max(t, t_hat / CLIP), t_hat * CLIP)
                predicted = (rec.b * self.acc.expected_length(round(verified_pp)), t_hat)
        self.tally.add(rec, predicted, exploring)
        self.cost.observe(x, t, rec.k_next, verified_pp)
        self._since_fit += 1

    def _account(self, j: int, rec, exploring: bool) -> None:
        """The exploration budget: each step earns ``explore`` of its time; an exploring step spends what it lost
        against the bucket's choice (its time less the time the choice would take for the same tokens)."""
        most = BUDGET_BURSTS * self.config.explore_steps * rec.period_s
        self.budget = min(self.budget + self.config.explore * rec.period_s, most)
        ratings = self.ratings[j]
        if exploring and self.warming and self.schedule is not None:
            self.budget -= rec.period_s  # a warm-up burst away from a schedule: no model yet, count all of it lost
        if not exploring or self.warming or ratings is None or ratings[min(self.choice[j], self.cap)] <= 0:
            return
        self.explored[j] += 1
        self.budget -= max(rec.period_s - rec.emitted / ratings[min(self.choice[j], self.cap)], 0.0)

    def _measure(self, rec) -> None:
        """Add the step to its (bucket, k) cell (module docstring): each k pays its own costs, earns its kept tokens."""
        if not rec.continuing:
            return  # a call's first step emits one token per request whatever k: it would favour the k not in use
        # the drafts a request verified: not drafts / b, which requests admitted (prefilled) in the step lower,
        # and which would drop a k>0's steps with prefills, its dearest, while k=0 keeps all of its own
        k_verified = rec.k_verify if rec.drafts else 0
        k = rec.k_next if k_verified in (0, rec.k_next) else k_verified if rec.k_next == 0 else None
        if k is None:
            return
        cell = self.cells.setdefault((self.bucket(rec.b), k), Cell())
        cell.add(rec.emitted, rec.period_s, rec.b, self.acc.expected_length(k))

    def time_at(self, j: int, b: float, k: int) -> float | None:
        """The cost model's time of a steady step at k with b requests, bucket j's context and prefill."""
        return self.cost.predict(features(b, self.ctx_per_req[j] * b, k, k, self.pre_per_step[j]))

    def measured_rate(self, j: int, k: int, cell: Cell) -> float:
        """A cell's kept tokens per second, repriced to the acceptance of now and moved to the bucket's mean batch."""
        b_cell, b = cell.request_steps / cell.steps, self.b_mean[j]
        t_cell, t_b = self.time_at(j, b_cell, k), self.time_at(j, b, k)
        ratio = t_b / t_cell if t_cell and t_b and min(t_cell, t_b) > 0 else b / b_cell
        repriced = self.acc.expected_length(k) / (cell.expected_length / cell.steps)  # E[L(k)] now against then
        return repriced * cell.emitted / cell.request_steps * b / (cell.seconds / cell.steps * ratio)

    def ratings_for(self, j: int) -> list[float] | None:
        """Bucket j's rating of each steady k in 0..cap, in tokens per second (None before a fit): the cost
        model's rate, calibrated on k=0's measurement there, and each k's measured rate weighed against it by
        request-steps (module docstring).

        A step never gets cheaper with more drafts, so predicted times are made
        non-decreasing in k (a rarely seen k cannot look cheaper than k=0 by fit noise).
        """
        b = self.b_mean[j]
        times = [self.time_at(j, b, k) for k in range(self.cap + 1)]
        if any(t is None for t in times):
            return None
        times = list(np.maximum.accumulate(times))
        if times[0] <= 0:
            return None
        modelled = [b * self.acc.expected_length(k) / t for k, t in enumerate(times)]
        here = {k: c for (jj, k), c in self.cells.items() if jj == j and k <= self.cap}  # bucket j's cells
        here = {k: c for k, c in here.items() if c.seconds > 0 and c.request_steps > 0}
        measured = {k: self.measured_rate(j, k, c) for k, c in here.items()}
        # the model, calibrated on k=0 here
        scale = measured[0] / modelled[0] if 0 in measured and here[0].steps >= MIN_MEASURED else 1.0
        out = []
        for k, r in enumerate(modelled):
            n = here[k].request_steps if k in measured else 0.0  # a rate's noise is the requests' acceptance
            out.append((n * measured.get(k, 0.0) + MODEL_REQUEST_STEPS * r * scale) / (n + MODEL_REQUEST_STEPS))
        return out

    def decide(self) -> None:
        """Refit the cost model and re-choose every bucket's k."""
        self._since_fit = 0
        if not self.cost.ready(self.cap):
            return
        # the warm-up's cells measured every k at once (often start-up checks too): start afresh (k=0 or schedule)
        if self.warming:
            self.warming, self.cells = False, {}
            self.choice = list(self.schedule) if self.schedule is not None else [0] * len(self.ranges)
        self.cost.fit()
        for j in range(len(self.ranges)):
            ratings = self.ratings[j] = self.ratings_for(j)
            if ratings is None:
                continue
            cur = min(self.choice[j], self.cap)
            if self.schedule is not None and self.steps_measured(j, cur) < MIN_MEASURED:
                continue  # a schedule's k stands until it has been measured in its bucket
            proven = [ratings[k] for k in range(1, len(ratings)) if self.steps_measured(j, k) >= MIN_MEASURED]
            best = max(range(len(ratings)), key=ratings.__getitem__)
            # speculate only where a measured k>0 pays by a margin (never lose to k=0); none where a schedule drafts
            gain = 0.0 if self.schedule is not None and self.schedule[j] > 0 else self.config.min_gain
            if max(proven, default=0.0) <= ratings[0] * (1.0 + gain):
                best = 0
            if best == 0 or cur == 0 or ratings[best] > ratings[cur] * (1.0 + SWITCH_GAIN):
                cur = best
            self.choice[j] = cur

    # ---- acting ------------------------------------------------------------------------
    def _explore(self, j: int) -> None:
        """Maybe start a burst of another k in bucket j."""
        ready, explore = self.cost.ready(self.cap), self.config.explore
        above = self.config.draft_below is not None and self.los[j] >= self.config.draft_below
        if self.cap == 0 or explore == 0 or above:  # above: a bucket the threshold keeps at k=0
            return
        if not ready and self.schedule is not None and self.budget <= 0:
            return  # a schedule runs meanwhile: the warm-up's bursts come out of the budget
        if ready and self.budget > 0 and self.choice[j] == 0 and self.schedule is None:
            k = self.unproven(j)
            if k is not None:  # the model's verdict on this k has not been checked in this bucket: check it now
                self.burst = Burst(j, k, self.config.explore_steps)
                return
        if ready and (self.budget <= 0 or self.rng.random() >= explore / max(self.config.explore_steps, 1)):
            return
        if ready and self.choice[j] == 0 and not self.could_win(j):
            return
        others = [k for k in range(self.cap + 1) if k != self.choice[j]]
        if ready and self.cost.theta is not None:
            ratings = self.ratings_for(j)
            if ratings is not None:  # only the k that may win: a k rated far below the best costs a burst for nothing
                others = [k for k in others if k == 0 or ratings[k] >= (1.0 - EXPLORE_WITHIN) * max(ratings)]  # k=0 too
        if not others:
            return
        if ready:
            self.burst = Burst(j, self.rng.choice(others), self.config.explore_steps)
        else:
            k = min(range(self.cap + 1), key=lambda k: (self._warm_later(k), self.cost.seen(k), self.rng.random()))
            self.burst = Burst(None, k, self.config.explore_steps)

    def _warm_later(self, k: int) -> bool:
        """Whether the warm-up may leave k for later: after a schedule, which may never run k=0, it comes first."""
        return self.schedule is None or k > 0 or self.cost.seen(0) >= READY_K0_STEPS

    def unproven(self, j: int) -> int | None:
        """The k>0 to measure in bucket j now: the one the model rates best there, if no k>0 has been measured
        there yet (its verdict, fitted at other batch sizes, is trusted only once checked in the bucket), or if
        it beats k=0 there by ``min_gain`` and has not been measured there (None otherwise, and before a fit)."""
        ratings = self.ratings[j] if self.cost.theta is not None else None
        if not ratings or len(ratings) < 2:
            return None
        k = max(range(1, len(ratings)), key=ratings.__getitem__)
        if all(self.steps_measured(j, kk) < MIN_MEASURED for kk in range(1, len(ratings))):
            return k
        pays = ratings[k] > ratings[0] * (1.0 + self.config.min_gain)
        return k if pays and self.steps_measured(j, k) < MIN_MEASURED else None

    def steps_measured(self, j: int, k: int) -> float:
        """The decayed steps of bucket j's cell at k (0 if none)."""
        cell = self.cells.get((j, k))
        return cell.steps if cell is not None else 0.0

    def could_win(self, j: int) -> bool:
        """Whether, by the cost model, some k>0 could beat k=0 by ``min_gain`` in bucket j if acceptance were
        ``EXPLORE_HEADROOM`` better than measured (True before the model is fitted)."""
        b = self.b_mean[j]
        times = [self.time_at(j, b, k) for k in range(self.cap + 1)]
        if self.cost.theta is None or any(t is None or t <= 0 for t in times):
            return True
        times = list(np.maximum.accumulate(times))
        lengths = [1 + min(k, (self.acc.expected_length(k) - 1) * (1 + EXPLORE_HEADROOM)) for k in range(self.cap + 1)]
        optimistic = [b * n / t for n, t in zip(lengths, times)]
        return max(optimistic[1:], default=0.0) > optimistic[0] * (1 + self.config.min_gain)

    def lookup(self) -> list[int]:
        ks = [min(k, self.cap) for k in self.choice]
        if self.burst is not None:
            ks = [self.burst.k if self.burst.covers(j) else k for j, k in enumerate(ks)]
        return below(lookup_from(self.ranges, ks), self.config.draft_below)

    def step(self, rec, b_next: int) -> list[int] | None:
        """Learn from ``rec`` (the step that just finished); ``b_next``: the batch of the step starting now.

        Returns the lookup to push to the scheduler, or None when it is unchanged.
        """
        self.observe(rec)
        if self.burst is not None:
            self.burst.steps_left -= 1
            if self.burst.steps_left <= 0 or not self.burst.covers(self.bucket(b_next)):
                self.burst = None
                self.decide()
        if self._since_fit >= REFIT_EVERY:
            self.decide()
        if self.burst is None and b_next > 0:
            self._explore(self.bucket(b_next))
        new = self.lookup()
        if new == self.pushed:
            return None
        self.pushed = new
        return new

    def set_cap(self, k: int) -> list[int]:
        """Never choose more than k (0: speculation off); returns the lookup to push."""
        self.cap, self.burst = int(k), None
        self.pushed = self.lookup()
        return self.pushed

    def report(self) -> dict:
        """Decisions and the tally since the last report (which it resets)."""
        out = {
            "buckets": [[lo, hi, min(k, self.cap)] for (lo, hi), k in zip(self.ranges, self.choice)],
            "ready": self.cost.ready(self.cap),
            "cap": self.cap,
            "acceptance": self.acc.probs()[: max(self.cap, 1)],
            **self.tally.report(),
        }
        self.tally.reset()
        return out
