"""Drafter catch-up: fill the drafter's KV cache for the positions it skipped during plain steps.

A plain step (the k=0 fast path) runs only the target, so the drafter's KV
cache has no entries for that step's positions. Before the drafter next runs
for a request, one drafter forward over the missed positions
``[drafter_valid[r], start_r)`` of every stale request in the step (each a
prefill chunk attending to its own earlier KV) writes them, so the drafter
proposes exactly what it would have proposed had it run at every step
(``tests/test_spec_control.py`` checks the first drafts).

An EAGLE-3 head reads, at position p, the token at p + 1 and the policy's hidden
states at p (combined by its ``fc``), as vLLM's first pass feeds it. A plain step
keeps those hidden states in a :class:`HeadStash` (one ``[hidden]`` row a
position, ``combine_hidden_states`` applied), and the head's catch-up takes them
from there. Prefill chunks are caught up at the end of their own plain step, so
prompt blocks that the prefix cache hands to later requests hold the head's KV
too; decode positions wait until the head next drafts, or are dropped with the
request. The forward is built
from vLLM 0.32's pieces: ``CommonAttentionMetadata``, the drafter's
``build_per_group_and_layer_attn_metadata`` and ``_get_slot_mapping``,
``set_forward_context`` and the drafter's model; token ids come from the input
batch and slots from the drafter's block table. A forward holds at most the
drafter's input buffer (``drafter.input_ids``); longer catch-ups are split
into pieces, a request's later piece going to a later forward.
"""

from __future__ import annotations

import numpy as np
import torch


def stale_pieces(
    drafter_valid: dict[str, int], step_start: dict[str, int], row_of: dict[str, int], budget: int
) -> list[tuple[int, int, int]]:
    """(row, start, end) pieces of at most ``budget`` tokens for the stale requests of this step.

    Requests of the step are removed from ``drafter_valid`` (they are caught up now);
    requests not in the step stay stale until they next run with the drafter.
    """
    pieces = []
    for rid, valid in list(drafter_valid.items()):
        start, row = step_start.get(rid), row_of.get(rid)
        if start is None or row is None:
            continue
        del drafter_valid[rid]
        pieces += [(row, a, min(a + budget, start)) for a in range(valid, start, budget)]
    return sorted(pieces)


def forwards(pieces: list[tuple[int, int, int]], budget: int) -> list[list[tuple[int, int, int]]]:
    """Group pieces into forwards of at most ``budget`` tokens, one piece per request per forward, earliest first."""
    out = []
    while pieces:
        batch, used, seen, rest = [], 0, set(), []
        for pc in pieces:
            n = pc[2] - pc[1]
            if pc[0] not in seen and used + n <= budget:
                batch.append(pc)
                used += n
            else:
                rest.append(pc)
            seen.add(pc[0])
        out.append(batch)
        pieces = rest
    return out


class HeadStash:
    """The policy's hidden states, combined by the head, at the positions plain steps ran for each request."""

    def __init__(self):
        self.chunks: dict[str, list[tuple[int, torch.Tensor]]] = {}  # request -> [(first position, [n, hidden])]

    @torch.inference_mode()
    def add(self, runner, so, aux: list[torch.Tensor], starts: dict[str, int]) -> dict[str, int]:
        """Keep this plain step's hidden states (``aux``: the policy's, ``[tokens, hidden]`` each, rows in the
        input batch's order); returns the requests whose step was a prefill chunk, with the chunk's end."""
        ib, n_tok = runner.input_batch, so.total_num_scheduled_tokens
        combined = runner.drafter.model.combine_hidden_states(torch.cat([h[:n_tok] for h in aux], dim=-1))
        chunk_ends, off = {}, 0
        for rid in ib.req_ids[: ib.num_reqs]:
            n = int(so.num_scheduled_tokens.get(rid, 0))
            if n:
                self.chunks.setdefault(rid, []).append((starts[rid], combined[off : off + n].clone()))
                if n > 1:
                    chunk_ends[rid] = starts[rid] + n
            off += n
        return chunk_ends

    def take(self, rid: str, start: int, end: int) -> torch.Tensor | None:
        """``[end - start, hidden]`` at positions ``[start, end)``, the latest chunk winning; None if one is missing."""
        chunks = self.chunks.get(rid, [])
        if not chunks:
            return None
        out = chunks[0][1].new_empty((end - start, chunks[0][1].shape[1]))
        seen = np.zeros(end - start, dtype=bool)
        for first, h in chunks:
            a, b = max(start, first), min(end, first + h.shape[0])
            if a < b:
                out[a - start : b - start] = h[a - first : b - first]
                seen[a - start : b - start] = True
        return out if seen.all() else None

    def keep_only(self, rids) -> None:
        """Drop every request but ``rids`` (those still stale)."""
        for rid in [r for r in self.chunks if r not in rids]:
            del self.chunks[rid]


