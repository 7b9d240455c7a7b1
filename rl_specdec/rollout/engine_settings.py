"""What each engine really runs, against what the config asked for.

vLLM may change an engine argument on the way in without an error: on its
CPU platform ``async_scheduling`` is switched off, ``dtype: auto`` becomes
bfloat16, ``max_num_batched_tokens`` is raised for speculation. So after an
engine starts, its extension reads the *effective* settings back from the
engine's own ``vllm_config`` (:meth:`RlSpecdecExtension.rl_specdec_settings`,
flat keys, speculative ones under ``speculative/``), and this module:

* compares them with the keys the user set (:func:`mismatches`): each
  setting the engine did not honour is one line with the key, the requested
  value, the effective value and, where known, the reason;
* checks that every engine of a group runs the same settings (:func:`agree`);
* writes a one-line summary for the console (:func:`summary_line`).

With run-time k (``speculation_control``) the settings report the control
mode and k_max, not the k of the moment: rl_specdec then owns
``num_speculative_tokens`` and the schedule (:data:`RUN_TIME_K`).

The group warns once per mismatch, or raises :class:`ConfigError` before the
first step under ``policy.generation.strict_engine_settings``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rl_specdec.config.generation import GenerationConfig
from rl_specdec.errors import ConfigError

KEY = "policy.generation.vllm_kwargs"

# Settings that are read back, by their flat key. Every one of them is also the
# vllm_kwargs key (or speculative_config key, under "speculative/") that sets it.
COMPARED = (
    "async_scheduling",
    "dtype",
    "max_num_batched_tokens",
    "max_num_seqs",
    "max_model_len",
    "enable_prefix_caching",
    "enable_chunked_prefill",
    "load_format",
    "enforce_eager",
    "kv_cache_memory_bytes",
    "speculative/method",
    "speculative/num_speculative_tokens",
    "speculative/num_speculative_tokens_per_batch_size",
    "speculative/draft_sample_method",
    "speculative/rejection_sample_method",
)

# With run-time k (speculation_control fixed or adaptive) rl_specdec sets these itself: k_max and vLLM's dynamic-k mode.
RUN_TIME_K = ("speculative/num_speculative_tokens", "speculative/num_speculative_tokens_per_batch_size")

# (setting, backend) -> why the engine runs something else, where it is known.
REASONS = {
    ("async_scheduling", "cpu"): "vLLM's CPU platform turns async scheduling off (vllm/platforms/cpu.py: "
    "'async scheduling is not required on CPU')",
    ("max_num_batched_tokens", None): "vLLM raises it to fit the draft tokens of every running request",
}


@dataclass(frozen=True)
class Mismatch:
    key: str
    requested: Any
    effective: Any
    reason: str | None

    def message(self) -> str:
        name = (
            f"{KEY}.speculative_config.{self.key.split('/', 1)[1]}"
            if self.key.startswith("speculative/")
            else f"{KEY}.{self.key}"
        )
        why = f" ({self.reason})" if self.reason else ""
        return f"{name}: requested {self.requested!r}, the engine runs {self.effective!r}{why}"


def requested(gen: GenerationConfig) -> dict[str, Any]:
    """The compared settings the user set, in the flat keys of the read-back."""
    spec = gen.speculation
    asked = {**gen.vllm_kwargs, **(spec.settings() if spec else {})}
    return {k: v for k, v in asked.items() if k in COMPARED and v is not None}


def _norm(v: Any) -> Any:
    """A setting as the engine reports it: no ``torch.`` prefix, nested tuples as lists."""
    if isinstance(v, (list, tuple)):
        return [list(e) if isinstance(e, (list, tuple)) else e for e in v]
    return str(v).removeprefix("torch.")


def _same(a: Any, b: Any) -> bool:
    return _norm(a) == _norm(b)


def mismatches(gen: GenerationConfig, effective: dict[str, Any]) -> list[Mismatch]:
    """Every setting the user asked for that the engine does not run. ``dtype: auto`` asks for nothing."""
    backend = effective.get("backend")
    owned = RUN_TIME_K if effective.get("speculation_control/mode", "off") != "off" else ()
    out = []
    for key, want in requested(gen).items():
        if (key == "dtype" and want == "auto") or key in owned:
            continue
        have = effective.get(key)
        if key in effective and not _same(want, have):
            reason = REASONS.get((key, backend)) or REASONS.get((key, None))
            out.append(Mismatch(key, want, have, reason))
    return out


def agree(per_engine: list[dict[str, Any]]) -> dict[str, Any]:
    """The group's settings; raises if an engine runs different settings from engine 0."""
    first = per_engine[0]
    for i, s in enumerate(per_engine[1:], start=1):
        diff = sorted(k for k in set(first) | set(s) if k not in ("engine_pid",) and not _same(first.get(k), s.get(k)))
        if diff:
            details = ", ".join(f"{k}: engine 0 {first.get(k)!r}, engine {i} {s.get(k)!r}" for k in diff)
            raise ConfigError(
                f"engine {i} runs different settings from engine 0 ({details}). The engines of one group must "
                "run the same model, dtype and speculation; check the nodes' hardware and vLLM versions."
            )
    return first


