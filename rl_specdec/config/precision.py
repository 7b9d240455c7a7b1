"""``policy.precision``'s names and the load-time checks: which precisions exist, what each keeps its
master weights in and computes in, which engine dtype goes with which (:func:`check_pairing`).

What the trainer does with them (autocast, FSDP2's MixedPrecisionPolicy, the refit's cast):
:mod:`rl_specdec.policy.precision`; the table of dtypes: docs/grpo.md, "Precision".
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from rl_specdec.errors import ConfigError

if TYPE_CHECKING:
    from rl_specdec.config.schema import PolicyConfig

PRECISIONS = ("fp32", "bf16-mixed", "bf16")
COMPUTE = {"fp32": "float32", "bf16-mixed": "bfloat16", "bf16": "bfloat16"}  # also the engines' default dtype
MASTER = {"fp32": "float32", "bf16-mixed": "float32", "bf16": "bfloat16"}
ENGINE_ALIASES = {"float": "float32", "half": "float16"}  # vLLM's other names for its dtypes
ENGINE_KEY = "policy.generation.vllm_kwargs.dtype"


def validate(value: str) -> None:
    if value != "auto" and value not in PRECISIONS:
        raise ConfigError(
            f"policy.precision={value!r} must be auto, fp32, bf16-mixed or bf16: bf16-mixed keeps fp32 weights "
            "and AdamW state and computes in bf16 (the usual choice on GPUs), bf16 keeps everything in bf16 "
            "(least memory), fp32 computes in fp32"
        )


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (``avx512_bf16`` or ``amx_bf16`` in /proc/cpuinfo's flags):
    there bf16 matmuls run 4-8x fp32's rate; without, oneDNN emulates them and fp32 is the faster choice."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = {w for line in f if line.startswith("flags") for w in line.split()}
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def resolve(value: str, device: str, cpu_bf16: bool | None = None) -> str:
    """``auto``: bf16-mixed on cuda and on a CPU with native bf16 (``cpu_bf16``, probed when None), else fp32."""
    if value != "auto":
        return value
    if device == "cuda":
        return "bf16-mixed"
    return "bf16-mixed" if (cpu_has_native_bf16() if cpu_bf16 is None else cpu_bf16) else "fp32"


def engine_dtype(p: PolicyConfig) -> str:
    """The engines' dtype: ``vllm_kwargs.dtype`` when set, else the precision's compute dtype."""
    kw = p.generation.vllm_kwargs.get("dtype")
    if kw in (None, "auto"):
        if p.precision not in PRECISIONS:
            raise ValueError(
                f"policy.precision={p.precision!r}: resolve 'auto' first (rl_specdec.config.resolve_device_and_dtype)"
            )
        return COMPUTE[p.precision]
    return ENGINE_ALIASES.get(str(kw), str(kw))


def check_pairing(precision: str, engine: str) -> None:
    """Refuse the engine dtypes no precision trains with; warn where engines and trainer compute
    differently by choice."""
    if engine not in ("float32", "bfloat16"):
        raise ConfigError(
            f"{ENGINE_KEY}={engine}: the trainer has no matching precision, engines run float32 or bfloat16 "
            "(fp16 training needs loss scaling, which the trainer does not do, "
            f"and bf16-trained weights may overflow in fp16). Remove {ENGINE_KEY} (it follows policy.precision), "
            "or set bfloat16 with policy.precision=bf16-mixed, or float32 with policy.precision=fp32"
        )
    compute = COMPUTE[precision]
    if engine == compute:
        return
    why = (
        "the engines sample from bf16-rounded weights in bf16 while the trainer computes in fp32: "
        "policy.precision=bf16-mixed trains faster with these engines"
        if engine == "bfloat16"
        else f"the trainer computes in bf16 ({precision}) while the engines run float32, "
        "slower and no closer to the trainer"
    )
    warnings.warn(
        f"{ENGINE_KEY}={engine} with policy.precision={precision}: {why}. train/logprob_mismatch shows the difference "
        f"(the clipped importance ratio corrects for it). Remove {ENGINE_KEY} to run the engines in {compute}.",
        stacklevel=2,
    )
