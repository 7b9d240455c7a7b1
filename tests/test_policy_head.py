"""An EAGLE-3 head trained inside the policy worker (in-process, toy policy): it learns, and the policy never
feels it."""

import torch
from test_policy_worker import _batch

from rl_specdec.config import DrafterTrainingConfig, GenerationConfig, PolicyConfig
from rl_specdec.grpo import ClippedPGLoss
from rl_specdec.heads.eagle3 import Eagle3Head, HeadShape, load_head, save_head
from rl_specdec.policy import PolicyWorker
from rl_specdec.toy.build import build_toy_models


def random_head(policy_path, folder) -> str:
    from transformers import AutoConfig

    torch.manual_seed(0)
    save_head(Eagle3Head(HeadShape.for_target(AutoConfig.from_pretrained(policy_path), 128)), folder)
    return str(folder)


def worker(path, head=None, every=1, micro_batch_size=100) -> PolicyWorker:
    spec = {"method": "eagle3", "model": head} if head else None
    gen = GenerationConfig(
        vllm_kwargs={"speculative_config": spec},
        drafter_training=DrafterTrainingConfig(enabled=head is not None, learning_rate=3e-3, every=every),
    )
    w = PolicyWorker(
        PolicyConfig(
            model_name=str(path), device="cpu", precision="fp32", micro_batch_size=micro_batch_size, generation=gen
        ),
        seed=0,
    )
    w.start()
    return w


def test_the_head_learns_and_the_policy_update_is_the_same_without_it(tmp_path):
    path = str(build_toy_models().policy)
    head = random_head(path, tmp_path / "head")
    batch, loss_fn = _batch(), ClippedPGLoss(0.2)
    plain, with_head = worker(path, micro_batch_size=2), worker(path, head, micro_batch_size=2)  # 3 micro-batches
    a = plain.train_step(batch, loss_fn)
    b = with_head.train_step(batch, loss_fn)
    assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"])
    pa, pb = plain.state_dict_for_refit(), with_head.state_dict_for_refit()
    assert all(torch.equal(pa[k], pb[k]) for k in pa)  # no gradient of the head's reached the policy
    first = with_head.head_result()
    assert first["version"] == 1.0 and set(first) >= {"loss", "agreement_1", "agreement_3", "time_s"}
    for _ in range(7):
        with_head.train_step(batch, loss_fn)
    last = with_head.head_result()
    assert last["version"] == 8.0 and last["loss"] < first["loss"] - 0.5, (first, last)
    sent = with_head.head_state_dict_for_refit()
    assert set(sent) == set(load_head(head).vllm_state_dict()) and not any("embed" in k or "lm_head" in k for k in sent)
    assert not torch.equal(sent["fc.weight"], load_head(head).vllm_state_dict()["fc.weight"])


def test_the_head_follows_its_schedule_and_comes_back_from_a_checkpoint(tmp_path):
    path = str(build_toy_models().policy)
    head = random_head(path, tmp_path / "head")
    batch, loss_fn = _batch(), ClippedPGLoss(0.2)
    w = worker(path, head, every=2)
    w.train_step(batch, loss_fn)
    assert w.head_result() == {}  # update 1 of every 2: no head step
    w.train_step(batch, loss_fn)
    assert w.head_result()["version"] == 1.0
    w.save_checkpoint(str(tmp_path / "ckpt"))
    w.train_step(batch, loss_fn)
    w.train_step(batch, loss_fn)
    back = worker(path, head, every=2)
    back.load_checkpoint(str(tmp_path / "ckpt"))
    saved = load_head(tmp_path / "ckpt" / "head").vllm_state_dict()
    assert all(torch.equal(back.head_state_dict_for_refit()[k], v) for k, v in saved.items())
    back.train_step(batch, loss_fn)
    back.train_step(batch, loss_fn)  # the schedule resumes in phase: this is update 4, a head step
    assert back.head_result()["version"] == 2.0


def test_under_bf16_compute_the_head_runs_its_matmuls_in_bf16_and_keeps_fp32_weights(tmp_path):
    """A policy that computes in bf16 (bf16-mixed) has its head's loss computed in bf16 too: the same loss to
    bf16's accuracy, not bit for bit, with the head's weights and gradients still fp32."""
    from rl_specdec.heads.eagle3 import micro_batch_loss

    path = str(build_toy_models().policy)
    head = load_head(random_head(path, tmp_path / "head"))
    h, v, n, t = head.shape.hidden_size, head.shape.vocab_size, 2, 12
    g = torch.Generator().manual_seed(0)
    states = [torch.randn(n, t, h, generator=g) for _ in range(max(head.shape.aux_layer_ids) + 1)]
    logp = torch.log_softmax(torch.randn(n * (t - 1), v, generator=g), -1)  # [M, V]: every position a response
    mb = {"input_ids": torch.randint(0, v, (n, t), generator=g), "loss_mask": torch.ones(n, t - 1)}
    embed, lm_head = torch.randn(v, h, generator=g) * 0.1, torch.randn(v, h, generator=g) * 0.1
    fp32, _, tokens = micro_batch_loss(head, states, logp, mb, embed, lm_head, 3, bf16=False)
    bf16, _, _ = micro_batch_loss(head, states, logp, mb, embed, lm_head, 3, bf16=True)
    assert tokens == n * (t - 1) and bf16.dtype == torch.float32
    assert fp32.item() != bf16.item() and abs(fp32.item() - bf16.item()) < 2e-2 * abs(fp32.item())
    bf16.backward()
    assert all(p.dtype == torch.float32 and p.grad is not None for p in head.parameters())
