"""What rl_specdec's engine extension reads and calls on vLLM's worker, and the async engine's CPU executor.

``worker`` below is vLLM's GPU/CPU worker object into which vLLM mixes
:class:`rl_specdec.rollout.engine_ext.RlSpecdecExtension`; the extension's
``collective_rpc`` methods pass it in. Reading its ``vllm_config``, reaching
the model runner and the drafter, and reloading weights (the target through the
worker's ``reload_weights``, the drafter through vLLM's in-place and layerwise
reload, which redo the CPU backend's weight repacking) all happen here.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

from rl_specdec.vllm_ext.lazy import lazy_classes
from rl_specdec.vllm_ext.methods import method as method_row

EXECUTOR_NAME = "CpuFixedUniProcExecutor"
EXECUTOR_QUALNAME = f"{__name__}.{EXECUTOR_NAME}"  # vLLM resolves a backend given by name (resolve_obj_by_qualname)
TARGETS = ("policy", "drafter")


def check_target(target: str) -> None:
    if target not in TARGETS:
        raise ValueError(f"target must be 'policy' or 'drafter', got {target!r}")


def model_runner(worker):
    return worker.model_runner


def drafter_model(worker):
    """The drafter's torch module, or None in an engine whose method has no drafter model (ngram, suffix, none)."""
    spec = worker.vllm_config.speculative_config
    if spec is None or method_row(spec.method).model_free:
        return None
    return worker.model_runner.drafter.model


def model(worker, target: str):
    """The target's (``policy``) or the drafter's torch module (None: no drafter model)."""
    check_target(target)
    return worker.model_runner.get_model() if target == "policy" else drafter_model(worker)


def shared_with_target(worker) -> set[str]:
    """Names of the drafter's tensors that are the target's own storage (``model.`` dropped, as a refit names them).

    vLLM gives an EAGLE head the target's embedding and LM head when its checkpoint lacks them or holds equal
    copies; a drafter refit that names one would write into the policy. Found from the live data pointers, so it
    holds whatever vLLM decided at load."""
    drafter = drafter_model(worker)
    if drafter is None:
        return set()
    params = list(worker.model_runner.get_model().parameters())
    ids, ptrs = {id(p) for p in params}, {p.data_ptr() for p in params if p.numel()}  # repacked CPU weights are empty

    def shared(p) -> bool:
        return id(p) in ids or (p.numel() > 0 and p.data_ptr() in ptrs)

    # remove_duplicate=False: a tied LM head is the embedding's parameter under a second name
    return {n.removeprefix("model.") for n, p in drafter.named_parameters(remove_duplicate=False) if shared(p)}


def hf_config(worker, target: str):
    """The Hugging Face config of the target or of the drafter."""
    c = worker.vllm_config
    return c.model_config.hf_config if target == "policy" else c.speculative_config.draft_model_config.hf_config


def vocab_size(worker) -> int:
    return worker.vllm_config.model_config.get_vocab_size()


def reload_whole(worker, target: str, pairs: list[tuple[str, Any]]) -> None:
    """Load a whole state dict into the target (the worker's ``reload_weights``) or the drafter (in-place reload)."""
    if target == "policy":
        worker.reload_weights(weights_iterator=pairs, is_checkpoint_format=True)
        return
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    with set_current_vllm_config(worker.vllm_config):
        reload_weights(worker.vllm_config, drafter_model(worker), pairs, None, is_checkpoint_format=True)


def begin_layerwise(module) -> None:
    """Open vLLM's layerwise reload on ``module`` (the first of its three steps)."""
    from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

    initialize_layerwise_reload(module)


def load_layerwise(worker, module, pairs: list[tuple[str, Any]]) -> None:
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config):
        module.load_weights(iter(pairs))


