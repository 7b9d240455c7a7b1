"""One policy process: a Hugging Face causal LM, its AdamW optimizer and an
optional frozen reference copy.

Alone (``start()`` with the defaults) it is the whole trainer, in this
process or in one Ray actor. In a :class:`~rl_specdec.policy.group.PolicyGroup`
every worker runs the same code on its shard of the batch, and
torch.distributed (:mod:`rl_specdec.policy.distributed`) makes them one
data-parallel trainer: DDP replicas or FSDP2 shards. The batch layout and
the loss contract are in :mod:`rl_specdec.policy.interface`.
"""

from __future__ import annotations

import functools
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
import torch.distributed as dist

from rl_specdec.policy import precision, state
from rl_specdec.policy.distributed import (
    free_port,
    grad_sync,
    init_process_group,
    needs_process_group,
    reduce_metrics,
    shard_frozen,
    wrap_for_training,
)
from rl_specdec.policy.interface import LossFn
from rl_specdec.policy.prefix import find_prefixes, group_order, score_shared, shared_tokens
from rl_specdec.policy.scoring import output_head, token_logprobs_and_entropy

if TYPE_CHECKING:
    from rl_specdec.config import PolicyConfig


# A batch's prompts are computed once per group where that leaves at most this share of the tokens sorted rows
# pad to: the shared path runs two forwards a micro-batch and pads in groups (benchmarks/studies/train_phase.py).
SHARE_PAYS = 0.75


