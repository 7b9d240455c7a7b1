"""The worker-extension methods behind run-time k: install, set k, report, debug hooks, self-check.

Mixed into :class:`~rl_specdec.generation.engine_ext.RlSpecdecExtension` and
called with ``collective_rpc``. The state lives on the worker as
``self._rl_spec`` (a :class:`SpecControl`): the scheduler registered in this
process, the fast path on this worker's model runner, the hooks, and in
``adaptive`` mode the controller, which updates the scheduler's lookup from
inside the engine loop between steps (also during one blocking sync
``generate``). The caller only configures it and reads its reports.
"""

from __future__ import annotations

import os
from typing import Any

from rl_specdec.generation.engine.controller import ControlSettings, Controller, Tally, bucket_ranges, ks_of
from rl_specdec.generation.engine.fastpath import FastPath, probe
from rl_specdec.generation.engine.scheduler import check_lookup, registered_scheduler
from rl_specdec.generation.engine.selfcheck import Hooks, SelfCheck

FALLBACK = "policy.generation.speculation_control.k0_fast_path=false"


class SpecControl:
    """One engine's run-time speculation state."""

    def __init__(self, worker, control: dict[str, Any]):
        self.mode, self.sched = control["mode"], registered_scheduler()
        self.k_max = self.sched.spec_k_max
        self.initial = list(self.sched.dynamic_sd_lookup)
        runner = worker.model_runner
        if control["k0_fast_path"]:
            problems = probe(runner)
            if problems:
                raise RuntimeError(self.refusal("its static probe found: " + "; ".join(problems)))
        self.fp = FastPath(runner, plain_steps=bool(control["k0_fast_path"]))
        self.fp.install()
        self.hooks = Hooks(self.fp, self.set_uniform)
        self.fp.listeners.append(self.hooks)
        self.vocab_size = worker.vllm_config.model_config.get_vocab_size()
        self.check: SelfCheck | None = None
        self.settings = ControlSettings(
            k_max=self.k_max,
            buckets=tuple(control["buckets"]),
            max_batch=len(self.initial) - 1,
            explore=control["explore"],
            explore_steps=control["explore_steps"],
            min_gain=control["min_gain"],
            memory_steps=control["memory_steps"],
            acceptance_memory=control["acceptance_memory"],
            seed=control.get("seed", 0),
        )
        self.ranges = bucket_ranges(self.settings.buckets, self.settings.max_batch)
        self.controller: Controller | None = None
        self.started = False
        self.tally = Tally()
        self._stats0 = dict(self.fp.stats)

    @staticmethod
    def refusal(what: str) -> str:
        import vllm

        return (
            f"the k=0 fast path does not work with vLLM {vllm.__version__}: {what}. It relies on private parts of "
            f"vLLM's model runner (docs/speculative_decoding.md, 'The k=0 fast path'). Set {FALLBACK} to run k=0 "
            "through vLLM's own speculative path (slower at k=0, but correct), and report this."
        )

    def start(self) -> None:
        """After the self-check: the controller (adaptive) or the tally (fixed) starts listening (once)."""
        self._stats0 = dict(self.fp.stats)
        if self.started:
            return
        self.started = True
        if self.mode == "adaptive":
            self.controller = Controller(self.settings, list(self.sched.dynamic_sd_lookup))
            self.fp.listeners.append(self._control_step)
        else:
            self.fp.listeners.append(lambda rec, so: self.tally.add(rec, None, False))

    def _control_step(self, rec, so) -> None:
        new = self.controller.step(rec, len(so.num_scheduled_tokens))
        if new is not None:
            self.sched.spec_set_lookup(new)

    def set_uniform(self, k: int) -> None:
        self.sched.spec_set_lookup([0] + [int(k)] * (len(self.initial) - 1))

    def set_k_max(self, k: int) -> list[int]:
        """``fixed``: k everywhere; ``adaptive``: the controller never chooses more than k. 0 turns speculation off."""
        if not 0 <= int(k) <= self.k_max:
            raise ValueError(f"k must be in 0..{self.k_max} (speculation_control.k_max), got {k}")
        if self.controller is not None:
            self.sched.spec_set_lookup(self.controller.set_cap(k))
        else:
            self.set_uniform(k)
        return list(self.sched.dynamic_sd_lookup)

    def report(self) -> dict[str, Any]:
        stats = dict(self.fp.stats)
        d = {k: stats[k] - self._stats0.get(k, 0) for k in stats}
        self._stats0 = stats
        if self.controller is not None:
            out = self.controller.report()
        else:
            out = {"buckets": [[lo, hi, k] for (lo, hi), k in zip(self.ranges, ks_of(self.ranges, self.sched.dynamic_sd_lookup))]}
            out.update(self.tally.report())
            self.tally.reset()
        return {"mode": self.mode, "steps": d["steps"], "plain_steps": d["plain_steps"], **out}


