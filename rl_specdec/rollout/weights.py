"""The weight wire format between the trainer and the engines.

Inside one process (the synchronous engine, whose core runs in its actor),
weights travel as ``(name, tensor)`` pairs. To the async engine's core, which
runs in another process, they cross vLLM's msgpack IPC: that encodes a tensor
*argument* but decodes untyped utility arguments as plain lists, so tensors
are packed as ``(name, dtype, shape, raw bytes)`` (:func:`pack`) and rebuilt
on the other side (:func:`unpack`). :func:`unpack` accepts both forms.

Integrity (fail-closed): before an engine loads anything, every received
tensor is checked against the names and shapes of the model it is meant for
(:func:`expected_tensors`, a meta-device Hugging Face model of the engine's
own config) and a checksum of the received bytes (:func:`checksum`) goes back
to the sender, which compares it with its own. vLLM's loader silently skips
a tensor it does not know, so without this a refit with a wrong name would
leave the engine on its old weights.
"""

from __future__ import annotations

import difflib
import logging
import zlib
from typing import Any, Iterable

Packed = tuple[str, str, list[int], bytes]
logger = logging.getLogger(__name__)


def pack(state_dict: dict[str, Any]) -> list[Packed]:
    """``(name, dtype, shape, raw bytes)`` per tensor: plain types that survive vLLM's IPC."""
    import torch

    out = []
    for name, t in state_dict.items():
        t = t.detach().to("cpu").contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        out.append((name, dtype, list(t.shape), t.view(torch.uint8).numpy().tobytes() if t.numel() else b""))
    return out


def unpack(weights: Iterable[Any]) -> list[tuple[str, Any]]:
    """``(name, tensor)`` pairs from packed tuples or from ``(name, tensor)`` pairs."""
    import torch

    out = []
    for w in weights:
        if len(w) == 2:
            out.append((w[0], w[1]))
            continue
        name, dtype, shape, data = w
        dt = getattr(torch, dtype)
        t = (
            torch.empty(shape, dtype=dt)
            if len(data) == 0
            else torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dt).view(shape)
        )
        out.append((name, t))
    return out


def _raw(t) -> memoryview:
    import torch

    t = t.detach().to("cpu").contiguous()
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def checksum(pairs: Iterable[tuple[str, Any]] | dict[str, Any]) -> str:
    """CRC32 over every tensor's name, shape and bytes, in name order (same for packed or unpacked)."""
    items = sorted((pairs.items() if isinstance(pairs, dict) else unpack(pairs)), key=lambda kv: kv[0])
    crc = 0
    for name, t in items:
        crc = zlib.crc32(f"{name}:{tuple(t.shape)}:{t.dtype}".encode(), crc)
        crc = zlib.crc32(_raw(t), crc)
    return f"{crc:08x}"


def expected_tensors(hf_config, target: str = "policy") -> tuple[dict[str, tuple[int, ...]], set[str]] | None:
    """``({name: shape}, optional names)`` of a Hugging Face model with this config, built on the meta device.

    Optional: weights tied to another (``lm_head.weight`` with tied embeddings).
    None when transformers has no class for the architecture (a custom drafter
    head): then one warning says that only the checksum guards the refit.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from rl_specdec.heads.eagle3 import expected_head_tensors, is_eagle3_config

    if is_eagle3_config(hf_config):  # no transformers class: its names and shapes are rl_specdec's head's
        return expected_head_tensors(hf_config), set()
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
    except (ValueError, KeyError, ImportError) as e:  # transformers: "Unrecognized configuration class ..."
        logger.warning(
            "the %s refit's names and shapes cannot be checked: transformers cannot build %s (%s: %s). "
            "Only the checksum guards this engine's %s refits.",
            target,
            type(hf_config).__name__,
            type(e).__name__,
            e,
            target,
        )
        return None
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and head.weight is embed.weight  # the model ties them as its config says
    return shapes, ({"lm_head.weight"} if tied else set())


def problems(
    expected: tuple[dict[str, tuple[int, ...]], set[str]] | None, pairs: list[tuple[str, Any]], complete: bool = True
) -> list[str]:
    """What is wrong with a refit ``pairs`` for a model with ``expected`` tensors ([] if nothing).

    ``complete=False``: ``pairs`` is one bucket of a streamed refit; names and shapes are
    checked, missing tensors are not (see :func:`missing`).
    """
    if expected is None:
        return []
    shapes, optional = expected
    out = []
    for name, t in pairs:
        if name not in shapes:
            close = difflib.get_close_matches(name, list(shapes), n=1)
            out.append(
                f"tensor {name!r} is not a parameter of the model" + (f" (did you mean {close[0]!r}?)" if close else "")
            )
        elif tuple(t.shape) != shapes[name]:
            out.append(f"tensor {name!r} has shape {tuple(t.shape)}, the model's is {shapes[name]}")
    if complete:
        out += missing(expected, {n for n, _ in pairs})
    return out


def missing(expected: tuple[dict[str, tuple[int, ...]], set[str]] | None, names: set[str]) -> list[str]:
    """The problem of a refit that did not send every tensor ([] if it did)."""
    if expected is None:
        return []
    shapes, optional = expected
    gone = sorted(set(shapes) - optional - names)
    return [f"{len(gone)} tensor(s) missing, e.g. {gone[:3]}"] if gone else []


def verify_reports(
    reports: list[dict[str, Any]], target: str, expected_checksum: str | None, streamed: bool = False
) -> None:
    """Fail closed: every engine loaded the whole refit, and holds the bytes that were sent."""
    from rl_specdec.errors import WeightIntegrityError

    kept = "the buckets before this one were loaded, so the run must stop" if streamed else "kept its previous weights"
    for i, r in enumerate(reports):
        if r["problems"]:
            raise WeightIntegrityError(
                f"engine {i} refused the {target} refit ({kept}): "
                + "; ".join(r["problems"])
                + ". The trainer's state dict does not match the engine's model: check that both load the same "
                "architecture (policy.model_name / speculative_config.model) and that names are Hugging Face names."
            )
        if expected_checksum is not None and r.get("checksum") != expected_checksum:
            raise WeightIntegrityError(
                f"engine {i} received {target} weights with checksum {r['checksum']}, but {expected_checksum} was "
                "sent: the weights were corrupted on the way. Restart the run (resume=true)."
            )
    sums = {r.get("checksum") for r in reports}
    if len(sums) > 1:
        raise WeightIntegrityError(
            f"the engines hold different {target} weights after one refit (checksums {sorted(sums)})"
        )
