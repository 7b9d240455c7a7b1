"""The step-cost model t(b, k): a per-kernel-class roofline of one engine step.

One forward pass of a model over ``n`` query tokens whose sequences hold ``C``
tokens of context (all sequences together) and ``QC`` = sum over query tokens
of their context length::

    t_fwd = max(W / BW, (2 P_body n + 2 P_head n_l) / F)   dense: weights once, 2 FLOPs per weight and token
          + max(kv (C + n) / BW, a QC / F)                  attention: the KV read once (written for n)
          + layers * t_layer                                a latency floor per layer
          + [tp > 1] 2 layers (t_ar + 2 (tp-1)/tp n h B / link)   two all-reduces per layer

with W = P * B bytes (P = P_body + P_head the matmul weights read per pass:
layers and LM head, B = 2 for bf16), n_l the tokens whose logits are needed
(every verified position; one per request in a prefill or a drafter pass;
none in a catch-up, which only fills the drafter's KV), kv the K and V bytes of one token (2 layers kv_heads head_dim
B: GQA), a = 4 layers heads head_dim, BW and F the device's bandwidth and dense
FLOP/s times their achieved fractions (and times tp). One engine step with b
requests that verify k_v drafts each and draft k_n for the next step::

    t = t_step + t_req b + t_fwd(target, n = b (k_v + 1))
        + [speculative] (t_spec + sum over the drafter's passes (t_pass + t_req_d b_pass + t_fwd(drafter, pass)))
        + [catch-up] (t_pass + t_fwd(drafter, the tokens it missed))

(t_req, t_req_d: host work per request in a target step and in a drafter pass,
sampling included: small on a GPU, large on this CPU.)

The drafter's first pass runs over the verified tokens (b (k_v + 1)), each
later one over one token per request that still drafts: k_n passes in all,
sequential. A speculative step that drafts nothing (k_n = 0) still runs one
drafter pass to keep its KV in sync, vLLM's own k=0 path; only draft_model with
rl_specdec's fast path skips it (a *plain* step) and catches the drafter up
when it next drafts (docs/speculative_decoding.md). A step with no drafter at
all is the no-speculation engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from benchmarks.whatif.hardware import Device
from benchmarks.whatif.models import ModelConfig
from benchmarks.whatif.workload import Pair, Workload

ACTIVATIONS = 2e9  # bytes per device kept for activations and CUDA graphs (assumption)
MEM_FRACTION = 0.9  # gpu_memory_utilization (vLLM's default is 0.9)


@dataclass
class Rows:
    """Steps to price, one entry per row (a row is ``m`` identical steps); every field an array."""

    m: np.ndarray  # steps in the row
    b: np.ndarray  # requests scheduled
    ctx: np.ndarray  # context tokens of those requests, summed (mid-row)
    vt: np.ndarray  # target query tokens (b (k_v + 1), or prompt tokens in a prefill)
    vl: np.ndarray  # target tokens whose logits are computed (vt in decode, b in a prefill)
    qc: np.ndarray  # target query x context products (attention FLOPs / a)
    spec: np.ndarray  # 1: a speculative step (t_spec, drafter passes); 0: plain or no drafter
    dtok: np.ndarray  # (rows, J) drafter query tokens per pass (0: no such pass)
    dseq: np.ndarray  # (rows, J) requests in each drafter pass
    cu: np.ndarray  # drafter catch-up tokens (one extra pass)


@dataclass(frozen=True)
class FwdConst:
    """One model on one device (and tp), the forward-pass equation's constants in seconds."""

    w: float  # reading the matmul weights once
    f: float  # dense FLOPs of the layers per query token
    h: float  # LM head FLOPs per token whose logits are computed
    kv: float  # reading (or writing) one token of KV
    a: float  # attention FLOPs per query token and token of its context
    floor: float  # per-layer latency floor and all-reduce latencies
    ar: float  # all-reduce transfer per query token


def fwd_const(dev: Device, model: ModelConfig, tp: int = 1) -> FwdConst:
    B = dev.bytes_per_param
    bw = dev.bandwidth * dev.eta_bw * tp
    fl = dev.flops * dev.eta_flops * tp
    floor = model.layers * dev.t_layer + (2 * model.layers * dev.t_allreduce if tp > 1 else 0.0)
    ar = 2 * model.layers * 2 * (tp - 1) / tp * model.hidden * B / dev.link if tp > 1 else 0.0
    head = model.hidden * (model.lm_vocab or model.vocab)
    return FwdConst(
        model.dense_params * B / bw,
        2.0 * (model.dense_params - head) / fl,
        2.0 * head / fl,
        model.kv_bytes_per_token(B) / bw,
        model.attn_flops_per_query_ctx / fl,
        floor,
        ar,
    )