class SpecControlExtension:
    """The ``collective_rpc`` methods of run-time k (mixed into the worker; ``self`` is the worker)."""

    def _spec(self) -> SpecControl:
        st = self.__dict__.get("_rl_spec")
        if st is None:
            raise RuntimeError("run-time speculation control is not installed in this engine (speculation_control.mode=off)")
        return st

    def rl_specdec_spec_install(self, control: dict[str, Any]) -> dict[str, Any]:
        """Install the fast path and the hooks (the controller starts after the self-check, :meth:`rl_specdec_spec_start`)."""
        if "_rl_spec" not in self.__dict__:
            self.__dict__["_rl_spec"] = SpecControl(self, control)
        st = self._spec()
        return {"mode": st.mode, "k_max": st.k_max, "k0_fast_path": st.fp.plain_steps, "engine_pid": os.getpid()}

    def rl_specdec_spec_self_check(self, phase: str):
        st = self._spec()
        if st.check is None:
            st.check = SelfCheck(st.fp, st.hooks, st.set_uniform, st.k_max, st.vocab_size)
        out = st.check.phase(phase)
        if phase == "verdict":
            st.sched.spec_set_lookup(st.initial)
        return out

    def rl_specdec_spec_start(self) -> None:
        self._spec().start()

    def rl_specdec_spec_set_k_max(self, k: int) -> list[int]:
        return self._spec().set_k_max(k)

    def rl_specdec_spec_set_lookup(self, lookup: list[int]) -> None:
        """A batch-size -> k lookup (index = scheduled requests); ``fixed`` mode only: the controller owns it otherwise."""
        st = self._spec()
        if st.controller is not None:
            raise RuntimeError("speculation_control.mode=adaptive: the controller sets the lookup; use set_speculation to cap it")
        st.sched.spec_set_lookup(check_lookup(lookup, len(st.initial), st.k_max))

    def rl_specdec_spec_lookup(self) -> list[int]:
        return list(self._spec().sched.dynamic_sd_lookup)

    def rl_specdec_spec_report(self) -> dict[str, Any]:
        """The decisions and tokens per second since the last report (one per generate call)."""
        return self._spec().report()

    def rl_specdec_spec_debug(self, **kw) -> dict[str, Any]:
        """Test hooks: ``cycle`` (uniform k per step from a list, None: stop), ``plan`` ([(steps, k)]: k after
        that many steps), ``record_drafts`` (bool), ``catch_up`` (bool), ``max_catch_up_tokens`` (int).
        Returns the first drafts recorded so far and the fast path's counters."""
        st = self._spec()
        h = st.hooks
        if "cycle" in kw:
            h.cycle = list(kw["cycle"]) if kw["cycle"] else None
        if "plan" in kw:
            h.set_plan(kw["plan"])
        if "record_drafts" in kw:
            h.record = bool(kw["record_drafts"])
        if "catch_up" in kw:
            st.fp.catch_up_on = bool(kw["catch_up"])
        if "max_catch_up_tokens" in kw:
            st.fp.max_catch_up_tokens = int(kw["max_catch_up_tokens"])
        drafts = [[list(prompt), sorted(d.items())] for prompt, d in h.take_drafts().items()]  # plain lists cross any RPC
        return {"first_drafts": drafts, "stats": dict(st.fp.stats)}
