"""The EAGLE-3 head in plain torch (no engine): its training-time test is the chain vLLM runs, step by step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rl_specdec.heads.eagle3 import Eagle3Head, HeadShape, default_aux_layers, expected_head_tensors, head_loss

SHAPE = HeadShape(
    hidden_size=64, num_attention_heads=2, head_dim=32, intermediate_size=96, vocab_size=40, aux_layer_ids=(1, 2, 3)
)


def chain_one_base(head: Eagle3Head, aux, ids, embed, t: int, steps: int) -> list[torch.Tensor]:
    """What the engine computes drafting from base ``t``: the first pass over positions <= t with true features,
    then each step alone at the next position, attending to the first pass's keys and the chain's own."""
    from rl_specdec.heads.eagle3 import rms_norm

    n = t + 1
    emb = torch.nn.functional.embedding(ids[:, 1 : n + 1], embed)  # [1, n, H]: x_{s+1} at position s
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    g, k, v = head._layer(emb, head.fc(aux[:, :n]), [], [], torch.arange(n), causal)
    outs, keys, values, g = [rms_norm(g[:, t:], head.norm, SHAPE.rms_norm_eps)], [k], [v], g[:, t:]
    for j in range(1, steps):
        e = torch.nn.functional.embedding(ids[:, t + j + 1 : t + j + 2], embed)  # [1, 1, H]
        g, k, v = head._layer(e, g, keys, values, torch.tensor([t + j]), None)  # a single query sees every key
        keys.append(k)
        values.append(v)
        outs.append(rms_norm(g, head.norm, SHAPE.rms_norm_eps))
    return outs


# published heads group their queries: 4 query heads on 2 key heads
GQA = dataclasses.replace(SHAPE, num_attention_heads=4, head_dim=16, num_key_value_heads=2)


@pytest.mark.parametrize("shape", [SHAPE, GQA], ids=["one key head per query head", "grouped-query"])
def test_training_time_test_equals_the_engines_chain(shape):
    torch.manual_seed(0)
    head = Eagle3Head(shape).eval()
    for p in head.parameters():  # norms away from 1 so a mixed-up norm shows
        torch.nn.init.normal_(p, 1.0 if p.dim() == 1 else 0.0, 0.3 if p.dim() == 1 else 0.1)
    t_len, steps = 12, 3
    aux, ids = torch.randn(1, t_len, 3 * 64), torch.randint(0, 40, (1, t_len))
    embed = torch.randn(40, 64)
    with torch.no_grad():
        ttt = head(aux, ids, embed, steps)
        for t in (0, 4, t_len - steps - 1):
            for j, ref in enumerate(chain_one_base(head, aux, ids, embed, t, steps)):
                assert torch.allclose(ttt[j][:, t], ref[:, 0], atol=1e-5), (t, j)


def fit(head, aux, ids, target, mask, embed, lm_head, steps: int = 60):
    """``steps`` Adam steps of the head's two-step loss: the last (loss, per-step agreement)."""
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    for _ in range(steps):
        loss, agree = head_loss(head, aux, ids, target, mask, embed, lm_head, 2)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss, agree


def test_head_loss_trains_toward_the_target_and_masks_positions():
    torch.manual_seed(1)
    head = Eagle3Head(SHAPE)
    aux, ids = torch.randn(2, 10, 3 * 64), torch.randint(0, 40, (2, 10))
    embed, lm_head = torch.randn(40, 64), torch.randn(40, 64)
    target = torch.log_softmax(torch.randn(2, 10, 40) * 3, -1)
    mask = torch.zeros(2, 10)
    mask[:, 3:8] = 1
    first, _ = head_loss(head, aux, ids, target, mask, embed, lm_head, 2)
    loss, agree = fit(head, aux, ids, target, mask, embed, lm_head)
    assert loss.item() < first.item() - 0.5 and min(agree) > 0.5
    garbage = target.clone()
    garbage[:, :3] = torch.log_softmax(torch.randn(2, 3, 40) * 30, -1)  # rows the mask leaves out
    assert head_loss(head, aux, ids, garbage, mask, embed, lm_head, 2)[0].item() == pytest.approx(loss.item(), rel=0.2)


