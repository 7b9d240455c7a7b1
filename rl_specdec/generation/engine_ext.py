"""Code that runs inside vLLM's engine process, reached through ``collective_rpc``.

This follows vLLM's RLHF examples (``rlhf_utils.WorkerExtension``): a class
that vLLM mixes into its worker (engine argument ``worker_extension_cls``),
whose methods the engine's owner calls by name with
``LLM.collective_rpc(name, args)`` or ``AsyncLLM.collective_rpc``. No private
attribute chains: whatever rl_specdec does inside the engine is here.

* :class:`RlSpecdecExtension`: start-up facts (is the CPU fix in place, is the
  rejection sampler's expand path right), the settings the engine really runs,
  and weight reload into the target model or the drafter, checked before
  anything is loaded (:mod:`~rl_specdec.generation.weights`).
* run-time speculation control (:class:`~rl_specdec.generation.engine.control.SpecControlExtension`,
  mixed in): the k=0 fast path, k set at run time, the adaptive controller;
  its code lives in :mod:`rl_specdec.generation.engine`, the scheduler class
  it needs is ``rl_specdec.generation.engine.scheduler.SettableKScheduler``.
* :data:`EXECUTOR_NAME`: for ``AsyncLLM``, whose engine core always runs in a
  separate (spawned) process, a ``UniProcExecutor`` subclass that applies the
  CPU fix in that process before the worker is built. It is passed as the
  public ``distributed_executor_backend`` engine argument, pickled by
  reference, and built on first use so that importing this module does not
  import vLLM.
"""

from __future__ import annotations

import os
from typing import Any

from rl_specdec.generation.engine.control import SpecControlExtension
from rl_specdec.generation.engine.lazy import lazy_classes

EXTENSION = f"{__name__}.RlSpecdecExtension"
EXECUTOR_NAME = "CpuFixedUniProcExecutor"


