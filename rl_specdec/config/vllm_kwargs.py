"""Load-time checks of ``vllm_kwargs`` and its ``speculative_config``.

The checks use vLLM's own declarations where it has them (the ``SpeculativeMethod``
literal, ``SpeculativeConfig``'s fields, ``EngineArgs``' fields), so a new vLLM
method passes through without a change here. Each error names the key and the
fix. The result is the dict handed to ``vllm.LLM``, with two RL defaults filled in:

* ``draft_sample_method: probabilistic`` for methods with a drafter model: at
  temperature 1 a greedy draft is accepted only with the target's probability
  of its argmax token, so a good drafter pays only with probabilistic drafting;
* ``draft_load_config: {load_format: auto}`` when the policy starts from
  ``load_format: dummy``: vLLM loads the drafter with the target's load config
  unless told otherwise, and refit only ever overwrites the target.
"""

from __future__ import annotations

import difflib
import json
import os
import warnings
from pathlib import Path
from typing import Any

from rl_specdec.config.kinds import check_kinds
from rl_specdec.errors import ConfigError
from rl_specdec.vllm_ext import declarations
from rl_specdec.vllm_ext.methods import method as method_row
from rl_specdec.vllm_ext.methods import names

# Engine arguments rl_specdec sets itself, and why.
RL_SPECDEC_OWNED = {
    "model": "policy.model_name",
    "seed": "the run's seed",
    "worker_extension_cls": "its engine extension, rl_specdec.rollout.engine_ext",
    "disable_log_stats": "spec-decode metrics need stat logging",
    "per_request_spec_decode_metrics": "each call's spec-decode counters come from it",
    "scheduler_cls": "policy.generation.speculation_control (run-time k needs its scheduler class)",
}
# Engine arguments that are sizes: >= 1, or one of the values vLLM gives a meaning (-1: fit to memory).
SPEC_SIZES = {"prompt_lookup_max": (), "prompt_lookup_min": ()}  # a lookup of fewer than one token matches nothing
ENGINE_SIZES = {
    "max_model_len": (-1,),
    "tensor_parallel_size": (),
    "pipeline_parallel_size": (),
    "kv_cache_memory_bytes": (),
    "max_num_seqs": (),
    "max_num_batched_tokens": (),
    "block_size": (),
}


def _local_vocab_size(path: str) -> int | None:
    """vocab_size from a local model folder's config.json; None if not a local folder."""
    cfg = Path(os.path.expanduser(path)) / "config.json"
    if not cfg.is_file():
        return None
    data = json.loads(cfg.read_text())
    if "vocab_size" not in data and "text_config" in data:
        data = data["text_config"]
    return data.get("vocab_size")


def validate_vllm_kwargs(
    vllm_kwargs: dict[str, Any] | None,
    policy_model: str | None,
    *,
    key: str = "policy.generation.vllm_kwargs",
    training: bool = True,
) -> dict[str, Any]:
    """Check ``vllm_kwargs`` and return the dict to pass to ``vllm.LLM``.

    ``policy_model`` (the policy's folder or hub id) is what a ``draft_model`` drafter's vocabulary is compared
    with; ``None`` checks everything else, before the models are resolved: no model file is read, nothing is
    fetched.
    """
    # null means "vLLM's default" (and speculative_config: null means no speculation)
    kw = {k: v for k, v in (vllm_kwargs or {}).items() if v is not None}
    known = declarations.engine_arg_names()
    for k in kw:
        if k not in known:
            close = difflib.get_close_matches(k, sorted(known), n=3, cutoff=0.6)
            raise ConfigError(
                f"{key}.{k} is not a vLLM engine argument. "
                + (f"Did you mean {close}? " if close else "")
                + "See vllm.engine.arg_utils.EngineArgs for the accepted names."
            )
    for k, by in RL_SPECDEC_OWNED.items():
        if k in kw:
            raise ConfigError(f"{key}.{k} is set by rl_specdec ({by}); remove it from vllm_kwargs.")
    scalars = {k: v for k, v in kw.items() if k != "speculative_config"}
    check_kinds(scalars, declarations.engine_arg_kinds(), key, ENGINE_SIZES)
    gmu = kw.get("gpu_memory_utilization")
    if gmu is not None and not (0.0 < float(gmu) <= 1.0):
        raise ConfigError(f"{key}.gpu_memory_utilization={gmu} must be in (0, 1].")

    spec = kw.get("speculative_config")
    if spec is None:
        return kw
    kw["speculative_config"] = validate_speculative_config(
        dict(spec),
        policy_model,
        key=f"{key}.speculative_config",
        training=training,
        policy_load_format=kw.get("load_format", "auto"),
        async_scheduling=kw.get("async_scheduling"),
    )
    return kw


