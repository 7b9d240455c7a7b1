"""Each prompt computed once for the rows that share it (``rl_specdec.policy.prefix``) equals scoring every row
whole: log-probs, entropies and gradients, on a grouped-query Llama like the real model and on the toy (Qwen2),
and one train step of the worker with and without it."""

from __future__ import annotations

import pytest
import torch
from test_policy_worker import FP32_EPS, adam_step_tolerance, grad_tolerance, started
from test_scoring import tiny_llama, toy_policy

from rl_specdec.grpo import ClippedPGLoss
from rl_specdec.grpo.batch import Trajectory, build_train_batch
from rl_specdec.policy import precision, scoring
from rl_specdec.policy.prefix import find_prefixes, group_order, score_shared
from rl_specdec.policy.scoring import token_logprobs_and_entropy


def grpo_batch(vocab: int, prompt_lengths=(5, 9, 3), group: int = 3, seed: int = 0):
    """Groups of ``group`` rows that share a prompt (of each length given), responses of 2-9 tokens."""
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for p in prompt_lengths:
        prompt = torch.randint(1, vocab, (p,), generator=g).tolist()
        for _ in range(group):
            r = torch.randint(1, vocab, (int(torch.randint(2, 10, (1,), generator=g)),), generator=g).tolist()
            trajs.append(Trajectory.single_turn(prompt, r, [-1.0] * len(r)))
    adv = torch.linspace(-1, 1, len(trajs))
    return build_train_batch(trajs, adv, pad_id=0)


def score_two_ways(model, b, compute=precision.plain, which=None):
    """(shared, whole): log-probs [N, T-1], entropies, parameter gradients of a loss that reads every row."""
    scored = b["loss_mask"] > 0
    out = []
    for shared in (True, False):
        model.zero_grad(set_to_none=True)
        if shared:
            pre = find_prefixes(b["input_ids"], scored)
            assert pre is not None and pre.ids.shape[0] < b["input_ids"].shape[0]
            if which is not None:
                pre.which = which(pre.which)
            lp, ent = score_shared(model, b["input_ids"], b["attention_mask"], scored, pre, True, compute)
        else:
            lp, ent = token_logprobs_and_entropy(
                model, b["input_ids"], b["attention_mask"], with_entropy=True, compute=compute, scored=scored
            )
        weights = torch.linspace(-1, 1, scored.numel()).view_as(scored)
        (lp * weights * scored).sum().backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        out.append((lp.detach(), ent, grads))
    return out


def assert_same_grads(grads: dict, grads0: dict, rel: float = 1e-5) -> None:
    """Equal to float32 rounding, summed in another order: each tensor within ``rel`` of its norm (the real
    model's 30 layers drift to ~8e-6)."""
    assert grads.keys() == grads0.keys()
    for k, g0 in grads0.items():
        assert (grads[k] - g0).norm() <= rel * max(float(g0.norm()), 1e-3), k


def test_shared_prompts_equal_whole_rows_on_a_grouped_query_llama(monkeypatch):
    monkeypatch.setattr(scoring, "CHUNK_ELEMENTS", 7 * 300)  # several chunks of scored rows
    model = tiny_llama()
    b = grpo_batch(300)
    m = b["loss_mask"] > 0
    (lp, ent, grads), (lp0, ent0, grads0) = score_two_ways(model, b)
    assert torch.allclose(lp[m], lp0[m], atol=1e-5, rtol=0) and (lp[~m] == 0).all()
    assert torch.allclose(ent[m], ent0[m], atol=1e-5) and (ent[~m] == 0).all()
    assert_same_grads(grads, grads0)
    # the comparison sees a row continued from another group's prompt
    (wrong, _, _), _ = score_two_ways(model, b, which=lambda w: w.roll(3))
    assert not torch.allclose(wrong[m], lp0[m], atol=1e-2)


def test_shared_prompts_equal_whole_rows_on_the_toy_fp32_and_bf16_mixed(toy):
    model = toy_policy(toy)
    b = grpo_batch(model.config.vocab_size, prompt_lengths=(4, 11, 7, 7), group=4, seed=1)
    m = b["loss_mask"] > 0
    (lp, ent, grads), (lp0, ent0, grads0) = score_two_ways(model, b)
    assert torch.allclose(lp[m], lp0[m], atol=1e-5, rtol=0) and torch.allclose(ent[m], ent0[m], atol=1e-5)
    assert_same_grads(grads, grads0)
    bf16 = precision.compute("bf16-mixed", torch.device("cpu"), fsdp2=False)
    (lp, _, _), (lp0, _, _) = score_two_ways(model, b, compute=bf16)
    assert torch.allclose(lp[m], lp0[m], atol=3e-2, rtol=0)  # the same bf16 matmuls over other shapes


