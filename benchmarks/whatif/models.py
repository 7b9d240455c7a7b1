"""Model shapes: the Qwen3 configs, the draft heads, the CPU toys, and what a forward pass reads and computes.

Every shape is the model's ``config.json`` (Hugging Face hub), quoted in ``source``.
Counts are per forward pass of one token unless said otherwise.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ModelConfig:
    """A decoder's shape. ``attn_in``: the attention input width in units of ``hidden`` (2 for an EAGLE-3
    layer, which attends over [embedding, hidden state]); ``extra_dense``: matmul weights beyond the layers
    and the LM head (EAGLE-3's fc 3h->h, an MTP layer's projection 2h->h); ``lm_vocab``: the rows of the LM
    head read per pass (EAGLE-3's reduced draft vocabulary), default ``vocab``."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    source: str
    attn_in: int = 1
    extra_dense: float = 0.0
    lm_vocab: int | None = None

    @property
    def layer_params(self) -> float:
        q = self.attn_in * self.hidden * self.heads * self.head_dim
        kv = 2 * self.attn_in * self.hidden * self.kv_heads * self.head_dim
        o = self.heads * self.head_dim * self.hidden
        return q + kv + o + 3 * self.hidden * self.intermediate  # SwiGLU MLP: gate, up, down

    @property
    def dense_params(self) -> float:
        """Matmul weights one forward pass reads: the layers, the LM head, any extra projection
        (the embedding table is gathered row by row, not read whole)."""
        return self.layers * self.layer_params + self.hidden * (self.lm_vocab or self.vocab) + self.extra_dense

    @property
    def total_params(self) -> float:
        """Parameters trained (the embedding counted once when tied to the LM head)."""
        return self.dense_params + (0 if self.tied else self.vocab * self.hidden)

    def kv_bytes_per_token(self, bytes_per_el: float) -> float:
        """K and V of one token of context, all layers (GQA: kv_heads, not heads)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * bytes_per_el

    @property
    def attn_flops_per_query_ctx(self) -> float:
        """FLOPs of one query token against one token of context: QK^T and PV, 2 FLOPs per multiply-add."""
        return 4 * self.layers * self.heads * self.head_dim


HF = "Hugging Face hub config.json of "
QWEN3_8B = ModelConfig("Qwen3-8B", 36, 4096, 32, 8, 128, 12288, 151936, False, HF + "Qwen/Qwen3-8B")
QWEN3_32B = ModelConfig("Qwen3-32B", 64, 5120, 64, 8, 128, 25600, 151936, False, HF + "Qwen/Qwen3-32B")
QWEN3_06B = ModelConfig("Qwen3-0.6B", 28, 1024, 16, 8, 128, 3072, 151936, True, HF + "Qwen/Qwen3-0.6B")
QWEN3_17B = ModelConfig("Qwen3-1.7B", 28, 2048, 16, 8, 128, 6144, 151936, True, HF + "Qwen/Qwen3-1.7B")
# the real model of configs/smollm2_*.yaml (its converted folder's config.json)
SMOLLM2_135M = ModelConfig("SmolLM2-135M", 30, 576, 9, 3, 64, 1536, 49152, True, HF + "HuggingFaceTB/SmolLM2-135M")
# EAGLE-3 head for Qwen3-8B (e.g. Tengyunw/qwen3_8b_eagle3, the one docs/speculative_decoding.md names): one
# Llama-style layer of the target's width whose attention reads [embedding, hidden] (2h), an fc fusing three
# target layers' hidden states (3h -> h), and an LM head over a reduced draft vocabulary (32,000: EAGLE-3's
# usual draft_vocab_size; assumed for this head). Its one layer is its only KV.
EAGLE3_8B = replace(
    QWEN3_8B,
    name="EAGLE-3 head (Qwen3-8B)",
    layers=1,
    tied=True,
    source="EAGLE-3 (Li et al. 2025) head layout on Qwen3-8B's width; draft vocab 32,000 assumed",
    attn_in=2,
    extra_dense=3 * 4096 * 4096,
    lm_vocab=32000,
)
# One MTP layer on Qwen3-8B (Qwen3 ships none: a hypothetical head, DeepSeek-V3's MTP module layout): a
# projection [norm(emb), norm(hidden)] 2h -> h, one decoder layer like the target's, and the target's own LM
# head (shared weights, read every pass).
MTP_8B = replace(
    QWEN3_8B,
    name="MTP layer (Qwen3-8B)",
    layers=1,
    tied=True,
    source="DeepSeek-V3 MTP module layout (arXiv 2412.19437) on Qwen3-8B's layer; shares the target's LM head",
    extra_dense=2 * 4096 * 4096,
)


def toy_qwen2(name: str, hidden: int, layers: int, heads: int, intermediate: int, vocab: int, source: str):
    """A toy Qwen2 of rl_specdec.toy (head_dim 32, kv heads = heads, tied embeddings)."""
    return ModelConfig(name, layers, hidden, heads, heads, hidden // heads, intermediate, vocab, True, source)


TOY = "rl_specdec/toy/build.py ModelShape"
TOY_POLICY = toy_qwen2("toy policy", 256, 4, 8, 768, 32, TOY)
TOY_DRAFTER = toy_qwen2("toy drafter", 128, 2, 4, 384, 32, TOY)
TOY_LT_POLICY = toy_qwen2("long-tail toy policy", 256, 4, 8, 768, 448, "rl_specdec/toy/longtail.py")
TOY_LT_DRAFTER = toy_qwen2("long-tail toy drafter", 128, 2, 4, 384, 448, "rl_specdec/toy/longtail.py")
# the long-tail target widened (MLP 768 -> 16,384 units, 4 identity layers appended) and a one-layer drafter
TOY_WIDE_POLICY = toy_qwen2("wide toy policy", 256, 8, 8, 16384, 448, "rl_specdec/toy/wide.py WideToyConfig")
TOY_WIDE_DRAFTER = toy_qwen2("wide toy drafter", 128, 1, 4, 384, 448, "rl_specdec/toy/wide.py WideToyConfig")


def from_hf_config(path_or_dict, name: str | None = None) -> ModelConfig:
    """A ModelConfig from a Hugging Face config.json (a path or its dict)."""
    cfg = path_or_dict if isinstance(path_or_dict, dict) else json.loads(open(path_or_dict).read())
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    return ModelConfig(
        name or cfg.get("_name_or_path") or "model",
        int(cfg["num_hidden_layers"]),
        hidden,
        heads,
        int(cfg.get("num_key_value_heads") or heads),
        int(cfg.get("head_dim") or hidden // heads),
        int(cfg["intermediate_size"]),
        int(cfg["vocab_size"]),
        bool(cfg.get("tie_word_embeddings", False)),
        f"config.json {path_or_dict if not isinstance(path_or_dict, dict) else '(given)'}",
    )


def like_toy_with_params(params: float, base: ModelConfig, name: str) -> ModelConfig:
    """Shapes unknown: ``base``'s layout (layers, head_dim 32, intermediate = 3 hidden) widened until its
    parameter count is ``params``. A stated stand-in until the real config.json is given."""
    L, V = base.layers, base.vocab
    # total = L (4 h^2 + 9 h^2) + V h  (attention 4h^2 with kv heads = heads, MLP 3 * h * 3h)
    h = (-V + math.sqrt(V * V + 4 * 13 * L * params)) / (2 * 13 * L)
    h = max(32, int(round(h / 32)) * 32)
    return replace(
        base,
        name=name,
        hidden=h,
        heads=h // 32,
        kv_heads=h // 32,
        intermediate=3 * h,
        source=f"assumed: {base.name}'s layout widened to {params:.3g} parameters",
    )


def with_layers_for(model: ModelConfig, params: float, tolerance: float = 0.02) -> ModelConfig | None:
    """``model`` with the layer count whose parameter count is ``params`` (a rebuilt toy that changed only its
    depth), or None if no whole number of layers comes within ``tolerance``."""
    head = model.total_params - model.layers * model.layer_params
    layers = max(int(round((params - head) / model.layer_params)), 1)
    out = replace(model, layers=layers, source=f"{model.source}, {layers} layers (from the parameter count)")
    return out if abs(out.total_params / params - 1) <= tolerance else None