def _check_schedule(schedule: Any, k_tokens: Any, key: str) -> tuple[list[list[int]], int]:
    """vLLM's batch-size schedule for k, checked with vLLM's own parser; returns it and the k it needs.

    vLLM silently caps every scheduled k at ``num_speculative_tokens``, so a
    schedule asking for more is an error here rather than a quiet no-op.
    """
    sk = f"{key}.num_speculative_tokens_per_batch_size"
    try:
        parsed = declarations.parse_speculation_schedule(
            [list(e) if isinstance(e, (list, tuple)) else e for e in schedule]
        )
    except (ValueError, TypeError) as e:
        raise ConfigError(
            f"{sk}: {e} Write it as a list of [first_batch_size, last_batch_size, k] ranges starting at 1, "
            "e.g. [[1, 16, 5], [17, 64, 3], [65, 1024, 2]]."
        ) from None
    k_max = max(k for _, _, k in parsed)
    if k_tokens is None:
        k_tokens = k_max
    elif k_max > int(k_tokens):
        raise ConfigError(
            f"{sk} asks for k={k_max} but {key}.num_speculative_tokens={k_tokens} caps every scheduled k; "
            f"set {key}.num_speculative_tokens={k_max} (or drop it: it defaults to the schedule's largest k)."
        )
    if k_max < 1:
        raise ConfigError(f"{sk} never speculates (every k is 0); set {key}=null to turn speculation off.")
    return [list(e) for e in parsed], int(k_tokens)


def _check_method(spec: dict[str, Any], key: str) -> str:
    """The method is one vLLM declares, and every key is a field of vLLM's SpeculativeConfig."""
    methods = declarations.speculative_methods()
    method = spec.get("method")
    if method is None:
        raise ConfigError(f"{key}.method is missing; set it to one of {methods}.")
    if method not in methods:
        raise ConfigError(f"{key}.method={method!r} is not a vLLM speculative method; use one of {methods}.")
    known = declarations.speculative_config_fields()
    for k in spec:
        if k not in known:
            raise ConfigError(f"{key}.{k} is not a field of vLLM's SpeculativeConfig; remove it or fix the spelling.")
    return method


def _check_drafter(spec: dict[str, Any], method: str, key: str) -> None:
    """A drafter model where the method needs one, none where it uses none."""
    if method_row(method).drafter_model and not spec.get("model"):
        raise ConfigError(
            f"{key}.model is missing: method {method!r} needs a drafter; set {key}.model to its path or hub id."
        )
    if method_row(method).model_free and spec.get("model"):
        raise ConfigError(f"{key}.model is set but method {method!r} uses no drafter model; remove {key}.model.")


def check_drafter_vocabulary(
    spec: dict[str, Any] | None, policy_model: str, *, key: str = "policy.generation.vllm_kwargs.speculative_config"
) -> None:
    """A drafter model of a method that shares the policy's vocabulary (``draft_model``) has it: compared where
    both are local folders (their ``config.json``); a hub id is left to vLLM, which compares them at start."""
    if not spec or not method_row(spec.get("method")).policy_vocabulary or spec.get("use_heterogeneous_vocab", False):
        return
    drafter_vocab, policy_vocab = _local_vocab_size(spec["model"]), _local_vocab_size(policy_model)
    if drafter_vocab is not None and policy_vocab is not None and drafter_vocab != policy_vocab:
        raise ConfigError(
            f"{key}.model ({spec['model']}) has vocab_size {drafter_vocab} but the policy "
            f"({policy_model}) has {policy_vocab}: the drafter cannot serve this target. "
            "Use a drafter from the same model family (same tokenizer), e.g. a smaller Qwen3 for a Qwen3 policy."
        )
    if drafter_vocab is None or policy_vocab is None:
        warnings.warn(
            f"{key}: the drafter/policy vocabularies were not compared (not local folders); "
            "vLLM checks them when the engine starts.",
            stacklevel=2,
        )


