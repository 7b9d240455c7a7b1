"""The toys' training loop computes a batch in groups of like length exactly as it computes it whole: the same loss
and the same update, with no real token cut. Pure logic on a tiny random model, no engine."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from rl_specdec.toy.build import ModelShape, qwen2_config
from rl_specdec.toy.sft import length_groups, pad_batch, train_lm

PAD = 0


def _batch(rng: random.Random, rows: int = 7):
    """Rows of 3 to 40 tokens (ids 2..31), the loss on each row's second half: most rows far shorter than the
    longest, as the long-tail toy's whole batches are."""
    seqs, masks = [], []
    for i in range(rows):
        n = 40 if i == 0 else rng.randint(3, 12)
        seqs.append([rng.randint(2, 31) for _ in range(n)])
        masks.append([0] * (n // 2) + [1] * (n - n // 2))
    return pad_batch(seqs, masks, PAD)


def test_groups_hold_every_row_once_cut_to_their_longest_row():
    ids, mask = _batch(random.Random(0))
    groups = length_groups(ids, mask, PAD, 3)
    assert len(groups) == 3 and sum(len(g) for g, _ in groups) == len(ids)
    rows = sorted(tuple(r[r != PAD].tolist()) for g, _ in groups for r in g)
    assert rows == sorted(tuple(r[r != PAD].tolist()) for r in ids)
    assert sum(float(m.sum()) for _, m in groups) == float(mask.sum())
    widths = [g.shape[1] for g, _ in groups]
    assert widths == sorted(widths) and widths[-1] == ids.shape[1] and widths[0] < ids.shape[1] / 2
    for g, _ in groups:
        assert (g[:, -1] != PAD).any(), "a group keeps a column that no row reaches"
    assert length_groups(ids, mask, PAD, 1) == [(ids, mask)]


@pytest.mark.parametrize("teacher", [False, True], ids=["sft", "distillation"])
def test_a_step_in_groups_is_the_whole_batchs_step(teacher):
    """One step of SFT or distillation: the logged loss and every weight after the update are the whole batch's.
    The same step on another batch (the negative control) moves the weights elsewhere."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(qwen2_config(ModelShape(64, 1, 2, 128)))
    ref = Qwen2ForCausalLM(qwen2_config(ModelShape(64, 1, 2, 128))).eval() if teacher else None

    def step(groups: int, seed: int = 0):
        m, logs = copy.deepcopy(model), []
        train_lm(m, _batch, PAD, 1e-2, 1, seed, teacher=ref, log=logs.append, groups=groups)
        return logs[-1], torch.cat([p.detach().flatten() for p in m.parameters()])

    w0 = torch.cat([p.detach().flatten() for p in model.parameters()])
    (log1, w1), (log3, w3), (_, other) = step(1), step(3), step(1, seed=1)
    loss1, loss3 = float(log1.split()[-1]), float(log3.split()[-1])
    assert loss1 == pytest.approx(loss3, rel=1e-5, abs=1e-6)
    d1, d3, d_other = w1 - w0, w3 - w0, other - w0  # the update: small beside the weights themselves
    tol = 1e-3 * float(d1.abs().max())
    assert float(d1.abs().max()) > 0 and torch.allclose(d1, d3, rtol=0, atol=tol)
    assert not torch.allclose(d1, d_other, rtol=0, atol=tol)
