"""One-step off-policy GRPO, the pure parts: its config keys, the importance weight's cap, the staleness bound,
the overlap metric, the rollouts a checkpoint carries, and a stop while rollouts are in flight.

The runs themselves (real engines): tests/test_off_policy_runs.py.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from rl_specdec.config import ConfigError, load_config
from rl_specdec.grpo import ClippedPGLoss

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "configs" / "grpo_spec.yaml"


# ---- config -------------------------------------------------------------------------------------------------


def test_off_policy_keys_default_to_todays_loop():
    cfg = load_config(SPEC)
    assert cfg.grpo.max_staleness == 0 and cfg.grpo.behaviour_is_cap is None
    cfg = load_config(SPEC, ["grpo.max_staleness=1", "grpo.behaviour_is_cap=2"])
    assert cfg.grpo.max_staleness == 1 and cfg.grpo.behaviour_is_cap == 2.0


@pytest.mark.parametrize(
    "override, needle",
    [
        ("grpo.max_staleness=2", "grpo.max_staleness=2: only 0"),
        ("grpo.max_staleness=-1", "Set grpo.max_staleness=1 or 0"),
        ("grpo.behaviour_is_cap=0.5", "grpo.behaviour_is_cap=0.5: the cap"),
        ("grpo.behaviour_is_cap=inf", "must be >= 1"),
    ],
)
def test_off_policy_keys_refuse_what_they_cannot_do(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(SPEC, [override])


# ---- the importance weight's cap ----------------------------------------------------------------------------


def _mb(gen, adv, mask):
    return {
        "gen_logprobs": gen,
        "advantages": adv,
        "loss_mask": mask,
        "batch_num_tokens": torch.full((gen.shape[0],), float(mask.sum())),
    }


def _grad(loss_fn, p_train, p_gen, adv):
    logp = torch.log(torch.tensor([p_train])).requires_grad_(True)
    mb = _mb(torch.log(torch.tensor([p_gen])), torch.tensor([adv]), torch.ones(1, len(p_train)))
    loss, metrics = loss_fn(logp, mb, None)
    loss.backward()
    return logp.grad[0].tolist(), metrics


def test_the_cap_truncates_the_weight_of_the_tokens_the_clip_keeps():
    """A < 0: the clip leaves ratio 3 (token 0) and 1.5 (token 1) unbounded; a cap of 2 makes token 0's gradient
    weight 2 instead of 3 and leaves token 1's; ratio 0.5 (token 2) is clipped, with no gradient either way."""
    p_train, p_gen = [0.6, 0.3, 0.1], [0.2, 0.2, 0.2]  # ratios 3, 1.5, 0.5
    plain, m0 = _grad(ClippedPGLoss(0.2), p_train, p_gen, -1.0)
    capped, m = _grad(ClippedPGLoss(0.2, behaviour_is_cap=2.0), p_train, p_gen, -1.0)
    n = 3  # d loss / d logp_t = -A * weight / n
    assert plain == pytest.approx([3.0 / n, 1.5 / n, 0.0])
    assert capped == pytest.approx([2.0 / n, 1.5 / n, 0.0])
    assert m["is_capped_fraction"].item() == pytest.approx(1 / 3) and "is_capped_fraction" not in m0


def test_the_cap_changes_nothing_on_policy():
    p = [0.5, 0.25, 0.9]
    plain, m0 = _grad(ClippedPGLoss(0.2), p, p, 2.0)
    capped, m = _grad(ClippedPGLoss(0.2, behaviour_is_cap=1.0), p, p, 2.0)
    assert capped == plain == pytest.approx([-2 / 3] * 3)
    assert m["loss"].item() == pytest.approx(m0["loss"].item()) and m["is_capped_fraction"].item() == 0.0


# ---- stamps, the bound, the checkpoint's rollouts -------------------------------------------------------------


