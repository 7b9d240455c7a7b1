"""The worker-extension methods behind run-time k: install, set k, report, self-check.

Mixed into :class:`~rl_specdec.rollout.engine_ext.RlSpecdecExtension` and
called with ``collective_rpc``. The state lives on the worker as
``self._rl_spec`` (a :class:`SpecControl`): the scheduler registered in this
process, the fast path on this worker's model runner, the self-check's hooks,
and in ``adaptive`` mode the controller, which updates the scheduler's lookup
from inside the engine loop between steps (also during one blocking sync
``generate``). The caller only configures it and reads its reports. What
touches vLLM (the scheduler subclass, the runner's wrappers, the drafter's KV)
is in :mod:`rl_specdec.vllm_ext`.
"""

from __future__ import annotations

import os
from typing import Any

from rl_specdec.config.generation import SpeculationControlConfig
from rl_specdec.rollout.runtime_k.controller import Controller, below, bucket_ranges, ks_of
from rl_specdec.rollout.runtime_k.metrics import Tally
from rl_specdec.rollout.runtime_k.selfcheck import SelfCheck, SelfCheckHooks
from rl_specdec.vllm_ext import worker as vx
from rl_specdec.vllm_ext.model_runner import FastPath, probe
from rl_specdec.vllm_ext.scheduler import registered_scheduler

FALLBACK = "policy.generation.speculation_control.k0_fast_path=false"


class SpecControl:
    """One engine's run-time speculation state."""

    def __init__(self, worker, config: SpeculationControlConfig, seed: int = 0):
        self.config, self.mode, self.sched = config, config.mode, registered_scheduler()
        self.k_max = self.sched.spec_k_max
        self.initial = list(self.sched.dynamic_sd_lookup)
        runner = vx.model_runner(worker)
        fast = config.fast_path
        if fast:
            problems = probe(runner)
            if problems:
                raise RuntimeError(self.refusal("its static probe found: " + "; ".join(problems)))
        self.fp = FastPath(runner, plain_steps=fast)
        self.fp.install()
        self.hooks = SelfCheckHooks(self.fp, self.set_uniform)
        self.fp.listeners.append(self.hooks)
        self.vocab_size = vx.vocab_size(worker)
        self.check: SelfCheck | None = None
        self.seed, self.max_batch = seed, len(self.initial) - 1
        self.ranges = bucket_ranges(config.buckets, self.max_batch)
        self.controller: Controller | None = None
        self.started = False
        self.tally = Tally()
        self._stats0 = dict(self.fp.stats)
        self._seen = SeenSteps()
        self.fp.listeners.append(self._seen.add)

    @staticmethod
    def refusal(what: str) -> str:
        from rl_specdec.vllm_ext import installed_version

        return (
            f"the k=0 fast path does not work with vLLM {installed_version()}: {what}. It relies on private parts of "
            f"vLLM's model runner (docs/speculative_decoding.md, 'The k=0 fast path'). Set {FALLBACK} to run k=0 "
            "through vLLM's own speculative path (slower at k=0, but correct), and report this."
        )

    def start(self) -> None:
        """After the self-check: the controller (adaptive) or the tally (fixed) starts listening (once)."""
        self._stats0 = dict(self.fp.stats)
        self._seen.report()  # the self-check's steps are not the first call's
        # a step's record comes at the next step's start: the self-check's last one is still to come
        self._seen.skip = self.fp.pending is not None
        if self.started:
            return
        self.started = True
        if self.mode == "adaptive":
            self.controller = Controller(
                self.config, self.k_max, self.max_batch, list(self.sched.dynamic_sd_lookup), self.seed
            )
            self.fp.listeners.append(self._control_step)
        else:
            self.fp.listeners.append(lambda rec, so: self.tally.add(rec, None, False))

    def _control_step(self, rec, so) -> None:
        new = self.controller.step(rec, len(so.num_scheduled_tokens))
        if new is not None:
            self.sched.spec_set_lookup(new)

    def uniform(self, k: int) -> list[int]:
        """The lookup with k at every batch size (index: running requests; 0 runs nothing)."""
        return [0] + [int(k)] * (len(self.initial) - 1)

    def set_uniform(self, k: int) -> None:
        self.sched.spec_set_lookup(self.uniform(k))

    def set_k_max(self, k: int) -> list[int]:
        """``fixed``: k everywhere (below ``draft_below``, if set); ``adaptive``: the controller never chooses more
        than k. 0 turns speculation off."""
        if not 0 <= int(k) <= self.k_max:
            raise ValueError(f"k must be in 0..{self.k_max} (speculation_control.k_max), got {k}")
        if self.controller is not None:
            self.sched.spec_set_lookup(self.controller.set_cap(k))
        else:
            self.sched.spec_set_lookup(below(self.uniform(k), self.config.draft_below))
        return list(self.sched.dynamic_sd_lookup)

    def draft_below(self) -> int | None:
        """The concurrency threshold the engine runs: in ``fixed`` mode read from the lookup it starts each
        call with (the first batch size from which k is 0 up to ``max_num_seqs``), in ``adaptive`` mode the
        bound its controller keeps. None where there is no such bound."""
        if self.mode == "adaptive":
            return self.config.draft_below
        lookup = self.initial
        last = max((b for b, k in enumerate(lookup) if k > 0), default=0)
        return last + 1 if 0 < last < len(lookup) - 1 else None

    def report(self) -> dict[str, Any]:
        stats = dict(self.fp.stats)
        d = {k: stats[k] - self._stats0.get(k, 0) for k in stats}
        self._stats0 = stats
        if self.controller is not None:
            out = self.controller.report()
        else:
            ks = ks_of(self.ranges, self.sched.dynamic_sd_lookup)
            out = {"buckets": [[lo, hi, k] for (lo, hi), k in zip(self.ranges, ks)]}
            out.update(self.tally.report())
            self.tally.reset()
        return {"mode": self.mode, "steps": d["steps"], "plain_steps": d["plain_steps"], **self._seen.report(), **out}


