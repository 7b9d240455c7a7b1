"""Distil the drafter towards the policy on the tokens each step just generated.

Targets: the policy's top-k next-token log-probs at every generated position.
vLLM returns them with the rollouts (``SamplingSettings.logprobs = top_k``:
the *target* model's raw distribution, speculation or not), so they cost no
extra policy forward, and a 150k vocabulary costs k numbers per token. They
are the distribution of the policy that generated the step, one update behind
the policy that generates the next one: a lag far smaller than a drafter that
is never refit.

Loss, per generated position t with top-k ids ``j`` and policy log-probs
``l_j`` (renormalised over the top k: ``p_j = softmax(l)_j``)::

    loss = - sum_j p_j log q(j | prefix_t)          (soft cross-entropy)
    kl   =   sum_j p_j (log p_j - log q(j | prefix_t))  (logged as drafter/kl)

averaged over positions. The drafter follows ``policy.precision``
(:mod:`rl_specdec.policy.precision`): under bf16-mixed it keeps fp32 weights
and AdamW state, computes under bf16 autocast and sends its refit in the
engines' dtype. :class:`DrafterTrainer` is plain torch (one process);
:class:`RayDrafter` runs it in its own Ray actor, so its step can overlap the
policy's update (``drafter_training.overlap``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from rl_specdec.config.generation import DrafterTrainingConfig
from rl_specdec.policy import precision as prec


def distill_batch(
    sequences: list[tuple[list[int], list[tuple[int, list[dict[int, float]]]]]], top_k: int, pad_id: int
) -> dict[str, torch.Tensor]:
    """Right-padded sequences and, at each position that predicts a generated token, the policy's top-k ids and
    log-probs.

    ``sequences[i]``: sample i's token ids and its spans of generated tokens, each ``(start, tops)``: ``tops[j]``
    is vLLM's dict for token ``start + j`` (it may also hold the sampled token when that fell outside the top k).
    A single-turn rollout is one span after its prompt; an episode has one per model turn.
    """
    n, t = len(sequences), max(len(ids) for ids, _ in sequences)
    input_ids = torch.full((n, t), pad_id, dtype=torch.long)  # [N, T]
    attention_mask = torch.zeros((n, t), dtype=torch.long)  # [N, T]
    mask = torch.zeros((n, t - 1))  # [N, T-1]  1 where position t predicts a generated token
    top_ids = torch.zeros((n, t - 1, top_k), dtype=torch.long)  # [N, T-1, K]
    top_lp = torch.full((n, t - 1, top_k), -1e9)  # [N, T-1, K]
    for i, (ids, spans) in enumerate(sequences):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention_mask[i, : len(ids)] = 1
        for start, tops in spans:
            for j, step in enumerate(tops[: len(ids) - start]):
                ranked = sorted(step.items(), key=lambda kv: -kv[1])[:top_k]
                pos = start - 1 + j  # the position whose next token is start + j
                mask[i, pos] = 1
                top_ids[i, pos, : len(ranked)] = torch.tensor([k for k, _ in ranked])
                top_lp[i, pos, : len(ranked)] = torch.tensor([v for _, v in ranked])
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "mask": mask,
        "top_ids": top_ids,
        "top_logprobs": top_lp,
    }


def distill_loss(logits: torch.Tensor, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(soft cross-entropy, KL(policy || drafter) on the top-k support), averaged over masked positions."""
    logq = F.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, mb["top_ids"])  # [n, T-1, K]
    logp = F.log_softmax(mb["top_logprobs"], dim=-1)  # [n, T-1, K]  renormalised over the top k
    p = logp.exp()
    mask = mb["mask"]  # [n, T-1]
    denom = mask.sum().clamp(min=1)
    ce = -((p * logq).sum(-1) * mask).sum() / denom
    kl = ((p * (logp - logq)).sum(-1) * mask).sum() / denom
    return ce, kl.detach()