def _rollouts(step=3, version=2, n=4, top=False):
    from rl_specdec.grpo.rollouts import Rollouts
    from rl_specdec.rollout import GenerationOutput

    out = GenerationOutput(
        token_ids=[[i, 1] for i in range(n)],
        logprobs=[[-0.5 - i, -float("inf") if i == 0 else -0.25] for i in range(n)],
        finish_reasons=["stop"] * (n - 1) + ["length"],
        top_logprobs=[[{7: -0.1, i: -2.5}, {1: -0.01}] for i in range(n)] if top else None,
        per_engine_time_s=[0.5, 0.75],
        finish_time_s=[0.1 * i for i in range(n)],
        spec_counters={"num_drafts": 3.0, "num_accepted_tokens_per_pos": [2.0, 1.0]},
        spec_control=[{"buckets": [[1, 1, 3]], "steps": 4}],
    )
    return Rollouts(step, [[5, 6]] * n, out, [version] * n)


def test_rollouts_older_than_the_bound_are_never_trained_on():
    from rl_specdec.grpo.rollouts import unusable

    prompts = [[5, 6]] * 4
    assert unusable(_rollouts(step=3, version=2), 3, 1, prompts, want_top=False) is None
    assert unusable(_rollouts(step=3, version=3), 3, 1, prompts, want_top=False) is None
    assert "2 updates old (grpo.max_staleness=1)" in unusable(_rollouts(step=3, version=1), 3, 1, prompts, False)
    assert "1 updates old (grpo.max_staleness=0)" in unusable(_rollouts(step=3, version=2), 3, 0, prompts, False)
    mixed = _rollouts(step=3, version=2)
    mixed.versions[1] = 0  # one sample too old is enough
    assert "3 updates old" in unusable(mixed, 3, 1, prompts, False)
    assert "generated for step 4" in unusable(_rollouts(step=3), 4, 1, prompts, False)
    assert "prompts are not this step's" in unusable(_rollouts(), 3, 1, [[5, 7]] * 4, False)
    assert "top-k log-probs" in unusable(_rollouts(), 3, 1, prompts, want_top=True)
    assert unusable(_rollouts(top=True), 3, 1, prompts, want_top=True) is None


def test_staleness_metrics_cover_the_trained_samples():
    from rl_specdec.grpo.rollouts import staleness_metrics

    ro = _rollouts(step=3, version=2)
    ro.versions[0] = 3
    assert staleness_metrics(ro, [0, 1, 2, 3]) == {"train/staleness": 0.75, "train/staleness_max": 1.0}
    assert staleness_metrics(ro, [0]) == {"train/staleness": 0.0, "train/staleness_max": 0.0}


@pytest.mark.parametrize("top", [False, True])
def test_a_checkpoints_rollouts_come_back_exactly(tmp_path, top):
    from rl_specdec.grpo.rollouts import ROLLOUTS_FILE, load_rollouts, save_rollouts

    assert load_rollouts(tmp_path) is None
    ro = _rollouts(top=top)
    save_rollouts(tmp_path, ro)
    assert (tmp_path / ROLLOUTS_FILE).is_file()
    back = load_rollouts(tmp_path)
    assert back == ro  # token ids, log-probs (-inf too), finish reasons, top-k with int ids, counters, versions


# ---- timing/overlap -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "gen, train, window, want",
    [
        ([(0, 4)], [(2, 6)], (0, 10), 0.2),  # both busy 2..4
        ([(0, 4)], [(4, 6)], (0, 10), 0.0),  # one after the other
        ([(1, 3), (2, 5)], [(0, 10)], (0, 10), 0.4),  # generation spans joined: 1..5
        ([(0, 10)], [(1, 2), (3, 4), (9, 12)], (0, 10), 0.3),  # cut to the window
        ([(-5, 1)], [(-5, 1)], (0, 4), 0.25),  # before the window does not count
        ([(0, 4)], [], (0, 4), 0.0),
        ([(0, 4)], [(0, 4)], (4, 4), 0.0),  # an empty window
    ],
)
def test_overlap_is_the_fraction_of_the_window_both_were_busy(gen, train, window, want):
    from rl_specdec.grpo.rollouts import overlap_fraction

    assert overlap_fraction(gen, train, window) == pytest.approx(want)
    assert overlap_fraction(train, gen, window) == pytest.approx(want)


