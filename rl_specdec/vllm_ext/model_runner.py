"""The k=0 fast path and the per-step records, as per-instance wrappers on vLLM's model runner.

**Why.** When vLLM 0.32's scheduler gives k=0 (``num_spec_tokens_to_schedule ==
0``) the model runner still takes its whole speculative path: the drafter runs
a forward to keep its KV cache in sync, the rejection sampler replaces the
plain sampler, and the draft hand-off runs with empty lists. That made k=0 cost
about 35% more than no speculation on the toy at batch 128 (docs/speculative_decoding.md).

**What.** A step is *plain* when nothing is verified now and nothing will be
drafted next. For a plain step ``runner.speculative_config`` is ``None`` from
the start of ``execute_model`` to the end of ``sample_tokens``, so the step runs
vLLM's own no-speculation code end to end (plain sampler, no metadata, no
drafter, no draft hand-off). Every reader of ``speculative_config`` per step in
vLLM 0.32's ``gpu_model_runner.py`` (which the CPU runner subclasses) takes the
plain branch when it is ``None``. The drafter's KV falls behind for the
requests of a plain step; :mod:`.drafter_kv` fills it before the drafter next runs. An EAGLE-3 head also needs the
policy's hidden states of those positions: a plain step keeps them (``ExecuteModelState.aux_hidden_states``, which
vLLM computes whenever a head is loaded) and catches its prefill chunks up at once. ngram keeps no state of its
own (it matches the request's token ids, which a plain step updates as any other), so it has nothing to catch up.

**Where.** Only on this runner instance: ``execute_model``, ``sample_tokens`` and
``propose_draft_token_ids`` are instance attributes that shadow the class's
methods; nothing is patched at class level. :func:`probe` lists what the
running vLLM lacks, and the start-up self-check (rl_specdec.rollout.runtime_k.selfcheck) proves the
path on the live engine.

Every engine step also yields one :class:`StepRecord` (batch size, tokens, k
verified and drafted, context, emitted tokens, per-position acceptance, wall
time) for the controller; ``listeners`` are called with each finished record.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

from rl_specdec.vllm_ext.drafter_kv import HeadStash, catch_up
from rl_specdec.vllm_ext.methods import method as method_row

RUNNER_ATTRS = (
    "execute_model",
    "sample_tokens",
    "propose_draft_token_ids",
    "speculative_config",
    "drafter",
    "rejection_sampler",
    "input_batch",
    "requests",
    "use_async_scheduling",
    "parallel_config",
)
HEAD_ATTRS = ("hidden_states", "use_heterogeneous_vocab", "pass_hidden_states_to_model")
DRAFTER_ATTRS = (
    "input_ids",
    "model",
    "build_per_group_and_layer_attn_metadata",
    "_get_slot_mapping",
    "vllm_config",
    "kv_cache_gid",
    "propose",
)
FIELDS = {  # vLLM dataclass -> the fields read here
    "vllm.v1.core.sched.output.SchedulerOutput": (
        "num_spec_tokens_to_schedule",
        "scheduled_spec_decode_tokens",
        "num_scheduled_tokens",
        "scheduled_new_reqs",
        "scheduled_cached_reqs",
        "finished_req_ids",
        "total_num_scheduled_tokens",
    ),
    "vllm.v1.core.sched.output.CachedRequestData": ("req_ids", "resumed_req_ids", "num_computed_tokens"),
    "vllm.v1.core.sched.output.NewRequestData": ("req_id", "num_computed_tokens"),
    "vllm.v1.outputs.ModelRunnerOutput": ("sampled_token_ids", "req_id_to_index"),
    "vllm.v1.worker.gpu_input_batch.CachedRequestState": ("sampling_params", "output_token_ids"),
    "vllm.v1.worker.gpu_model_runner.ExecuteModelState": ("scheduler_output", "aux_hidden_states"),
}


def _fields(qualname: str) -> set[str]:
    import importlib

    module, name = qualname.rsplit(".", 1)
    cls = getattr(importlib.import_module(module), name)
    return set(cls._fields) if hasattr(cls, "_fields") else {f.name for f in dataclasses.fields(cls)}


def probe_classes() -> None:
    """The static probe: every field this module reads exists in this vLLM (raises RuntimeError naming it)."""
    missing = [f"{q.rsplit('.', 1)[1]}.{f}" for q, names in FIELDS.items() for f in names if f not in _fields(q)]
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    missing += [f"GPUModelRunner.{m}" for m in RUNNER_ATTRS[:3] if not callable(getattr(GPUModelRunner, m, None))]
    if missing:
        raise RuntimeError(f"vLLM lacks {', '.join(missing)}")


def probe(runner) -> list[str]:
    """What this engine's runner lacks for the fast path with catch-up ([] = supported); run on the live runner."""
    problems = [f"the model runner has no {a}" for a in RUNNER_ATTRS if not hasattr(runner, a)]
    if problems:
        return problems
    sc = runner.speculative_config
    if sc is None:
        return ["speculation is off"]
    row = method_row(sc.method)
    if sc.uses_draft_model() or row.head:
        problems += [f"the drafter has no {a}" for a in DRAFTER_ATTRS if not hasattr(runner.drafter, a)]
    elif not (row.runtime_k and row.model_free):
        problems.append(
            f"method {sc.method!r}: the fast path is written for draft_model and eagle3 (with the drafter's "
            "catch-up) and ngram (no drafter state) only"
        )
    if row.head and not problems:
        problems += [f"the head has no {a}" for a in HEAD_ATTRS if not hasattr(runner.drafter, a)]
        if not getattr(runner, "use_aux_hidden_state_outputs", False):
            problems.append("the policy returns no hidden states for the head (use_aux_hidden_state_outputs)")
        elif runner.drafter.use_heterogeneous_vocab:
            problems.append("the head's vocabulary maps to the policy's (the catch-up feeds policy token ids)")
    if runner.use_async_scheduling:
        problems.append("async scheduling is on (the scheduler pre-allocates draft placeholders)")
    pc = runner.parallel_config
    if pc.pipeline_parallel_size > 1 or pc.data_parallel_size > 1:
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
    if state is None or state.sampling_params is None:  # gone from the runner, or a pooling request
        return len(ids)
    sp = state.sampling_params
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
    if out is None:  # an empty step: nothing sampled
        return None, None, 0
    ids, index = out.sampled_token_ids, out.req_id_to_index
    emitted = sum(len(x) for x in ids)
    if not spec_tokens:
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
        row = method_row(runner.speculative_config.method)
        # a method that drafts from the request's own token ids (ngram), which vLLM keeps in plain steps too, has
        # no drafter state to catch up; a head's is caught up from the hidden states a plain step keeps
        self.needs_catch_up = not row.model_free
        self.stash = HeadStash() if row.head else None
        self.catch_up_on = self.needs_catch_up  # tests turn it off to show the self-check fails without it
        self.stats = {"steps": 0, "plain_steps": 0, "catch_up_calls": 0, "catch_up_tokens": 0}
        self.listeners: list[Callable[[StepRecord, Any], None]] = []  # (finished record, next scheduler output)
        self.pending: StepRecord | None = None  # finished, waiting for the next step's start (its period)
        self._cur: StepRecord | None = None
        self._spec_tokens: dict = {}
        self._t0 = self._t_prev = 0.0

    def in_plain_step(self) -> bool:
        """Whether the step running now is a plain one."""
        return self._cur is not None and self._cur.plain

    def install(self) -> None:
        for name in self.orig:
            setattr(self.runner, name, getattr(self, name))  # instance attributes shadow the class's methods

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
        keep = self.stash is not None and self.in_plain_step() and self.runner.execute_model_state is not None
        state = self.runner.execute_model_state if keep else None
        try:
            out = self.orig["sample_tokens"](grammar_output)
        finally:
            self.runner.speculative_config = self.spec_config
        if state is not None and state.aux_hidden_states is not None:
            # after sampling: the token after a finished prompt, which a head reads at its last position, is known
            ends = self.stash.add(self.runner, state.scheduler_output, state.aux_hidden_states, self.step_start)
            if ends and self.catch_up_on:
                self._catch_up(ends)
        self._finish(out)
        return out

    def propose_draft_token_ids(self, scheduler_output, *args, **kwargs):
        if self.drafter_valid and self.catch_up_on:
            self._catch_up(self.step_start)
        return self.orig["propose_draft_token_ids"](scheduler_output, *args, **kwargs)

    def _catch_up(self, ends: dict[str, int]) -> None:
        n = catch_up(self.runner, self.drafter_valid, ends, self.max_catch_up_tokens, self.stash)
        if n:
            self.stats["catch_up_calls"] += 1
            self.stats["catch_up_tokens"] += n
            if self._cur is not None:
                self._cur.catch_up += n

    # ---- bookkeeping --------------------------------------------------------------------
    def _begin(self, so) -> None:
        now = time.perf_counter()
        starts = self.step_start = _starts(so)
        spec = so.scheduled_spec_decode_tokens
        cached = so.scheduled_cached_reqs.req_ids
        plain = (
            self.plain_steps and so.total_num_scheduled_tokens > 0 and so.num_spec_tokens_to_schedule == 0 and not spec
        )
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
        if self.stash is not None and so.finished_req_ids:
            self.stash.keep_only(self.drafter_valid)
        resumed = so.scheduled_cached_reqs.resumed_req_ids or ()
        for rid in resumed:  # preempted and resumed: recomputed from its start, on new blocks
            if rid in self.drafter_valid:
                self.drafter_valid[rid] = min(self.drafter_valid[rid], starts.get(rid, 0))
        # a prefix-cache hit may land on blocks filled during plain steps: catch up from 0 (a head's prefill
        # chunks were caught up in their own step, and it has no hidden states of another request's positions)
        if self.poisoned and self.stash is None:
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


