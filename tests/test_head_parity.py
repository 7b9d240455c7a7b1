"""The trainer's EAGLE-3 head and vLLM's drafter are one function: same weights in, same draft logits out.

Each case saves a random target and a random head (norms away from 1, so a mixed-up norm shows), loads both
into vLLM's own modules in this process (``rl_specdec.vllm_ext.head_parity``: vLLM's loader, its aux-layer
reading, its embedding and LM-head sharing; plain attention in place of the paged kernel), and compares the
logits of the first pass and each chained step with the trainer's head fed the transformers target's hidden
states. The negative controls put one fault each into the trainer's side and show the comparison fails.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from rl_specdec.heads import eagle3
from rl_specdec.heads.eagle3 import Eagle3Head, HeadShape, load_head, save_head

VOCAB, STEPS, T = 48, 3, 12
# float32 rounding through three chained draft steps: up to 1.1e-5 measured (an AVX-512 CPU), 4e-7-8e-6 elsewhere;
# every fault the negative controls put in gives 1.8 or more
ROUNDING = 1e-4


def _target(kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, max_position_embeddings=64)
    if kind == "qwen2":  # the toys' architecture: one key head per query head, biased q/k/v
        config = Qwen2Config(num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=4, **common)
        return Qwen2ForCausalLM(config)
    if kind == "llama":  # shaped like SmolLM2-135M: grouped-query 3:1, tied embeddings, theta 1e5
        config = LlamaConfig(
            num_hidden_layers=6,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=True,
            rope_theta=100000.0,
            **{**common, "hidden_size": 96},
        )
        return LlamaForCausalLM(config)
    # Qwen3-8B's form, scaled down (configs/qwen3_eagle3.yaml): q/k norms, grouped-query 4:1, untied
    config = Qwen3Config(
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        **common,
    )
    return Qwen3ForCausalLM(config)


def _randomise(module: torch.nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    for p in module.parameters():
        torch.nn.init.normal_(p, 1.0 if p.dim() == 1 else 0.0, 0.3 if p.dim() == 1 else 0.1)


def _published(head: Eagle3Head, folder, ids_key: list[int] | None) -> None:
    """Save ``head`` as a published head is: vLLM's keys only, a t2d beside d2t, aux ids top-level (or none)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    config = {k: v for k, v in head.shape.config_json().items() if k not in ("rl_specdec_head", "eagle_config")}
    if ids_key:
        config["eagle_aux_hidden_state_layer_ids"] = ids_key
    (folder / "config.json").write_text(json.dumps(config))
    tensors = {k: v.detach().contiguous() for k, v in head.vllm_state_dict().items()}
    if head.shape.draft_vocab_size:
        tensors |= {"d2t": head.d2t, "t2d": torch.zeros(VOCAB, dtype=torch.bool)}
    save_file(tensors, str(folder / "model.safetensors"))


