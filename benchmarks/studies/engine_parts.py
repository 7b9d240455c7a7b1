"""Where a ``generate`` call's time goes inside a synchronous engine actor, for benchmarks.

:func:`engine_group` returns a :class:`~rl_specdec.rollout.group.VllmGeneration` whose actors time, per
call, with ``time.perf_counter``: the actor's whole ``generate``; vLLM's ``LLM.generate`` in it; the
engine core's steps (``step_fn``) and, in them, the scheduler's ``schedule`` and ``update_from_output``,
the executor's ``execute_model`` and ``sample_tokens``; ``post_step`` (the draft hand-off); and the
extension RPCs the actor makes after the call (run-time k's report). Everything else in ``LLM.generate``
is adding the requests and processing the outputs. ``parts(group)`` returns the sums since the last
call (and clears them). The wrappers cost the same few microseconds per call in every engine.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

# part name -> (attribute path from the EngineCore, or None for the actor's own methods)
CORE_PARTS = {
    "step_fn": ("", "step_fn"),
    "post_step": ("", "post_step"),
    "schedule": ("scheduler", "schedule"),
    "update_from_output": ("scheduler", "update_from_output"),
    "execute_model": ("model_executor", "execute_model"),
    "sample_tokens": ("model_executor", "sample_tokens"),
}


def _timed(fn, acc: dict[str, float], name: str, count: str | None = None):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[name] += time.perf_counter() - t0
            if count:
                acc[count] += 1

    return wrapper


def engine_group():
    """VllmGeneration whose actors time the parts of every ``generate`` call."""
    from rl_specdec.rollout.group import VllmGeneration
    from rl_specdec.rollout.worker import VllmWorker

    class PartsWorker(VllmWorker):
        def _install_timers(self) -> dict[str, float]:
            if getattr(self, "_acc", None) is None:
                self._acc: dict[str, float] = defaultdict(float)
                core = self.llm.llm_engine.engine_core.engine_core  # in-process EngineCore
                for name, (owner, attr) in CORE_PARTS.items():
                    obj = getattr(core, owner) if owner else core
                    count = "steps" if name == "step_fn" else None
                    setattr(obj, attr, _timed(getattr(obj, attr), self._acc, name, count))
                self.llm.generate = _timed(self.llm.generate, self._acc, "LLM.generate")
            return self._acc

        def generate(self, prompt_token_ids, sampling, offset: int) -> dict[str, Any]:
            acc = self._install_timers()
            t0 = time.perf_counter()
            try:
                return super().generate(prompt_token_ids, sampling, offset)
            finally:
                acc["actor generate"] += time.perf_counter() - t0
                acc["calls"] += 1

        def engine_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
            acc = self._install_timers()
            t0 = time.perf_counter()
            try:
                return super().engine_rpc(method, *args, **kwargs)
            finally:
                acc[f"rpc {method}"] += time.perf_counter() - t0

        def parts(self) -> dict[str, float]:
            out = dict(self._install_timers())
            self._acc.clear()
            return out

    class Group(VllmGeneration):
        worker_cls = PartsWorker

    return Group


def parts(group) -> dict[str, float]:
    """The first engine's summed part times (s) and counts (``steps``, ``calls``) since the last read."""
    import ray

    return ray.get(group.workers[0].parts.remote())
