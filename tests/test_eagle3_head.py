"""The EAGLE-3 head in plain torch (no engine): its training-time test is the chain vLLM runs, step by step."""

from __future__ import annotations

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


def test_training_time_test_equals_the_engines_chain():
    torch.manual_seed(0)
    head = Eagle3Head(SHAPE).eval()
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


def test_head_loss_trains_toward_the_target_and_masks_positions():
    torch.manual_seed(1)
    head = Eagle3Head(SHAPE)
    aux, ids = torch.randn(2, 10, 3 * 64), torch.randint(0, 40, (2, 10))
    embed, lm_head = torch.randn(40, 64), torch.randn(40, 64)
    target = torch.log_softmax(torch.randn(2, 10, 40) * 3, -1)
    mask = torch.zeros(2, 10)
    mask[:, 3:8] = 1
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    first, _ = head_loss(head, aux, ids, target, mask, embed, lm_head, 2)
    for _ in range(60):
        loss, agree = head_loss(head, aux, ids, target, mask, embed, lm_head, 2)
        opt.zero_grad()
        loss.backward()
        opt.step()
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


@pytest.mark.parametrize(("layers", "ids"), [(30, (2, 15, 27)), (36, (2, 18, 33)), (8, (2, 4, 5)), (4, (1, 2, 3))])
def test_default_aux_layers_are_vllms_where_distinct(layers, ids):
    assert default_aux_layers(layers) == ids
