"""One-step off-policy GRPO, the pure parts: its config keys, the importance weight's cap, the staleness bound,
the overlap metric, the rollouts a checkpoint carries, and a stop while rollouts are in flight.

The runs themselves (real engines): tests/test_off_policy_runs.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rl_specdec.config import ConfigError, load_config
from rl_specdec.grpo import ClippedPGLoss

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "configs" / "grpo_spec.yaml"


# ---- config -------------------------------------------------------------------------------------------------


def test_off_policy_keys_default_to_todays_loop():
    cfg = load_config(SPEC, resolve_models=False)
    assert cfg.grpo.max_staleness == 0 and cfg.grpo.behaviour_is_cap is None
    cfg = load_config(SPEC, ["grpo.max_staleness=1", "grpo.behaviour_is_cap=2"], resolve_models=False)
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
        load_config(SPEC, [override], resolve_models=False)


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