# ---- observing the runner (the start-up self-check) --------------------------------------------
def first_drafts(runner, so, step_start: dict[str, int]) -> list[tuple[tuple[int, ...], int, int]]:
    """(prompt ids, position, first draft) of every request verifying drafts in this step: the drafter's
    argmax given the true prefix, to compare a caught-up drafter with one that ran every step."""
    ib, out = runner.input_batch, []
    for rid, drafts in so.scheduled_spec_decode_tokens.items():
        idx = ib.req_id_to_index.get(rid)
        if idx is None or not drafts:
            continue
        prompt = tuple(int(t) for t in ib.token_ids_cpu[idx, : ib.num_prompt_tokens[idx]])
        out.append((prompt, step_start[rid] + 1, int(drafts[0])))
    return out


def count_plain_step_calls(fastpath: FastPath, counts: dict[str, int]) -> Callable[[], None]:
    """Count drafter proposals and rejection-sampler calls made during plain steps into ``counts``
    (keys ``drafter``, ``rejection_sampler``), with instance wrappers; returns the function that removes them."""
    runner, wrapped = fastpath.runner, []
    for key, obj, name in (
        ("drafter", runner.drafter, "propose"),
        ("rejection_sampler", runner.rejection_sampler, "forward"),
    ):
        orig = getattr(obj, name)

        def counted(*a, _orig=orig, _key=key, **kw):
            if fastpath.in_plain_step():
                counts[_key] += 1
            return _orig(*a, **kw)

        setattr(obj, name, counted)
        wrapped.append((obj, name))

    def unwrap() -> None:
        for obj, name in wrapped:
            obj.__dict__.pop(name, None)

    return unwrap


PROBES = {"model runner, scheduler output and request state fields": probe_classes}
