"""Every touch of vLLM's internals, behind one door, and the gate that checks them at start-up.

rl_specdec uses vLLM's public API (``vllm.LLM``, ``SamplingParams``, ``AsyncLLM``,
``collective_rpc``, the ``worker_extension_cls`` and ``scheduler_cls`` engine
arguments) everywhere. Whatever goes further (a subclass of a vLLM class, a
wrapper on one of its objects, a field of its internal dataclasses, a private
function) lives in one module of this package, and nothing else does:

=================  ==============================================================
``declarations``   vLLM's own lists that configs are validated against
``platform``       the platform, and the fields read off request outputs
``worker``         the worker: model runner, drafter, weight reload, settings read back;
                   the async engine's CPU executor
``cpu_sampler``    CPU sampler fixes (probe-gated): rejection, seeded chunks
``compile_cache``  the compile cache loaded on CPU instead of compiled again (probe-gated)
``scheduler``      the scheduler subclass with a settable batch-size -> k lookup
``model_runner``   the k=0 fast path: instance wrappers on the model runner, step records
``drafter_kv``     the drafter forward that catches its KV cache up
``openai_app``     vLLM's OpenAI app with our renderer and chat handler
``head_parity``    vLLM's EAGLE-3 drafter loaded in process, to check the trainer's head against
``facts``          the version, probe results and declarations a driver reads from a file instead
                   of importing vLLM (turned on by the command-line entry points)
=================  ==============================================================

Each of those modules declares ``PROBES``: checks of every name and signature it
relies on, which raise when vLLM moves them. :func:`check_vllm` runs them, for
the features a run uses, when a config loads and again in every engine process,
together with a check of vLLM's version against :data:`WRITTEN_FOR`. A moved
hook always stops the run, naming the hook and the version; another version
whose probes pass stops it too, unless ``policy.generation.allow_untested_vllm``
is set (the hooks also prove themselves on the live engine: the k=0 fast path's
start-up self-check, the sampling self-check).

This package imports nothing of rl_specdec but :mod:`rl_specdec.errors` (and
its own modules), so every other package may use it.
"""

from __future__ import annotations

import functools
import importlib
import logging

from rl_specdec.errors import VllmIncompatible
from rl_specdec.vllm_ext import facts

logger = logging.getLogger(__name__)

WRITTEN_FOR = "0.32.0"  # the vLLM release these hooks were written and tested against (pyproject.toml pins it)
OVERRIDE_KEY = "policy.generation.allow_untested_vllm"
FEATURES = {  # feature -> the modules whose hooks it uses
    "core": ("declarations", "platform", "worker", "cpu_sampler", "compile_cache"),
    "runtime_k": ("scheduler", "model_runner", "drafter_kv"),
    "server": ("openai_app",),
    "heads": ("head_parity",),
}


def installed_version() -> str:
    def live() -> str:
        import vllm

        return str(vllm.__version__)

    return str(facts.fact("version", live))


@functools.lru_cache(maxsize=None)
def probe_failures(feature: str) -> tuple[str, ...]:
    """``"module: hook: error"`` for each probe of ``feature`` that fails here (empty: all pass)."""
    return tuple(facts.fact(f"probe_failures/{feature}", lambda: list(_probe(feature))))


def _probe(feature: str) -> tuple[str, ...]:
    out = []
    for name in FEATURES[feature]:
        module = importlib.import_module(f"{__name__}.{name}")
        for hook, probe in module.PROBES.items():
            try:
                probe()
            except (ImportError, AttributeError, RuntimeError, TypeError, ValueError, OSError) as e:
                out.append(f"{name}: {hook}: {type(e).__name__}: {e}")
    return tuple(out)


def check_vllm(allow_untested: bool = False, features: tuple[str, ...] = ("core",)) -> None:
    """The gate: raise :class:`~rl_specdec.errors.VllmIncompatible` if a hook of ``features`` moved, or if
    vLLM is not the version the hooks were written for (unless ``allow_untested``, which warns instead)."""
    unknown = sorted(set(features) - set(FEATURES))
    if unknown:
        raise ValueError(f"unknown vLLM hook features {unknown}; known: {sorted(FEATURES)}")
    version = installed_version()
    failures = [f for feature in features for f in probe_failures(feature)]
    if failures:
        raise VllmIncompatible(
            f"rl_specdec's hooks into vLLM {version} (written for vLLM {WRITTEN_FOR}) no longer fit: "
            + "; ".join(failures)
            + f". Install vllm=={WRITTEN_FOR} (pip install -e '.[cpu]', or '.[gpu]'), or update rl_specdec/vllm_ext/."
        )
    if version.split("+")[0] == WRITTEN_FOR:
        return
    message = (
        f"vLLM {version} is installed, but rl_specdec's engine hooks were written and tested for vLLM {WRITTEN_FOR}"
    )
    if not allow_untested:
        raise VllmIncompatible(
            f"{message}. Install vllm=={WRITTEN_FOR} (pip install -e '.[cpu]', or '.[gpu]'), or set "
            f"{OVERRIDE_KEY}=true to run anyway: the hooks' probes pass, but their behaviour is untested there."
        )
    _warn_once(f"{message}; running anyway ({OVERRIDE_KEY}=true).")


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    logger.warning("%s", message)