@torch.inference_mode()
def catch_up(
    runner, drafter_valid: dict[str, int], step_start: dict[str, int], max_tokens: int, stash: HeadStash | None = None
) -> int:
    """Run the drafter over what it missed for the stale requests of this step; returns the tokens caught up.
    ``stash``: a head's hidden states (pieces it lacks are skipped, leaving the head's drafts worse, never a
    token changed)."""
    drafter = runner.drafter
    budget = int(min(drafter.input_ids.shape[0], max_tokens))
    pieces = stale_pieces(drafter_valid, step_start, runner.input_batch.req_id_to_index, budget)
    hidden = None
    if stash is not None:
        req_ids = runner.input_batch.req_ids
        hidden = {pc: stash.take(req_ids[pc[0]], pc[1], pc[2]) for pc in pieces}
        pieces = [pc for pc in pieces if hidden[pc] is not None]
        stash.keep_only(drafter_valid)
    for batch in forwards(pieces, budget):
        drafter_prefill(runner, batch, hidden)
    return sum(e - s for _, s, e in pieces)


def drafter_prefill(runner, batch: list[tuple[int, int, int]], hidden: dict | None = None) -> None:
    """One drafter forward over ``[(row, start, end), ...]`` (distinct rows, ascending). ``hidden``: a head's
    ``[end - start, hidden]`` per piece; a head reads the token after each position."""
    from vllm.forward_context import set_forward_context
    from vllm.v1.attention.backend import CommonAttentionMetadata

    drafter, ib = runner.drafter, runner.input_batch
    batch = sorted(batch)
    rows, starts, ends = (list(x) for x in zip(*batch))
    qlens = np.array([e - s for s, e in zip(starts, ends)], dtype=np.int32)
    n_tok = int(qlens.sum())
    shift = 0 if hidden is None else 1
    tok = np.concatenate([ib.token_ids_cpu[r, s + shift : e + shift] for r, s, e in zip(rows, starts, ends)])
    tok = tok.astype(np.int64)
    pos = np.concatenate([np.arange(s, e) for s, e in zip(starts, ends)]).astype(np.int64)
    qsl = np.zeros(len(rows) + 1, dtype=np.int32)
    qsl[1:] = np.cumsum(qlens)
    seq_lens = np.array(ends, dtype=np.int32)
    bt = ib.block_table[max(drafter.kv_cache_gid, 0)]  # -1: the drafter shares group 0
    block_table = bt.block_table.cpu[rows]
    blocks = block_table.numpy()[np.repeat(np.arange(len(rows)), qlens), pos // bt.block_size].astype(np.int64)
    slot = torch.from_numpy(blocks * bt.block_size + pos % bt.block_size)
    cad = CommonAttentionMetadata(
        query_start_loc=torch.from_numpy(qsl),
        query_start_loc_cpu=torch.from_numpy(qsl),
        seq_lens=torch.from_numpy(seq_lens),
        num_reqs=len(rows),
        num_actual_tokens=n_tok,
        max_query_len=int(qlens.max()),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=block_table,
        slot_mapping=slot,
        causal=True,
        seq_lens_cpu_upper_bound=torch.from_numpy(seq_lens),
    )
    _, per_layer = drafter.build_per_group_and_layer_attn_metadata(cad)
    drafter.input_ids[:n_tok] = torch.from_numpy(tok).to(drafter.input_ids.dtype)
    kwargs = {}
    if hidden is not None:
        drafter.hidden_states[:n_tok] = torch.cat([hidden[pc] for pc in batch])
        kwargs["hidden_states"] = drafter.hidden_states[:n_tok]
    with set_forward_context(
        per_layer, drafter.vllm_config, num_tokens=n_tok, slot_mapping=drafter._get_slot_mapping(n_tok, slot)
    ):
        drafter.model(
            input_ids=drafter.input_ids[:n_tok], positions=torch.from_numpy(pos), inputs_embeds=None, **kwargs
        )


def _probe() -> None:
    import dataclasses
    import inspect

    from vllm.forward_context import set_forward_context
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    need = {
        "query_start_loc",
        "query_start_loc_cpu",
        "seq_lens",
        "num_reqs",
        "num_actual_tokens",
        "max_query_len",
        "max_seq_len",
        "block_table_tensor",
        "slot_mapping",
        "causal",
        "seq_lens_cpu_upper_bound",
    }
    missing = sorted(need - {f.name for f in dataclasses.fields(CommonAttentionMetadata)})
    if "slot_mapping" not in inspect.signature(set_forward_context).parameters:
        missing.append("set_forward_context(slot_mapping=)")
    for name in ("build_per_group_and_layer_attn_metadata", "_get_slot_mapping"):
        if not callable(getattr(SpecDecodeBaseProposer, name, None)):
            missing.append(f"SpecDecodeBaseProposer.{name}")
    if missing:
        raise RuntimeError(f"the drafter's forward lacks {', '.join(missing)}")


PROBES = {"drafter forward (CommonAttentionMetadata, set_forward_context, SpecDecodeBaseProposer)": _probe}
