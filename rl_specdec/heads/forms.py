"""The EAGLE-3 heads the trainer takes: the forms whose parity with vLLM's drafter is tested, and nothing else.

The trainer's head (:mod:`rl_specdec.heads.eagle3`) computes what vLLM's
``llama_eagle3.Eagle3LlamaForCausalLM`` computes in its plain form; the parity
tests (``tests/test_head_parity.py``) load both from one folder and compare
their draft logits. A published head is read as vLLM reads its
``config.json``, and every option that changes vLLM's computation away from
that form is refused here, with the reason, instead of being trained wrongly.
A head can still be served frozen whatever its form
(``drafter_training.enabled=false``): then only vLLM runs it.
"""

from __future__ import annotations

from pathlib import Path

# architecture -> the drafter vLLM 0.32 builds for it (its registry; the probe in vllm_ext.head_parity checks it)
SUPPORTED = {
    "LlamaForCausalLMEagle3": "llama_eagle3.Eagle3LlamaForCausalLM",
    "Eagle3LlamaForCausalLM": "llama_eagle3.Eagle3LlamaForCausalLM",
}
NEAREST = (
    "the supported form is a one-layer LlamaForCausalLMEagle3 head (silu MLP, no attention or MLP bias, default "
    "rotary embedding, no norm_before_residual/norm_output/norm_before_fc/fc_norm, hidden_size = the target's)"
)
# options vLLM's Llama EAGLE-3 drafter reads, with the value of the supported form
_PLAIN = {
    "num_hidden_layers": 1,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "norm_before_residual": False,
    "norm_output": False,
    "norm_before_fc": False,
    "fc_norm": False,
    "logit_scale": 1.0,
}


def _eagle(config: dict) -> dict:
    return config.get("eagle_config") or {}


def aux_layer_ids(config: dict) -> list[int] | None:
    """The aux layer ids as vLLM's model runner reads them: the top-level key first, then ``eagle_config``."""
    return config.get("eagle_aux_hidden_state_layer_ids") or _eagle(config).get("eagle_aux_hidden_state_layer_ids")


def _option_problems(config: dict) -> list[str]:
    out = []
    for key, plain in _PLAIN.items():
        value = config.get(key, plain)
        if key == "norm_before_fc":
            value = _eagle(config).get(key, value)
        if value is None and key != "num_hidden_layers":
            continue
        if value != plain:
            out.append(f"{key}={value!r} (the trainer's head has {key}={plain!r})")
    if _eagle(config).get("use_aux_hidden_state", True) is not True:
        out.append("eagle_config.use_aux_hidden_state=false (the trainer's head reads the target's aux states)")
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        out.append(f"rotary scaling {rope.get('rope_type', rope.get('type'))!r} (the trainer's head has none)")
    target_hidden = config.get("target_hidden_size")
    if target_hidden not in (None, config.get("hidden_size")):
        out.append(f"target_hidden_size={target_hidden} differs from hidden_size={config.get('hidden_size')}")
    return out


def _aux_problems(config: dict, target_layers: int | None) -> list[str]:
    ids = aux_layer_ids(config)
    if not ids:
        return []
    out = []
    if len(set(ids)) != len(ids):  # vLLM keeps each once, and its fc would read fewer states than it has inputs for
        out.append(f"aux layer ids {ids} repeat a layer")
    if target_layers is not None and not all(0 <= i < target_layers for i in ids):
        out.append(
            f"aux layer ids {ids} must lie in 0..{target_layers - 1} (the residual stream after that many of the "
            f"target's {target_layers} layers; at {target_layers} vLLM reads the pre-norm state, transformers the "
            "post-norm one)"
        )
    count = config.get("num_aux_hidden_states")
    if count is not None and count != len(ids):
        out.append(f"num_aux_hidden_states={count} but {len(ids)} aux layer ids")
    return out


def untrainable(config: dict, target_layers: int | None = None) -> str:
    """Why a head's ``config.json`` (a dict) is not a form the trainer's head mirrors ("" if it is).
    ``target_layers``: the target's layer count, to check the aux layer ids against."""
    if not config:
        return "it has no config.json"
    if "rl_specdec_head" in config:
        return "; ".join(_aux_problems(config, target_layers))
    archs = config.get("architectures") or []
    if not any("Eagle3" in a for a in archs):
        return f"its architectures {archs} are not an EAGLE-3 head's"
    odd = [a for a in archs if a not in SUPPORTED]
    if odd:
        from rl_specdec.vllm_ext.head_parity import drafter_class

        runs = ", ".join(f"{a} as {drafter_class(a) or 'nothing vLLM knows'}" for a in odd)
        return f"vLLM runs {runs}, whose parity with the trainer's head is not tested; {NEAREST}"
    problems = _option_problems(config) + _aux_problems(config, target_layers)
    return "; ".join(problems + ([NEAREST] if problems else []))


def tensor_problems(names: set[str], expected: set[str], own_vocabulary: bool) -> str:
    """Why a head checkpoint's tensor names do not fit the trainer's head ("" if they do): a tensor it does not
    know would change what vLLM drafts without the trainer learning it, so it is refused, never dropped."""
    names = names - {"t2d", "d2t"}  # the draft vocabulary maps (t2d is the inverse of d2t and unused)
    if "embed_tokens.weight" in names:
        return "it holds its own embed_tokens: the trainer learns a head that shares the target's"
    if "lm_head.weight" in names and not own_vocabulary:
        return (
            "it holds its own full-vocabulary lm_head.weight: vLLM drafts with that copy (it shares the policy's "
            "only while they are equal), and the trainer trains through the policy's, so the two would part. "
            "Delete lm_head.weight from the checkpoint to draft through the policy's LM head"
        )
    extra, missing = sorted(names - expected), sorted(expected - names)
    parts = [f"tensors the trainer's head does not have: {extra}"] if extra else []
    parts += [f"no {missing}"] if missing else []
    return "; ".join(parts)


def tensor_names(folder: str | Path) -> set[str]:
    """The tensor names of a head folder's weight files, without loading them."""
    import torch
    from safetensors import safe_open

    names: set[str] = set()
    files = sorted(Path(folder).glob("*.safetensors"))
    for f in files or sorted(Path(folder).glob("*.bin")):
        if f.suffix == ".safetensors":
            with safe_open(str(f), "pt") as handle:
                names |= set(handle.keys())
        else:
            names |= set(torch.load(f, weights_only=True, map_location="meta"))
    return names
