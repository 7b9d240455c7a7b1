"""The torch policy: a Hugging Face causal LM in a Ray actor that trains.

The loop reaches it through :class:`PolicyInterface` (log-probs, one train
step, a state dict for refit, checkpoints), so a multi-GPU FSDP2 group can
stand in for the single CPU actor. The loss is *given* to ``train_step`` by
the caller: this package knows nothing of GRPO.

Batch layout (right-padded, ``N`` sequences of length ``T``)::

    input_ids      [N, T]    prompt + response token ids
    attention_mask [N, T]    1 on real tokens
    loss_mask      [N, T-1]  1 where token t+1 is a response token (the ones we score)
    + any per-token [N, T-1] or per-sequence [N] tensors the loss needs

``token_logprobs[n, t]`` is log p(input_ids[n, t+1] | input_ids[n, :t+1]).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
import torch.nn.functional as F

# loss_fn(token_logprobs [n, T-1], micro_batch, ref_logprobs or None) -> (scalar loss, {name: scalar tensor})
LossFn = Callable[[torch.Tensor, dict[str, torch.Tensor], torch.Tensor | None], tuple[torch.Tensor, dict[str, torch.Tensor]]]


class PolicyInterface(Protocol):
    def train_step(self, batch: dict[str, torch.Tensor], loss_fn: LossFn) -> dict[str, float]: ...

    def get_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor: ...

    def state_dict_for_refit(self) -> Any: ...

    def save_checkpoint(self, path: str) -> None: ...

    def load_checkpoint(self, path: str) -> None: ...


def token_logprobs_and_entropy(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, with_entropy: bool = False):
    """Log-prob of each next token [N, T-1] (and the policy's entropy there, no grad)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()  # [N, T-1, V]
    logp_all = F.log_softmax(logits, dim=-1)  # [N, T-1, V]
    logp = logp_all.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # [N, T-1]
    if not with_entropy:
        return logp, None
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)  # [N, T-1]
    return logp, entropy


def _dtype(name: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return getattr(torch, name)


class PolicyWorker:
    """One process, one model. Wrapped with ``ray.remote`` by :class:`RayPolicy`."""

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "auto",
        learning_rate: float = 1e-4,
        weight_decay: float = 0.0,
        max_grad_norm: float = 1.0,
        micro_batch_size: int = 64,
        keep_reference: bool = False,
        seed: int = 0,
        num_threads: int | None = None,
    ):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        if not torch.cuda.is_available():
            torch.set_num_threads(num_threads or os.cpu_count() or 1)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = _dtype(dtype)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype).to(self.device)
        self.model.train()
        self.ref = None
        if keep_reference:
            self.ref = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype).to(self.device).eval()
            self.ref.requires_grad_(False)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=learning_rate, weight_decay=weight_decay)
        self.max_grad_norm = max_grad_norm
        self.micro_batch_size = micro_batch_size

    def _micro_batches(self, batch: dict[str, torch.Tensor], keep_order: bool = False):
        """Length-sorted micro-batches, each trimmed to its own longest sequence.

        Sorting cuts the padding the model computes on (the batch is padded to
        its longest rollout, the micro-batches only to theirs). The loss is
        normalised by the whole batch's token count, so order does not matter
        for training; ``keep_order`` keeps input order for log-prob outputs.
        Yields (indices, micro_batch).
        """
        lengths = batch["attention_mask"].sum(1)  # [N]
        n = lengths.shape[0]
        order = torch.arange(n) if keep_order else torch.argsort(lengths, descending=True, stable=True)
        for s in range(0, n, self.micro_batch_size):
            idx = order[s : s + self.micro_batch_size]
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
        for idx, mb in self._micro_batches(batch, keep_order=True):
            lp = token_logprobs_and_entropy(self.model, mb["input_ids"], mb["attention_mask"])[0]
            out[idx, : lp.shape[1]] = (lp * mb["attention_mask"][:, 1:]).cpu()  # 0 where t+1 is padding
        self.model.train()
        return out

    def train_step(self, batch: dict[str, torch.Tensor], loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step over the whole batch (gradient accumulation over micro-batches).

        ``loss_fn`` must normalise by the whole batch (e.g. divide by the
        batch's total response tokens), so summing micro-batch losses gives
        the full-batch loss.
        """
        t0 = time.time()
        self.opt.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        ntok = float(batch["loss_mask"].sum())
        ent_sum = 0.0
        for _, mb in self._micro_batches(batch):
            logp, entropy = token_logprobs_and_entropy(self.model, mb["input_ids"], mb["attention_mask"], with_entropy=True)
            ref_logp = None
            if self.ref is not None:
                with torch.no_grad():
                    ref_logp, _ = token_logprobs_and_entropy(self.ref, mb["input_ids"], mb["attention_mask"])
            loss, metrics = loss_fn(logp, mb, ref_logp)
            loss.backward()
            ent_sum += float((entropy * mb["loss_mask"]).sum())
            for k, v in metrics.items():  # "*_max" metrics reduce by max, the rest by sum
                sums[k] = max(sums.get(k, 0.0), float(v)) if k.endswith("_max") else sums.get(k, 0.0) + float(v)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.opt.step()
        out = dict(sums)  # the loss function's metrics are already batch-normalised sums
        out["entropy"] = ent_sum / max(ntok, 1.0)
        out["grad_norm"] = float(grad_norm)
        out["step_time_s"] = time.time() - t0
        return out

    def state_dict_for_refit(self) -> dict[str, torch.Tensor]:
        """Hugging Face-named CPU tensors in the policy's dtype."""
        return {k: v.detach().to("cpu") for k, v in self.model.state_dict().items()}

    def save_checkpoint(self, path: str) -> None:
        """Write model + optimizer into ``path`` (a fresh folder chosen by the caller)."""
        p = Path(path)
        p.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(p / "model", safe_serialization=True)
        torch.save({"optimizer": self.opt.state_dict(), "torch_rng": torch.get_rng_state()}, p / "optimizer.pt")

    def load_checkpoint(self, path: str) -> None:
        from safetensors.torch import load_file

        p = Path(path)
        state = {}
        for f in sorted((p / "model").glob("*.safetensors")):
            state.update(load_file(str(f)))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        tied = {"lm_head.weight"} if getattr(self.model.config, "tie_word_embeddings", False) else set()
        if set(missing) - tied or unexpected:
            raise RuntimeError(f"checkpoint {p} does not match the policy: missing {missing}, unexpected {unexpected}")
        extra = torch.load(p / "optimizer.pt", weights_only=False)
        self.opt.load_state_dict(extra["optimizer"])
        torch.set_rng_state(extra["torch_rng"])


class RayPolicy:
    """The single-actor policy group used on CPU (and on one GPU)."""

    def __init__(self, model_path: str, num_gpus: float = 0, **kwargs):
        import ray

        self.actor = ray.remote(PolicyWorker).options(num_cpus=0, num_gpus=num_gpus).remote(model_path, **kwargs)

    def train_step(self, batch, loss_fn) -> dict[str, float]:
        import ray

        return ray.get(self.actor.train_step.remote(batch, loss_fn))

    def get_logprobs(self, batch) -> torch.Tensor:
        import ray

        return ray.get(self.actor.get_logprobs.remote(batch))

    def state_dict_for_refit(self):
        """An ObjectRef to the state dict: engines fetch it straight from Ray's object store."""
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
