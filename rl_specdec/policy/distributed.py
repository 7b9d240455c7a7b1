"""torch.distributed for the policy workers: the process group, DDP and FSDP2
wrapping, gradient reduction, the batch split and the metric reduction.

Nothing here knows Ray: :mod:`rl_specdec.policy.group` starts the processes,
this module makes them one data-parallel trainer.

Exact equivalence with one worker. The loss handed to ``train_step`` is
normalised by the *global* number of response tokens (every row carries it),
so the full-batch gradient is the *sum* of the workers' gradients. DDP and
FSDP2 average by default (they divide by the world size), which would shrink
the step by that factor; here both reduce by plain sum: DDP through a
sum-all-reduce communication hook, FSDP2 with a gradient divide factor of 1
and sum-only collectives (gloo has no PREMUL_SUM, which FSDP2 would otherwise
use for a custom factor).

With ``policy.precision=bf16-mixed`` FSDP2 runs under
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``
(:mod:`rl_specdec.policy.precision` says why not autocast): the sum-reduction
above is then done in fp32 (FSDP2 applies the divide factor, 1, in the reduce
dtype), and gloo takes both the bf16 all-gathers and the fp32 reductions. DDP
needs nothing: under autocast the gradients are the fp32 parameters' own.
"""

from __future__ import annotations

import os
import socket
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch import nn


def free_port() -> int:
    """A TCP port that is free on this node now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def needs_process_group(world_size: int, strategy: str) -> bool:
    """One DDP worker is a plain model (exactly the single-process trainer); FSDP2 always shards through a group."""
    return world_size > 1 or strategy == "fsdp2"


def init_process_group(rank: int, world_size: int, master_addr: str, master_port: int, device: torch.device) -> None:
    """gloo on CPU, NCCL on GPU; rank 0's node address and port as the rendezvous."""
    os.environ["MASTER_ADDR"] = master_addr
    os.environ["MASTER_PORT"] = str(master_port)
    if device.type == "cuda":
        dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=device)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)


def _sum_allreduce_hook(_state, bucket):  # no annotations: DDP checks them, and this module's are strings
    """DDP communication hook: all-reduce a ``dist.GradBucket`` by sum (DDP's default divides by the world size)."""
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda fut: fut.value()[0])


def _fsdp2_units(model: nn.Module) -> list[nn.Module]:
    """The decoder layers (Hugging Face's ``_no_split_modules``): each becomes one FSDP2 unit."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    units = [m for m in model.modules() if type(m).__name__ in names]
    if not units:
        raise ValueError(
            f"policy.strategy=fsdp2: {type(model).__name__} names no decoder-layer class (_no_split_modules); use "
            "policy.strategy=ddp"
        )
    return units


def _fully_shard(model: nn.Module, device: torch.device, mp_policy=None, frozen: bool = False) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp_policy = mp_policy or MixedPrecisionPolicy()  # the default: compute and reduce in the parameters' dtype
    for unit in _fsdp2_units(model):
        fully_shard(unit, mesh=mesh, mp_policy=mp_policy)
    # The root: embeddings, final norm, head (tied weights stay one parameter). FSDP2 keeps a root
    # gathered after forward, for the backward; a frozen model has none, so its root reshards at once.
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=True if frozen else None)


def wrap_for_training(model: nn.Module, strategy: str, device: torch.device, mp_policy=None) -> nn.Module:
    """The module to run forward/backward through. With FSDP2 the model is sharded in place (under
    ``mp_policy``, a ``MixedPrecisionPolicy``, if given) and returned."""
    if not dist.is_initialized():
        return model
    if strategy == "fsdp2":
        from torch.distributed.fsdp import FSDPModule

        _fully_shard(model, device, mp_policy)
        for m in model.modules():
            if isinstance(m, FSDPModule):  # per unit: the setters do not recurse
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)
        return model
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None, forward_sync_buffers=False
    )
    ddp.register_comm_hook(None, _sum_allreduce_hook)
    return ddp


def shard_frozen(model: nn.Module, strategy: str, device: torch.device) -> nn.Module:
    """The frozen reference model: sharded like the policy under FSDP2, a local replica otherwise."""
    if dist.is_initialized() and strategy == "fsdp2":
        _fully_shard(model, device, frozen=True)
    return model


@contextmanager
def grad_sync(module: nn.Module, enabled: bool):
    """Reduce gradients on this backward only if ``enabled`` (the last micro-batch of a step)."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel):
        with nullcontext() if enabled else module.no_sync():
            yield
        return
    if hasattr(module, "set_requires_gradient_sync"):  # an FSDP2 module
        module.set_requires_gradient_sync(enabled)
    yield


def reduce_metrics(
    sums: dict[str, float], maxes: dict[str, float], device: torch.device
) -> tuple[dict[str, float], dict[str, float]]:
    """Sum ``sums`` and take the max of ``maxes`` over all ranks (every rank holds the same keys)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return sums, maxes
    out = []
    for values, op in ((sums, dist.ReduceOp.SUM), (maxes, dist.ReduceOp.MAX)):
        keys = sorted(values)
        t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device)
        if keys:
            dist.all_reduce(t, op=op)
        out.append(dict(zip(keys, t.tolist())))
    return out[0], out[1]


def shard_batch(batch: dict[str, torch.Tensor], world_size: int) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """Split a batch over ``world_size`` ranks: one ``(row indices, shard)`` per rank.

    Rows are dealt round-robin in order of length, longest first, so the
    ranks get nearly equal token counts. The batch is first padded to a
    multiple of ``world_size`` with copies of its shortest row whose
    ``loss_mask`` is zero (they add nothing to the loss, its gradients or its
    metrics), so every rank holds as many rows and runs as many micro-batches:
    FSDP2 needs every rank in every forward. Padding rows have index -1.
    With one rank, the batch as it is.
    """
    n = batch["input_ids"].shape[0]
    if world_size == 1:
        return [(torch.arange(n), batch)]
    order = torch.argsort(batch["attention_mask"].sum(1), descending=True, stable=True)  # [N]
    pad = (-n) % world_size
    order = torch.cat([order, order[-1:].repeat(pad)])  # [N + pad]
    real = torch.arange(n + pad) < n  # [N + pad]
    shards = []
    for r in range(world_size):
        pos = torch.arange(r, n + pad, world_size)
        idx = order[pos]
        shard = {k: v[idx].clone() for k, v in batch.items()}
        shard["loss_mask"][~real[pos]] = 0
        shards.append((torch.where(real[pos], idx, -1), shard))
    return shards
