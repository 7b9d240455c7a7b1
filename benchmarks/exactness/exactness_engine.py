"""Inside the engine, for the exactness check: steer k per engine step and record, per step, what each request did.

:class:`ExactnessExtension` is the package's worker extension plus one RPC, ``rl_specdec_exactness``:

* ``schedule``: k per engine step, from a list read cyclically (None: leave k to the engine's mode). A seeded
  random list gives a random k per step; runs of 0 followed by a k>0 give k=0 stretches followed by drafting,
  with the drafter catch-up; since it is read per step, k changes within a generate call;
* ``catch_up``: False switches the drafter catch-up off (the negative control: the drafter then proposes from a
  stale KV cache; what is sampled must still be the target's);
* ``restart_controller``: a fresh adaptive controller, so the next call runs its warm-up (each k for a few
  steps) again;
* ``take``: returns and clears the steps recorded since the last take.

A recorded step is ``{"k_next", "k_verify", "plain", "reqs": {req_id: [start, scheduled, drafts verified,
tokens emitted, drafter tokens caught up]}}``; ``start`` is the request's computed tokens before the step.
Engines load the extension by name (``benchmarks.exactness.exactness_engine.ExactnessExtension``): the repository's
root must be on PYTHONPATH before Ray starts (``benchmarks.step_records.importable``).
"""

from __future__ import annotations

from typing import Any

from rl_specdec.rollout.engine_ext import RlSpecdecExtension

NAME = f"{__name__}.ExactnessExtension"
WRAPPED = ("execute_model", "sample_tokens", "propose_draft_token_ids")


class StepTrace:
    """Instance wrappers over the fast path's own wrappers on the model runner; one dict per engine step."""

    def __init__(self, fp):
        self.fp, self.steps, self.cur = fp, [], None
        self.orig = {n: getattr(fp.runner, n) for n in WRAPPED}
        for n in WRAPPED:
            setattr(fp.runner, n, getattr(self, n))

    def execute_model(self, so, *args, **kwargs):
        if so.total_num_scheduled_tokens > 0:
            spec = so.scheduled_spec_decode_tokens
            plain0 = self.fp.stats["plain_steps"]
            out = self.orig["execute_model"](so, *args, **kwargs)
            starts = self.fp.step_start
            self.cur = {
                "k_next": int(so.num_spec_tokens_to_schedule),
                "k_verify": max((len(v) for v in spec.values()), default=0),
                "plain": self.fp.stats["plain_steps"] > plain0,
                "reqs": {
                    rid: [starts.get(rid, 0), int(n), len(spec.get(rid, ())), 0, 0]
                    for rid, n in so.num_scheduled_tokens.items()
                },
            }
            self.steps.append(self.cur)
            return out
        return self.orig["execute_model"](so, *args, **kwargs)

    def sample_tokens(self, grammar_output):
        out = self.orig["sample_tokens"](grammar_output)
        if out is not None and self.cur is not None:
            for rid, i in out.req_id_to_index.items():
                if rid in self.cur["reqs"]:
                    self.cur["reqs"][rid][3] = len(out.sampled_token_ids[i])
        return out

    def propose_draft_token_ids(self, scheduler_output, *args, **kwargs):
        before = dict(self.fp.drafter_valid)
        out = self.orig["propose_draft_token_ids"](scheduler_output, *args, **kwargs)
        if self.cur is not None:
            for rid, valid in before.items():
                if rid in self.cur["reqs"] and rid not in self.fp.drafter_valid:
                    self.cur["reqs"][rid][4] = self.fp.step_start.get(rid, valid) - valid
        return out


class KSchedule:
    """A fast-path listener: k for every batch size from ``ks`` (read cyclically), one entry per engine step."""

    def __init__(self, set_k):
        self.set_k, self.ks, self.steps = set_k, None, 0

    def __call__(self, done, so) -> None:
        self.steps += 1
        if self.ks:
            self.set_k(self.ks[self.steps % len(self.ks)])


class ExactnessExtension(RlSpecdecExtension):
    def rl_specdec_exactness(self, **kw) -> dict[str, Any]:
        """See the module's docstring; returns ``{"steps": [...]}`` when ``take``, else ``{}``."""
        st = self._spec()
        d = self.__dict__
        if "_ex_trace" not in d:
            d["_ex_trace"], d["_ex_ks"] = StepTrace(st.fp), KSchedule(st.set_uniform)
            st.fp.listeners.append(d["_ex_ks"])
        if "schedule" in kw:
            d["_ex_ks"].ks = [int(k) for k in kw["schedule"]] if kw["schedule"] else None
            d["_ex_ks"].steps = 0
        if "catch_up" in kw:
            st.fp.catch_up_on = bool(kw["catch_up"])
        if kw.get("restart_controller") and st.controller is not None:
            st.controller = None
            st.started = False
            st.fp.listeners.remove(st._control_step)
            st.sched.spec_set_lookup(st.initial)
            st.start()
        if not kw.get("take"):
            return {}
        steps, d["_ex_trace"].steps = d["_ex_trace"].steps, []
        return {"steps": steps}


def engine_group():
    """VllmGeneration with :class:`ExactnessExtension` in its engines."""
    from rl_specdec.rollout.group import VllmGeneration
    from rl_specdec.rollout.worker import VllmWorker

    class ExactnessWorker(VllmWorker):
        extension = NAME

    class ExactnessGeneration(VllmGeneration):
        worker_cls = ExactnessWorker

    return ExactnessGeneration
