"""The adaptive controller's choice logic, on synthetic engines (pure logic: no vLLM, no Ray).

A synthetic engine replays generate calls whose batch shrinks from 128 to 1 as
rollouts finish. Each step's wall time comes from a cost table t(b, k_verify,
k_next) (ms, with noise) and its acceptance from P_i = p^i; the controller
sees nothing but the step records a real engine writes, and sets the lookup
the next steps run with. Tables:

* ``DEAR``: verification costs as much as decoding (a compute-bound CPU at
  any batch): k=0 everywhere is best;
* ``CHEAP``: verifying and drafting are nearly free next to the fixed cost of
  a step (a memory-bound GPU at small batch): k_max everywhere is best;
* ``CPU``: the step-cost model fitted on this project's CPU: k>0 pays only at
  small batch;
* ``RIDGE``: a step reads the weights (a fixed time) until its tokens' compute
  passes that, as on a GPU: k>0 pays far below the ridge, and above it no k>0
  could pay even with every draft accepted.

Negative controls: the same controller fed the dear table lands on 0 and fed
the cheap one on k_max (the decision follows the costs, not a default); with
a useless drafter (acceptance 0) even the cheap table gives 0; without
exploration the controller cannot leave its initial lookup.
"""

from __future__ import annotations

import bisect
import math
import random

import numpy as np

from rl_specdec.config import SpeculationControlConfig
from rl_specdec.rollout.runtime_k.controller import Controller, bucket_ranges, lookup_from
from rl_specdec.rollout.runtime_k.controller_state import Cell
from rl_specdec.vllm_ext.model_runner import StepRecord

K = 4
MAX_BATCH = 256


def DEAR(b, kv, kn):
    return 0.5 + 1.0 * b * (1 + kv) + (kn > 0) * (1.0 + 0.05 * b) + kn * (0.5 + 0.03 * b)


def RIDGE(b, kv, kn):  # a step reads the weights (6 ms) until its tokens' compute passes that: the GPU shape
    return 3.0 + max(6.0, 0.3 * b * (1 + kv)) + (kn > 0) * 1.0 + kn * (0.4 + 0.01 * b)


def CHEAP(b, kv, kn):
    return 10.0 + 0.01 * b * (1 + kv) + (kn > 0) * 0.2 + kn * 0.1


def CPU(
    b, kv, kn
):  # a fit on this CPU's toy pair: a + c_r b + [k>0](s0 + s1 b) + k (d0 + c_v b), split into verify and draft halves
    return (
        3.6
        + 0.257 * b
        + (kv > 0) * (1.0 + 0.02 * b)
        + kv * 0.09 * b
        + (kn > 0) * (0.94 + 0.02 * b)
        + kn * (1.21 + 0.082 * b)
    )


def settings(**kw):
    return SpeculationControlConfig(mode="adaptive", k_max=K, **{"explore": 0.05, **kw})


def controller(s: SpeculationControlConfig, initial_k: int) -> Controller:
    lookup = lookup_from(bucket_ranges(s.buckets, MAX_BATCH), [initial_k] * len(s.buckets))
    return Controller(s, K, MAX_BATCH, lookup, seed=1)


def run(table, p_accept=0.8, calls=40, initial_k=2, ctl=None, seed=0, times=None, catch_up_ms=0.0, **kw):
    """Replay ``calls`` generate calls on a synthetic engine; returns the controller. ``times``: a list that gets
    each call's simulated seconds; ``catch_up_ms``: what a switch up from k=0 costs per request (the drafter
    catch-up, which the cost table leaves out)."""
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    s = settings(**kw)
    ctl = ctl or controller(s, initial_k)
    lookup = list(ctl.pushed)
    for _ in range(calls):
        lengths = sorted(int(8 + 120 * rng.random() ** 3) for _ in range(128))  # a long tail of rollouts
        step, kv, ctx, prev, clock = 0, 0, 0, None, 0.0
        while True:
            b = len(lengths) - bisect.bisect_right(lengths, step)
            if b == 0:
                break
            kn = lookup[b]
            catch_up = b if kv == 0 and kn > 0 and step > 0 else 0
            t = (table(b, kv, kn) + catch_up * catch_up_ms) * 1e-3 * math.exp(rng.gauss(0, 0.1))
            acc = [int(nrng.binomial(b, p_accept ** (i + 1))) for i in range(kv)]
            rec = StepRecord(
                b=b,
                tokens=b * (1 + kv),
                drafts=b * kv,
                k_verify=kv,
                k_next=kn,
                ctx=ctx,
                plain=kv == kn == 0,
                continuing=step > 0,
                emitted=b + sum(acc),
                drafted_pp=[b] * kv or None,
                accepted_pp=acc or None,
                period_s=t,
                catch_up=catch_up,
            )
            if prev is not None:
                new = ctl.step(prev, b)
                lookup = new if new is not None else lookup
            prev, kv, ctx, clock = rec, kn, ctx + b * (1 + kn), clock + t
            step += 1 + kn // 2
        if times is not None:
            times.append(clock)
    return ctl


