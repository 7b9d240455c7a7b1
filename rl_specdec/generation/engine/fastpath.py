"""The k=0 fast path and the per-step records, as per-instance wrappers on vLLM's model runner.

**Why.** When vLLM 0.32's scheduler gives k=0 (``num_spec_tokens_to_schedule ==
0``) the model runner still takes its whole speculative path: the drafter runs
a forward to keep its KV cache in sync, the rejection sampler replaces the
plain sampler, and the draft hand-off runs with empty lists. That made k=0 cost
~30% more than no speculation on the toy at batch 128 (docs/speculative_decoding.md).

**What.** A step is *plain* when nothing is verified now and nothing will be
drafted next. For a plain step ``runner.speculative_config`` is ``None`` from
the start of ``execute_model`` to the end of ``sample_tokens``, so the step runs
vLLM's own no-speculation code end to end (plain sampler, no metadata, no
drafter, no draft hand-off). Every reader of ``speculative_config`` per step in
vLLM 0.32's ``gpu_model_runner.py`` (which the CPU runner subclasses) takes the
plain branch when it is ``None``. The drafter's KV falls behind for the
requests of a plain step; :mod:`.catchup` fills it before the drafter next runs.

**Where.** Only on this runner instance: ``execute_model``, ``sample_tokens`` and
``propose_draft_token_ids`` are instance attributes that shadow the class's
methods; nothing is patched at class level. :func:`probe` lists what the
running vLLM lacks, and the start-up self-check (:mod:`.control`) proves the
path on the live engine.

Every engine step also yields one :class:`StepRecord` (batch size, tokens, k
verified and drafted, context, emitted tokens, per-position acceptance, wall
time) for the controller; ``listeners`` are called with each finished record.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

from rl_specdec.generation.engine.catchup import catch_up

RUNNER_ATTRS = ("execute_model", "sample_tokens", "propose_draft_token_ids", "speculative_config", "drafter", "input_batch", "requests")
SCHED_OUT_FIELDS = ("num_spec_tokens_to_schedule", "scheduled_spec_decode_tokens", "num_scheduled_tokens", "scheduled_new_reqs", "scheduled_cached_reqs", "finished_req_ids")
DRAFTER_ATTRS = ("input_ids", "model", "build_per_group_and_layer_attn_metadata", "_get_slot_mapping", "vllm_config")


def probe(runner) -> list[str]:
    """What this vLLM/engine lacks for the fast path with catch-up ([] = supported)."""
    from vllm.v1.core.sched.output import SchedulerOutput

    problems = [f"the model runner has no {a}" for a in RUNNER_ATTRS if not hasattr(runner, a)]
    fields = {f.name for f in dataclasses.fields(SchedulerOutput)}
    problems += [f"SchedulerOutput has no {f}" for f in SCHED_OUT_FIELDS if f not in fields]
    sc = getattr(runner, "speculative_config", None)
    if sc is None:
        return problems + ["speculation is off"]
    if not sc.uses_draft_model():
        problems.append(f"method {sc.method!r}: the fast path and the drafter catch-up are written for draft_model only")
    problems += [f"the drafter has no {a}" for a in DRAFTER_ATTRS if not hasattr(getattr(runner, "drafter", None), a)]
    if getattr(runner, "use_async_scheduling", False):
        problems.append("async scheduling is on (the scheduler pre-allocates draft placeholders)")
    pc = getattr(runner, "parallel_config", None)
    if pc is not None and (pc.pipeline_parallel_size > 1 or pc.data_parallel_size > 1):
        problems.append("pipeline or data parallel")
    return problems


@dataclasses.dataclass(slots=True)
class StepRecord:
    """One engine step, as the model runner saw it."""

    b: int  # requests scheduled
    tokens: int  # tokens scheduled (prefill chunks included)
    drafts: int  # draft tokens verified in this step
    k_verify: int  # the most drafts one request verified
    k_next: int  # drafts each request makes in this step, for the next one
    ctx: int  # context tokens of the scheduled requests before the step
    plain: bool  # ran as a plain step (the fast path)
    continuing: bool  # some request carried over from the previous step (no idle gap before it)
    catch_up: int = 0  # drafter tokens caught up in this step
    emitted: int = 0  # tokens sampled (accepted drafts + one per request)
    drafted_pp: list[int] | None = None  # requests that verified >= i drafts, i = 1..k_verify
    accepted_pp: list[int] | None = None  # requests whose first i drafts were all accepted
    runner_s: float = 0.0  # wall time inside execute_model + sample_tokens
    period_s: float | None = None  # wall time from this step's start to the next one's; None: unknown (idle gap)


def _starts(so) -> dict[str, int]:
    """num_computed_tokens at the start of this step, per scheduled request."""
    d = {nr.req_id: int(nr.num_computed_tokens) for nr in so.scheduled_new_reqs}
    c = so.scheduled_cached_reqs
    d.update(zip(c.req_ids, map(int, c.num_computed_tokens)))
    return d


def _useful(ids: list[int], state) -> int:
    """How many of a request's sampled tokens it keeps: up to its first stop token and within max_tokens
    (the tokens accepted past either are dropped by the scheduler, so drafting them earned nothing)."""
    sp = getattr(state, "sampling_params", None)
    if sp is None:
        return len(ids)
    n = len(ids)
    stops = () if sp.ignore_eos else sp.all_stop_token_ids
    if stops:
        n = next((i + 1 for i, t in enumerate(ids) if t in stops), n)
    if sp.max_tokens is not None:
        n = min(n, max(sp.max_tokens - (len(state.output_token_ids) - len(ids)), 1))
    return n


def _acceptance(spec_tokens: dict[str, list[int]], out, requests) -> tuple[list[int] | None, list[int] | None, int]:
    """(drafted per position, accepted per position, emitted tokens) from a step's output (after the model
    runner's bookkeeping). In a step that verified drafts, a token counts as emitted, and a draft as accepted,
    only if the request keeps it (:func:`_useful`)."""
    ids = getattr(out, "sampled_token_ids", None) or []
    emitted = sum(len(x) for x in ids)
    index = getattr(out, "req_id_to_index", None)
    if not spec_tokens or index is None:
        return None, None, emitted
    k = max(len(v) for v in spec_tokens.values())
    drafted, accepted = [0] * k, [0] * k
    for rid, drafts in spec_tokens.items():
        i = index.get(rid)
        if i is None:
            continue
        kept = _useful(ids[i], requests.get(rid))
        emitted -= len(ids[i]) - kept
        for j in range(len(drafts)):
            drafted[j] += 1
        for j in range(min(len(ids[i]) - 1, kept, len(drafts))):
            accepted[j] += 1
    return drafted, accepted, emitted


class FastPath:
    """The wrappers of one model runner. ``plain_steps=False`` keeps vLLM's own path at k=0 (records only)."""

    def __init__(self, runner, plain_steps: bool = True):
        self.runner, self.spec_config, self.plain_steps = runner, runner.speculative_config, plain_steps
        self.orig = {n: getattr(runner, n) for n in ("execute_model", "sample_tokens", "propose_draft_token_ids")}
        self.drafter_valid: dict[str, int] = {}  # stale request -> first position missing from the drafter's KV
        self.poisoned = False  # a plain step ran: prefix-cached blocks may hold target KV without drafter KV
        self.step_start: dict[str, int] = {}
        self.max_catch_up_tokens = 1 << 30  # tests lower it to exercise the split into pieces
        self.catch_up_on = True
        self.stats = {"steps": 0, "plain_steps": 0, "catch_up_calls": 0, "catch_up_tokens": 0}
        self.listeners: list[Callable[[StepRecord, Any], None]] = []  # (finished record, next scheduler output)
        self.pending: StepRecord | None = None  # finished, waiting for the next step's start (its period)
        self._cur: StepRecord | None = None
        self._spec_tokens: dict = {}
        self._t0 = self._t_prev = 0.0

    def install(self) -> None:
        for name in self.orig:
            setattr(self.runner, name, getattr(self, name))  # instance attributes shadow the class's methods

    def uninstall(self) -> None:
        for name in self.orig:
            self.runner.__dict__.pop(name, None)
        self.runner.speculative_config = self.spec_config

    # ---- the wrappers -------------------------------------------------------------------
    def execute_model(self, scheduler_output, *args, **kwargs):
        so = scheduler_output
        self._begin(so)
        if self._cur.plain:
            self.runner.speculative_config = None
        try:
            out = self.orig["execute_model"](so, *args, **kwargs)
        except BaseException:
            self.runner.speculative_config = self.spec_config
            raise
        if out is not None:  # no sample_tokens call follows (an empty step)
            self.runner.speculative_config = self.spec_config
            self._finish(None)
        return out

    def sample_tokens(self, grammar_output):
        try:
            out = self.orig["sample_tokens"](grammar_output)
        finally:
            self.runner.speculative_config = self.spec_config
        self._finish(out)
        return out

    def propose_draft_token_ids(self, scheduler_output, *args, **kwargs):
        if self.drafter_valid and self.catch_up_on:
            n = catch_up(self.runner, self.drafter_valid, self.step_start, self.max_catch_up_tokens)
            if n:
                self.stats["catch_up_calls"] += 1
                self.stats["catch_up_tokens"] += n
                if self._cur is not None:
                    self._cur.catch_up += n
        return self.orig["propose_draft_token_ids"](scheduler_output, *args, **kwargs)

    # ---- bookkeeping --------------------------------------------------------------------
    def _begin(self, so) -> None:
        now = time.perf_counter()
        starts = self.step_start = _starts(so)
        spec = so.scheduled_spec_decode_tokens
        cached = so.scheduled_cached_reqs.req_ids
        plain = self.plain_steps and so.total_num_scheduled_tokens > 0 and so.num_spec_tokens_to_schedule == 0 and not spec
        self._cur = StepRecord(
            b=len(so.num_scheduled_tokens),
            tokens=so.total_num_scheduled_tokens,
            drafts=sum(len(v) for v in spec.values()),
            k_verify=max((len(v) for v in spec.values()), default=0),
            k_next=so.num_spec_tokens_to_schedule,
            ctx=sum(starts.values()),
            plain=plain,
            continuing=len(cached) > 0,
        )
        self._spec_tokens, self._t0 = spec, now
        if self.pending is not None:
            done, self.pending = self.pending, None
            if self._cur.continuing:
                done.period_s = now - self._t_prev
            for fn in self.listeners:
                fn(done, so)
        self._t_prev = now
        self._track_staleness(so, starts, plain)

    def _track_staleness(self, so, starts: dict[str, int], plain: bool) -> None:
        for rid in so.finished_req_ids:
            self.drafter_valid.pop(rid, None)
        resumed = getattr(so.scheduled_cached_reqs, "resumed_req_ids", ()) or ()
        for rid in resumed:  # preempted and resumed: recomputed from its start, on new blocks
            if rid in self.drafter_valid:
                self.drafter_valid[rid] = min(self.drafter_valid[rid], starts.get(rid, 0))
        if self.poisoned:  # a prefix-cache hit may land on blocks filled during plain steps: catch up from 0
            for nr in so.scheduled_new_reqs:
                if nr.num_computed_tokens > 0:
                    self.drafter_valid[nr.req_id] = 0
            for rid in resumed:
                if starts.get(rid, 0) > 0:
                    self.drafter_valid[rid] = 0
        self.stats["steps"] += int(so.total_num_scheduled_tokens > 0)  # steps with work (an engine may step empty)
        if plain:
            self.stats["plain_steps"] += 1
            self.poisoned = True
            for rid in so.num_scheduled_tokens:
                self.drafter_valid.setdefault(rid, starts.get(rid, 0))

    def _finish(self, out) -> None:
        cur, self._cur = self._cur, None
        if cur is None:
            return
        cur.runner_s = time.perf_counter() - self._t0
        cur.drafted_pp, cur.accepted_pp, cur.emitted = _acceptance(self._spec_tokens, out, self.runner.requests)
        self.pending = cur
