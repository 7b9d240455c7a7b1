"""``SettableKScheduler``: vLLM's scheduler with a batch-size -> k lookup that can be set at run time.

vLLM 0.32's scheduler reads ``dynamic_sd_lookup[len(scheduled requests)]`` once
per step to decide how many tokens each request drafts next
(``num_spec_tokens_to_schedule``). The lookup is built once from
``speculative_config.num_speculative_tokens_per_batch_size``; this subclass only
replaces its values. It is passed as the public engine argument
``scheduler_cls`` by qualified name and registers itself in a module-level list,
so that the worker extension, which runs in the same process with a UniProc
executor (the in-process sync ``LLM``, and ``AsyncLLM``'s engine core on CPU),
can reach it. With a multi-process executor the registry is empty and every
setter fails loudly.
"""

from __future__ import annotations

import weakref

from rl_specdec.vllm_ext.lazy import lazy_classes

SCHEDULER_NAME = "SettableKScheduler"
SCHEDULER_QUALNAME = f"{__name__}.{SCHEDULER_NAME}"
_SCHEDULERS: list[weakref.ref] = []


def check_lookup(lookup: list[int], length: int, k_max: int) -> list[int]:
    """``lookup`` as a list of ints, or ValueError naming what is wrong."""
    lookup = [int(k) for k in lookup]
    if len(lookup) != length:
        raise ValueError(
            f"the lookup needs {length} entries (index = number of scheduled requests, 0 unused), got {len(lookup)}"
        )
    if min(lookup) < 0 or max(lookup) > k_max:
        raise ValueError(f"every k must be in 0..{k_max} (the engine's num_speculative_tokens)")
    return lookup


def _make_scheduler_cls():
    from vllm.v1.core.sched.scheduler import Scheduler

    class SettableKScheduler(Scheduler):
        """vLLM's scheduler plus :meth:`spec_set_lookup`; refuses to start outside vLLM's dynamic-k mode."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if self.num_spec_tokens > 0 and self.dynamic_sd_lookup is None:
                raise RuntimeError(
                    "SettableKScheduler needs speculative_config.num_speculative_tokens_per_batch_size "
                    "(rl_specdec sets [[1, max_num_seqs, k_max]]) so that vLLM runs in its dynamic-k mode"
                )
            self.spec_k_max = self.num_spec_tokens
            _SCHEDULERS.append(weakref.ref(self))

        def spec_set_lookup(self, lookup: list[int]) -> None:
            if self.dynamic_sd_lookup is None:
                raise RuntimeError("speculation is off in this engine: there is no k to set")
            # one assignment: schedule() reads the list by index, so the swap is atomic between steps
            self.dynamic_sd_lookup = check_lookup(lookup, len(self.dynamic_sd_lookup), self.spec_k_max)

    return SettableKScheduler


# vLLM resolves scheduler_cls by qualname
__getattr__ = lazy_classes(__name__, globals(), {SCHEDULER_NAME: _make_scheduler_cls})


def registered_scheduler():
    """The newest live ``SettableKScheduler`` of this process; RuntimeError if there is none."""
    live = [s for s in (r() for r in _SCHEDULERS) if s is not None]
    if not live:
        raise RuntimeError(
            f"no {SCHEDULER_NAME} in this process: the engine must be started with scheduler_cls="
            f"{SCHEDULER_QUALNAME!r} and a UniProc executor (the worker shares the engine core's process)"
        )
    return live[-1]


def _probe() -> None:
    import inspect

    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup  # noqa: F401

    src = inspect.getsource(Scheduler)
    missing = [a for a in ("self.dynamic_sd_lookup", "self.num_spec_tokens") if a not in src]
    if missing:
        raise RuntimeError(f"vLLM's Scheduler no longer uses {', '.join(missing)} (the batch-size -> k lookup)")


PROBES = {"Scheduler.dynamic_sd_lookup": _probe}