def validate_speculative_config(
    spec: dict[str, Any],
    policy_model: str | None,
    *,
    key: str = "speculative_config",
    training: bool = True,
    policy_load_format: str = "auto",
    async_scheduling: bool | None = None,
) -> dict[str, Any]:
    """Check a speculative config against vLLM's declarations; return it with the RL defaults filled in.
    ``policy_model``: as in :func:`validate_vllm_kwargs`."""
    spec = {k: v for k, v in spec.items() if v is not None}  # a key set to null is unset (model=null after ngram)
    method = _check_method(spec, key)
    check_kinds(spec, declarations.speculative_config_kinds(), key, SPEC_SIZES)
    k_tokens = spec.get("num_speculative_tokens")
    schedule = spec.get("num_speculative_tokens_per_batch_size")
    if k_tokens is None and not schedule:
        raise ConfigError(f"{key}.num_speculative_tokens is missing; set it to the number of drafted tokens, e.g. 3.")
    if k_tokens is not None and int(k_tokens) < 1:
        raise ConfigError(
            f"{key}.num_speculative_tokens={k_tokens} must be >= 1 (3 is a good start); to turn speculation off set "
            f"{key}=null."
        )
    if schedule is not None:
        schedule, k_tokens = _check_schedule(schedule, k_tokens, key)
    needs_model = method_row(method).drafter_model
    _check_drafter(spec, method, key)
    if policy_model is not None:
        check_drafter_vocabulary(spec, policy_model, key=key)

    rsm = spec.get("rejection_sample_method", "standard")
    if rsm == "synthetic" and training:
        raise ConfigError(
            f"{key}.rejection_sample_method='synthetic' fakes acceptance for benchmarking and changes "
            "what is sampled; it must not be used for training. Remove it (the default is 'standard')."
        )

    if async_scheduling and not method_row(method).async_scheduling and method not in declarations.mtp_methods():
        raise ConfigError(
            f"vllm_kwargs.async_scheduling=true cannot be combined with {key}.method={method!r} in vLLM 0.32 "
            f"(async scheduling supports {names(lambda m: m.async_scheduling)} and MTP). Set async_scheduling=false "
            "or use one of those methods."
        )

    out = dict(spec)
    if schedule is not None:
        out["num_speculative_tokens_per_batch_size"] = schedule
        out["num_speculative_tokens"] = k_tokens
    if needs_model or method in declarations.mtp_methods():
        out.setdefault("draft_sample_method", "probabilistic")
    if needs_model and policy_load_format == "dummy" and "draft_load_config" not in out:
        out["draft_load_config"] = {"load_format": "auto"}
    return out


def check_backend_runs(
    spec: dict[str, Any] | None,
    *,
    on_cpu: bool,
    key: str = "policy.generation.vllm_kwargs.speculative_config",
    has_arctic_inference: bool | None = None,
) -> None:
    """Refuse a speculation method the backend cannot run: on CPU only the table's ``cpu`` methods (the ones the
    losslessness tests start there; eagle and MTP are not tested on it: MTP layers need a policy trained with them,
    and the heads built here are EAGLE-3's); a method's package (suffix: arctic-inference)."""
    method = (spec or {}).get("method")
    if method not in declarations.speculative_methods():
        return  # none, or one validate_speculative_config refuses with the list of methods
    row = method_row(method)
    if on_cpu and not row.cpu:
        raise ConfigError(
            f"{key}.method={method!r} does not run on vLLM's CPU backend: on CPU rl_specdec runs "
            f"{', '.join(names(lambda m: m.cpu))} only (docs/speculative_decoding.md, 'The methods'). Switch "
            f"method with {key}.method=ngram (or draft_model with a model), or run on GPUs."
        )
    if row.package == "arctic-inference":
        found = declarations.has_arctic_inference() if has_arctic_inference is None else has_arctic_inference
        if not found:
            raise ConfigError(
                f"{key}.method='suffix' needs the arctic-inference package, which is not installed: run "
                "bash scripts/install_arctic_inference.sh (CPU) or pip install arctic-inference (GPU), "
                f"or use {key}.method=ngram."
            )