CASES = {  # target, grouped-query head, draft vocabulary, published form (aux ids as written)
    "qwen2 target": ("qwen2", 0, 0, None),
    "qwen2 target, GQA head, draft vocabulary": ("qwen2", 2, 20, None),
    "llama target (SmolLM2-shaped), GQA head": ("llama", 2, 0, None),
    "llama target, draft vocabulary, published with unsorted aux ids": ("llama", 3, 24, [4, 1, 3]),
    "qwen3 target, published Tengyunw-shaped head, default aux ids": ("qwen3", 2, 32, []),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """case -> (the trainer's head, the transformers target, vLLM's pair), all from one pair of folders."""
    from rl_specdec.vllm_ext.head_parity import DrafterPair, release

    out = {}
    for i, (name, (kind, kv, draft, ids)) in enumerate(CASES.items()):
        d = tmp_path_factory.mktemp(f"case{i}")
        target = _target(kind)
        _randomise(target, i)
        target.eval().save_pretrained(d / "target")
        shape = HeadShape.for_target(target.config)
        shape = dataclasses.replace(shape, num_key_value_heads=kv, draft_vocab_size=draft)
        head = Eagle3Head(dataclasses.replace(shape, aux_layer_ids=tuple(ids)) if ids else shape)
        _randomise(head, 100 + i)
        if draft:
            keep = torch.randperm(VOCAB)[:draft].sort().values
            head.set_draft_vocabulary(keep, torch.randn(VOCAB, shape.hidden_size))
        if ids is None:
            save_head(head, d / "head")
        else:
            _published(head, d / "head", ids)
        loaded = load_head(d / "head", target.config.num_hidden_layers).eval()  # as the policy workers load it
        out[name] = (loaded, target, DrafterPair(str(d / "target"), str(d / "head"), STEPS))
    yield out
    release()


def trainer_logits(head: Eagle3Head, target, ids: torch.Tensor, order=None) -> list[torch.Tensor]:
    """The trainer's draft logits over the target's vocabulary, [T, V] per step (``-inf`` off a draft
    vocabulary). ``order``: the aux states concatenated in this order of the head's ids (a fault to show)."""
    with torch.no_grad():
        states = target(ids[None], output_hidden_states=True).hidden_states
        layers = order or head.shape.aux_layer_ids
        aux = torch.cat([states[i] for i in layers], -1)  # [1, T, n*H]
        outs = head(aux, ids[None], target.get_input_embeddings().weight, STEPS)
        if not head.shape.draft_vocab_size:
            return [o[0] @ target.get_output_embeddings().weight.T for o in outs]
        full = []
        for o in outs:
            logits = torch.full((ids.shape[0], VOCAB), float("-inf"))
            logits[:, head.draft_ids()] = o[0] @ head.lm_head.weight.T
            full.append(logits)
        return full


def gap(built_case, order=None) -> float:
    """The largest relative difference between the trainer's and vLLM's draft logits over three bases and every step."""
    head, target, pair = built_case
    torch.manual_seed(7)
    ids = torch.randint(0, VOCAB, (T,))
    mine, worst = trainer_logits(head, target, ids, order), 0.0
    for t in (0, 4, T - STEPS - 1):
        for j, theirs in enumerate(pair.draft_logits(ids, t, STEPS)):
            ours = mine[j][t]
            assert torch.equal(torch.isinf(ours), torch.isinf(theirs)), "a different draft vocabulary"
            finite = torch.isfinite(ours)
            diff = (ours[finite] - theirs[finite]).abs() / (1 + theirs[finite].abs())  # float32 rounding scales
            worst = max(worst, float(diff.max()))
    return worst


@pytest.mark.integration  # vLLM's own drafter modules in this process (the fixture's builds take ~25 s)
@pytest.mark.parametrize("case", list(CASES))
def test_the_trainers_head_drafts_what_vllm_drafts(built, case):
    head, target, pair = built[case]
    with torch.no_grad():
        states = target(torch.arange(T)[None] % VOCAB, output_hidden_states=True).hidden_states
    aux = torch.cat([states[i][0] for i in head.shape.aux_layer_ids], -1)
    assert torch.allclose(aux, pair.target_aux(torch.arange(T) % VOCAB), atol=1e-5), "the aux states differ"
    assert gap(built[case]) < ROUNDING


@pytest.mark.integration
def test_a_shuffled_aux_order_is_caught(built):
    case = built["llama target (SmolLM2-shaped), GQA head"]
    ids = case[0].shape.aux_layer_ids
    assert gap(case) < ROUNDING and gap(case, order=ids[::-1]) > 1e-3


@pytest.mark.integration
def test_a_missing_norm_is_caught(built, monkeypatch):
    case = built["qwen2 target"]
    monkeypatch.setattr(eagle3, "rms_norm", lambda x, weight, eps: x * weight)  # every norm without its division
    assert gap(case) > 1e-3


def test_a_head_with_a_tensor_the_trainer_lacks_is_refused(tmp_path):
    """A head carrying Qwen3-style q/k norms under the Llama architecture: vLLM's Llama head would fail or skip
    them; the trainer refuses the checkpoint instead of dropping them."""
    from safetensors.torch import save_file

    shape = HeadShape(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=16,
        intermediate_size=96,
        vocab_size=VOCAB,
        aux_layer_ids=(1, 2, 3),
    )
    head = Eagle3Head(shape)
    save_head(head, tmp_path)
    tensors = {**head.vllm_state_dict(), "midlayer.self_attn.q_norm.weight": torch.ones(16)}
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"does not have: \['midlayer.self_attn.q_norm.weight'\]"):
        load_head(tmp_path)
    save_file(
        {
            **{k: v.detach().contiguous() for k, v in head.vllm_state_dict().items()},
            "lm_head.weight": torch.zeros(VOCAB, 64),
        },
        str(tmp_path / "model.safetensors"),
    )
    with pytest.raises(ValueError, match="full-vocabulary lm_head.weight"):
        load_head(tmp_path)