def _fwd(c: FwdConst, n, ctx, qc, nl, mx=np.maximum):
    """The forward-pass equation (module docstring) for n > 0 query tokens, nl of them with logits;
    ``mx``: max for floats."""
    return mx(c.w, c.f * n + c.h * nl) + mx(c.kv * (ctx + n), c.a * qc) + c.floor + c.ar * n


def forward_time(dev: Device, model: ModelConfig, n, ctx, qc, nl=None, tp: int = 1):
    """One forward pass of ``model`` (logits for every token unless ``nl``); 0 where n = 0."""
    n = np.asarray(n, dtype=float)
    return np.where(n > 0, _fwd(fwd_const(dev, model, tp), n, ctx, qc, n if nl is None else nl), 0.0)


class Pricer:
    """Step times of one pair on one device: vectorized over rows (:meth:`rows`) or one step (:meth:`step`),
    both from the same constants and equation."""

    def __init__(self, dev: Device, pair: Pair, tp: int = 1):
        self.dev, self.pair, self.tp = dev, pair, tp
        self.T, self.D = fwd_const(dev, pair.target, tp), fwd_const(dev, pair.drafter, tp)

    def rows(self, r: Rows) -> np.ndarray:
        """Seconds of each row (m steps each)."""
        dev, T, D = self.dev, self.T, self.D
        per_seq = r.ctx / np.maximum(r.b, 1)
        t = (
            dev.t_step
            + dev.t_req * r.b
            + np.where(r.vt > 0, _fwd(T, r.vt, r.ctx, r.qc, r.vl), 0.0)
            + r.spec * dev.t_spec
        )
        for j in range(r.dtok.shape[1]):
            tok, seq = r.dtok[:, j], r.dseq[:, j]
            t = t + np.where(
                tok > 0, dev.t_pass + dev.t_req_draft * seq + _fwd(D, tok, seq * per_seq, tok * per_seq, seq), 0.0
            )
        t = t + np.where(r.cu > 0, dev.t_pass + _fwd(D, r.cu, r.ctx, r.cu * per_seq / 2, 0.0), 0.0)
        return t * r.m

    def step(self, b, ctx, vt, vl, qc, spec, dtok, dseq, cu) -> float:
        """Seconds of one step (floats; dtok and dseq: the drafter passes in order)."""
        dev, T, D = self.dev, self.T, self.D
        per_seq = ctx / max(b, 1)
        t = dev.t_step + dev.t_req * b + _fwd(T, vt, ctx, qc, vl, max) + spec * dev.t_spec
        for tok, seq in zip(dtok, dseq):
            if tok > 0:
                t += dev.t_pass + dev.t_req_draft * seq + _fwd(D, tok, seq * per_seq, tok * per_seq, seq, max)
        if cu > 0:
            t += dev.t_pass + _fwd(D, cu, ctx, cu * per_seq / 2, 0.0, max)
        return t


def step_times(dev: Device, pair: Pair, rows: Rows, tp: int = 1) -> np.ndarray:
    """Seconds of each row (m steps each)."""
    return Pricer(dev, pair, tp).rows(rows)


def one_row(m=1, b=1, ctx=0.0, vt=1, qc=0.0, spec=0, dtok=(), dseq=(), cu=0, vl=None, J: int = 8) -> Rows:
    """A single row (scalars), the drafter passes padded to ``J``."""
    dt, ds = np.zeros((1, J)), np.zeros((1, J))
    dt[0, : len(dtok)], ds[0, : len(dseq)] = dtok, dseq
    a = lambda v: np.array([float(v)])  # noqa: E731
    return Rows(a(m), a(b), a(ctx), a(vt), a(vt if vl is None else vl), a(qc), a(spec), dt, ds, a(cu))


