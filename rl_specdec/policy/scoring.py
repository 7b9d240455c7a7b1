"""Scoring tokens: the LM head and a float32 log-softmax only where the loss reads them, a chunk at a time.

The loss reads one log-prob per response token, yet a causal LM's forward runs its LM head over every
position, prompt and padding included, and a float32 log-softmax over the whole vocabulary then holds
``[N, T-1, V]`` floats (and as much again for their gradient). At Qwen3's vocabulary (151,936) a micro-batch
of 8 sequences of 1,100 tokens is 5.3 GB of logits before the log-softmax.

:func:`token_logprobs_and_entropy` instead lets the model's body run as it is, and replaces its LM head's
forward, for that one call, by a function that

1. keeps only the scored positions' hidden states (``scored``: the loss mask in training), ``[R, H]``;
2. runs the LM head and the float32 log-softmax over chunks of those rows (about ``CHUNK_ELEMENTS`` logits a
   chunk), gathering each row's next-token log-prob; under autograd each chunk is checkpointed, so its
   logits are recomputed in the backward instead of kept: peak memory is O(chunk x V), not O(N x T x V);
3. takes the entropy and, for a head that learns from the policy, its soft targets (the full distribution
   at the scored rows, detached) from the same chunks, in the forward only.

Replacing the forward (not the module) keeps every parameter name, DDP's and FSDP2's hooks on the model,
and autocast: the body and the head run inside the model's own forward exactly as before, so the numbers
are the same to float32 rounding (``tests/test_scoring.py``). A model whose LM head is not a plain
``nn.Linear`` applied last (logit soft-capping or scaling, a custom test module) is scored the old way.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from rl_specdec.policy import precision

# About 64M float32 logits (256 MB) a chunk: 1,365 rows at SmolLM2's vocabulary, 441 at Qwen3's, the whole
# batch at the toys'.
CHUNK_ELEMENTS = 2**26

# Config fields of architectures that change the logits after the LM head's matmul: scored the old way.
_POST_HEAD = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def token_logprobs_and_entropy(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    with_entropy: bool = False,
    compute=precision.plain,
    features: Callable | None = None,
    scored: torch.Tensor | None = None,
    past: tuple | None = None,
):
    """Log-prob of each scored next token [N, T-1] (and the policy's entropy there, no grad); 0 elsewhere.

    ``scored`` [N, T-1]: the positions t whose next token t+1 is scored (default: every real token). The
    forward runs under ``compute(T)`` (:func:`rl_specdec.policy.precision.compute`: bf16 autocast for
    bf16-mixed); the log-softmax is always float32, whatever dtype the logits come in.
    ``features(hidden_states, target)``, if given, sees the forward's hidden states and the log-probs of the
    whole vocabulary at the scored positions, ``[R, V]`` in row-major order of ``scored`` (a head learns
    from them). ``past``: (key/value cache [N, ..., P, ...], its mask [N, P], each row's cached length [N]):
    the rows continue cached prefixes (:mod:`rl_specdec.policy.prefix`).
    """
    scored = (attention_mask[:, 1:] if scored is None else scored) > 0  # [N, T-1]
    head = output_head(model)
    more = {"output_hidden_states": True} if features is not None else {}  # only models that feed a head get it
    model_mask = attention_mask
    if past is not None:  # position ids go on from each row's own prefix; the prefix's padding stays masked
        cache, prefix_mask, prefix_len = past
        model_mask = torch.cat([prefix_mask, attention_mask], 1)  # [N, P+T]
        steps = torch.arange(input_ids.shape[1], device=input_ids.device)  # [T]
        more.update(past_key_values=cache, position_ids=prefix_len[:, None] + steps[None, :])
    if head is None:
        return _whole_vocabulary(model, input_ids, model_mask, with_entropy, compute, features, scored, more)
    targets = input_ids[:, 1:][scored]  # [R]
    side: dict[str, torch.Tensor | None] = {}

    def score(hidden: torch.Tensor) -> torch.Tensor:  # hidden [N, T, H] -> the scored rows' log-probs [R]
        rows = hidden[:, :-1][scored]  # [R, H]
        logp, side["entropy"], side["target"] = chunked_logprobs(
            rows, head.weight, head.bias, targets, with_entropy, features is not None
        )
        return logp

    with _forward_replaced(head, score), compute(input_ids.shape[1]):
        out = model(input_ids=input_ids, attention_mask=model_mask, **more)
    if features is not None:
        features(out.hidden_states, side["target"])
    logp = out.logits.new_zeros(scored.shape)  # [N, T-1]
    logp[scored] = out.logits  # the model's output is the scored rows' log-probs [R]
    if not with_entropy:
        return logp, None
    entropy = torch.zeros(scored.shape, device=logp.device)  # [N, T-1]
    entropy[scored] = side["entropy"]
    return logp, entropy


def chunked_logprobs(h, weight, bias, targets, with_entropy: bool, with_target: bool, chunk_rows: int | None = None):
    """h [R, H] through the LM head (weight [V, H]) and a float32 log-softmax, ``chunk_rows`` rows at a time:
    (log-prob of ``targets`` [R], entropy [R] or None, log-probs [R, V] or None). Only the first carries grad."""
    vocab = weight.shape[0]
    step = chunk_rows or max(1, CHUNK_ELEMENTS // vocab)
    parts, entropies, dists = [], [], []
    for s in range(0, h.shape[0], step):
        extras: list[torch.Tensor] = []

        def one(hc, w, b, tc, extras=extras):  # hc [c, H] -> [c]
            logp_all = F.log_softmax(lm_head_logits(hc, w, b).float(), dim=-1)  # [c, V]
            if not extras:  # the first call, not a checkpoint's recomputation in the backward
                with torch.no_grad():
                    extras.append(-(logp_all.exp() * logp_all).sum(-1) if with_entropy else None)  # [c]
                    extras.append(logp_all.detach() if with_target else None)  # [c, V]
            return logp_all.gather(-1, tc.unsqueeze(-1)).squeeze(-1)  # [c]

        args = (h[s : s + step], weight, bias, targets[s : s + step])
        needs_grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
        parts.append(checkpoint(one, *args, use_reentrant=False) if needs_grad else one(*args))
        entropies.append(extras[0])
        dists.append(extras[1])
    if not parts:  # nothing scored in this micro-batch
        # zeros that keep the graph, so DDP's hooks still see every parameter (the group pads with such rows)
        empty = h.new_zeros(0, dtype=torch.float32) + (h.sum() + weight.sum()) * 0
        return empty, empty.detach() if with_entropy else None, h.new_zeros(0, vocab) if with_target else None
    logp = torch.cat(parts)  # [R]
    entropy = torch.cat(entropies) if with_entropy else None  # [R]
    return logp, entropy, torch.cat(dists) if with_target else None


def lm_head_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The LM head's matmul on a chunk of rows [c, H] -> [c, V], in the dtype autocast gives it (bf16-mixed: bf16)."""
    return F.linear(h, weight, bias)


def output_head(model) -> torch.nn.Linear | None:
    """The model's LM head when it is a plain ``nn.Linear`` whose output the model returns as its logits."""
    inner = getattr(model, "module", model)  # DDP wraps; FSDP2 shards in place
    get = getattr(inner, "get_output_embeddings", None)
    head = get() if callable(get) else None
    config = getattr(inner, "config", None)
    if not isinstance(head, torch.nn.Linear) or config is None:
        return None
    if any(getattr(config, k, None) not in (None, 0, 1.0) for k in _POST_HEAD):
        return None
    return head


@contextlib.contextmanager
def _forward_replaced(module: torch.nn.Module, forward: Callable) -> Iterator[None]:
    """``module(x)`` calls ``forward(x)`` inside this block: its hooks (DDP's, FSDP2's) still run around it."""
    module.forward = forward
    try:
        yield
    finally:
        del module.forward  # back to the class's forward


def _whole_vocabulary(model, input_ids, attention_mask, with_entropy, compute, features, scored, more):
    """The reference computation: logits and a float32 log-softmax at every position, then the scored ones."""
    with compute(input_ids.shape[1]):
        out = model(input_ids=input_ids, attention_mask=attention_mask, **more)
    logp_all = F.log_softmax(out.logits[:, :-1].float(), dim=-1)  # [N, T-1, V]
    if features is not None:
        features(out.hidden_states, logp_all.detach()[scored])
    logp = logp_all.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1) * scored  # [N, T-1]
    if not with_entropy:
        return logp, None
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1) * scored  # [N, T-1]
    return logp, entropy
