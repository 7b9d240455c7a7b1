"""``policy.precision``: what the trainer keeps in which dtype, what it computes in, what the refit sends.

=============  ==============  =====================  ==================  ==========================
precision      master weights  AdamW moments, grads   forward/backward    frozen reference
=============  ==============  =====================  ==================  ==========================
``fp32``       float32         float32                float32             float32
``bf16-mixed`` float32         float32                bfloat16 (below)    bfloat16
``bf16``       bfloat16        bfloat16               bfloat16            bfloat16
=============  ==============  =====================  ==================  ==========================

``bf16-mixed`` computes in bf16 in one of two ways, chosen by the strategy:

* one worker and DDP: ``torch.autocast(device, bfloat16)`` around the
  forward (matmuls in bf16, the residual stream, norms and the loss in fp32);
  gradients land in the fp32 parameters' ``.grad`` and DDP reduces them in fp32.
* FSDP2: ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: each
  layer is all-gathered in bf16 and runs entirely in bf16, its gradients are
  reduce-scattered in fp32 into the fp32 shards. Autocast would keep a bf16
  copy of every layer's weights alive from forward to backward (the matmuls
  save their bf16 inputs), a whole unsharded bf16 model per GPU, and gather
  fp32: FSDP2's own policy keeps the sharding's memory and halves the
  gathers. The price: FSDP2's bf16 compute is not autocast's, so its step
  equals one worker's to bf16 accuracy, not to fp32 rounding. (DDP runs one
  worker's arithmetic; it differs only where matmuls batched differently
  round differently in bf16: a third of the bf16 error, on the toy.)

Log-probs for the loss are always a float32 ``log_softmax`` of the logits. The
refit sends the engines' dtype (``policy.generation.vllm_kwargs.dtype``,
which follows the precision unless set), cast on the trainer before the
gather. The names and which engine dtypes may go with which precision:
:mod:`rl_specdec.config.precision`.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import TYPE_CHECKING, Callable

from rl_specdec.config.precision import COMPUTE, MASTER, engine_dtype

if TYPE_CHECKING:
    import torch

__all__ = ["COMPUTE", "MASTER", "SDPA_MATH_MAX_LEN", "compute", "dtype", "engine_dtype", "fsdp2_policy", "plain"]


def dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)


# On CPU, bf16 attention over short sequences runs faster through SDPA's math kernel than through its
# flash kernel, whose bf16 backward is slow at these sizes (1.4-1.9x for a whole forward and backward of
# the toy at 16 to 128 tokens, the flash kernel 1.2x ahead at 256 and beyond; fp32 is alike either way).
SDPA_MATH_MAX_LEN = 128


def plain(_seq_len: int) -> AbstractContextManager:
    return nullcontext()


def compute(precision: str, device: torch.device, fsdp2: bool) -> Callable[[int], AbstractContextManager]:
    """``compute(seq_len)``: what a forward over sequences of that length runs under. bf16 autocast for
    bf16-mixed without FSDP2 (FSDP2 casts through its MixedPrecisionPolicy); for bf16 compute on CPU,
    SDPA's math kernel up to ``SDPA_MATH_MAX_LEN`` tokens."""
    autocast = precision == "bf16-mixed" and not fsdp2
    math_sdpa = COMPUTE[precision] == "bfloat16" and device.type == "cpu"
    if not (autocast or math_sdpa):
        return plain
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def enter(seq_len: int) -> AbstractContextManager:
        stack = ExitStack()
        if autocast:
            stack.enter_context(torch.autocast(device.type, dtype=torch.bfloat16))
        if math_sdpa and seq_len <= SDPA_MATH_MAX_LEN:
            stack.enter_context(sdpa_kernel([SDPBackend.MATH]))
        return stack

    return enter


def fsdp2_policy(precision: str):
    """FSDP2's MixedPrecisionPolicy for bf16-mixed (bf16 gathers and compute, fp32 gradient
    reduction); None otherwise."""
    if precision != "bf16-mixed":
        return None
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