def chosen(ctl) -> list[int]:
    return [k for _, _, k in ctl.report()["buckets"]]


def test_dear_verification_picks_zero_everywhere():
    assert chosen(run(DEAR)) == [0] * 7


def test_cheap_verification_picks_k_max_everywhere():
    assert min(chosen(run(CHEAP))) >= K - 1  # K, or K-1 where the two measure within SWITCH_GAIN


def test_useless_drafter_picks_zero_even_when_verification_is_cheap():
    assert chosen(run(CHEAP, p_accept=0.0)) == [0] * 7


def oracle_rates(table, p, b):
    """True tokens per ms at batch b for each steady k."""
    return [b * (1 + sum(p**i for i in range(1, k + 1))) / table(b, k, k) for k in range(K + 1)]


def test_cpu_costs_speculate_at_small_batch_and_choose_near_the_best_k():
    """Where a steady k>0 pays by far (25%) it drafts, with a k near the best; where no k pays it does not.
    In between it may keep k=0: its measurements include the switches into k>0, which the steady oracle omits."""
    ctl = run(CPU, p_accept=0.85, calls=80)
    ks = chosen(ctl)
    for j, k in enumerate(ks):
        rates = oracle_rates(CPU, 0.85, ctl.b_mean[j])
        if max(rates) > 1.25 * rates[0]:
            assert k > 0, (j, ks, rates)
        if max(rates) == rates[0]:
            assert k == 0, (j, ks, rates)
        if k > 0:
            assert rates[k] >= 0.9 * max(rates), (j, ks, rates)
    assert ks[0] >= 3 and ks[-1] == 0, ks


def test_draft_below_keeps_the_bulk_at_k0():
    """With ``draft_below`` the controller never drafts, nor explores, from that many running requests up, even on
    the cheap table where k_max pays everywhere (the test above: k_max in every bucket without it); below the
    threshold it still finds k_max."""
    ctl = controller(settings(draft_below=16), initial_k=0)
    pushed, step = [], ctl.step
    ctl.step = lambda rec, b: pushed.append(step(rec, b)) or pushed[-1]  # every lookup it sets, warm-up's too
    run(CHEAP, ctl=ctl)
    lookups = [lk for lk in pushed if lk is not None]
    assert lookups and all(k == 0 for lk in lookups for b, k in enumerate(lk) if b >= 16), lookups
    assert all(ctl.explored[j] == 0 for j, (lo, _) in enumerate(ctl.ranges) if lo >= 16), ctl.explored
    assert min(chosen(ctl)[:4]) >= K - 1, chosen(ctl)


def test_without_exploration_it_cannot_leave_its_initial_lookup():
    """Negative control: the results above come from measured costs, not from a default."""
    assert chosen(run(DEAR, explore=0.0, initial_k=3)) == [3] * 7


def test_it_readapts_when_acceptance_collapses():
    ctl = run(CHEAP, p_accept=0.9, calls=60)  # k>0 is chosen only once measured in its bucket
    assert min(chosen(ctl)) >= K - 1
    # once every bucket is at k=0 no drafts update the acceptance, which stays a little above 0; on the cheap
    # table k=4 at batch 1 still pays by ~min_gain with it, so the last bucket takes longer to give way
    run(CHEAP, p_accept=0.0, ctl=ctl, calls=100, seed=1)
    assert chosen(ctl) == [0] * 7


def test_predictions_track_what_the_engine_realises():
    ctl = run(CPU, p_accept=0.85, calls=60)
    run(CPU, p_accept=0.85, ctl=ctl, calls=1, seed=5)
    r = ctl.report()  # the last call only
    assert r["ready"] and r["timed_steps"] > 50
    assert abs(r["predicted_tokens_per_s"] / r["realised_tokens_per_s"] - 1) < 0.15, r


def _moved(ctl, j: int, k: int, steps: int) -> float:
    """How far bucket j's rating of k moves from the model's towards ``steps`` steps measured 30% above it."""
    ctl.cells = {key: c for key, c in ctl.cells.items() if key[0] != j}
    model = ctl.ratings_for(j)[k]
    b, t = ctl.b_mean[j], 0.01  # steps at the bucket's mean batch, 10 ms each
    emitted = 1.3 * model * t * steps  # tokens: 1.3 x the model's rate
    ctl.cells[(j, k)] = Cell(emitted, t * steps, steps, b * steps, ctl.acc.expected_length(k) * steps)
    return (ctl.ratings_for(j)[k] - model) / (0.3 * model)


