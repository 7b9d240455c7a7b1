"""policy.precision in one process: what each mode keeps in which dtype, what it computes in, what a
checkpoint holds and what the refit sends; the drafter trainer follows. The last test starts bf16 engines.

1 worker against 2 (DDP, FSDP2) under bf16-mixed: test_policy_group.py. The config checks: test_config.py.
"""

from __future__ import annotations

import pytest
import torch

from adam_steps import BF16_UNIT, adam_step, adam_step_from_checkpoint, assert_adam_first_step, gradient
from conftest import dist_samples, draft_spec, position_test, start_engine
from rl_specdec.config import PolicyConfig
from rl_specdec.config.generation import GenerationConfig
from rl_specdec.grpo import ClippedPGLoss
from rl_specdec.grpo.batch import Trajectory, build_train_batch
from rl_specdec.policy import PolicyWorker, scoring, token_logprobs_and_entropy

LOSS = ClippedPGLoss(0.2, kl_coef=0.05)  # runs the frozen reference too
LR = 1e-4


def make_batch(tokenizer, seed: int, n: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    trajectories = []
    for _ in range(n):
        digits = torch.randint(0, 10, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        prompt = tokenizer.encode("".join(map(str, digits)) + "=")
        response = tokenizer.encode("".join(map(str, sorted(digits)))) + [tokenizer.eos_token_id]
        trajectories.append(
            Trajectory.single_turn(prompt, response, (-0.5 - torch.rand(len(response), generator=g)).tolist())
        )
    return build_train_batch(trajectories, torch.randn(n, generator=g), tokenizer.pad_token_id)


def started(path, precision: str, engines: str | None = None, **kw) -> PolicyWorker:
    gen = GenerationConfig(vllm_kwargs={"dtype": engines} if engines else {})
    w = PolicyWorker(
        PolicyConfig(model_name=str(path), device="cpu", precision=precision, micro_batch_size=4, generation=gen, **kw),
        keep_reference=True,
        seed=0,
    )
    w.start()
    return w


def linear_output_dtypes(worker: PolicyWorker, batch, monkeypatch) -> dict[str, set]:
    """The dtypes the policy's and the reference's matmuls produce over one train step (the LM heads' in the
    chunks that score the response tokens, rl_specdec.policy.scoring)."""
    seen: dict[str, set] = {"policy": set(), "reference": set(), "lm_head": set()}
    hooks = [
        m.register_forward_hook(lambda _m, _i, out, key=key: seen[key].add(out.dtype))
        for key, model in (("policy", worker.model), ("reference", worker.ref))
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) and m is not model.get_output_embeddings()
    ]

    def recorded(h, w, b):
        out = scoring.F.linear(h, w, b)
        seen["lm_head"].add(out.dtype)
        return out

    monkeypatch.setattr(scoring, "lm_head_logits", recorded)
    worker.train_step(batch, LOSS)
    monkeypatch.undo()
    for h in hooks:
        h.remove()
    return seen


def dtypes(tensors) -> set:
    return {t.dtype for t in tensors}


def first_step_error(toy, tokenizer, seed: int) -> float:
    """|g_bf16-mixed - g_fp32| / |g_fp32| of the first step on the batch of ``seed``, from fresh workers."""
    batch = make_batch(tokenizer, seed=seed)
    fp32, mixed = started(toy.policy, "fp32"), started(toy.policy, "bf16-mixed")
    fp32.train_step(batch, LOSS)
    mixed.train_step(batch, LOSS)
    g32 = gradient(adam_step(fp32.model.named_parameters(), fp32.opt))
    g16 = gradient(adam_step(mixed.model.named_parameters(), mixed.opt))
    return ((g16 - g32).norm() / g32.norm()).item()


def test_bf16_mixed_keeps_fp32_master_weights_and_computes_in_bf16(toy, tokenizer, monkeypatch):
    batch = make_batch(tokenizer, seed=1)
    fp32, mixed = started(toy.policy, "fp32"), started(toy.policy, "bf16-mixed")
    before = {n: p.detach().clone() for n, p in mixed.model.named_parameters()}
    assert dtypes(mixed.model.parameters()) == {torch.float32} and dtypes(mixed.ref.parameters()) == {torch.bfloat16}
    bf16, fp32_ = {torch.bfloat16}, {torch.float32}
    assert linear_output_dtypes(mixed, batch, monkeypatch) == {"policy": bf16, "reference": bf16, "lm_head": bf16}
    assert linear_output_dtypes(fp32, batch, monkeypatch) == {"policy": fp32_, "reference": fp32_, "lm_head": fp32_}
    step = adam_step(mixed.model.named_parameters(), mixed.opt)
    assert_adam_first_step(before, step, LR)  # fp32 weights and moments, stepped in fp32
    g32, g16 = gradient(adam_step(fp32.model.named_parameters(), fp32.opt)), gradient(step)
    errs = [((g16 - g32).norm() / g32.norm()).item()] + [first_step_error(toy, tokenizer, s) for s in (2, 3, 4, 5)]
    # a bf16 computation's error: not fp32's (< 2^-10 even with the bf16 reference), not garbage. One batch's
    # error moves from 1.6 to 12 units between batches (the toy's weights differ with the machine that built
    # them), so the bound is on the median of five
    assert BF16_UNIT / 4 < sorted(errs)[2] < 8 * BF16_UNIT, errs
    logp, _ = token_logprobs_and_entropy(
        mixed.model, batch["input_ids"], batch["attention_mask"], compute=mixed.compute
    )
    assert logp.dtype == torch.float32  # the loss's log-softmax stays fp32


def test_bf16_mixed_checkpoint_holds_fp32_and_resumes_adam(toy, tokenizer, tmp_path):
    b1, b2 = make_batch(tokenizer, seed=1), make_batch(tokenizer, seed=2)
    w = started(toy.policy, "bf16-mixed")
    w.train_step(b1, LOSS)
    w.save_checkpoint(str(tmp_path / "ckpt"))
    saved = adam_step_from_checkpoint(tmp_path / "ckpt")
    for part in ("params", "exp_avg", "exp_avg_sq"):
        assert dtypes(saved[part].values()) == {torch.float32}, part
    live = adam_step(w.model.named_parameters(), w.opt)
    # the master weights, not a bf16 copy
    assert all(torch.equal(saved["params"][n], live["params"][n]) for n in live["params"])
    again = started(toy.policy, "bf16-mixed")
    again.load_checkpoint(str(tmp_path / "ckpt"))
    w.train_step(b2, LOSS)
    again.train_step(b2, LOSS)
    m1, m2 = (gradient(adam_step(x.model.named_parameters(), x.opt)) for x in (w, again))
    assert (
        m1 - m2
    ).norm() <= 1e-6 * m1.norm()  # Adam's moments came back: a fresh Adam's would be 0.1 g2, not 0.09 g1 + 0.1 g2


@pytest.mark.parametrize("precision, engines", [("bf16-mixed", None), ("fp32", "bfloat16")])
def test_refit_sends_the_engines_dtype(toy, precision, engines):
    w = started(toy.policy, precision, engines)
    sd = w.state_dict_for_refit()
    assert set(sd) == set(w.model.state_dict()) and dtypes(sd.values()) == {torch.bfloat16}
    assert sd["lm_head.weight"] is sd["model.embed_tokens.weight"]  # tied: sent once, under both names
    assert all(torch.equal(sd[n], p.detach().to(torch.bfloat16)) for n, p in w.model.named_parameters())
    assert dtypes(w.model.parameters()) == {torch.float32}  # the master weights stay fp32
    buckets = list(w.state_dict_buckets(300_000))
    assert len(buckets) > 5 and all(dtypes(b.values()) == {torch.bfloat16} for b in buckets)
    for b in buckets:  # bounded in the bytes that travel (2 per weight), a tensor larger than a bucket alone
        unique = {id(t): t for t in b.values()}.values()
        assert len(unique) == 1 or sum(t.numel() * t.element_size() for t in unique) <= 300_000


def test_fsdp2_gathers_and_computes_in_bf16_and_reduces_in_fp32():
    """Not observable in test_policy_group's 2-worker step: its gradients are bf16-rounded per rank
    (FSDP2's unsharded gradients are bf16), and a bf16 sum adds less than bf16 compute's own error."""
    from rl_specdec.policy.precision import fsdp2_policy

    mp = fsdp2_policy("bf16-mixed")
    assert (mp.param_dtype, mp.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert fsdp2_policy("fp32") is None and fsdp2_policy("bf16") is None


def test_fp32_refit_is_the_live_fp32_weights(toy):
    w = started(toy.policy, "fp32")
    sd = w.state_dict_for_refit()
    assert all(sd[n].data_ptr() == p.data_ptr() for n, p in w.model.named_parameters())  # no copy, as before precision


def test_bf16_keeps_everything_in_bf16_and_rounds_small_updates_away(toy, tokenizer):
    batch = make_batch(tokenizer, seed=1)
    lr = 1e-6  # the GPU configs' learning rate
    mixed, bf16 = started(toy.policy, "bf16-mixed", learning_rate=lr), started(toy.policy, "bf16", learning_rate=lr)
    before = {n: p.detach().float() for n, p in bf16.model.named_parameters()}
    for w in (mixed, bf16):
        w.train_step(batch, LOSS)
    step = adam_step(bf16.model.named_parameters(), bf16.opt)
    for part in ("params", "exp_avg", "exp_avg_sq"):
        assert dtypes(step[part].values()) == {torch.bfloat16}, part
    assert dtypes(bf16.state_dict_for_refit().values()) == {torch.bfloat16}

    def moved(w) -> float:  # share of the weights the step changed
        changed = sum(int((p.detach().float() != before[n]).sum()) for n, p in w.model.named_parameters())
        return changed / sum(p.numel() for p in w.model.parameters())

    # the documented risk: a step of 1e-6 is below half a bf16 step of any weight larger than ~2.6e-4
    assert moved(mixed) > 0.99 and moved(bf16) < 0.05, (moved(mixed), moved(bf16))


def test_drafter_trainer_follows_the_precision(toy, tokenizer):
    from rl_specdec.config.generation import DrafterTrainingConfig
    from rl_specdec.drafter.trainer import DrafterTrainer, distill_batch

    g = torch.Generator().manual_seed(0)
    prompts = [tokenizer.encode(f"{n}=") for n in (314, 27182, 1414)]
    responses = [tokenizer.encode(s) + [tokenizer.eos_token_id] for s in ("134", "12278", "1144")]
    top = [
        [{int(t): float(-torch.rand(1, generator=g)) for t in torch.randint(0, 12, (4,), generator=g)} for _ in r]
        for r in responses
    ]
    seqs = [(p + r, [(len(p), ts)]) for p, r, ts in zip(prompts, responses, top)]
    batch = distill_batch(seqs, top_k=4, pad_id=tokenizer.pad_token_id)
    t = DrafterTrainer(str(toy.drafter), DrafterTrainingConfig(), precision="bf16-mixed", num_threads=1)
    seen = set()
    hooks = [
        m.register_forward_hook(lambda _m, _i, out: seen.add(out.dtype))
        for m in t.model.modules()
        if isinstance(m, torch.nn.Linear)
    ]
    t.train(batch)
    for h in hooks:
        h.remove()
    assert seen == {torch.bfloat16} and dtypes(t.model.parameters()) == {torch.float32}
    assert dtypes(s for st in t.opt.state.values() for s in (st["exp_avg"], st["exp_avg_sq"])) == {torch.float32}
    assert dtypes(t.state_dict_for_refit().values()) == {torch.bfloat16}


# ---- bf16 engines: speculation adds nothing over no speculation ------------------------------------


@pytest.mark.integration
def test_bf16_speculation_samples_what_bf16_without_it_samples(local_ray, toy, tokenizer):
    """The temperature-1 distribution test of test_generation.py, both engines in bf16: draft_model
    speculation changes nothing at bf16 either (the lossless tests stay in fp32, where they are exact)."""
    engines = {
        name: start_engine(toy.policy, spec, dtype="bfloat16")
        for name, spec in (("plain", None), ("draft", draft_spec(toy.drafter)))
    }
    try:
        assert all(e.engine_info[0]["settings"]["dtype"] == "bfloat16" for e in engines.values())
        plain = dist_samples(engines["plain"], tokenizer, seed=1000)
        spec = dist_samples(engines["draft"], tokenizer, seed=2000)
    finally:
        for e in engines.values():
            e.shutdown()
    p, per_pos = position_test(plain, spec)
    assert p > 1e-3, (
        f"bf16: draft_model speculation samples another distribution than no speculation (adjusted p={p:.2e}; "
        f"{per_pos})"
    )