def test_prefixes_are_found_only_where_rows_share_one():
    b = grpo_batch(300, prompt_lengths=(5, 9), group=2)
    scored = b["loss_mask"] > 0
    pre = find_prefixes(b["input_ids"], scored)
    assert pre.which.tolist() == [0, 0, 1, 1] and pre.starts.tolist() == [4, 4, 8, 8]
    assert pre.mask.sum(1).tolist() == [4, 8] and torch.equal(pre.ids[1], b["input_ids"][2, :8])
    assert find_prefixes(b["input_ids"][::2], scored[::2]) is None  # one row a prompt: nothing to share
    none_scored = scored.clone()
    none_scored[1] = False  # a data-parallel padding row
    assert find_prefixes(b["input_ids"], none_scored) is None


def test_group_order_keeps_a_prompt_s_rows_together_longest_first():
    b = grpo_batch(300, prompt_lengths=(3, 12, 6), group=3, seed=2)
    lengths = b["attention_mask"].sum(1)
    order = group_order(b["input_ids"], b["loss_mask"], lengths).tolist()
    assert sorted(order) == list(range(9))
    groups = [i // 3 for i in order]
    assert groups[0:3] == [groups[0]] * 3 and groups[3:6] == [groups[3]] * 3  # contiguous
    assert int(lengths[order[0]]) == int(lengths.max())
    for g in range(3):
        inside = [int(lengths[i]) for i in order[3 * g : 3 * g + 3]]
        assert inside == sorted(inside, reverse=True)


def test_a_train_step_with_shared_prompts_equals_one_on_whole_rows(monkeypatch):
    """The worker's step, micro-batches cutting through groups, with and without ``share_prefix``."""
    import rl_specdec.policy.worker as worker_module
    from rl_specdec.toy.build import build_toy_models

    path = str(build_toy_models().policy)
    b = grpo_batch(13, prompt_lengths=(14, 20, 12, 16, 18), group=4, seed=3)  # the toy's vocabulary
    shared, whole = started(path, micro_batch_size=6), started(path, micro_batch_size=6, share_prefix=False)
    calls = []

    def counted(*args, **kw):
        calls.append(args[1].shape)
        return score_shared(*args, **kw)

    monkeypatch.setattr(worker_module, "score_shared", counted)
    a = shared.train_step(b, ClippedPGLoss(0.2))
    monkeypatch.undo()
    c = whole.train_step(b, ClippedPGLoss(0.2))
    assert len(calls) >= 3  # the shared path ran, on most micro-batches
    for k in ("loss", "pg_loss", "entropy", "grad_norm", "logprob_mismatch"):
        assert abs(a[k] - c[k]) < 1e-4 * max(1.0, abs(a[k])), k
    ga, gc = dict(shared.model.named_parameters()), dict(whole.model.named_parameters())
    sa, sc = shared.state_dict_for_refit(), whole.state_dict_for_refit()
    lr, eps = shared.config.learning_rate, shared.opt.defaults["eps"]
    for name in ga:
        tol = grad_tolerance(ga[name].grad, len(b["input_ids"]))
        assert (ga[name].grad - gc[name].grad).abs().max() <= tol, name
        bound = adam_step_tolerance(ga[name].grad, gc[name].grad, tol, lr, eps)
        assert ((sa[name] - sc[name]).abs() <= bound + 4 * FP32_EPS * (sc[name].abs() + lr)).all(), name


@pytest.mark.integration
def test_shared_prompts_equal_whole_rows_on_the_real_model(smollm2):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    b = grpo_batch(model.config.vocab_size, prompt_lengths=(12, 20), group=3, seed=4)
    m = b["loss_mask"] > 0
    (lp, ent, grads), (lp0, ent0, grads0) = score_two_ways(model, b)
    assert torch.allclose(lp[m], lp0[m], atol=2e-5, rtol=0) and torch.allclose(ent[m], ent0[m], atol=2e-5)
    assert_same_grads(grads, grads0, rel=1e-4)


def test_prompts_are_shared_only_where_that_computes_fewer_tokens():
    """Long prompts and short answers (the real model's chat task) share; short prompts and long-tailed
    answers (the wide pair) pad more in groups than sorted, and stay whole; one worker of a group never shares."""
    from types import SimpleNamespace

    from rl_specdec.policy.worker import PolicyWorker

    worker = SimpleNamespace(config=SimpleNamespace(micro_batch_size=8))
    chat = grpo_batch(300, prompt_lengths=(70, 74, 80), group=8)
    order, bounds, share = PolicyWorker._layout(worker, chat, share=True)
    assert share and bounds == [0, 8, 16, 24] and sorted(order.tolist()) == list(range(24))
    g = torch.Generator().manual_seed(0)
    trajs = []
    for p in (10, 14, 12):
        prompt = torch.randint(1, 300, (p,), generator=g).tolist()
        for r in (4, 6, 8, 10, 12, 20, 40, 250):
            trajs.append(Trajectory.single_turn(prompt, [5] * r, [-1.0] * r))
    tail = build_train_batch(trajs, torch.ones(len(trajs)), pad_id=0)
    order, bounds, share = PolicyWorker._layout(worker, tail, share=True)
    assert not share and sorted(order[:3].tolist()) == [7, 15, 23]  # sorted: the three longest together
    assert not PolicyWorker._layout(worker, chat, share=False)[2]