def test_a_step_of_one_request_moves_a_rating_less_than_a_step_of_many():
    """A bucket's rating of k is its measurement shrunk to the cost model by request-steps: at one running
    request a step's tokens are one request's acceptance, so 20 such steps move the rating less than halfway
    from the model towards them, while 4 steps of 16 requests move it most of the way. (Shrunk by steps, the
    20 one-request steps would move it 83% of the way.)"""
    ctl = run(CPU, p_accept=0.85, calls=10)
    assert ctl.b_mean[0] == 1.0
    assert _moved(ctl, 0, 3, steps=20) < 0.5
    assert _moved(ctl, ctl.bucket(16), 3, steps=4) > 0.6


def _drafting_buckets(calls: int) -> int:
    """Buckets drafting after ``calls`` calls from k=0 on the cheap table, over three seeds."""
    return sum(sum(k > 0 for k in chosen(run(CHEAP, calls=calls, initial_k=0, seed=s))) for s in range(3))


def test_a_k_the_model_says_pays_is_measured_at_once(monkeypatch):
    """A bucket at k=0 where no k>0 has been measured, or where the model rates an unmeasured k>0 above k=0,
    starts a burst of the model's best k>0 at its next step, without waiting for a random draw: 3 calls from
    k=0 are enough for the cheap table's buckets to draft. Negative control: without it (random bursts only)
    most still do not."""
    assert _drafting_buckets(3) >= 15  # of 21
    monkeypatch.setattr(Controller, "unproven", lambda self, j: None)
    assert _drafting_buckets(3) <= 8


def _hopeless_buckets(ctl, table) -> list[int]:
    """Buckets where no k>0 beats k=0 by min_gain even with every draft accepted (the steady oracle)."""
    out = []
    for j in range(len(ctl.ranges)):
        rates = oracle_rates(table, 1.0, ctl.b_mean[j])
        if max(rates[1:]) <= rates[0] * (1 + ctl.config.min_gain):
            out.append(j)
    return out


def test_no_exploration_where_no_k_can_pay(monkeypatch):
    """Once its cost model has learnt the costs, the controller rarely explores a bucket where no k>0 could
    pay; the cheaper buckets it still explores. Negative control: without the gate it explores the dear ones
    far more. Over four seeds: the linear model cannot fit the ridge's kink, and in some seeds its fit lets a
    few bursts through above it."""

    def explored_after_learning() -> tuple[int, int]:
        hopeless_steps, steps = 0, 0
        for s in range(4):
            ctl = run(RIDGE, p_accept=0.85, calls=40, explore=0.1, seed=10 + s)
            ctl.explored = [0] * len(ctl.ranges)
            run(RIDGE, p_accept=0.85, ctl=ctl, calls=40, seed=20 + s)
            hopeless = _hopeless_buckets(ctl, RIDGE)
            assert hopeless and len(hopeless) < len(ctl.ranges), hopeless
            hopeless_steps += sum(ctl.explored[j] for j in hopeless)
            steps += sum(ctl.explored)
        return hopeless_steps, steps

    gated, steps = explored_after_learning()
    assert steps > 0
    monkeypatch.setattr(Controller, "could_win", lambda self, j: True)
    ungated, _ = explored_after_learning()
    assert gated * 3 < ungated, (gated, ungated)


def _exploration_loss(share: float) -> tuple[float, int]:
    """Time lost against k=0 everywhere, once warmed up, on the dear table with a catch-up at every switch up
    that the cost model does not see, and the steps explored."""
    kw = dict(table=DEAR, catch_up_ms=8.0)
    ctl, explored, plain = run(calls=20, explore=share, **kw), [], []
    ctl.explored = [0] * len(ctl.ranges)
    run(ctl=ctl, calls=40, seed=3, times=explored, **kw)
    run(calls=40, seed=3, times=plain, explore=0.0, initial_k=0, **kw)
    return sum(explored) / sum(plain) - 1, sum(ctl.explored)


