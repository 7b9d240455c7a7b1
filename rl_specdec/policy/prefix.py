"""Prompts computed once per group: a GRPO batch holds each prompt G times, and the loss reads none of it.

Every row of a group starts with the same prompt, and no prompt position is scored except the last (it
predicts the first response token). Scoring rows one by one therefore runs the model's body over the same
prompt G times. :func:`score_shared` instead

1. groups the rows by their *unscored prefix*, the tokens before the first scored position (the prompt but
   its last token), ``U`` distinct prefixes of up to ``P`` tokens;
2. runs the body once over the prefixes, right-padded ``[U, P]``, keeping its key/value cache and skipping
   the LM head (nothing there is scored);
3. gives each row its prefix's cache rows (``DynamicCache.batch_select_indices``: an index, so gradients
   from every row flow back into the one prefix pass) and runs the rest of each row, ``[N, S]``, on top of
   it, scored as :func:`~rl_specdec.policy.scoring.token_logprobs_and_entropy` scores a whole row: position
   ids continue from each row's own prefix length, and the prefix's padding is masked out;
4. puts the log-probs and entropies back at the rows' own positions, ``[N, T-1]``.

On SmolLM2's chat task a row is ~74 prompt and ~20 response tokens: a group of 8 rows is 752 tokens scored
one by one, 73 + 8 x 21 = 241 this way. The numbers are the same to float32 rounding, gradients included
(``tests/test_prefix.py``). Only the last token of the prefix onward carries hidden states, so a head that
learns from every position's hidden states (``features``) is scored the plain way, and so is a model in a
process group: DDP and FSDP2 expect one forward per backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl_specdec.policy import precision
from rl_specdec.policy.scoring import _forward_replaced, output_head, token_logprobs_and_entropy


@dataclass
class Prefixes:
    starts: torch.Tensor  # [N] each row's first scored position: its prefix is input_ids[n, :start]
    which: torch.Tensor  # [N] the row's prefix, an index into ids
    ids: torch.Tensor  # [U, P] the distinct prefixes, right-padded
    mask: torch.Tensor  # [U, P]


def prefix_keys(input_ids: torch.Tensor, scored: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, ...]]]:
    """Each row's first scored position [N] (argmax: the first maximum) and its unscored prefix as a key."""
    starts = (scored > 0).float().argmax(1)  # [N]
    return starts, [tuple(row[:s].tolist()) for row, s in zip(input_ids, starts.tolist())]


def find_prefixes(input_ids: torch.Tensor, scored: torch.Tensor) -> Prefixes | None:
    """The rows' unscored prefixes, deduplicated; None when no two rows share one (nothing to gain) or a row
    scores nothing or starts scoring at its first position (nothing to cache)."""
    starts, row_keys = prefix_keys(input_ids, scored)
    if not bool(scored.any(1).all()) or int(starts.min()) < 1:
        return None
    keys: dict[tuple[int, ...], int] = {}
    which = [keys.setdefault(key, len(keys)) for key in row_keys]
    if len(keys) == len(which):
        return None
    p = max(len(k) for k in keys)
    ids = input_ids.new_zeros(len(keys), p)  # [U, P]
    mask = input_ids.new_zeros(len(keys), p)  # [U, P]
    for key, u in keys.items():
        ids[u, : len(key)] = torch.tensor(key, dtype=ids.dtype)
        mask[u, : len(key)] = 1
    return Prefixes(starts, torch.tensor(which, device=input_ids.device), ids, mask)


def group_order(input_ids: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Row order [N] that keeps rows of one prefix together (so a micro-batch holds whole groups), groups
    longest first and rows in a group longest first."""
    key_of = prefix_keys(input_ids, loss_mask)[1]
    longest: dict[tuple[int, ...], int] = {}
    for key, n in zip(key_of, lengths.tolist()):
        longest[key] = max(longest.get(key, 0), n)
    rank = {key: i for i, key in enumerate(sorted(longest, key=lambda k: -longest[k]))}  # stable: first seen first
    rows = sorted(range(len(key_of)), key=lambda i: (rank[key_of[i]], -int(lengths[i])))
    return torch.tensor(rows, dtype=torch.long)


def shared_tokens(input_ids, loss_mask, lengths, order: torch.Tensor, bounds: list[int]) -> int:
    """Tokens the body computes on when rows in ``order`` are cut at ``bounds`` and each micro-batch's prompts
    are computed once: per micro-batch, its distinct prefixes padded to the longest, and every row from its
    first scored position on, padded to the longest such rest."""
    starts, key_of = prefix_keys(input_ids, loss_mask)
    total = 0
    for a, b in zip(bounds[:-1], bounds[1:]):
        idx = order[a:b]
        keys = {key_of[i] for i in idx.tolist()}
        total += len(keys) * int(starts[idx].max()) + len(idx) * int((lengths[idx] - starts[idx]).max())
    return total


def score_shared(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    scored: torch.Tensor,
    prefixes: Prefixes,
    with_entropy: bool = False,
    compute=precision.plain,
):
    """:func:`token_logprobs_and_entropy` of ``input_ids`` [N, T] with each row's unscored prefix computed once
    per distinct prefix. Returns (log-probs [N, T-1], entropy [N, T-1] or None), 0 where not scored."""
    head = output_head(model)
    with _forward_replaced(head, lambda h: h[..., :0]), compute(prefixes.ids.shape[1]):  # no LM head: [U, P, 0]
        cache = model(input_ids=prefixes.ids, attention_mask=prefixes.mask, use_cache=True).past_key_values
    cache.batch_select_indices(prefixes.which)  # [U, ...] -> [N, ...]: each row its prefix's keys and values
    lengths = attention_mask.sum(1)  # [N]
    rest = lengths - prefixes.starts  # [N] tokens from the first scored position on
    s = int(rest.max())
    steps = torch.arange(s, device=input_ids.device)  # [S]
    cols = prefixes.starts[:, None] + steps[None, :]  # [N, S] where each suffix token sits in its row
    real = steps[None, :] < rest[:, None]  # [N, S]
    cols = torch.where(real, cols, 0)
    suffix_ids = torch.where(real, input_ids.gather(1, cols), 0)  # [N, S]
    scored_t = torch.cat([scored, torch.zeros_like(scored[:, :1])], 1)  # [N, T]: position T-1 scores nothing
    suffix_scored = (scored_t.gather(1, cols) > 0) & real  # [N, S]
    logp_s, ent_s = token_logprobs_and_entropy(
        model,
        suffix_ids,
        real.long(),
        with_entropy=with_entropy,
        compute=compute,
        scored=suffix_scored[:, :-1],
        past=(cache, prefixes.mask[prefixes.which], prefixes.mask.sum(1)[prefixes.which]),
    )
    return _place(logp_s, cols, real, scored.shape), None if ent_s is None else _place(ent_s, cols, real, scored.shape)


def _place(values: torch.Tensor, cols: torch.Tensor, real: torch.Tensor, shape) -> torch.Tensor:
    """Suffix values [N, S-1] (value j: the token after suffix position j) back at their rows' positions [N, T-1]."""
    out = values.new_zeros(shape[0], shape[1] + 1)  # [N, T]: one spare column takes the masked-out scatters
    spare = torch.full_like(cols, shape[1])
    where = torch.where(real, cols, spare)[:, :-1]  # [N, S-1]
    return out.scatter(1, where, values)[:, :-1]
