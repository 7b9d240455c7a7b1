"""A discrete-event simulation of one GRPO generation phase on one engine.

All B sequences are submitted together and run under continuous batching:
up to ``max_seqs`` run at once (vLLM's max_num_seqs; the rest wait, first come
first served, and are prefilled in the step that admits them), every running
sequence takes part in every step and advances by its accepted drafts + 1,
capped at its length; a finished one leaves the batch, so the batch shrinks to
the long tail. Each step the policy sets the drafts k each
request makes for the next step (:mod:`.policies`); the step's shape (requests,
context, verified tokens, drafter passes, catch-up) is priced by
:class:`.costmodel.Pricer`.

Acceptance: draft slot i of a request is accepted with probability alpha_i
(:mod:`.workload`), accepted drafts are the leading run of accepted slots. A
request that finishes keeps only the tokens up to its length (like the
scheduler dropping tokens past max_tokens), and the controller is told only
the kept ones, as the engine's step records do.

Two paths, the same statistics: policies whose k depends only on the batch
and the request (*static*) advance ``m`` steps at once wherever no request can
finish within them (each step advances a request at most k+1 tokens), drawing
each request's accepted drafts from a multinomial; their steps do not depend on
the device, so one run is priced on every device. Policies that look at the
step times (the controller, adaptive verification) run step by step on one
device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from benchmarks.whatif.costmodel import Pricer, Rows
from benchmarks.whatif.workload import Pair, Workload

J = 8  # drafter pass columns in Rows (k <= 8)


class State:
    """Per-sequence state of a phase (arrays over all B sequences)."""

    def __init__(self, wl: Workload):
        self.started = np.zeros(len(wl.lengths), bool)  # admitted (prefilled)
        self.max_seqs = wl.max_seqs or len(wl.lengths)
        self.rem = wl.lengths.astype(np.int64).copy()  # tokens still to generate
        self.ctx = np.full(len(wl.lengths), float(wl.prompt_len))  # context tokens: prompt + generated
        self.kv = np.zeros(len(wl.lengths), np.int64)  # drafts waiting to be verified
        self.stale = np.zeros(len(wl.lengths))  # positions the drafter missed (plain steps, fast path)
        self.emitted = 0

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        """(running requests, requests admitted now): the waiting fill the free slots in submission order."""
        run = np.flatnonzero(self.started & (self.rem > 0))
        waiting = np.flatnonzero(~self.started)
        new = waiting[: max(self.max_seqs - len(run), 0)]
        return run, new


@dataclass
class Step:
    """One row: ``m`` identical steps, its shape for the pricer and (for m = 1) its step record."""

    m: int
    b: int
    ctx: float
    vt: float
    vl: float
    qc: float
    spec: int
    dtok: list = field(default_factory=list)
    dseq: list = field(default_factory=list)
    cu: float = 0.0
    drafts: int = 0
    k_verify: int = 0
    k_next: int = 0
    emitted: int = 0
    plain: bool = False
    continuing: bool = True
    drafted_pp: list | None = None
    accepted_pp: list | None = None


def _passes(first_tokens: float, k_new: np.ndarray) -> tuple[list, list]:
    """The drafter's sequential passes: the first over the verified tokens, then one token per request that
    still drafts; a speculative step that drafts nothing runs the first (its KV sync) only."""
    n = max(int(k_new.max()), 1)
    rest = [int((k_new > j).sum()) for j in range(1, n)]
    return [float(first_tokens)] + rest, [len(k_new)] + rest


def accepted(a: np.ndarray, pair: Pair, rng: np.random.Generator, q: np.ndarray | None = None) -> np.ndarray:
    """Accepted drafts per request verifying a[r] drafts: the leading run of accepted slots (slot i with
    probability alpha_i, or q[r, i] where a confidence was drawn)."""
    K = int(a.max()) if len(a) else 0
    if K == 0:
        return np.zeros(len(a), np.int64)
    p = pair.alphas(K) if q is None else q[:, :K]
    lead = np.cumprod(rng.random((len(a), K)) < p, axis=1)
    return (lead * (np.arange(K) < a[:, None])).sum(1)


def engine_step(st: State, run, new, k_new, P: int, pair: Pair, spec_engine: bool, rng, admit=None) -> Step:
    """One engine step: the running requests ``run`` verify their drafts (all, or those ``admit`` admits) and
    emit the kept tokens, the admitted ``new`` ones are prefilled (P tokens each) and sample one; all draft
    k_new (in order: run, then new) for the next step. Where the drafter fell behind it catches up first."""
    kv = st.kv[run]
    a, q = admit(st, run, kv) if admit is not None and len(run) else (kv, None)
    acc = accepted(a, pair, rng, q)
    kept = np.minimum(acc + 1, st.rem[run])
    nn, b, ctx = len(new), len(run) + len(new), float(st.ctx[run].sum())
    amax = int(a.max()) if len(run) else 0
    plain = not spec_engine or (pair.catch_up and amax == 0 and int(k_new.max()) == 0)
    vt = float((a + 1).sum()) + nn * P
    qc = float((a + 1).sum()) * ctx / max(len(run), 1) + nn * P * P / 2
    s = Step(1, b, ctx, vt, float((a + 1).sum()) + nn, qc, int(not plain), plain=plain, continuing=len(run) > 0)
    if spec_engine and not plain:
        if pair.catch_up:
            s.cu = float(st.stale[run].sum())
            st.stale[run] = 0.0
        s.dtok, s.dseq = _passes(vt, k_new)
    elif spec_engine:
        st.stale[run] += 1
        st.stale[new] += P
    s.drafts, s.k_verify, s.k_next = int(a.sum()), amax, int(k_new.max())
    s.emitted = int(kept.sum()) + nn
    if s.drafts:
        credited = np.minimum(acc, kept)  # a draft counts as accepted only if the request keeps it
        s.drafted_pp = [int((a >= i).sum()) for i in range(1, amax + 1)]
        s.accepted_pp = [int((credited >= i).sum()) for i in range(1, amax + 1)]
    st.rem[run] -= kept
    st.ctx[run] += kept
    st.started[new] = True
    st.rem[new] -= 1
    st.ctx[new] += 1
    st.kv[np.concatenate([run, new])] = k_new
    st.emitted += s.emitted
    return s


def macro_step(st, idx, k, pair, spec_engine, rng) -> Step | None:
    """m >= 2 steady steps at per-request k (each verifying what it drafted) in which no request can finish,
    or None. Each request's accepted drafts over the m steps: a multinomial draw of m steps' outcomes."""
    m = int(np.min(st.rem[idx] // (k + 1)))
    if m < 2:
        return None
    adv = np.full(len(idx), m, np.int64)
    for kk in np.unique(k):
        if kk > 0:
            sel = k == kk
            adv[sel] += rng.multinomial(m, pair.pmf(int(kk)), size=int(sel.sum())) @ np.arange(kk + 1)
    b, total = len(idx), int(adv.sum())
    ctx = float(st.ctx[idx].sum()) + total / (2.0 * m) * (m - 1)  # the mean step's context
    plain = not spec_engine or (pair.catch_up and int(k.max()) == 0)
    vt = float((k + 1).sum())
    s = Step(m, b, ctx, vt, vt, vt * ctx / b, int(not plain), emitted=total, plain=plain, k_next=int(k.max()))
    if spec_engine and not plain:
        s.dtok, s.dseq = _passes(vt, k)
    elif spec_engine:
        st.stale[idx] += m
    st.rem[idx] -= adv
    st.ctx[idx] += adv
    st.emitted += total
    return s


def to_rows(steps: list[Step]) -> Rows:
    n = len(steps)
    dt, ds = np.zeros((n, J)), np.zeros((n, J))
    for i, s in enumerate(steps):
        dt[i, : len(s.dtok)], ds[i, : len(s.dseq)] = s.dtok, s.dseq
    col = lambda f: np.array([float(getattr(s, f)) for s in steps])  # noqa: E731
    return Rows(col("m"), col("b"), col("ctx"), col("vt"), col("vl"), col("qc"), col("spec"), dt, ds, col("cu"))


@dataclass
class Phase:
    """What a simulated phase did: its rows (static path) or its time (step-by-step path), and counts."""

    steps: int
    tokens: int
    rows: Rows | None = None
    time: float | None = None
    k_steps: dict = field(default_factory=dict)  # steps by the most drafts a request made for the next step
    extra: dict = field(default_factory=dict)


def simulate_static(pair: Pair, wl: Workload, policy, rng: np.random.Generator) -> Phase:
    """A phase under a static policy (k from the batch size and the request only): device-independent rows."""
    st = State(wl)
    policy.start_phase(wl, rng)
    steps = []
    while True:
        run, new = st.next_batch()
        idx = np.concatenate([run, new])
        if not len(idx):
            break
        k = policy.k_next(len(idx), idx, st)
        catch_up = policy.spec and pair.catch_up and int(k.max()) > 0 and st.stale[run].any()
        s = None
        if not len(new) and np.array_equal(st.kv[run], k) and not catch_up:
            s = macro_step(st, run, k, pair, policy.spec, rng)
        steps.append(s if s is not None else engine_step(st, run, new, k, wl.prompt_len, pair, policy.spec, rng))
    k_steps: dict = {}
    for s in steps:
        k_steps[s.k_next] = k_steps.get(s.k_next, 0) + s.m
    return Phase(sum(s.m for s in steps), st.emitted, rows=to_rows(steps), k_steps=k_steps)


def simulate_feedback(
    pair: Pair, wl: Workload, policy, pricer: Pricer, rng: np.random.Generator, noise: float = 0.03
) -> Phase:
    """A phase step by step on one device, for a policy that reads step times or confidences. Each step's wall
    time is the model's, times a lognormal noise (sigma ``noise``), and goes to the policy as its measurement."""
    st = State(wl)
    policy.start_phase(wl, rng)
    total, n, k_steps = 0.0, 0, {}
    while True:
        run, new = st.next_batch()
        idx = np.concatenate([run, new])
        if not len(idx):
            break
        policy.before_step(len(idx))
        k = policy.k_next(len(idx), idx, st)
        s = engine_step(st, run, new, k, wl.prompt_len, pair, policy.spec, rng, policy.admitter(pricer, pair, rng))
        t = pricer.step(s.b, s.ctx, s.vt, s.vl, s.qc, s.spec, s.dtok, s.dseq, s.cu) * math.exp(
            noise * rng.standard_normal()
        )
        policy.after_step(s, t)
        total, n = total + t, n + 1
        k_steps[s.k_next] = k_steps.get(s.k_next, 0) + 1
    policy.end_phase()
    return Phase(n, st.emitted, time=total, k_steps=k_steps, extra=policy.summary())
