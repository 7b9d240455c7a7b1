"""The head-budget study's top-k loss is the build's loss when nothing is cut, and a cut changes it."""

from __future__ import annotations

import dataclasses

import torch

from benchmarks.studies.head_budget import topk_head_loss
from rl_specdec.heads.eagle3 import Eagle3Head, HeadShape, head_loss

SHAPE = HeadShape(
    hidden_size=64, num_attention_heads=2, head_dim=32, intermediate_size=96, vocab_size=40, aux_layer_ids=(1, 2, 3)
)


def setup(seed: int = 0):
    torch.manual_seed(seed)
    head = Eagle3Head(dataclasses.replace(SHAPE, draft_vocab_size=24))
    embed, lm_head = torch.randn(40, 64), torch.randn(40, 64)
    head.set_draft_vocabulary(torch.sort(torch.randperm(40)[:24]).values, lm_head)
    ids = torch.randint(0, 40, (3, 12))  # [B, T]
    mask = torch.zeros(3, 12)
    mask[:, 4:10] = 1  # [B, T]: the rows that predict an answer token
    aux = torch.randn(3, 12, 3 * 64)  # [B, T, 3H]
    logp = torch.log_softmax(3 * torch.randn(3, 12, 40), -1)  # [B, T, V]: a peaked target
    return head, embed, lm_head, ids, mask, aux, logp


def test_the_top_k_loss_at_the_whole_vocabulary_is_the_builds_loss():
    head, embed, lm_head, ids, mask, aux, logp = setup()
    want, _ = head_loss(head, aux, ids, logp, mask, embed, lm_head, 3)
    rows = logp[mask > 0]  # [M, V]
    got = topk_head_loss(head, aux, ids, rows.topk(40, -1), mask, embed, 3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # the same gradients reach the head
    g_want = torch.autograd.grad(want, head.fc.weight)[0]
    g_got = torch.autograd.grad(topk_head_loss(head, aux, ids, rows.topk(40, -1), mask, embed, 3), head.fc.weight)[0]
    torch.testing.assert_close(g_got, g_want, rtol=1e-4, atol=1e-6)


def test_keeping_fewer_log_probs_is_a_different_target():
    """The negative control: the equality above is not one any loss would pass."""
    head, embed, lm_head, ids, mask, aux, logp = setup()
    want, _ = head_loss(head, aux, ids, logp, mask, embed, lm_head, 3)
    got = topk_head_loss(head, aux, ids, logp[mask > 0].topk(3, -1), mask, embed, 3)
    assert abs((got - want).item()) > 1e-3
