"""The weight wire format between the trainer and the engines.

Inside one process (the synchronous engine, whose core runs in its actor),
weights travel as ``(name, tensor)`` pairs. To the async engine's core, which
runs in another process, they cross vLLM's msgpack IPC: that encodes a tensor
*argument* but decodes untyped utility arguments as plain lists, so tensors
are packed as ``(name, dtype, shape, raw bytes)`` (:func:`pack`) and rebuilt
on the other side (:func:`unpack`). :func:`unpack` accepts both forms.
"""

from __future__ import annotations

from typing import Any, Iterable

Packed = tuple[str, str, list[int], bytes]


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
        t = torch.empty(shape, dtype=dt) if len(data) == 0 else torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dt).view(shape)
        out.append((name, t))
    return out