class DrafterTrainer:
    """The drafter's torch model and AdamW, in one process."""

    def __init__(
        self,
        model_path: str,
        cfg: DrafterTrainingConfig,
        precision: str = "fp32",
        seed: int = 0,
        num_threads: int | None = None,
        engine_dtype: str | None = None,
    ):
        """``precision``: the policy's (resolved); ``engine_dtype``: what the refit sends (default: the
        precision's compute dtype)."""
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        if not torch.cuda.is_available():
            torch.set_num_threads(num_threads or os.cpu_count() or 1)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.compute = prec.compute(precision, self.device, fsdp2=False)
        self.refit_dtype = prec.dtype(engine_dtype or prec.COMPUTE[precision])
        self.model = (
            AutoModelForCausalLM.from_pretrained(model_path, dtype=prec.dtype(prec.MASTER[precision]))
            .to(self.device)
            .train()
        )
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr_for("draft_model"), weight_decay=0.0)
        self.cfg = cfg
        self.version = 0  # drafter refits so far

    def train(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """``steps_per_update`` optimizer steps on one step's rollouts; returns loss, KL (before) and time."""
        t0 = time.time()
        n, first = batch["input_ids"].shape[0], {}
        for step in range(self.cfg.steps_per_update):
            self.opt.zero_grad(set_to_none=True)
            for s in range(0, n, self.cfg.micro_batch_size):
                mb = {k: v[s : s + self.cfg.micro_batch_size].to(self.device) for k, v in batch.items()}
                with self.compute(mb["input_ids"].shape[1]):
                    logits = self.model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
                ce, kl = distill_loss(logits, mb)
                share = mb["mask"].sum() / batch["mask"].sum().clamp(min=1)  # micro-batches add up to the batch mean
                (ce * share).backward()
                if step == 0:
                    first["loss"] = first.get("loss", 0.0) + float(ce.detach() * share)
                    first["kl"] = first.get("kl", 0.0) + float(kl * share)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
        self.version += 1
        return {**first, "version": float(self.version), "time_s": time.time() - t0}

    def state_dict_for_refit(self) -> dict[str, torch.Tensor]:
        """CPU tensors in the engines' dtype (the master weights stay as they are)."""
        return {
            k: v.detach().to("cpu", self.refit_dtype if v.is_floating_point() else v.dtype)
            for k, v in self.model.state_dict().items()
        }

    def save_checkpoint(self, path: str) -> None:
        p = Path(path)
        p.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(p / "model", safe_serialization=True)
        torch.save({"optimizer": self.opt.state_dict(), "version": self.version}, p / "optimizer.pt")

    def load_checkpoint(self, path: str) -> None:
        from safetensors.torch import load_file

        p = Path(path)
        state: dict[str, torch.Tensor] = {}
        for f in sorted((p / "model").glob("*.safetensors")):
            state.update(load_file(str(f)))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        if set(missing) - {"lm_head.weight"} or unexpected:
            raise RuntimeError(
                f"drafter checkpoint {p} does not match the drafter: missing {missing}, unexpected {unexpected}"
            )
        extra = torch.load(p / "optimizer.pt", weights_only=False)
        self.opt.load_state_dict(extra["optimizer"])
        self.version = int(extra["version"])


class RayDrafter:
    """A :class:`DrafterTrainer` in its own Ray actor; ``train`` returns at once, ``result`` waits."""

    def __init__(
        self,
        model_path: str,
        cfg: DrafterTrainingConfig,
        precision: str,
        seed: int,
        num_gpus: float = 0,
        engine_dtype: str | None = None,
    ):
        import ray

        self.actor = (
            ray.remote(DrafterTrainer)
            .options(num_cpus=0, num_gpus=num_gpus)
            .remote(model_path, cfg, precision, seed, engine_dtype=engine_dtype)
        )
        self._pending = None

    def train(self, batch: dict[str, torch.Tensor]) -> None:
        self._pending = self.actor.train.remote(batch)

    def result(self) -> dict[str, float] | None:
        """The metrics of the last ``train`` (waits for it); None if none is pending."""
        import ray

        ref, self._pending = self._pending, None
        return None if ref is None else ray.get(ref)

    def state_dict_for_refit(self):
        return self.actor.state_dict_for_refit.remote()

    def save_checkpoint(self, path: str) -> None:
        import ray

        ray.get(self.actor.save_checkpoint.remote(path))

    def load_checkpoint(self, path: str) -> None:
        import ray

        ray.get(self.actor.load_checkpoint.remote(path))

    def shutdown(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)