def check(gen: GenerationConfig, per_engine: list[dict[str, Any]], warn) -> dict[str, Any]:
    """Agreement, then mismatches: ``warn(message)`` once per setting, or ConfigError under
    ``gen.strict_engine_settings``."""
    settings = agree(per_engine)
    found = mismatches(gen, settings)
    if found and gen.strict_engine_settings:
        lines = "; ".join(m.message() for m in found)
        raise ConfigError(
            f"the engines do not run what the config asks for: {lines}. Change the setting, or set "
            "policy.generation.strict_engine_settings=false to run with a warning."
        )
    for m in found:
        warn(m.message())
    return settings


def kv_capacity(settings: dict[str, Any]) -> int | None:
    """How many requests of ``max_model_len`` tokens the engine's KV cache holds at once (vLLM's "maximum
    concurrency"), its drafter's layers included; None where the engine did not report its blocks."""
    blocks, size, length = (settings.get(k) for k in ("kv_cache_blocks", "block_size", "max_model_len"))
    if not (blocks and size and length):
        return None
    return blocks // -(-length // size)


def kv_shortfall(settings: dict[str, Any], wanted: int) -> str | None:
    """A warning when the KV cache cannot hold the ``wanted`` requests an engine is given at once (up to
    ``max_num_seqs``): the scheduler then runs fewer at a time and a call takes more steps. Else None."""
    cap, seqs = kv_capacity(settings), settings.get("max_num_seqs") or wanted
    need = min(wanted, seqs)
    if cap is None or cap >= need:
        return None
    drafter = " (the drafter's layers take their share)" if settings.get("speculative/method") else ""
    have = settings.get("kv_cache_memory_bytes")
    if have:
        mib = -(-have * need // cap // 2**20)
        fix = f"set {KEY}.kv_cache_memory_bytes to at least {mib * 2**20} ({mib} MiB)"
    else:
        fix = f"raise {KEY}.gpu_memory_utilization, or lower max_model_len"
    return (
        f"{KEY}: the KV cache holds {cap} requests of max_model_len {settings.get('max_model_len')} tokens "
        f"at once{drafter}, and a call gives an engine up to {need}: the rest wait, and a call takes more "
        f"steps. To run them together, {fix}."
    )


def summary_line(settings: dict[str, Any], num_engines: int) -> str:
    """One line for the console: what every engine runs."""
    s = settings
    mode = s.get("speculation_control/mode", "off")
    if s.get("speculative/method"):
        sched = s.get("speculative/num_speculative_tokens_per_batch_size")
        k = f"k by batch size {sched}" if sched else f"k={s.get('speculative/num_speculative_tokens')}"
        if mode != "off":
            fast = "k=0 fast path" if s.get("speculation_control/k0_fast_path") else "k=0 through vLLM's path"
            below = s.get("speculation_control/draft_below")
            where = f", drafting below {below} running requests" if below else ""
            where += f", starting from {sched}" if s.get("speculation_control/start") == "schedule" else ""
            k = f"k chosen at run time ({mode}, 0..{s.get('speculation_control/k_max')}{where}, {fast})"
        drafts, rejection = s.get("speculative/draft_sample_method"), s.get("speculative/rejection_sample_method")
        spec = f"{s['speculative/method']} {k} ({drafts} drafts, {rejection} rejection)"
    else:
        spec = "no speculation"
    fix = {True: "CPU sampling fix applied", False: "CPU sampling fix not needed"}.get(s.get("cpu_expand_fix"), "")
    parts = [
        f"{num_engines} engine(s): vLLM {s.get('vllm_version')} on {s.get('backend')}",
        spec,
        str(s.get("dtype")).removeprefix("torch."),
        "async scheduling on" if s.get("async_scheduling") else "async scheduling off",
        "eager" if s.get("enforce_eager") else f"compilation mode {s.get('compilation_mode')}",
        f"prefix caching {'on' if s.get('enable_prefix_caching') else 'off'}",
        f"max_num_batched_tokens {s.get('max_num_batched_tokens')}",
        fix,
    ]
    return ", ".join(p for p in parts if p)
