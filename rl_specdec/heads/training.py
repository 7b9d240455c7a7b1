"""An EAGLE-3 head trained inside the policy worker, from the forward the policy's update already runs.

The GRPO update's forward over a micro-batch returns, besides the policy's
logits, the hidden states the head reads (``output_hidden_states``). They
are detached, as is the policy's next-token distribution the head learns,
so the head's loss sends no gradient into the policy: the head has its own
AdamW and its own backward, run right after the forward. Data-parallel
workers each learn on their shard and all-reduce the head's gradients (the
head is replicated, never sharded: it is one layer). Its embedding and LM head
are the policy's, read at the start of the step (gathered from FSDP2's shards
where needed) and never trained here.

Schedule: every ``drafter_training.every``-th update, one head step over all
of the update's micro-batches; ``chain_steps`` is the training-time-test
depth (the ``k`` the head learns to draft). The head's weights go to the
engines after the policy's refit (``rl_specdec.drafter.upkeep``).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from rl_specdec.heads.eagle3 import load_head, micro_batch_loss, save_head


def _full(p: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value, detached (an FSDP2 shard is gathered: every rank must call this)."""
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()


class HeadTrainer:
    def __init__(self, folder: str, training, device, refit_dtype, bf16: bool = False, target_layers=None):
        self.bf16 = bf16  # the policy computes in bf16: so does the head (its weights and AdamW stay fp32)
        self.head = load_head(folder, target_layers).to(device).train()
        self.opt = torch.optim.AdamW(self.head.parameters(), lr=training.lr_for("eagle3"), weight_decay=0.0)
        self.every, self.chain_steps, self.refit_dtype = training.every, training.chain_steps, refit_dtype
        self.updates_seen = 0  # policy updates so far: the schedule counts them
        self.version = 0  # head steps taken
        self.result: dict[str, float] = {}
        self._embed = self._lm_head = None
        self._sums: dict[str, float] = {}

    def due(self) -> bool:
        return (self.updates_seen + 1) % self.every == 0

    def begin(self, model: torch.nn.Module) -> None:
        """Read the policy's embedding and LM head for this step (before its update changes them)."""
        self._embed = _full(model.get_input_embeddings().weight).float()
        self._lm_head = _full(model.get_output_embeddings().weight).float()
        self._sums, self._busy = {"loss": 0.0, "tokens": 0.0}, 0.0
        self.opt.zero_grad(set_to_none=True)

    def learn(self, hidden_states, target: torch.Tensor, mb: dict[str, torch.Tensor]) -> None:
        """One micro-batch: the head's loss on the policy's detached features, backward into the head only.

        hidden_states: the policy's (embeddings, layer 1, ...), each [n, T, H]; target [M, V]: the policy's
        log-probs at the response positions, in row-major order of mb["loss_mask"];
        mb["loss_mask"] [n, T-1]: 1 where token t+1 is a response token; mb["batch_num_tokens"]: the whole
        (global) batch's response tokens, so the micro-batches' and the workers' gradients sum to its mean."""
        t0 = time.time()
        if float(mb["loss_mask"].sum()) == 0:
            return
        loss, agree, tokens = micro_batch_loss(
            self.head, hidden_states, target, mb, self._embed, self._lm_head, self.chain_steps, self.bf16
        )
        (loss * tokens / float(mb["batch_num_tokens"][0])).backward()
        self._sums["loss"] += float(loss.detach()) * tokens
        self._sums["tokens"] += tokens
        for j, a in enumerate(agree):
            self._sums[f"agreement_{j + 1}"] = self._sums.get(f"agreement_{j + 1}", 0.0) + a * tokens
        self._busy += time.time() - t0

    def end(self, trained: bool) -> None:
        """Close the policy's update: the head's step (its gradients all-reduced first), or only the count."""
        self.updates_seen += 1
        if not trained:
            return
        t0 = time.time()
        if dist.is_initialized() and dist.get_world_size() > 1:
            for p in self.head.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), 1.0)
        self.opt.step()
        self.version += 1
        n = max(self._sums.pop("tokens"), 1.0)
        self.result = {k: v / n for k, v in self._sums.items()}  # this worker's shard
        step_s = time.time() - t0
        # the head's own time, and its optimizer's part (outside the update's forward_backward_s)
        self.result.update(version=float(self.version), time_s=self._busy + step_s, optimizer_s=step_s)
        self._embed = self._lm_head = None

    def state_dict_for_refit(self) -> dict[str, torch.Tensor]:
        """The head's tensors under vLLM's names, CPU, in the engines' dtype (never the policy's embedding)."""
        return {k: v.detach().to("cpu", self.refit_dtype) for k, v in self.head.vllm_state_dict().items()}

    def save(self, path: Path) -> None:
        save_head(self.head, path)
        torch.save(
            {"opt": self.opt.state_dict(), "updates_seen": self.updates_seen, "version": self.version},
            path / "trainer.pt",
        )

    def load(self, path: Path) -> None:
        self.head.load_vllm_state_dict(load_head(path).vllm_state_dict())
        saved = torch.load(path / "trainer.pt", weights_only=False)
        self.opt.load_state_dict(saved["opt"])
        self.updates_seen, self.version = saved["updates_seen"], saved["version"]
