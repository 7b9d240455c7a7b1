"""The one door to the package's adaptive controller: nothing else in this benchmark imports it.

:func:`controller_api` builds ``rl_specdec.rollout.runtime_k.controller.Controller`` with a
``SpeculationControlConfig`` as its settings, and hands back ``StepRecord``
(``rl_specdec.vllm_ext.model_runner``), the record the engine feeds it each step.
"""

from __future__ import annotations


def controller_api():
    """(make_controller, StepRecord, where): ``make_controller(k_max, max_batch, initial_lookup, seed=0, **config)``
    builds the package's Controller with ``config`` as its speculation_control settings (buckets, explore,
    explore_steps, min_gain, memory_steps, acceptance_memory)."""
    from rl_specdec.config.generation import SpeculationControlConfig
    from rl_specdec.rollout.runtime_k.controller import Controller
    from rl_specdec.vllm_ext.model_runner import StepRecord

    def make(k_max, max_batch, initial_lookup, seed=0, **config):
        cfg = SpeculationControlConfig(mode="adaptive", k_max=k_max, **config)
        return Controller(cfg, k_max=k_max, max_batch=max_batch, initial_lookup=list(initial_lookup), seed=seed)

    return make, StepRecord, "rl_specdec.rollout.runtime_k.controller"
