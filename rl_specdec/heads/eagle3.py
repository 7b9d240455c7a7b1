"""An EAGLE-3 head in plain torch: the drafter vLLM runs for ``method: eagle3``, in a form the trainer can train.

An EAGLE-3 head is one decoder layer that reads the target's own hidden states.
At position ``t`` of a sequence ``x`` it sees ``g_t = fc(cat(aux_t))`` (the
target's residual stream after a low, a middle and a late layer, concatenated)
and the embedding of the next token ``x_{t+1}``, and predicts ``x_{t+2}``. To
draft further it feeds its own pre-norm output back in place of ``g``: step
``j`` (1-based) at base position ``t`` sits at position ``t+j-1``, reads token
``x_{t+j}`` and predicts ``x_{t+j+1}``. Its attention sees the first step's keys
at positions ``<= t`` and its own chain's keys (``training-time test``).

This module mirrors ``vllm/model_executor/models/llama_eagle3.py`` (the Llama
head, which serves Qwen2 and Llama targets alike): the same weight names, norms
and residuals, so a head trained here drafts the same tokens in the engine. The
head owns no embedding and no LM head: it uses the target's, which vLLM shares
into the head when the checkpoint omits them. A checkpoint that held copies
would be aliased to the target's modules by vLLM (it compares them with
``torch.equal``), and a later refit of those copies would overwrite the policy.
So they are never saved and never sent.

vLLM's aux layer id ``L`` is the residual stream after ``L`` decoder layers:
index ``L`` of transformers' ``hidden_states`` tuple (index 0 is the embedding),
for ``0 <= L < num_hidden_layers`` (at ``L = num_hidden_layers`` vLLM reads the
pre-norm state, transformers the post-norm one, so that id is refused). vLLM
sorts the ids, so features are concatenated in ascending order, and so is
:attr:`HeadShape.aux_layer_ids`. Which published heads are taken, and why, is
:mod:`rl_specdec.heads.forms`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from rl_specdec.heads.forms import tensor_problems, untrainable

HEAD_ARCHITECTURE = "LlamaForCausalLMEagle3"  # vLLM's registry maps it to its Llama EAGLE-3 head
_FROZEN = "Or set policy.generation.drafter_training.enabled=false to serve it frozen (vLLM alone runs it)."


@dataclass(frozen=True)
class HeadShape:
    """An EAGLE-3 head's shape, read from and written to its ``config.json``."""

    hidden_size: int  # the target's: the head adds the target's embeddings to its own stream
    num_attention_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's
    aux_layer_ids: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    # 0: the head drafts over the target's whole vocabulary through the target's own LM head. n > 0: over n of
    # its tokens, through the head's own LM head [n, H], mapped to the target's ids by ``d2t`` (EAGLE-3's draft
    # vocabulary): on a wide vocabulary the LM head is most of the head's pass
    draft_vocab_size: int = 0
    num_key_value_heads: int = 0  # 0: one per attention head; fewer: grouped-query attention (published heads)

    def __post_init__(self):
        ids = tuple(self.aux_layer_ids)
        if len(set(ids)) != len(ids):
            raise ValueError(f"aux layer ids {ids} repeat a layer: vLLM reads each layer once")
        # vLLM's target hands over its aux states in layer order, whatever order the config names them in
        object.__setattr__(self, "aux_layer_ids", tuple(sorted(ids)))

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @classmethod
    def for_target(cls, target_config, intermediate_size: int | None = None) -> HeadShape:
        """A head sized like one of the target's layers, reading its default aux layers."""
        rope = getattr(target_config, "rope_parameters", None) or {}
        return cls(
            hidden_size=target_config.hidden_size,
            num_attention_heads=target_config.num_attention_heads,
            head_dim=getattr(target_config, "head_dim", None)
            or target_config.hidden_size // target_config.num_attention_heads,
            intermediate_size=intermediate_size or target_config.intermediate_size,
            vocab_size=target_config.vocab_size,
            aux_layer_ids=default_aux_layers(target_config.num_hidden_layers),
            rms_norm_eps=target_config.rms_norm_eps,
            rope_theta=float(rope.get("rope_theta", getattr(target_config, "rope_theta", 10000.0))),
            max_position_embeddings=target_config.max_position_embeddings,
        )

    def config_json(self) -> dict:
        """vLLM's view of the head (``draft_vocab_size`` = the target's vocabulary unless it has its own)."""
        return {
            "architectures": [HEAD_ARCHITECTURE],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "target_hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": 1,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size or self.vocab_size,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            # the Llama head reads the aux count from here only; the engine reads the ids from here too
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids)},
            "rl_specdec_head": asdict(self),
        }

    @classmethod
    def from_config(cls, config, target_layers: int | None = None) -> HeadShape:
        """The shape of an EAGLE-3 head from its config object (transformers' or vLLM's, which wraps it). A head
        that names no aux layers reads vLLM's default ones of a target with ``target_layers`` layers."""
        ids = getattr(config, "eagle_aux_hidden_state_layer_ids", None)  # read as vLLM's model runner reads it
        ids = ids or (getattr(config, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
        ids = ids or (default_aux_layers(target_layers) if target_layers else (0, 1, 2))  # (0, 1, 2): the count alone
        heads = config.num_attention_heads
        draft = getattr(config, "draft_vocab_size", None) or config.vocab_size
        kv = getattr(config, "num_key_value_heads", None) or heads
        rope = getattr(config, "rope_parameters", None) or {}
        return cls(
            hidden_size=config.hidden_size,
            num_attention_heads=heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            aux_layer_ids=tuple(ids),
            draft_vocab_size=0 if draft == config.vocab_size else draft,
            num_key_value_heads=0 if kv == heads else kv,
            rms_norm_eps=getattr(config, "rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", None) or 10000.0)),
            max_position_embeddings=getattr(config, "max_position_embeddings", 2048),
        )

    @classmethod
    def read(cls, folder: str | Path, target_layers: int | None = None) -> HeadShape:
        """The shape of the head in ``folder``: one written here, or a published one-layer Llama EAGLE-3 head."""
        path = Path(folder) / "config.json"
        config = json.loads(path.read_text()) if path.is_file() else {}
        why = untrainable(config, target_layers)
        if "rl_specdec_head" in config and not why:
            raw = config["rl_specdec_head"]
            return cls(**{**raw, "aux_layer_ids": tuple(raw["aux_layer_ids"])})
        if why:
            raise ValueError(
                f"{folder} is not an EAGLE-3 head rl_specdec can train: {why}. Train a head built here "
                "(toy:eagle3, toy:wide-eagle3, pkg:smollm2-135m-instruct-eagle3, or one saved with "
                f"rl_specdec.heads.eagle3.save_head) or a one-layer Llama EAGLE-3 head. {_FROZEN}"
            )
        return cls.from_config(type("HeadConfig", (), config)(), target_layers)


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's default ``(2, n//2, n-3)`` where those are distinct; else three spread over ``1..n-1``."""
    ids = (2, num_layers // 2, num_layers - 3)
    if len(set(ids)) == 3 and min(ids) >= 1:
        return ids
    if num_layers < 4:
        raise ValueError(f"an EAGLE-3 head needs a target with at least 4 layers, not {num_layers}")
    return (1, num_layers // 2, num_layers - 1)


def is_trainable_head(folder: str | Path) -> bool:
    """A head folder the trainer can load: one this package wrote, or a published one-layer Llama EAGLE-3 head."""
    path = Path(folder) / "config.json"
    return path.is_file() and not untrainable(json.loads(path.read_text()))


def is_eagle3_config(config) -> bool:
    """An EAGLE-3 head's config (by its architecture, as vLLM resolves it)."""
    return any("Eagle3" in a for a in (getattr(config, "architectures", None) or []))


def expected_head_tensors(config) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` a head refit must send: the head's own tensors, never the target's embedding or LM head."""
    with torch.device("meta"):
        head = Eagle3Head(HeadShape.from_config(config))
    return {k: tuple(v.shape) for k, v in head.vllm_state_dict().items()}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """vLLM's RMSNorm: computed in fp32, cast back."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding (vLLM's Llama): x [B, heads, T, D], positions [T]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
    freqs = positions.float()[:, None] * inv  # [T, D/2]
    cos, sin = freqs.cos().to(x.dtype), freqs.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


class Eagle3Head(nn.Module):
    """The head's own weights, named as vLLM loads them (``fc``, ``midlayer.*``, ``norm``)."""

    def __init__(self, shape: HeadShape):
        super().__init__()
        h, q, kv = shape.hidden_size, shape.num_attention_heads * shape.head_dim, shape.kv_heads * shape.head_dim
        self.shape = shape
        self.fc = nn.Linear(h * len(shape.aux_layer_ids), h, bias=False)
        self.midlayer = nn.Module()
        m = self.midlayer
        m.hidden_norm, m.input_layernorm, m.post_attention_layernorm = (nn.Parameter(torch.ones(h)) for _ in "abc")
        m.self_attn = nn.ModuleDict({n: nn.Linear(2 * h, d, bias=False) for n, d in (("q_proj", q), ("k_proj", kv))})
        m.self_attn["v_proj"] = nn.Linear(2 * h, kv, bias=False)
        m.self_attn["o_proj"] = nn.Linear(q, h, bias=False)
        m.mlp = nn.ModuleDict(
            {
                "gate_proj": nn.Linear(h, shape.intermediate_size, bias=False),
                "up_proj": nn.Linear(h, shape.intermediate_size, bias=False),
                "down_proj": nn.Linear(shape.intermediate_size, h, bias=False),
            }
        )
        self.norm = nn.Parameter(torch.ones(h))
        if shape.draft_vocab_size:  # its own LM head; d2t: draft index i is the target's token i + d2t[i]
            self.lm_head = nn.Linear(h, shape.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(shape.draft_vocab_size, dtype=torch.long))

    def vllm_state_dict(self) -> dict[str, torch.Tensor]:
        """The head's trained tensors under the names vLLM's ``load_weights`` takes (norms end in ``.weight``):
        what a refit sends. ``d2t`` is fixed when the head is built, so it is saved but never sent."""
        return {(k if k.endswith(".weight") else k + ".weight"): v for k, v in self.named_parameters()}

    def load_vllm_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        own = {k: k if k.endswith(".weight") else k + ".weight" for k, _ in self.named_parameters()}
        state = {k: tensors[v] for k, v in own.items()}
        if self.shape.draft_vocab_size:  # a saved head has its d2t; a refit's tensors keep the one it has
            state["d2t"] = tensors.get("d2t", self.d2t)
        self.load_state_dict(state)

    def draft_ids(self) -> torch.Tensor:
        """The target's token id of each draft index [n] (only with a draft vocabulary)."""
        return torch.arange(self.shape.draft_vocab_size, device=self.d2t.device) + self.d2t

    def set_draft_vocabulary(self, token_ids: torch.Tensor, target_lm_head: torch.Tensor) -> None:
        """Draft over ``token_ids`` (the target's ids, ascending), starting from the target's own LM head rows."""
        with torch.no_grad():
            self.d2t.copy_(token_ids - torch.arange(len(token_ids)))
            self.lm_head.weight.copy_(target_lm_head[token_ids])

    def _layer(self, emb, g, keys, values, positions, mask):
        """One chain step: emb, g [B, T, H] -> (pre-norm output [B, T, H], this step's key and value)."""
        s, m, a = self.shape, self.midlayer, self.midlayer.self_attn
        eps, (b, t, _) = s.rms_norm_eps, g.shape
        x = torch.cat([rms_norm(emb, m.input_layernorm, eps), rms_norm(g, m.hidden_norm, eps)], -1)  # [B, T, 2H]

        def split(y, heads):  # [B, T, heads*D] -> [B, heads, T, D]
            return y.view(b, t, heads, s.head_dim).transpose(1, 2)

        q = rotate(split(a["q_proj"](x), s.num_attention_heads), positions, s.rope_theta)
        k = rotate(split(a["k_proj"](x), s.kv_heads), positions, s.rope_theta)
        v = split(a["v_proj"](x), s.kv_heads)
        ks, vs = torch.cat(keys + [k], 2), torch.cat(values + [v], 2)  # [B, kv heads, (j+1)T, D]
        group = s.num_attention_heads // s.kv_heads  # query head i reads key head i // group, as vLLM's GQA
        ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)  # [B, heads, (j+1)T, D]
        att = F.scaled_dot_product_attention(q, ks, vs, attn_mask=mask)  # [B, heads, T, D]
        residual = a["o_proj"](att.transpose(1, 2).reshape(b, t, -1)) + g
        h = rms_norm(residual, m.post_attention_layernorm, eps)
        h = m.mlp["down_proj"](F.silu(m.mlp["gate_proj"](h)) * m.mlp["up_proj"](h))
        return h + residual, k, v

    def forward(self, aux: torch.Tensor, input_ids: torch.Tensor, embed: torch.Tensor, steps: int) -> list:
        """Training-time test over ``steps`` chain steps, teacher-forced with the true tokens.

        aux [B, T, n*H] (the target's aux states at every position), input_ids [B, T], embed [V, H] (the
        target's embedding). Returns one normed output [B, T, H] per step: step j's row t predicts
        ``x_{t+j+1}``; rows whose inputs run past the sequence read pad ids and must be masked by the loss."""
        t = input_ids.shape[1]
        base = torch.arange(t, device=aux.device)
        causal = base[None, :] <= base[:, None]  # [T, T]: the first step's keys at positions <= t
        diagonal = torch.eye(t, dtype=torch.bool, device=aux.device)  # a later step's key at its own base
        g, keys, values, outs = self.fc(aux), [], [], []
        for j in range(steps):
            ids = F.pad(input_ids[:, j + 1 :], (0, j + 1))  # [B, T]: x_{t+j+1}
            mask = torch.cat([causal] + [diagonal] * j, 1)  # [T, (j+1)T]
            g, k, v = self._layer(F.embedding(ids, embed), g, keys, values, base + j, mask)
            keys.append(k)
            values.append(v)
            outs.append(rms_norm(g, self.norm, self.shape.rms_norm_eps))
        return outs


def head_loss(head: Eagle3Head, aux, input_ids, target_logp, mask, embed, lm_head, steps: int):
    """Soft cross-entropy of each chain step against the target's next-token distribution.

    target_logp [B, T, V]: the target's log-probs of token t+1 given the prefix up to t (its logits at t),
    detached, or only its rows where ``mask`` is set, [M, V] in row-major order (what the trainer's chunked
    scoring keeps); mask [B, T]: 1 where row t of ``target_logp`` is a response position to learn. Step j's
    row t predicts x_{t+j+1}, whose distribution is target_logp[:, t+j]. A head with a draft vocabulary uses
    its own LM head and learns the target's distribution over that vocabulary, renormalised. Returns (loss,
    per-step top-1 agreement with the target over its whole vocabulary: a draft vocabulary's misses count)."""
    own = head.shape.draft_vocab_size > 0
    weight, keep = (head.lm_head.weight, head.draft_ids()) if own else (lm_head, None)
    position = mask.nonzero(as_tuple=True)[1] if target_logp.dim() == 2 else None  # [M]: each target row's t
    total, agree = 0.0, []
    for j, out in enumerate(head(aux, input_ids, embed, steps)):
        shift = j + 1
        rows = mask[:, shift:] > 0  # [B, T-j-1]: only these reach the LM head, the dear matmul on a wide vocabulary
        logp = F.log_softmax(out[:, :-shift][rows] @ weight.T, -1)  # [R, V or n]
        # the same rows of the target, in the same order: those at t >= shift
        tgt = target_logp[position >= shift] if position is not None else target_logp[:, shift:][rows]
        tgt, w = tgt.float(), mask[:, shift:][rows]  # [R, V] (bf16 in a build pool), [R]
        top = tgt.argmax(-1)  # [R]: the target's top token over its whole vocabulary
        if own:
            tgt = F.log_softmax(tgt[:, keep], -1)  # [R, n]
        ce = -(tgt.exp() * logp).sum(-1)  # [R]
        denom = w.sum().clamp(min=1)
        total = total + (ce * w).sum() / denom
        guess = keep[logp.argmax(-1)] if own else logp.argmax(-1)  # [R]: the head's top token, as a target id
        agree.append(float(((guess == top).float() * w).sum() / denom))
    return total / steps, agree


def micro_batch_loss(head, hidden_states, target, mb, embed, lm_head, chain_steps: int, bf16: bool):
    """The head's loss on one micro-batch of the policy's detached features: (loss, per-step agreement, the
    response tokens it covers). ``target``: the policy's log-probs at the response positions, [M, V] in
    row-major order of ``mb["loss_mask"]`` (row t predicts token t+1). ``bf16``: the head's matmuls under bf16
    autocast (its weights, the loss and the optimizer stay fp32), as the policy computes under bf16-mixed: on
    a GPU the head's update in fp32 runs at fp32's matmul speed, 7x its time in bf16."""
    ids = head.shape.aux_layer_ids
    aux = torch.cat([hidden_states[i] for i in ids], -1).detach().float()  # [n, T, 3H]
    target = target.detach().float()  # [M, V]
    mask = F.pad(mb["loss_mask"], (0, 1))  # [n, T]
    with torch.autocast(aux.device.type, dtype=torch.bfloat16, enabled=bf16):
        loss, agree = head_loss(head, aux, mb["input_ids"], target, mask, embed, lm_head, chain_steps)
    return loss, agree, float(mask.sum())


def save_head(head: Eagle3Head, folder: str | Path) -> None:
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(head.shape.config_json(), indent=2))
    tensors = {k: v.detach().float().contiguous() for k, v in head.vllm_state_dict().items()}
    if head.shape.draft_vocab_size:
        tensors["d2t"] = head.d2t.detach().cpu().contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def load_head(folder: str | Path, target_layers: int | None = None) -> Eagle3Head:
    """The head in ``folder`` (or a hub id, fetched as vLLM fetches it): its weights, its ``d2t`` map if any.
    ``target_layers``: the target's layer count, for a published head that names no aux layers."""
    from safetensors.torch import load_file

    if not Path(folder).is_dir():  # a hub id (GPU users): the same files the engines load
        from huggingface_hub import snapshot_download

        folder = snapshot_download(str(folder), allow_patterns=["config.json", "*.safetensors", "*.bin"])
    head = Eagle3Head(HeadShape.read(folder, target_layers))
    files = sorted(Path(folder).glob("*.safetensors"))
    tensors = {}
    for f in files or sorted(Path(folder).glob("*.bin")):
        tensors.update(load_file(str(f)) if f.suffix == ".safetensors" else torch.load(f, weights_only=True))
    why = tensor_problems(set(tensors), set(head.vllm_state_dict()), head.shape.draft_vocab_size > 0)
    if why:
        raise ValueError(f"{folder} is not an EAGLE-3 head rl_specdec can train: {why}. {_FROZEN}")
    head.load_vllm_state_dict(tensors)  # a published head's t2d (the inverse of d2t) is not needed
    return head