class PolicyWorker:
    """One process of the policy. Build it, then ``start()`` it (the group starts its actors in two steps
    because rank 0's address must be known before any worker joins the process group)."""

    def __init__(self, config: PolicyConfig, *, keep_reference: bool = False, seed: int = 0):
        if config.precision == "auto" or config.device == "auto":
            raise ValueError(
                f"policy.precision={config.precision!r}, policy.device={config.device!r}: 'auto' is resolved once, "
                "when the config is loaded (rl_specdec.config.resolve_device_and_dtype); pass a loaded or resolved "
                "PolicyConfig"
            )
        self.config = config
        self.keep_reference = keep_reference
        self.seed = seed
        self.tokenizer_source: str | None = None  # set by a load from a folder or hub id; not by from_module
        self.tokenizer = None  # read from tokenizer_source at the first checkpoint
        self.rank, self.world_size = 0, 1

    def node_info(self) -> dict[str, Any]:
        """Where this worker runs (it names the worker in errors) and a free port for the rendezvous."""
        import socket

        import ray

        return {
            "ip": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "host_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
            "free_port": free_port(),
        }

    def start(
        self,
        rank: int = 0,
        world_size: int = 1,
        master_addr: str = "127.0.0.1",
        master_port: int = 0,
        *,
        num_threads: int | None = None,
        local_rank: int = 0,
    ) -> None:
        """Join the process group (if any), load the model, shard or replicate it, build the optimizer."""
        cfg = self.config
        torch.manual_seed(self.seed)
        if cfg.device == "cuda":  # a reserved GPU is cuda:0 in this actor; a shared node's GPUs go by local rank
            self.device = torch.device("cuda", local_rank if cfg.gpus_per_worker == 0 else 0)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
            torch.set_num_threads(num_threads or cfg.num_threads or os.cpu_count() or 1)
        self.rank, self.world_size = rank, world_size
        if needs_process_group(world_size, cfg.strategy):
            init_process_group(rank, world_size, master_addr, master_port, self.device)
        # the frozen reference needs no master copy: it is loaded in the compute dtype
        master, frozen = precision.MASTER[cfg.precision], precision.COMPUTE[cfg.precision]
        # AdamW's state takes the parameters' dtype
        adamw = functools.partial(torch.optim.AdamW, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
        model = self._load(master)
        layers = model.config.num_hidden_layers
        self._attach(model, adamw, functools.partial(self._load, frozen) if self.keep_reference else None)
        self.head = trained_head(cfg, self.device, self.refit_dtype, layers)

    def _load(self, dtype: str) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.config.model_name, dtype=precision.dtype(dtype))
        self.tokenizer_source = self.config.model_name  # a checkpoint carries the tokenizer of the model it trains
        return model.to(self.device)

    @classmethod
    def from_module(
        cls, config: PolicyConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> PolicyWorker:
        """A started single-process worker around an in-memory ``model`` and its ``optimizer`` (tests).

        The same micro-batching, train step and loss contract as a loaded
        worker; ``config`` gives ``micro_batch_size``, ``max_grad_norm`` and the
        precision's compute (bf16 autocast for bf16-mixed) and refit dtype (its
        model, device and optimizer settings are not used: the model stays
        where it is, in the dtype it has). ``model(input_ids=..., attention_mask=...)``
        must return an object with ``.logits`` [N, T, V]. It joins no process
        group: in a process without torch.distributed the model is trained as
        it is (neither wrapped nor sharded). No reference model is kept.
        """
        self = cls(config)
        self.device = next(model.parameters()).device
        self._attach(model, lambda _params: optimizer, load_reference=None)
        self.head = None
        return self

    def _attach(
        self,
        model: torch.nn.Module,
        make_optimizer: Callable[[Iterator[torch.nn.Parameter]], torch.optim.Optimizer],
        load_reference: Callable[[], torch.nn.Module] | None,
    ) -> None:
        """The one path from a model to a trainable worker, whoever built the model.

        The model is wrapped (DDP) or sharded (FSDP2) first; the frozen
        reference is loaded only then, so one unsharded model sits in memory
        at a time; the optimizer is built last, over the parameters as
        sharding left them.
        """
        cfg = self.config
        fsdp2 = cfg.strategy == "fsdp2" and dist.is_initialized()
        # FSDP2 casts through its MixedPrecisionPolicy instead
        self.compute = precision.compute(cfg.precision, self.device, fsdp2)
        self.refit_dtype = precision.dtype(precision.engine_dtype(cfg))
        self.model = model
        self.model.train()
        # DDP wrapper, or the FSDP2-sharded model
        self.train_model = wrap_for_training(
            self.model, cfg.strategy, self.device, precision.fsdp2_policy(cfg.precision)
        )
        self.ref = None
        if load_reference is not None:
            ref = load_reference().eval()
            ref.requires_grad_(False)
            self.ref = shard_frozen(ref, cfg.strategy, self.device)
        self.opt = make_optimizer(self.model.parameters())

    def _layout(self, batch: dict[str, torch.Tensor], keep_order: bool = False, share: bool = False):
        """(row order [N], micro-batch bounds, whether each prompt is computed once for its rows).

        Sorting by length cuts the padding the model computes on (the batch is padded to its longest rollout,
        the micro-batches only to theirs), and :func:`balanced_split` cuts the sorted rows where the padded
        tokens add up least, never past the tokens a full micro-batch of the longest rows holds. The count of
        micro-batches stays ``ceil(N / micro_batch_size)``: data-parallel workers run as many forwards each.
        ``share`` keeps each prompt's rows together instead (:func:`rl_specdec.policy.prefix.group_order`), in
        even slices, where that computes at most ``SHARE_PAYS`` of the tokens (short prompts and long-tailed
        responses pad more in groups than sorted). ``keep_order`` keeps input order in even slices (log-probs).
        """
        lengths = batch["attention_mask"].sum(1)  # [N]
        n, size = lengths.shape[0], self.config.micro_batch_size
        even = list(range(0, n, size)) + [n]
        if keep_order:
            return torch.arange(n), even, False
        order = torch.argsort(lengths, descending=True, stable=True)
        bounds = balanced_split(lengths[order].tolist(), math.ceil(n / size), size * int(lengths.max()))
        if share:
            grouped = group_order(batch["input_ids"], batch["loss_mask"], lengths)
            plain = sum((b - a) * int(lengths[order[a]]) for a, b in zip(bounds[:-1], bounds[1:]))
            if shared_tokens(batch["input_ids"], batch["loss_mask"], lengths, grouped, even) <= SHARE_PAYS * plain:
                return grouped, even, True
        return order, bounds, False

    def micro_batches(self, batch: dict[str, torch.Tensor]):
        """The micro-batches a train step runs ``batch`` in (:meth:`_layout`'s order and cuts): (indices,
        micro_batch)."""
        return self._micro_batches(batch, self._layout(batch))

    def _micro_batches(self, batch: dict[str, torch.Tensor], layout: tuple):
        """The micro-batches of a :meth:`_layout`, each trimmed to its own longest sequence. The loss is
        normalised by the whole batch's token count, so order does not matter for training.
        Yields (indices, micro_batch)."""
        lengths = batch["attention_mask"].sum(1)  # [N]
        order, bounds, _ = layout
        for a, b in zip(bounds[:-1], bounds[1:]):
            idx = order[a:b]
            t = int(lengths[idx].max())
            mb = {}
            for k, v in batch.items():
                v = v[idx]
                if v.dim() == 2:  # [n, T] or [n, T-1]: trim to this micro-batch's length
                    v = v[:, : t if v.shape[1] == batch["input_ids"].shape[1] else t - 1]
                mb[k] = v.to(self.device)
            yield idx, mb

    @torch.no_grad()
    def get_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        self.model.eval()
        n, t = batch["input_ids"].shape
        out = torch.zeros(n, t - 1)  # [N, T-1]
        for idx, mb in self._micro_batches(batch, self._layout(batch, keep_order=True)):
            lp = token_logprobs_and_entropy(self.model, mb["input_ids"], mb["attention_mask"], compute=self.compute)[0]
            out[idx, : lp.shape[1]] = lp.cpu()  # every real token scored; 0 where t+1 is padding
        self.model.train()
        return out

    def train_step(self, batch: dict[str, torch.Tensor], loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step over this worker's batch (gradient accumulation over micro-batches).

        ``loss_fn`` must normalise by the whole (global) batch, e.g. divide by
        its total response tokens, so summing micro-batch losses, and the
        workers' gradients, gives the full-batch loss. Gradients are reduced
        across workers on the last micro-batch only; metrics are reduced too,
        so every worker returns the whole batch's figures.
        """
        t0 = time.time()
        self.opt.zero_grad(set_to_none=True)
        head_on = self.head is not None and self.head.due()
        if head_on:
            self.head.begin(self.model)
        sums, maxes = self._forward_backward(batch, loss_fn, head_on, sync=True)
        forward_backward_s = time.time() - t0
        sums, maxes = reduce_metrics(sums, maxes, self.device)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        self.opt.step()
        if self.head is not None:
            self.head.end(trained=head_on)
        ntok = sums.pop("num_tokens")
        out = {**sums, **maxes}  # the loss function's metrics are already batch-normalised sums
        out["entropy"] = sums["entropy"] / max(ntok, 1.0)
        out["grad_norm"] = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        out["step_time_s"] = time.time() - t0
        out["forward_backward_s"] = forward_backward_s  # the head's reading and learning included, when it trains
        return out

    def _forward_backward(self, batch, loss_fn: LossFn, head_on: bool, sync: bool):
        """Every micro-batch's forward and backward (the head learning from the forward when ``head_on``);
        gradients accumulate, reduced across workers on the last one when ``sync``. The metrics' sums and maxes."""
        sums: dict[str, float] = {"entropy": 0.0, "num_tokens": float(batch["loss_mask"].sum())}
        maxes: dict[str, float] = {}
        last = math.ceil(batch["input_ids"].shape[0] / self.config.micro_batch_size) - 1  # as many as it yields
        # a head learns from every position's hidden states; DDP and FSDP2 (even one FSDP2 worker) expect one
        # forward per backward
        layout = self._layout(batch, share=self.config.share_prefix and not dist.is_initialized() and not head_on)
        share = layout[2]
        for i, (_, mb) in enumerate(self._micro_batches(batch, layout)):
            with grad_sync(self.train_model, enabled=sync and i == last):
                learn = functools.partial(self.head.learn, mb=mb) if head_on else None
                logp, entropy = self._score(self.train_model, mb, share, with_entropy=True, features=learn)
                ref_logp = None
                if self.ref is not None:
                    with torch.no_grad():
                        ref_logp, _ = self._score(self.ref, mb, share)
                loss, metrics = loss_fn(logp, mb, ref_logp)
                loss.backward()
            sums["entropy"] += float((entropy * mb["loss_mask"]).sum())
            for k, v in metrics.items():  # "*_max" metrics reduce by max, the rest by sum
                if k.endswith("_max"):
                    maxes[k] = max(maxes.get(k, 0.0), float(v))
                else:
                    sums[k] = sums.get(k, 0.0) + float(v)
        return sums, maxes

    def forward_backward_time(self, batch: dict[str, torch.Tensor], loss_fn: LossFn) -> float:
        """Seconds of this batch's forwards and backwards as an update without the head runs them; the gradients
        are dropped and nothing steps. An update's ``forward_backward_s`` less this, on the same batch, is what its
        head added to it (the paired benchmark charges that to the head's variant alone)."""
        t0 = time.time()
        self._forward_backward(batch, loss_fn, head_on=False, sync=False)
        seconds = time.time() - t0
        self.opt.zero_grad(set_to_none=True)
        if self.head is not None:
            self.head.opt.zero_grad(set_to_none=True)
        return seconds

    def _score(self, model, mb: dict[str, torch.Tensor], share: bool, with_entropy: bool = False, features=None):
        """Log-probs (and entropy) [n, T-1] of the response tokens only: the loss reads nothing else. With
        ``share``, each prompt's tokens are computed once for the rows that share it (rl_specdec.policy.prefix)."""
        scored = mb["loss_mask"] > 0  # [n, T-1]
        prefixes = find_prefixes(mb["input_ids"], scored) if share and output_head(model) is not None else None
        if prefixes is None:
            return token_logprobs_and_entropy(
                model, mb["input_ids"], mb["attention_mask"], with_entropy, self.compute, features, scored
            )
        return score_shared(model, mb["input_ids"], mb["attention_mask"], scored, prefixes, with_entropy, self.compute)

    def state_dict_for_refit(self) -> dict[str, torch.Tensor] | None:
        """The whole Hugging Face-named state dict, CPU tensors in the engines' dtype (rank 0; None elsewhere)."""
        whole = state.as_dict(state.full_state_items(self.model, self.refit_dtype))
        return whole if self.rank == 0 else None

    def state_dict_buckets(self, max_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
        """The same tensors in dicts of at most ``max_bytes``, one at a time (rank 0 yields; the others only gather)."""
        yield from state.bucketed(state.full_state_items(self.model, self.refit_dtype), max_bytes)

    def save_checkpoint(self, path: str) -> None:
        """Write model + optimizer into ``path`` (a fresh folder chosen by the caller), whatever the worker count.
        The master weights and AdamW state as they are kept (float32 under fp32 and bf16-mixed). The policy's
        tokenizer goes beside the model, so ``path/model`` loads, and serves, as the checkpoint it started from."""
        state.save(self.model, self.opt, path)
        if self.rank == 0 and self.head is not None:
            self.head.save(Path(path) / "head")
        if self.rank == 0 and self.tokenizer_source:
            if self.tokenizer is None:  # read once: every checkpoint writes the same one
                from transformers import AutoTokenizer

                self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_source)
            self.tokenizer.save_pretrained(f"{path}/model")

    def load_checkpoint(self, path: str) -> None:
        state.load(self.model, self.opt, path)
        if self.head is not None and (Path(path) / "head").is_dir():  # else: the configured head (a warning upstream)
            self.head.load(Path(path) / "head")

    # ---- an EAGLE-3 head trained beside the policy (rl_specdec.heads.training) --------------------
    def head_result(self) -> dict[str, float]:
        """The last head step's metrics on this worker's shard ({} before the first)."""
        return dict(self.head.result) if self.head is not None else {}

    def head_state_dict_for_refit(self) -> dict[str, torch.Tensor] | None:
        return self.head.state_dict_for_refit() if self.head is not None else None


def trained_head(cfg: PolicyConfig, device: torch.device, refit_dtype: torch.dtype, target_layers: int):
    """The head this worker trains: drafter_training on an eagle3 engine; else None. ``target_layers``: the
    policy's, for a published head that names no aux layers (vLLM then reads its default ones)."""
    spec = cfg.generation.speculation
    if not (cfg.generation.drafter_training.enabled and spec is not None and spec.is_head):
        return None
    from rl_specdec.heads.training import HeadTrainer

    bf16 = precision.COMPUTE[cfg.precision] == "bfloat16"
    return HeadTrainer(spec.model, cfg.generation.drafter_training, device, refit_dtype, bf16, target_layers)


def balanced_split(lengths: list[int], parts: int, budget: int) -> list[int]:
    """Where to cut rows sorted by length, longest first, into ``parts`` contiguous micro-batches so that the
    padded tokens (rows x the first row's length, summed) are fewest, with no micro-batch over ``budget``
    padded tokens. Returns the ``parts + 1`` bounds, 0 first and ``len(lengths)`` last.

    Dynamic programming over the cut points: best[m, i] is the least padding that covers rows [0, i) with m
    micro-batches; a table of n x n costs per m (n = 512 at most here: milliseconds)."""
    n = len(lengths)
    parts = max(1, min(parts, n))
    length = torch.tensor(lengths, dtype=torch.float64)  # [n]
    j, i = torch.arange(n)[:, None], torch.arange(n + 1)[None, :]
    cost = (i - j) * length[:, None]  # [n, n+1]: rows [j, i) padded to row j's length
    cost[(i <= j) | (cost > budget)] = math.inf
    best = torch.full((n + 1,), math.inf, dtype=torch.float64)
    best[0] = 0.0
    choice = []
    for _ in range(parts):
        total = best[:n, None] + cost  # [n, n+1]: the last micro-batch starts at row j
        best, arg = total.min(0)
        choice.append(arg)
    if not math.isfinite(float(best[n])):  # the budget cannot be kept with so few parts: cut evenly
        size = math.ceil(n / parts)
        return sorted({min(n, k * size) for k in range(parts + 1)})
    bounds = [n]
    for arg in reversed(choice):
        bounds.append(int(arg[bounds[-1]]))
    return bounds[::-1]
