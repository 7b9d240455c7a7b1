"""The controller started from a schedule (``speculation_control.start: schedule``), on the synthetic engines
of ``test_spec_controller`` (pure logic: no vLLM, no Ray).

From a schedule the controller keeps each bucket's k until it has measured it there, drafts without
``min_gain`` where the schedule drafts, and pays for its warm-up out of the exploration budget. Negative
controls: from k=0 (``start: zero``) the same runs leave the buckets where a k>0 pays by less than
``min_gain`` at k=0; with exploration off it cannot leave the schedule, even where the schedule loses.
"""

from __future__ import annotations

import math

from test_spec_controller import CPU, DEAR, MAX_BATCH, K, chosen, oracle_rates, run, settings

from rl_specdec.rollout.runtime_k.controller import Controller, bucket_ranges, lookup_from

P_ACCEPT = 0.85


def from_schedule(ks: list[int], **kw) -> Controller:
    s = settings(**kw)
    return Controller(s, K, MAX_BATCH, lookup_from(bucket_ranges(s.buckets, MAX_BATCH), ks), seed=1)


def oracle_schedule() -> tuple[list[int], list[float]]:
    """The best steady k per bucket of the CPU table, and its gain over k=0."""
    ks, gains = [], []
    for lo, hi in bucket_ranges(settings().buckets, MAX_BATCH):
        rates = oracle_rates(CPU, P_ACCEPT, math.sqrt(lo * hi))
        ks.append(max(range(K + 1), key=rates.__getitem__))
        gains.append(max(rates) / rates[0] - 1)
    return ks, gains


def test_a_schedule_that_loses_is_left_once_measured():
    """On the dear table every k>0 loses: started from k=3 everywhere it ends at k=0 everywhere; with
    exploration off (the negative control) it keeps the schedule."""
    assert chosen(run(DEAR, ctl=from_schedule([3] * 7, start="schedule"))) == [0] * 7
    assert chosen(run(DEAR, ctl=from_schedule([3] * 7, start="schedule", explore=0.0))) == [3] * 7


def test_a_schedule_that_pays_is_kept_where_zero_would_not_draft():
    """Started from the CPU table's best k per bucket, it still drafts in every bucket after 40 calls, also
    where that k pays by less than ``min_gain`` (a start from k=0 asks that margin of a measurement); from
    k=0, the same runs leave at least one such bucket at k=0."""
    ks, gains = oracle_schedule()
    small = [j for j, g in enumerate(gains) if 0 < g < settings().min_gain]
    assert small and min(ks) > 0, (ks, gains)  # the table has such buckets

    def ends(start: str, seed: int) -> list[int]:
        return chosen(run(CPU, p_accept=P_ACCEPT, calls=40, seed=seed, ctl=from_schedule(ks, start=start)))

    for seed in range(3):
        kept = ends("schedule", seed)
        assert min(kept) > 0, (seed, kept)
    zero = [ends("zero", seed) for seed in range(3)]
    assert any(ch[j] == 0 for ch in zero for j in small), zero


def test_the_warm_up_from_a_schedule_comes_out_of_the_budget():
    """From a schedule the warm-up does not take over the engine: it explores about ``explore`` of the steps
    (a burst each time the budget allows), where from k=0 every step of the warm-up is in a burst."""

    def explored_share(start: str) -> float:
        ctl = from_schedule([3] * 7, start=start)
        steps = explored = 0
        for seed in range(2):
            run(CPU, p_accept=P_ACCEPT, calls=3, seed=seed, ctl=ctl)
            r = ctl.report()
            steps, explored = steps + r["timed_steps"], explored + r["explore_steps"]
        return explored / steps

    bound = 1.5 * settings().explore  # a burst, once started, runs out its steps
    assert explored_share("schedule") < bound < explored_share("zero")


def test_the_buckets_split_where_the_schedule_changes_k():
    """A schedule whose k changes inside a bucket (here at 3, 5 and 17) starts every batch size at the schedule's
    own k; from k=0 the configured buckets stay as they are, and would start 2-3 at one k."""
    s = settings(start="schedule")
    schedule = [0] + [5, 5, 4, 4] + [2] * 12 + [0] * (MAX_BATCH - 16)  # vLLM's [[1,2,5],[3,4,4],[5,16,2],[17,..,0]]
    ctl = Controller(s, K + 1, MAX_BATCH, schedule, seed=1)
    assert [lo for lo, _ in ctl.ranges] == [1, 2, 3, 4, 5, 8, 16, 17, 32, 64]
    assert ctl.lookup() == schedule
    zero = Controller(settings(start="zero"), K + 1, MAX_BATCH, schedule, seed=1)
    assert [lo for lo, _ in zero.ranges] == list(s.buckets)