def test_exploring_costs_at_most_its_share_of_the_time(monkeypatch):
    """The budget is the backstop for what the cost model gets wrong. With the gate off and every k a candidate
    (as if the model rated them all near the best), exploring on the dear table loses at most about its share
    of the time; without the budget it loses far more."""
    from rl_specdec.rollout.runtime_k import controller

    share = 0.1
    monkeypatch.setattr(Controller, "could_win", lambda self, j: True)
    monkeypatch.setattr(controller, "EXPLORE_WITHIN", 1.0)
    loss, explored = _exploration_loss(share)
    assert explored > 0 and loss < share * 1.5, (loss, explored)  # a burst, once started, runs out its steps
    account = Controller._account

    def unbounded_budget(self, j, rec, exploring):
        account(self, j, rec, exploring)
        self.budget = float("inf")

    monkeypatch.setattr(Controller, "_account", unbounded_budget)
    unbounded, _ = _exploration_loss(share)
    assert unbounded > share * 2, unbounded


def test_cap_zero_turns_speculation_off_and_stops_exploring():
    ctl = run(CHEAP, calls=10)
    assert set(ctl.set_cap(0)) == {0}
    ctl.report()
    run(CHEAP, ctl=ctl, calls=3)
    assert set(ctl.pushed) == {0} and ctl.report()["explore_steps"] == 0


def test_buckets_cover_every_batch_size_once():
    ranges = bucket_ranges((1, 2, 4, 8, 16, 32, 64), 100)
    assert ranges[0] == (1, 1) and ranges[-1] == (64, 100)
    assert all(hi + 1 == lo for (_, hi), (lo, _) in zip(ranges, ranges[1:]))
    lk = lookup_from(ranges, [5, 4, 3, 2, 1, 0, 0])
    assert len(lk) == 101 and lk[1] == 5 and lk[3] == 4 and lk[63] == 0 and lk[31] == 1


# ---- what a step is worth: kept tokens, and which steps count --------------------------


def _req(output, max_tokens=100, ignore_eos=False, stops=frozenset({9})):
    from types import SimpleNamespace

    sp = SimpleNamespace(ignore_eos=ignore_eos, all_stop_token_ids=set(stops), max_tokens=max_tokens)
    return SimpleNamespace(sampling_params=sp, output_token_ids=list(output))


def test_tokens_past_a_stop_or_max_tokens_are_not_counted():
    from types import SimpleNamespace

    from rl_specdec.vllm_ext.model_runner import _acceptance

    out = SimpleNamespace(sampled_token_ids=[[5, 9, 7, 8]], req_id_to_index={"a": 0})  # 3 drafts accepted + bonus
    spec = {"a": [5, 9, 7]}
    earlier = [1, 2]  # tokens the request had before this step (the runner appends this step's before we read it)
    assert _acceptance(spec, out, {"a": _req(earlier + [5, 9, 7, 8])}) == ([1, 1, 1], [1, 1, 0], 2)  # stops at 9
    assert _acceptance(spec, out, {"a": _req(earlier + [5, 9, 7, 8], ignore_eos=True)}) == ([1, 1, 1], [1, 1, 1], 4)
    assert _acceptance(spec, out, {"a": _req(earlier + [5, 9, 7, 8], max_tokens=3, stops=())}) == (
        [1, 1, 1],
        [1, 0, 0],
        1,
    )


def test_a_calls_first_step_counts_for_no_k():
    """It emits one token per request whatever k is; counted, it would lower the rate of the k in force."""
    s = settings()
    ctl = controller(s, 2)
    rec = dict(b=100, tokens=3000, drafts=0, k_verify=0, k_next=2, ctx=0, plain=False, emitted=100, period_s=0.05)
    ctl.observe(StepRecord(continuing=False, **rec))
    assert ctl.cells == {}
    ctl.observe(StepRecord(continuing=True, **rec))  # the same step inside a call: a switch up into k=2
    assert list(ctl.cells) == [(ctl.bucket(100), 2)]


def test_a_step_that_admits_requests_counts_for_its_k():
    """In the bulk of a call requests finish and waiting ones are prefilled in the same steps, more often the
    faster a k emits: such a step at k=3 is k=3's cost (k=0 keeps its own), though a third of its requests
    verified nothing. Control: a step that switches between two k>0 counts for neither."""
    s = settings()
    ctl = controller(s, 3)
    j = ctl.bucket(240)
    # 160 decoding requests verified 3 drafts each, 80 were admitted (drafts / b = 2)
    mixed = dict(b=240, tokens=160 * 4 + 80 * 20, drafts=160 * 3, k_verify=3, plain=False, continuing=True)
    ctl.observe(StepRecord(k_next=3, ctx=9000, emitted=160 * 3 + 80, period_s=0.3, **mixed))
    assert list(ctl.cells) == [(j, 3)]
    ctl.observe(StepRecord(k_next=2, ctx=9000, emitted=160 * 3 + 80, period_s=0.3, **mixed))  # 3 -> 2: neither
    assert ctl.cells[(j, 3)].steps == 1.0 and (j, 2) not in ctl.cells
