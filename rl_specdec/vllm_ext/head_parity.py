"""vLLM's EAGLE-3 drafter and its target, loaded in this process from their folders, to check heads against.

The modules, their weight loading, the aux layers the target hands the drafter,
and the sharing of the target's embedding and LM head into the drafter are
vLLM's own: ``get_model`` as the engine loads both, the model runner's reading
of the aux layer ids, the proposer's ``_maybe_share_*``. Two things stand in for
the engine: one process without a scheduler, and in place of the paged
attention kernel (which needs the scheduler's metadata) plain attention over a
key/value memory, causal within a call. The kernel's exactness is the engine
tests' business (greedy tokens and log-probs against transformers); what this
checks is everything around it: aux order, norms, rotary embedding, residuals,
the first pass's inputs, the chain's hidden state, the draft vocabulary map.

The drafter is driven as the proposer drives it (``llm_base_proposer.propose``):
the first pass reads the target's tokens shifted by one at their own positions
and ``combine_hidden_states`` of the target's aux states; each later step reads
one token at the next position and the previous step's second output.
"""

from __future__ import annotations

import socket
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


class MemoryAttention(nn.Module):
    """Stands in for vLLM's ``Attention``: q, k, v [N, heads * D] after rotary; keys kept across calls."""

    def __init__(self, attn: nn.Module):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_size
        self.scale = attn.impl.scale
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def forward(self, q, k, v, *args, **kwargs):
        n = q.shape[0]
        self.keys.append(k.view(n, self.kv_heads, self.head_dim))
        self.values.append(v.view(n, self.kv_heads, self.head_dim))
        ks, vs = torch.cat(self.keys), torch.cat(self.values)  # [M + N, kv heads, D]
        group = self.heads // self.kv_heads
        ks, vs = ks.repeat_interleave(group, 1).transpose(0, 1), vs.repeat_interleave(group, 1).transpose(0, 1)
        m = ks.shape[1] - n
        mask = torch.ones(n, m + n, dtype=torch.bool).tril(m)  # query i sees the memory and itself
        out = F.scaled_dot_product_attention(
            q.view(n, self.heads, self.head_dim).transpose(0, 1), ks, vs, attn_mask=mask, scale=self.scale
        )
        return out.transpose(0, 1).reshape(n, self.heads * self.head_dim)

    def forget(self) -> None:
        self.keys, self.values = [], []


def _swap_attention(model: nn.Module) -> list[MemoryAttention]:
    from vllm.model_executor.layers.attention.attention import Attention

    swapped = []
    for name, module in list(model.named_modules()):
        for child, sub in list(module.named_children()):
            if isinstance(sub, Attention):
                setattr(module, child, MemoryAttention(sub))
                swapped.append(getattr(module, child))
    return swapped


_STARTED: list[bool] = []


def _one_process_group() -> None:
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    if _STARTED:
        return
    if not torch.accelerator.is_available():  # as vLLM's CPU model runner does: its loader empties a cache
        from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

        _set_torch_accelerator_to_noop()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
    initialize_model_parallel(1, 1)
    _STARTED.append(True)


def release() -> None:
    """Tear down the process group :class:`DrafterPair` started, so the process may start others."""
    from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

    if _STARTED:
        destroy_model_parallel()
        destroy_distributed_environment()
        _STARTED.clear()