class RlSpecdecExtension(SpecControlExtension):
    """Mixed into vLLM's worker; ``self`` is the worker (``self.model_runner``, ``self.reload_weights``)."""

    def rl_specdec_engine_facts(self) -> dict[str, Any]:
        from vllm.platforms import current_platform

        from rl_specdec.generation import cpu_patches

        on_cpu = current_platform.is_cpu()
        return {
            "engine_pid": os.getpid(),
            "cpu_expand_patched": cpu_patches.is_patched(),
            "expand_path_ok": cpu_patches.expand_path_is_correct() if on_cpu else True,
        }

    def rl_specdec_settings(self) -> dict[str, Any]:
        """The settings this engine really runs, read from its own ``vllm_config`` (see generation/settings.py)."""
        import vllm
        from vllm.platforms import current_platform

        from rl_specdec.generation import cpu_patches

        c = self.vllm_config
        sched, model, cache, spec = c.scheduler_config, c.model_config, c.cache_config, c.speculative_config
        out = {
            "vllm_version": vllm.__version__,
            "backend": str(current_platform.device_type),
            "cpu_expand_fix": cpu_patches.is_patched(),
            "cpu_top_k_fix": cpu_patches.top_k_is_patched(),
            "async_scheduling": bool(sched.async_scheduling),
            "dtype": str(model.dtype).removeprefix("torch."),
            "max_num_batched_tokens": sched.max_num_batched_tokens,
            "max_num_seqs": sched.max_num_seqs,
            "max_model_len": model.max_model_len,
            "enable_chunked_prefill": bool(sched.enable_chunked_prefill),
            "enable_prefix_caching": bool(cache.enable_prefix_caching),
            "kv_cache_memory_bytes": cache.kv_cache_memory_bytes,
            "load_format": str(c.load_config.load_format),
            "enforce_eager": bool(model.enforce_eager),
            "compilation_mode": int(c.compilation_config.mode),
            "cudagraph_mode": str(c.compilation_config.cudagraph_mode),
        }
        if spec is not None:
            sched_k = spec.num_speculative_tokens_per_batch_size
            out.update({
                "speculative/method": spec.method,
                "speculative/num_speculative_tokens": spec.num_speculative_tokens,
                "speculative/num_speculative_tokens_per_batch_size": [list(e) for e in sched_k] if sched_k else None,
                "speculative/draft_sample_method": spec.draft_sample_method,
                "speculative/rejection_sample_method": spec.rejection_sample_method,
            })
            out.update(self._rl_specdec_control_settings())
        return out

    def _rl_specdec_control_settings(self) -> dict[str, Any]:
        """Run-time k: the mode, not the k of the moment (k is chosen while the engine runs)."""
        st = self.__dict__.get("_rl_spec")
        if st is None:
            return {"speculation_control/mode": "off"}
        return {
            "speculation_control/mode": st.mode,
            "speculation_control/k_max": st.k_max,
            "speculation_control/k0_fast_path": st.fp.plain_steps,
            # the schedule vLLM was started with is rl_specdec's vehicle for run-time k, not a setting
            "speculative/num_speculative_tokens_per_batch_size": None,
        }

    def _rl_specdec_expected(self, target: str):
        from rl_specdec.generation.weights import expected_tensors

        cache = self.__dict__.setdefault("_rl_specdec_expected_cache", {})
        if target not in cache:
            c = self.vllm_config
            hf = c.model_config.hf_config if target == "policy" else c.speculative_config.draft_model_config.hf_config
            cache[target] = expected_tensors(hf)
        return cache[target]

    def rl_specdec_load_weights(self, weights: list[Any], target: str = "policy") -> dict[str, Any]:
        """Load HF-named weights (packed or ``(name, tensor)``) into the target model or the drafter.

        Nothing is loaded if any tensor is unknown, mis-shaped or missing: the
        problems come back instead. Returns ``{"loaded", "checksum", "problems"}``.
        """
        from rl_specdec.generation.weights import checksum, problems, unpack

        if target not in ("policy", "drafter"):
            raise ValueError(f"target must be 'policy' or 'drafter', got {target!r}")
        if target == "drafter" and getattr(getattr(self.model_runner, "drafter", None), "model", None) is None:
            return {"loaded": 0, "checksum": None, "problems": ["this engine has no drafter model (speculative_config.method without a model)"]}
        pairs = unpack(weights)
        found = problems(self._rl_specdec_expected(target), pairs)
        if found:
            return {"loaded": 0, "checksum": checksum(pairs), "problems": found}
        if target == "policy":
            self.reload_weights(weights_iterator=pairs, is_checkpoint_format=True)
        else:
            from vllm.config import set_current_vllm_config
            from vllm.model_executor.model_loader.reload.inplace import reload_weights

            with set_current_vllm_config(self.vllm_config):  # the drafter's in-place reload (CPU repacks after it)
                reload_weights(self.vllm_config, self.model_runner.drafter.model, pairs, None, is_checkpoint_format=True)
        return {"loaded": len(pairs), "checksum": checksum(pairs), "problems": []}

    # ---- a streamed refit: begin, one call per bucket, end ------------------------------------
    def _rl_specdec_model(self, target: str):
        if target == "policy":
            return self.model_runner.get_model()
        return getattr(getattr(self.model_runner, "drafter", None), "model", None)

    def rl_specdec_begin_reload(self, target: str = "policy") -> dict[str, Any]:
        """Start a streamed refit: vLLM's layerwise reload, opened here and closed by :meth:`rl_specdec_end_reload`.

        The same three steps as vLLM's ``reload_weights`` (initialize, ``load_weights``
        per bucket, finalize), so no process holds more than one bucket of new weights.
        No generation may run until it ends.
        """
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        if target not in ("policy", "drafter"):
            raise ValueError(f"target must be 'policy' or 'drafter', got {target!r}")
        model = self._rl_specdec_model(target)
        if model is None:
            return {"problems": ["this engine has no drafter model (speculative_config.method without a model)"]}
        initialize_layerwise_reload(model)
        self._rl_specdec_stream = {"target": target, "model": model, "names": set()}
        return {"problems": []}

    def rl_specdec_load_bucket(self, weights: list[Any]) -> dict[str, Any]:
        """Load one bucket of a streamed refit; unknown or mis-shaped tensors are refused (none of the bucket loads)."""
        from vllm.config import set_current_vllm_config

        from rl_specdec.generation.weights import checksum, problems, unpack

        st = self._rl_specdec_stream
        pairs = unpack(weights)
        found = problems(self._rl_specdec_expected(st["target"]), pairs, complete=False)
        if not found:
            with set_current_vllm_config(self.vllm_config):
                st["model"].load_weights(iter(pairs))
            st["names"].update(n for n, _ in pairs)
        return {"loaded": 0 if found else len(pairs), "checksum": checksum(pairs), "problems": found}

    def rl_specdec_end_reload(self) -> dict[str, Any]:
        """Finish a streamed refit (layers nothing was sent for keep their weights); report missing tensors."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        from rl_specdec.generation.weights import missing

        st, self._rl_specdec_stream = getattr(self, "_rl_specdec_stream", None), None
        if st is None:  # begin refused (no drafter): nothing to finish
            return {"problems": []}
        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(st["model"], self.vllm_config.model_config)
        return {"problems": missing(self._rl_specdec_expected(st["target"]), st["names"])}


def _make_executor_class():
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    class CpuFixedUniProcExecutor(UniProcExecutor):
        """``UniProcExecutor`` that applies the CPU expand fix in its own process before the worker starts."""

        def _init_executor(self) -> None:
            from rl_specdec.generation.cpu_patches import apply_cpu_spec_decode_fixes

            apply_cpu_spec_decode_fixes()
            super()._init_executor()

    return CpuFixedUniProcExecutor


# pickle finds the executor class by this module attribute, in the engine-core process too
__getattr__ = lazy_classes(__name__, globals(), {EXECUTOR_NAME: _make_executor_class})


def cpu_fixed_executor():
    """The executor class (builds it on first use)."""
    return __getattr__(EXECUTOR_NAME)