class SeenSteps:
    """What the engine steps since the last report ran at: the fewest requests any of them held, and how many
    verified drafts. A run whose drafter drafts nothing reads from these where its schedule never drafted."""

    def __init__(self):
        self.fewest: int | None = None
        self.drafted = 0
        self.skip = False  # the next record is an earlier phase's

    def add(self, rec, so) -> None:
        if self.skip:
            self.skip = False
            return
        if rec.b > 0:
            self.fewest = rec.b if self.fewest is None else min(self.fewest, rec.b)
        self.drafted += int(rec.drafts > 0)

    def report(self) -> dict[str, int]:
        out = {"draft_steps": self.drafted, **({"fewest_running": self.fewest} if self.fewest is not None else {})}
        self.fewest, self.drafted = None, 0
        return out


class SpecControlExtension:
    """The ``collective_rpc`` methods of run-time k (mixed into the worker; ``self`` is the worker)."""

    def _spec(self) -> SpecControl:
        st = self.__dict__.get("_rl_spec")
        if st is None:
            raise RuntimeError(
                "run-time speculation control is not installed in this engine (speculation_control.mode=off)"
            )
        return st

    def rl_specdec_spec_install(self, control: dict[str, Any], seed: int = 0) -> dict[str, Any]:
        """Install the fast path and the hooks (the controller starts after the self-check,
        :meth:`rl_specdec_spec_start`). ``control``: the fields of ``SpeculationControlConfig`` (plain
        types cross the async engine's process boundary)."""
        if "_rl_spec" not in self.__dict__:
            self.__dict__["_rl_spec"] = SpecControl(self, SpeculationControlConfig(**control), seed)
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

    def rl_specdec_spec_report(self) -> dict[str, Any]:
        """The decisions and tokens per second since the last report (one per generate call)."""
        return self._spec().report()

    def rl_specdec_control_settings(self) -> dict[str, Any]:
        """Run-time k in the engine's settings: the mode, not the k of the moment (k is chosen while it runs)."""
        st = self.__dict__.get("_rl_spec")
        if st is None:
            return {"speculation_control/mode": "off"}
        start = st.config.start if st.mode == "adaptive" else None
        out = {
            "speculation_control/mode": st.mode,
            "speculation_control/k_max": st.k_max,
            "speculation_control/k0_fast_path": st.fp.plain_steps,
            "speculation_control/draft_below": st.draft_below(),
            "speculation_control/start": start,
        }
        if start != "schedule":  # the schedule vLLM was started with is then run-time k's vehicle, not a setting
            out["speculative/num_speculative_tokens_per_batch_size"] = None
        return out