# ---- a stop while the next step's rollouts are in flight ----------------------------------------------------------


class _Pending:
    def __init__(self, seconds: float):
        self.seconds, self.waited = seconds, False

    def done(self) -> bool:
        return self.seconds == 0

    def result(self):
        self.waited = True
        time.sleep(self.seconds)  # a signal meanwhile interrupts it
        return "output"


def test_in_flight_rollouts_are_waited_for_without_a_stop_and_dropped_with_one():
    from rl_specdec.grpo.pipeline import wait_or_drop
    from rl_specdec.grpo.stop import StopSignals

    with StopSignals(60.0) as stop:
        assert wait_or_drop(_Pending(0.01), stop) == "output"
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
        slow = _Pending(30.0)
        t0 = time.monotonic()
        assert wait_or_drop(slow, stop) is None and slow.waited  # the signal came while it waited: dropped
        assert time.monotonic() - t0 < 20 and stop.requested
        late = _Pending(30.0)
        assert wait_or_drop(late, stop) is None and not late.waited  # asked for before: not waited for
        assert wait_or_drop(_Pending(0), stop) == "output"  # finished already: kept


def test_a_real_interrupt_while_waiting_is_not_a_drop():
    from rl_specdec.grpo.pipeline import wait_or_drop
    from rl_specdec.grpo.stop import StopSignals

    class Interrupted(_Pending):
        def result(self):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        wait_or_drop(Interrupted(1.0), StopSignals(60.0))


@pytest.mark.parametrize(
    "overrides, cores, warns",
    [
        ([], 2, True),  # as shipped: the engine binds both cores, the trainer wants both
        (["policy.generation.cpus_per_engine=1", "policy.num_threads=1"], 2, False),  # the split
        (["policy.generation.cpus_per_engine=1"], 2, True),  # the trainer still takes both cores
        (["policy.generation.cpus_per_engine=2", "policy.num_threads=2"], 4, False),
        (["policy.num_workers=2", "policy.generation.cpus_per_engine=2", "policy.num_threads=1"], 4, False),
        (["policy.num_workers=2", "policy.generation.cpus_per_engine=2"], 4, True),  # 2 x 2 threads + 2 cores
    ],
)
def test_an_overlap_on_shared_cores_is_named_with_the_fix(overrides, cores, warns):
    from rl_specdec.grpo.pipeline import shared_cores

    cfg = load_config(SPEC, ["grpo.max_staleness=1", "policy.device=cpu", *overrides])
    why = shared_cores(cfg, cores)
    assert (why is not None) == warns, why
    if warns:
        assert f"this host's {cores} cores" in why and "policy.num_threads=1" in why and "cpus_per_engine=" in why
        fixed = load_config(SPEC, ["policy.device=cpu", *why.split("e.g. ")[1].split(", or")[0].split()])
        assert shared_cores(fixed, cores) is None, "the suggested fix still shares the cores"


def test_an_overlap_on_gpus_is_not_checked_for_cores():
    from rl_specdec.grpo.pipeline import shared_cores

    cfg = load_config(SPEC, ["grpo.max_staleness=1", "policy.device=cpu"])
    assert shared_cores(cfg, 2) is not None
    cfg.policy.device = "cuda"  # as loaded on a GPU host: the engines take GPUs, not the trainer's cores
    assert shared_cores(cfg, 2) is None


def test_host_cores_is_the_affinity_mask_where_there_is_one(monkeypatch):
    from rl_specdec.grpo import pipeline

    if hasattr(os, "sched_getaffinity"):
        assert pipeline.host_cores() == len(os.sched_getaffinity(0))
        monkeypatch.delattr(os, "sched_getaffinity")  # as on macOS
    assert pipeline.host_cores() == (os.cpu_count() or 1)
