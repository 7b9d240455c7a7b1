"""Scoring only the response tokens, a chunk of positions at a time, equals scoring the whole vocabulary at
every position (``rl_specdec.policy.scoring``): the log-probs, the entropy, a head's soft targets and the
gradients, on the toy (Qwen2), a grouped-query Llama like the real model, and the real model itself."""

from __future__ import annotations

import pytest
import torch

from rl_specdec.heads.eagle3 import head_loss
from rl_specdec.policy import precision, scoring
from rl_specdec.policy.scoring import output_head, token_logprobs_and_entropy


def tiny_llama(vocab: int = 300):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,  # as SmolLM2
    )
    return LlamaForCausalLM(cfg).float()


def toy_policy(toy):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(toy.policy, dtype=torch.float32)


def batch(vocab: int, n: int = 5, t: int = 17, seed: int = 0):
    """Right-padded rows of different lengths; the response is each row's last few real tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (n, t), generator=g)  # [N, T]
    lengths = torch.tensor([t, t - 3, t - 6, 9, t - 1])[:n]
    mask = (torch.arange(t)[None, :] < lengths[:, None]).long()  # [N, T]
    ids = ids * mask
    prompt = torch.tensor([4, 6, 3, 5, 8])[:n]
    pos = torch.arange(t - 1)[None, :]
    loss_mask = ((pos >= prompt[:, None] - 1) & (pos < lengths[:, None] - 1)).float()  # [N, T-1]
    return ids, mask, loss_mask


def same_to_rounding(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5) -> bool:
    """Equal within float32 rounding of the tensor's own scale: a gradient sums many positions, and how a kernel
    blocks that sum moves entries near zero by ~1e-7 of the largest (an elementwise rtol would fail there)."""
    return float((a - b).abs().max()) <= rel * float(b.abs().max())


def score_both(model, ids, mask, scored, compute=precision.plain):
    """(the chunked path's, the whole vocabulary's) log-probs, entropies, targets and parameter gradients."""
    results = []
    for whole in (False, True):
        seen = {}
        model.zero_grad(set_to_none=True)
        fn = scoring._whole_vocabulary if whole else None
        kw = dict(with_entropy=True, compute=compute, features=lambda _h, tgt: seen.update(target=tgt))
        if fn is None:
            logp, ent = token_logprobs_and_entropy(model, ids, mask, scored=scored, **kw)
        else:
            more = {"output_hidden_states": True}
            logp, ent = fn(model, ids, mask, True, compute, kw["features"], scored > 0, more)
        weights = torch.linspace(-1, 1, scored.numel()).view_as(scored)  # a loss that reads every scored row
        (logp * weights * scored).sum().backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        results.append((logp.detach(), ent, seen["target"], grads))
    return results


@pytest.mark.parametrize("chunk_elements", [scoring.CHUNK_ELEMENTS, 7 * 300])  # one chunk; chunks of 7 rows
def test_chunked_scoring_equals_the_whole_vocabulary_on_a_grouped_query_llama(monkeypatch, chunk_elements):
    monkeypatch.setattr(scoring, "CHUNK_ELEMENTS", chunk_elements)
    model = tiny_llama()
    assert output_head(model) is model.lm_head
    ids, mask, loss_mask = batch(300)
    (lp, ent, tgt, grads), (lp0, ent0, tgt0, grads0) = score_both(model, ids, mask, loss_mask)
    m = loss_mask > 0
    assert torch.allclose(lp[m], lp0[m], atol=1e-5, rtol=0) and (lp[~m] == 0).all()
    assert torch.allclose(ent[m], ent0[m], atol=1e-5) and (ent[~m] == 0).all()
    assert tgt.shape == (int(m.sum()), 300) and torch.allclose(tgt, tgt0, atol=1e-5)
    assert grads.keys() == grads0.keys()
    for k in grads:
        assert same_to_rounding(grads[k], grads0[k]), k
    # the comparison sees an off-by-one position: the log-probs one row later are not these
    assert not torch.allclose(lp[m], lp0.roll(1, dims=1)[m], atol=1e-3)
    # and the gradients' comparison sees one scored token left out
    fewer = loss_mask.clone()
    fewer[0, fewer[0].nonzero()[0]] = 0
    (_, _, _, grads1), _ = score_both(model, ids, mask, fewer)
    assert not all(same_to_rounding(grads1[k], grads0[k]) for k in grads0)


def test_chunked_scoring_equals_the_whole_vocabulary_on_the_toy_fp32_and_bf16_mixed(toy, monkeypatch):
    monkeypatch.setattr(scoring, "CHUNK_ELEMENTS", 5 * 64)  # several chunks even at the toy's small vocabulary
    model = toy_policy(toy)
    vocab = model.config.vocab_size
    ids, mask, loss_mask = batch(vocab, seed=1)
    m = loss_mask > 0
    (lp, _, tgt, grads), (lp0, _, tgt0, grads0) = score_both(model, ids, mask, loss_mask)
    assert torch.allclose(lp[m], lp0[m], atol=1e-5, rtol=0) and torch.allclose(tgt, tgt0, atol=1e-5)
    for k in grads:
        assert same_to_rounding(grads[k], grads0[k]), k
    bf16 = precision.compute("bf16-mixed", torch.device("cpu"), fsdp2=False)
    (lp, _, _, _), (lp0, _, _, _) = score_both(model, ids, mask, loss_mask, compute=bf16)
    assert torch.allclose(lp[m], lp0[m], atol=2e-2, rtol=0)  # the same bf16 matmuls, chunked
    # every real token scored by default, as get_logprobs scores them
    whole, _ = token_logprobs_and_entropy(model, ids, mask)
    assert ((whole != 0) == (mask[:, 1:] > 0)).all()


def test_a_micro_batch_with_nothing_scored_still_reaches_every_parameter():
    """A data-parallel group pads with rows that score nothing: their loss is 0 and DDP needs every grad."""
    model = tiny_llama()
    ids, mask, loss_mask = batch(300)
    logp, ent = token_logprobs_and_entropy(model, ids, mask, with_entropy=True, scored=torch.zeros_like(loss_mask))
    assert (logp == 0).all() and (ent == 0).all()
    logp.sum().backward()
    assert all(p.grad is not None and (p.grad == 0).all() for p in model.parameters())


def test_the_head_loss_reads_target_rows_as_it_reads_the_padded_distribution(tmp_path):
    """The trainer hands a head only the response rows' distributions [M, V]; its loss is the loss of the
    padded [B, T, V] form it had, and a row out of order changes it."""
    from rl_specdec.heads.eagle3 import Eagle3Head, HeadShape

    g = torch.Generator().manual_seed(0)
    b, t, h, v = 3, 10, 32, 50
    shape = HeadShape(h, 4, 8, 64, v, (0, 1, 2), num_key_value_heads=2)
    head = Eagle3Head(shape)
    aux, ids = torch.randn(b, t, 3 * h, generator=g), torch.randint(0, v, (b, t), generator=g)
    full = torch.log_softmax(torch.randn(b, t, v, generator=g), -1)  # [B, T, V]
    mask = torch.zeros(b, t)
    mask[0, 3:8], mask[1, 1:5], mask[2, 6:9] = 1, 1, 1
    embed, lm_head = torch.randn(v, h, generator=g) * 0.1, torch.randn(v, h, generator=g) * 0.1
    padded, agree = head_loss(head, aux, ids, full, mask, embed, lm_head, 3)
    rows, agree_rows = head_loss(head, aux, ids, full[mask > 0], mask, embed, lm_head, 3)
    assert torch.equal(padded, rows) and agree == agree_rows
    shuffled = full[mask > 0].roll(1, dims=0)
    assert not torch.allclose(head_loss(head, aux, ids, shuffled, mask, embed, lm_head, 3)[0], padded)


@pytest.mark.integration
def test_chunked_scoring_equals_the_whole_vocabulary_on_the_real_model(smollm2):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    assert output_head(model) is not None
    ids, mask, loss_mask = batch(model.config.vocab_size, n=3, t=24, seed=2)
    (lp, ent, tgt, grads), (lp0, ent0, tgt0, grads0) = score_both(model, ids, mask, loss_mask)
    m = loss_mask > 0
    assert torch.allclose(lp[m], lp0[m], atol=2e-5, rtol=0) and torch.allclose(ent[m], ent0[m], atol=2e-5)
    assert torch.allclose(tgt, tgt0, atol=2e-5)
    for k in grads:
        assert torch.allclose(grads[k], grads0[k], atol=1e-6, rtol=1e-3), k