class DrafterPair:
    """The target and its EAGLE-3 drafter as an engine loads them (fp32, eager), on CPU."""

    def __init__(self, target: str, head: str, k: int = 3):
        from vllm.config import set_current_vllm_config
        from vllm.engine.arg_utils import EngineArgs
        from vllm.model_executor.model_loader import get_model
        from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        spec = {"method": "eagle3", "model": head, "num_speculative_tokens": k}
        args = EngineArgs(
            model=target, speculative_config=spec, skip_tokenizer_init=True, enforce_eager=True, dtype="float32"
        )
        self.config = args.create_engine_config()
        with set_current_vllm_config(self.config):
            _one_process_group()
            self.target = get_model(vllm_config=self.config)
            draft_config = self.config.speculative_config.draft_model_config
            self.drafter = get_model(vllm_config=self.config, model_config=draft_config)
        runner = SimpleNamespace(speculative_config=self.config.speculative_config)
        ids = GPUModelRunner._get_eagle3_aux_layers_from_config(runner)
        self.target.set_aux_hidden_state_layers(ids or self.target.get_eagle3_default_aux_hidden_state_layers())
        proposer = SimpleNamespace(model=self.drafter, vllm_config=self.config, use_local_argmax_reduction=False)
        SpecDecodeBaseProposer._maybe_share_embeddings(proposer, self.target)
        SpecDecodeBaseProposer._maybe_share_lm_head(proposer, self.target)
        self.memories = _swap_attention(self.target) + _swap_attention(self.drafter)

    @torch.no_grad()
    def target_aux(self, ids: torch.Tensor) -> torch.Tensor:
        """The aux hidden states the target hands the drafter, concatenated as it does: ids [T] -> [T, n*H]."""
        for m in self.memories:
            m.forget()
        _, aux = self.target(input_ids=ids, positions=torch.arange(len(ids)))
        return torch.cat(aux, -1)

    @torch.no_grad()
    def draft_logits(self, ids: torch.Tensor, t: int, steps: int) -> list[torch.Tensor]:
        """The drafter's logits over the target's vocabulary, drafting from base ``t`` with the true tokens fed
        back: the first pass over positions ``0..t`` reads ``ids[1:t+2]``, step ``j`` reads ``ids[t+j+1]``
        at position ``t+j``. Returns one [V] row per step (``-inf`` outside a draft vocabulary)."""
        aux = self.target_aux(ids)[: t + 1]  # [t+1, n*H]
        for m in self.memories:
            m.forget()
        hidden = self.drafter.combine_hidden_states(aux)  # [t+1, H]
        last, hidden = self.drafter(input_ids=ids[1 : t + 2], positions=torch.arange(t + 1), hidden_states=hidden)
        out, hidden = [self.drafter.compute_logits(last[t:])[0]], hidden[t:]
        for j in range(1, steps):
            tok, pos = ids[t + j + 1 : t + j + 2], torch.tensor([t + j])
            last, hidden = self.drafter(input_ids=tok, positions=pos, hidden_states=hidden)
            out.append(self.drafter.compute_logits(last)[0])
        return out


def _probe_loading() -> None:
    from vllm.model_executor.model_loader import get_model  # noqa: F401
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop  # noqa: F401
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    for name in ("_maybe_share_embeddings", "_maybe_share_lm_head"):
        getattr(SpecDecodeBaseProposer, name)
    GPUModelRunner._get_eagle3_aux_layers_from_config


def _probe_modules() -> None:
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

    for name in ("combine_hidden_states", "compute_logits", "load_weights"):
        getattr(Eagle3LlamaForCausalLM, name)
    for name in ("num_heads", "num_kv_heads", "head_size", "impl"):
        if name not in Attention.__init__.__code__.co_names:
            raise AttributeError(f"vLLM's Attention no longer sets {name}")


def drafter_class(architecture: str) -> str:
    """``module.Class`` of the drafter vLLM builds for a head's architecture ("" if vLLM knows none)."""
    from vllm.model_executor.models.registry import _SPECULATIVE_DECODING_MODELS

    module, cls = _SPECULATIVE_DECODING_MODELS.get(architecture, ("", ""))
    return f"{module}.{cls}" if module else ""


PROBES = {
    "get_model, _maybe_share_*, _get_eagle3_aux_layers_from_config": _probe_loading,
    "Eagle3LlamaForCausalLM, Attention fields": _probe_modules,
    "_SPECULATIVE_DECODING_MODELS": lambda: (
        drafter_class("LlamaForCausalLMEagle3")
        or (_ for _ in ()).throw(AttributeError("vLLM no longer maps LlamaForCausalLMEagle3 to a drafter"))
    ),
}