def end_layerwise(worker, module) -> None:
    """Close the layerwise reload: layers nothing was sent for keep their weights; CPU weights are repacked."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    with set_current_vllm_config(worker.vllm_config):
        finalize_layerwise_reload(module, worker.vllm_config.model_config)


def engine_facts() -> dict[str, Any]:
    """The engine process's id, whether the CPU sampling fix is in place and the expand path is right, and its
    compiled models (loaded from vLLM's compile cache or compiled afresh)."""
    from rl_specdec.vllm_ext import compile_cache, cpu_sampler, platform

    return {
        "engine_pid": os.getpid(),
        "cpu_expand_patched": cpu_sampler.is_patched(),
        "expand_path_ok": cpu_sampler.expand_path_is_correct() if platform.is_cpu() else True,
        "compile_cache": compile_cache.counts(),
    }


def read_settings(worker) -> dict[str, Any]:
    """The settings this engine really runs, read from its own ``vllm_config`` (flat keys, see
    rl_specdec/rollout/engine_settings.py)."""
    import vllm

    from rl_specdec.vllm_ext import cpu_sampler, platform

    c = worker.vllm_config
    sched, model_cfg, cache, spec = c.scheduler_config, c.model_config, c.cache_config, c.speculative_config
    out = {
        "vllm_version": vllm.__version__,
        "backend": platform.device_type(),
        "cpu_expand_fix": cpu_sampler.is_patched(),
        "cpu_top_k_fix": cpu_sampler.top_k_is_patched(),
        "async_scheduling": bool(sched.async_scheduling),
        "dtype": str(model_cfg.dtype).removeprefix("torch."),
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "max_num_seqs": sched.max_num_seqs,
        "max_model_len": model_cfg.max_model_len,
        "enable_chunked_prefill": bool(sched.enable_chunked_prefill),
        "enable_prefix_caching": bool(cache.enable_prefix_caching),
        "kv_cache_memory_bytes": cache.kv_cache_memory_bytes,
        "kv_cache_blocks": cache.num_gpu_blocks,  # what that memory holds, drafter's layers included
        "block_size": cache.block_size,
        "load_format": str(c.load_config.load_format),
        "enforce_eager": bool(model_cfg.enforce_eager),
        "compilation_mode": int(c.compilation_config.mode),
        "cudagraph_mode": str(c.compilation_config.cudagraph_mode),
    }
    if spec is not None:
        sched_k = spec.num_speculative_tokens_per_batch_size
        out.update(
            {
                "speculative/method": spec.method,
                "speculative/num_speculative_tokens": spec.num_speculative_tokens,
                "speculative/num_speculative_tokens_per_batch_size": [list(e) for e in sched_k] if sched_k else None,
                "speculative/draft_sample_method": spec.draft_sample_method,
                "speculative/rejection_sample_method": spec.rejection_sample_method,
            }
        )
    return out


def _make_executor_class():
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    class CpuFixedUniProcExecutor(UniProcExecutor):
        """``UniProcExecutor`` that applies the CPU fixes (sampling, compile cache) in its own process before the
        worker starts."""

        def _init_executor(self) -> None:
            from rl_specdec.vllm_ext.compile_cache import apply_compile_cache_fix
            from rl_specdec.vllm_ext.cpu_sampler import apply_cpu_spec_decode_fixes

            apply_cpu_spec_decode_fixes()
            apply_compile_cache_fix()
            super()._init_executor()

    return CpuFixedUniProcExecutor


# pickle finds the executor class by this module attribute, in the engine-core process too
__getattr__ = lazy_classes(__name__, globals(), {EXECUTOR_NAME: _make_executor_class})


def _probe_reload() -> None:
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    params = list(inspect.signature(reload_weights).parameters)
    if (
        params[:4] != ["vllm_config", "model", "weights_iterator", "weights_path"]
        or "is_checkpoint_format" not in params
    ):
        raise RuntimeError(f"reload.inplace.reload_weights takes ({', '.join(params)})")


def _probe_layerwise() -> None:
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload, initialize_layerwise_reload

    for fn in (initialize_layerwise_reload, finalize_layerwise_reload):
        if not callable(fn):
            raise RuntimeError(f"{fn!r} is not callable")


def _probe_worker() -> None:
    from vllm.v1.worker.gpu_worker import Worker

    if not callable(getattr(Worker, "reload_weights", None)):
        raise RuntimeError("vLLM's Worker has no reload_weights")


def _probe_executor() -> None:
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    if not callable(getattr(UniProcExecutor, "_init_executor", None)):
        raise RuntimeError("UniProcExecutor has no _init_executor to extend")


PROBES = {
    "Worker.reload_weights": _probe_worker,
    "model_loader.reload.inplace.reload_weights": _probe_reload,
    "model_loader.reload.layerwise": _probe_layerwise,
    "UniProcExecutor._init_executor": _probe_executor,
}
