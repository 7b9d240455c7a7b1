"""Installing run-time k in an engine at start-up, and proving its k=0 fast path on the live engine.

:func:`install_script` is a generator of requests that each engine actor
drives with its own engine (the sync worker with blocking calls, the async one
with awaits): ``("rpc", method, args)`` for a ``collective_rpc`` into the
extension, ``("generate", prompts)`` for a greedy call of
:data:`~rl_specdec.rollout.runtime_k.selfcheck.CHECK_TOKENS` tokens with
``ignore_eos``. It installs the fast path, runs the self-check (the same
prompts with k = k_max and with k=0 first: identical outputs, plain steps that
never call the drafter, a caught-up drafter), and starts the controller.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Awaitable, Callable, Generator

from rl_specdec.config.generation import SpeculationControlConfig
from rl_specdec.errors import ConfigError
from rl_specdec.rollout.runtime_k.control import SpecControl
from rl_specdec.rollout.runtime_k.selfcheck import CHECK_TOKENS

__all__ = ["CHECK_TOKENS", "drive", "install_script"]


def install_script(control: SpeculationControlConfig, seed: int) -> Generator[tuple, Any, dict[str, Any]]:
    """Install run-time k and prove the fast path (see the module doc); returns the install report."""
    info = yield ("rpc", "rl_specdec_spec_install", (dataclasses.asdict(control), seed))
    if info["k0_fast_path"]:
        outs = []
        for phase in ("reference", "switch"):
            prompts = yield ("rpc", "rl_specdec_spec_self_check", (phase,))
            outs.append((yield ("generate", prompts)))
        problems = yield ("rpc", "rl_specdec_spec_self_check", ("verdict",))
        if outs[0] != outs[1]:
            problems.append("greedy outputs changed when k=0 steps ran through it")
        if problems:
            raise ConfigError(SpecControl.refusal("its start-up self-check found: " + "; ".join(problems)))
    yield ("rpc", "rl_specdec_spec_start", ())
    return info


async def drive(script: Generator[tuple, Any, Any], answer: Callable[[tuple], Awaitable[Any]]) -> Any:
    """Run ``script`` to its end, answering each request with ``await answer(request)``; returns its value.

    The async worker passes its coroutines; the sync worker wraps its blocking calls and runs this with
    ``asyncio.run`` (its actor thread has no event loop).
    """
    result = None
    while True:
        try:
            request = script.send(result)
        except StopIteration as stop:
            return stop.value
        result = await answer(request)