def test_head_names_are_the_ones_vllm_loads_and_never_the_targets():
    names = expected_head_tensors(
        type("C", (), {**SHAPE.config_json(), "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}})()
    )
    assert names["fc.weight"] == (64, 192) and names["midlayer.self_attn.q_proj.weight"] == (64, 128)
    assert "norm.weight" in names and "midlayer.hidden_norm.weight" in names
    assert not any(n.startswith(("embed_tokens", "lm_head", "model.")) for n in names)


def test_a_draft_vocabulary_head_keeps_its_map_sends_its_own_lm_head_and_learns_over_its_tokens(tmp_path):
    """EAGLE-3's draft vocabulary: the head's own LM head over n target tokens, mapped back by d2t (saved, never
    sent); it learns the target's distribution renormalised over those tokens, so how much of the target's mass
    lies outside them never moves the loss."""
    from rl_specdec.heads.eagle3 import load_head, save_head

    torch.manual_seed(2)
    keep = torch.tensor([1, 4, 5, 9, 20, 33])
    lm_head, embed = torch.randn(40, 64), torch.randn(40, 64)
    head = Eagle3Head(dataclasses.replace(SHAPE, draft_vocab_size=6))
    head.set_draft_vocabulary(keep, lm_head)
    assert torch.equal(head.draft_ids(), keep) and torch.equal(head.lm_head.weight, lm_head[keep])
    sent = head.vllm_state_dict()
    assert sent["lm_head.weight"].shape == (6, 64) and "d2t" not in sent
    config = type("C", (), head.shape.config_json())()
    assert config.draft_vocab_size == 6 and expected_head_tensors(config)["lm_head.weight"] == (6, 64)
    save_head(head, tmp_path)
    loaded = load_head(tmp_path)
    assert torch.equal(loaded.draft_ids(), keep) and torch.equal(loaded.lm_head.weight, head.lm_head.weight)

    aux, ids = torch.randn(2, 10, 3 * 64), torch.randint(0, 40, (2, 10))
    target = torch.log_softmax(torch.randn(2, 10, 40) * 3, -1)
    mask = torch.ones(2, 10)
    elsewhere = target.clone()
    elsewhere[..., keep] -= 3.0  # more of the mass outside the draft vocabulary: renormalised away
    first, _ = head_loss(head, aux, ids, target, mask, embed, lm_head, 2)
    assert head_loss(head, aux, ids, elsewhere, mask, embed, lm_head, 2)[0].item() == pytest.approx(first.item())
    loss, agree = fit(head, aux, ids, target, mask, embed, lm_head)
    assert loss.item() < first.item() - 0.3
    for j, a in enumerate(agree):  # agreement is over the whole vocabulary: a top token off the draft one is a miss
        assert a <= torch.isin(target[:, j + 1 :].argmax(-1), keep).float().mean().item() + 1e-6
    mostly_kept = torch.log_softmax(target + 6.0 * torch.isin(torch.arange(40), keep), -1)
    assert min(fit(head, aux, ids, mostly_kept, mask, embed, lm_head)[1]) > 0.5
    assert torch.equal(head.draft_ids(), keep)  # training moves the LM head, never the map


def test_a_published_head_loads_with_its_grouped_query_attention_and_draft_vocabulary(tmp_path):
    """A one-layer Llama EAGLE-3 head as published: no rl_specdec entry, no aux layers named (vLLM reads its
    default ones of the target), grouped-query attention, a draft vocabulary with d2t and t2d, a .bin file."""
    import json

    from rl_specdec.heads.eagle3 import is_trainable_head, load_head

    shape = dataclasses.replace(GQA, draft_vocab_size=6, aux_layer_ids=default_aux_layers(30))
    torch.manual_seed(3)
    head = Eagle3Head(shape)
    head.set_draft_vocabulary(torch.tensor([1, 4, 5, 9, 20, 33]), torch.randn(40, 64))
    config = {k: v for k, v in shape.config_json().items() if k not in ("rl_specdec_head", "eagle_config")}
    (tmp_path / "config.json").write_text(json.dumps(config))
    torch.save({**head.vllm_state_dict(), "d2t": head.d2t, "t2d": torch.ones(40, dtype=torch.bool)}, tmp_path / "x.bin")
    assert is_trainable_head(tmp_path)
    loaded = load_head(tmp_path, target_layers=30)
    assert loaded.shape == shape and loaded.midlayer.self_attn["k_proj"].weight.shape == (32, 128)
    assert all(torch.equal(loaded.vllm_state_dict()[k], v) for k, v in head.vllm_state_dict().items())
    assert torch.equal(loaded.draft_ids(), head.draft_ids())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    assert not is_trainable_head(tmp_path)
    with pytest.raises(ValueError, match="num_hidden_layers=2"):
        load_head(tmp_path, target_layers=30)


@pytest.mark.parametrize(("layers", "ids"), [(30, (2, 15, 27)), (36, (2, 18, 33)), (8, (2, 4, 5)), (4, (1, 2, 3))])
def test_default_aux_layers_are_vllms_where_distinct(layers, ids):
    assert default_aux_layers(layers) == ids