def steady_row(b: float, k: int, ctx_per_seq: float, mode: str = "auto", pair: Pair | None = None) -> Rows:
    """A steady step at k verified and k drafted. ``mode``: "none" (no drafter), "plain" (the fast path's
    k=0), "sync" (k=0 with vLLM's drafter pass), "auto" (k>0: speculative; k=0: plain for a pair with the
    fast path, sync otherwise)."""
    if mode == "auto":
        mode = "spec" if k > 0 else ("plain" if pair is None or pair.catch_up else "sync")
    ctx = b * ctx_per_seq
    vt = b * (k + 1)
    if mode in ("none", "plain"):
        return one_row(b=b, ctx=ctx, vt=b, qc=b * ctx_per_seq)
    passes = max(k, 1)
    dtok = [vt] + [b] * (passes - 1)
    return one_row(b=b, ctx=ctx, vt=vt, qc=vt * ctx_per_seq, spec=1, dtok=dtok, dseq=[b] * passes)


def steady_time(
    dev: Device, pair: Pair, b: float, k: int, ctx_per_seq: float, mode: str = "auto", tp: int = 1
) -> float:
    return float(step_times(dev, pair, steady_row(b, k, ctx_per_seq, mode, pair), tp)[0])


def steady_speedup(dev: Device, pair: Pair, b: float, k: int, ctx_per_seq: float, tp: int = 1) -> float:
    """Decode tokens/s at steady k against no speculation, at batch b: E[L(k)] t(b, none) / t(b, k)."""
    base = steady_time(dev, pair, b, 0, ctx_per_seq, "none", tp)
    return pair.expected_length(k) * base / steady_time(dev, pair, b, k, ctx_per_seq, "auto", tp)


def peak_kv_tokens(wl: Workload) -> float:
    """Most context tokens held at once when every running sequence gains one token a step and a finished one
    frees its KV: max over t of n(t) (P + t)."""
    L = np.sort(wl.lengths)
    n = len(L) - np.arange(len(L))  # sequences still running just before the i-th shortest ends
    return float(np.max(n * (wl.prompt_len + L)))


def memory_needed(dev: Device, pair: Pair, wl: Workload) -> float:
    B = dev.bytes_per_param
    weights = (pair.target.total_params + pair.drafter.dense_params) * B
    kv = peak_kv_tokens(wl) * (pair.target.kv_bytes_per_token(B) + pair.drafter.kv_bytes_per_token(B))
    return weights + kv


def choose_tp(dev: Device, pair: Pair, wl: Workload) -> int:
    """The pair's tensor parallel, else the smallest power of two whose devices hold the weights and the
    phase's peak KV in MEM_FRACTION of their memory (less ACTIVATIONS each)."""
    if pair.tp:
        return pair.tp
    need = memory_needed(dev, pair, wl)
    tp = 1
    while tp < 8 and need / tp > dev.memory * MEM_FRACTION - ACTIVATIONS:
        tp *= 2
    return tp


TRAIN_FLOPS_PER_PARAM_TOKEN = 8.0  # 6 N: the policy's forward and backward; 2 N: the old log-probs; no reference


def train_time(dev: Device, pair: Pair, wl: Workload, tp: int = 1) -> float:
    """The train phase of the same GRPO step on the engine's devices (colocated): 8 N FLOPs per token of prompt
    and response at the device's MFU (no reference model: kl_coef 0)."""
    tokens = float(wl.tokens + len(wl.lengths) * wl.prompt_len)
    return TRAIN_FLOPS_PER_PARAM_TOKEN * pair.target.total_params * tokens / (dev.flops * dev.mfu * tp)


HEAD_METHODS = ("eagle3", "mtp")
HEAD_CHAIN_STEPS = 3  # drafter_training.chain_steps's default: the training-time-test steps per token


def head_train_time(dev: Device, pair: Pair, wl: Workload, tp: int = 1, chain_steps: int = HEAD_CHAIN_STEPS) -> float:
    """A head trained online (drafter_training on an eagle3 or mtp pair; rl_specdec/heads/training.py): its features
    and targets come from the policy's own update forward, so no extra policy pass; the head runs forward and
    backward over every response token once per training-time-test step, 6 FLOPs per weight its pass reads (its
    layer, its fc, the LM head it projects through; a frozen LM head needs 4, so this bounds it from above).
    Zero for a draft model, whose training is priced apart."""
    if pair.method not in HEAD_METHODS:
        return 0.0
    return 6.0 * pair.drafter.dense_params * float(wl.tokens) * chain_steps / (dev.flops * dev.mfu * tp)
