"""Code that runs inside vLLM's engine process, reached through ``collective_rpc``.

This follows vLLM's RLHF examples (``rlhf_utils.WorkerExtension``): a class
that vLLM mixes into its worker (engine argument ``worker_extension_cls``),
whose methods the engine's owner calls by name with
``LLM.collective_rpc(name, args)`` or ``AsyncLLM.collective_rpc``. Whatever
rl_specdec does inside the engine is a method here; whatever those methods
need of vLLM's internals goes through :mod:`rl_specdec.vllm_ext` (they pass
``self``, the worker, to it).

* :class:`RlSpecdecExtension`: start-up facts (is the CPU fix in place, is the
  rejection sampler's expand path right), the settings the engine really runs,
  and weight reload into the target model or the drafter, checked before
  anything is loaded (:mod:`~rl_specdec.rollout.weights`).
* run-time k (:class:`~rl_specdec.rollout.runtime_k.control.SpecControlExtension`,
  mixed in): the k=0 fast path, k set at run time, the adaptive controller.
"""

from __future__ import annotations

from typing import Any

from rl_specdec.rollout import weights
from rl_specdec.rollout.runtime_k.control import SpecControlExtension
from rl_specdec.vllm_ext import worker as vx

EXTENSION = f"{__name__}.RlSpecdecExtension"
NO_DRAFTER = "this engine has no drafter model (speculative_config.method without a model)"


class RlSpecdecExtension(SpecControlExtension):
    """Mixed into vLLM's worker; ``self`` is the worker."""

    def rl_specdec_engine_facts(self) -> dict[str, Any]:
        return vx.engine_facts()

    def rl_specdec_settings(self) -> dict[str, Any]:
        """The settings this engine really runs (see rollout/engine_settings.py), run-time k's mode included."""
        out = vx.read_settings(self)
        if "speculative/method" in out:
            out.update(self.rl_specdec_control_settings())
        return out

    def _rl_specdec_expected(self, target: str):
        cache = self.__dict__.setdefault("_rl_specdec_expected_cache", {})
        if target not in cache:
            cache[target] = weights.expected_tensors(vx.hf_config(self, target), target)
        return cache[target]

    def _rl_specdec_problems(self, target: str, pairs, complete: bool) -> list[str]:
        found = weights.problems(self._rl_specdec_expected(target), pairs, complete=complete)
        if target == "drafter":
            if "_rl_specdec_shared" not in self.__dict__:
                self._rl_specdec_shared = vx.shared_with_target(self)
            found += [
                f"tensor {n!r} is the policy's own in this engine (vLLM shares it into the drafter): a drafter "
                "refit must not send it, or it would overwrite the policy"
                for n, _ in pairs
                if n in self._rl_specdec_shared
            ]
        return found

    def rl_specdec_load_weights(self, packed: list[Any], target: str = "policy") -> dict[str, Any]:
        """Load HF-named weights (packed or ``(name, tensor)``) into the target model or the drafter.

        Nothing is loaded if any tensor is unknown, mis-shaped or missing: the
        problems come back instead. Returns ``{"loaded", "checksum", "problems"}``.
        """
        vx.check_target(target)
        if vx.model(self, target) is None:
            return {"loaded": 0, "checksum": None, "problems": [NO_DRAFTER]}
        pairs = weights.unpack(packed)
        found = self._rl_specdec_problems(target, pairs, complete=True)
        if not found:
            vx.reload_whole(self, target, pairs)
        return {"loaded": 0 if found else len(pairs), "checksum": weights.checksum(pairs), "problems": found}

    # ---- a streamed refit: begin, one call per bucket, end ------------------------------------
    def rl_specdec_begin_reload(self, target: str = "policy") -> dict[str, Any]:
        """Start a streamed refit: vLLM's layerwise reload, opened here and closed by :meth:`rl_specdec_end_reload`.

        The same three steps as vLLM's ``reload_weights`` (initialize, ``load_weights``
        per bucket, finalize), so no process holds more than one bucket of new weights.
        No generation may run until it ends.
        """
        vx.check_target(target)
        module = vx.model(self, target)
        if module is None:
            return {"problems": [NO_DRAFTER]}
        vx.begin_layerwise(module)
        self._rl_specdec_stream = {"target": target, "model": module, "names": set()}
        return {"problems": []}

    def rl_specdec_load_bucket(self, packed: list[Any]) -> dict[str, Any]:
        """Load one bucket of a streamed refit; unknown or mis-shaped tensors are refused (none of the bucket loads)."""
        st = self._rl_specdec_stream
        pairs = weights.unpack(packed)
        found = self._rl_specdec_problems(st["target"], pairs, complete=False)
        if not found:
            vx.load_layerwise(self, st["model"], pairs)
            st["names"].update(n for n, _ in pairs)
        return {"loaded": 0 if found else len(pairs), "checksum": weights.checksum(pairs), "problems": found}

    def rl_specdec_end_reload(self) -> dict[str, Any]:
        """Finish a streamed refit (layers nothing was sent for keep their weights); report missing tensors."""
        st, self._rl_specdec_stream = self.__dict__.get("_rl_specdec_stream"), None
        if st is None:  # begin refused (no drafter): nothing to finish
            return {"problems": []}
        vx.end_layerwise(self, st["model"])
        return {"problems": weights.missing(self._rl_specdec_expected(st["target"]), st["names"])}
