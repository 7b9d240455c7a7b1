"""The torch policy worker in-process on the toy policy: micro-batching must not change results."""

import torch

from rl_specdec.algorithms import ClippedPGLoss
from rl_specdec.algorithms.grpo import build_train_batch
from rl_specdec.config import PolicyConfig
from rl_specdec.generation import GenerationOutput
from rl_specdec.policy import PolicyWorker, token_logprobs_and_entropy
from rl_specdec.toy.build import build_toy_models, build_tokenizer


def _batch():
    tok = build_tokenizer()
    g = torch.Generator().manual_seed(0)
    prompts, responses = [], []
    for n in (3, 9, 5, 14, 7, 4):
        digits = torch.randint(0, 10, (n,), generator=g).tolist()
        prompts.append(tok.encode("".join(map(str, digits)) + "="))
        responses.append(tok.encode("".join(map(str, sorted(digits)))[: n // 2 + 1]) + [tok.eos_token_id])
    out = GenerationOutput(token_ids=responses, logprobs=[[-1.0] * len(r) for r in responses], finish_reasons=["stop"] * len(responses))
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    return build_train_batch(prompts, out, adv, tok.pad_token_id)


def started(path, **kw) -> PolicyWorker:
    """One worker in this process, as the single-worker group runs it (CPU, float32)."""
    w = PolicyWorker(PolicyConfig(model_name=str(path), device="cpu", dtype="float32", **kw), seed=0)
    w.start()
    return w


def test_micro_batching_matches_one_full_batch():
    path = str(build_toy_models().policy)
    batch = _batch()
    whole = started(path, micro_batch_size=100)
    micro = started(path, micro_batch_size=2)

    # log-probs: same values, same (input) order, zeros outside each row's length
    lp_whole, lp_micro = whole.get_logprobs(batch), micro.get_logprobs(batch)
    assert lp_whole.shape == batch["loss_mask"].shape
    assert torch.allclose(lp_whole, lp_micro, atol=1e-5)
    ref, _ = token_logprobs_and_entropy(whole.model.eval(), batch["input_ids"], batch["attention_mask"])
    m = batch["loss_mask"] > 0
    assert torch.allclose(lp_whole[m], ref.detach()[m], atol=1e-5)

    # one optimizer step with accumulation over 3 micro-batches == one step on the whole batch
    loss_fn = ClippedPGLoss(0.2)
    a, b = whole.train_step(batch, loss_fn), micro.train_step(batch, loss_fn)
    for k in ("loss", "pg_loss", "entropy", "grad_norm", "logprob_mismatch", "ratio_error"):
        assert abs(a[k] - b[k]) < 1e-4 * max(1.0, abs(a[k])), k
    sa, sb = whole.state_dict_for_refit(), micro.state_dict_for_refit()
    assert max((sa[k] - sb[k]).abs().max().item() for k in sa) < 1e-5  # vs Adam step size lr = 1e-4
    assert any((sa[k] - started(path).state_dict_for_refit()[k]).abs().max() > 0 for k in sa)  # it trained
