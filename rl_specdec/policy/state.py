"""The policy's state in a form that does not depend on the number of workers.

* Refit: :func:`full_state_items` walks the model's Hugging Face-named
  tensors one at a time, gathering an FSDP2 shard into the full tensor on
  every rank (a collective: all ranks walk together), and
  :func:`bucketed` packs them into dicts of bounded size, so no process ever
  holds more than one bucket beyond the model itself.
* Checkpoints: the model is written in Hugging Face format and the optimizer
  as a *full* state dict keyed by parameter name
  (``torch.distributed.checkpoint.state_dict`` with ``full_state_dict``), so a
  run saved by 2 workers (DDP or FSDP2) resumes on 1 and the reverse. Rank 0
  writes and reads the files; it broadcasts to the others on load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

FORMAT = 2  # optimizer.pt: 2 = full state dict keyed by parameter name; absent = torch's index-keyed state_dict()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def full_state_items(
    model: nn.Module, dtype: torch.dtype | None = None
) -> Iterator[tuple[list[str], torch.Tensor | None]]:
    """``(names, full CPU tensor)`` for each tensor of the model, in state-dict order.

    A tensor under several names (an LM head tied to the embedding) comes once,
    with all its names: the engines need every name (vLLM's weight reload does not
    re-tie a head it is not sent), the bytes travel once. Every rank must iterate to
    the end; ranks other than 0 get ``None``: they only take part in the gathers.
    ``dtype``: floating-point tensors are cast to it (the engines' dtype) before
    the gather and the copy to CPU, so fp32 master weights cross in bf16 to bf16 engines.
    """
    names: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        names.setdefault(id(t), []).append(name)
        tensors.setdefault(id(t), t)
    rank = _rank()
    for key, t in tensors.items():
        t = t.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)  # a no-op when it has it already (the live tensor, as before)
        if hasattr(t, "full_tensor"):  # an FSDP2 shard (DTensor): all-gather
            t = t.full_tensor()
        yield names[key], (t.to("cpu") if rank == 0 else None)


def as_dict(items: Iterable[tuple[list[str], torch.Tensor | None]]) -> dict[str, torch.Tensor]:
    return {n: t for names, t in items if t is not None for n in names}


def bucketed(
    items: Iterable[tuple[list[str], torch.Tensor | None]], max_bytes: int
) -> Iterator[dict[str, torch.Tensor]]:
    """Group tensors in order into dicts of at most ``max_bytes`` (a tensor larger than that goes alone;
    a tied tensor counts once, under all its names)."""
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for names, t in items:
        if t is None:
            continue
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = {}, 0
        for name in names:
            bucket[name] = t
        size += nbytes
    if bucket:
        yield bucket


def _tied(model: nn.Module) -> bool:
    return bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))


def save(model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Write ``path/model`` (Hugging Face safetensors) and ``path/optimizer.pt`` from rank 0. A collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd = get_model_state_dict(model, options=opts)
    # An optimizer that has not stepped yet is saved as None: torch would first give it a zero step,
    # which shifts Adam's bias correction for the rest of the run.
    osd = get_optimizer_state_dict(model, optimizer, options=opts) if optimizer.state else None
    if _rank() != 0:
        return
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(p / "model", state_dict=msd, safe_serialization=True)
    torch.save({"format": FORMAT, "optimizer": osd, "torch_rng": torch.get_rng_state()}, p / "optimizer.pt")


def _read(model: nn.Module, path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted((path / "model").glob("*.safetensors")):
        state.update(load_file(str(f)))
    expected = set(model.state_dict())
    if (
        _tied(model)
        and "lm_head.weight" in expected
        and "lm_head.weight" not in state
        and "model.embed_tokens.weight" in state
    ):
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise RuntimeError(f"checkpoint {path} does not match the policy: missing {missing}, unexpected {unexpected}")
    return state, torch.load(path / "optimizer.pt", weights_only=False)


def load(model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Restore model, optimizer and torch RNG from :func:`save`'s files. A collective: rank 0 reads and broadcasts."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    world = dist.get_world_size() if dist.is_initialized() else 1
    msd, extra, header = {}, {}, [None]  # rank 0 tells the others: (format, torch RNG state, optimizer stepped?, error)
    if _rank() == 0:
        try:
            msd, extra = _read(model, Path(path))
            header = [(extra.get("format"), extra["torch_rng"], extra["optimizer"] is not None, None)]
        except Exception as e:  # the other ranks must learn of it, not wait in a broadcast
            header = [(None, None, False, f"{type(e).__name__}: {e}")]
            if world == 1:
                raise
    if world > 1:
        dist.broadcast_object_list(header, src=0)
    fmt, rng, stepped, error = header[0]
    if error:
        raise RuntimeError(f"loading checkpoint {path} failed on rank 0: {error}")
    if fmt != FORMAT:  # written by one worker before FORMAT 2: an index-keyed optimizer state
        if world > 1 or hasattr(model, "set_requires_gradient_sync"):
            raise RuntimeError(
                f"checkpoint {path} holds an index-keyed optimizer state (older rl_specdec): resume it with "
                "policy.num_workers=1 and policy.strategy=ddp"
            )
        model.load_state_dict(msd)
        optimizer.load_state_dict(extra["optimizer"])
    else:
        # Two calls, not set_state_dict: with an empty model dict (ranks > 0 under broadcast) it would skip the model.
        opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=world > 1)
        set_model_state_dict(model, msd, options=opts)
        if stepped:
            set_optimizer_state_dict(model, optimizer, extra.get("optimizer") or {}, options=opts)
        else:
            optimizer.state.clear()  # as fresh as when it was saved
    torch.set_rng_state(rng)
