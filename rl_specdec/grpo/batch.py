"""Trajectories and the train batch built from them, for single-turn and multi-turn rollouts alike.

A :class:`Trajectory` is one token sequence (prompt, model turns and whatever
came between them: tool results, user turns) plus, for each model turn, where
it starts, the ids the engine generated there and their log-probs. A
single-turn rollout is the case of one turn that starts after the prompt.

:func:`build_train_batch` right-pads trajectories into the policy worker's
layout (rl_specdec/policy/worker.py); the loss covers every model turn's
tokens and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Trajectory:
    token_ids: list[int]  # the whole sequence the policy scores
    turns: list[tuple[int, list[int], list[float]]]  # (start, generated ids, their log-probs) per model turn

    @classmethod
    def single_turn(cls, prompt_ids: list[int], gen_ids: list[int], gen_logprobs: list[float]) -> "Trajectory":
        return cls(list(prompt_ids) + list(gen_ids), [(len(prompt_ids), list(gen_ids), list(gen_logprobs))])

    def check(self) -> None:
        for start, ids, lps in self.turns:
            if start < 1 or self.token_ids[start : start + len(ids)] != ids or len(lps) != len(ids):
                raise ValueError(
                    f"a model turn at position {start} ({len(ids)} ids, {len(lps)} log-probs) does not match the "
                    "trajectory's tokens there: the multi-turn prompt did not keep the model's own tokens"
                )


def select_for_training(advantages: torch.Tensor, skip_zero: bool) -> list[int]:
    """Indices of the samples to train on: those with a non-zero advantage (all if none or if not skipping)."""
    keep = torch.nonzero(advantages != 0).flatten().tolist() if skip_zero else []
    return keep or list(range(advantages.numel()))


def build_train_batch(trajectories: list[Trajectory], advantages: torch.Tensor, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded tensors for the policy worker; ``advantages`` [N] is one value per trajectory."""
    n, t = len(trajectories), max(len(x.token_ids) for x in trajectories)
    input_ids = torch.full((n, t), pad_id, dtype=torch.long)  # [N, T]
    attention_mask = torch.zeros((n, t), dtype=torch.long)  # [N, T]
    loss_mask = torch.zeros((n, t - 1))  # [N, T-1]
    gen_logprobs = torch.zeros((n, t - 1))  # [N, T-1]
    for i, x in enumerate(trajectories):
        x.check()
        input_ids[i, : len(x.token_ids)] = torch.tensor(x.token_ids)
        attention_mask[i, : len(x.token_ids)] = 1
        for start, ids, lps in x.turns:
            # position t predicts token t+1: a turn's tokens sit at start .. start+len-1
            loss_mask[i, start - 1 : start - 1 + len(ids)] = 1
            gen_logprobs[i, start - 1 : start - 1 + len(ids)] = torch.tensor(lps)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "gen_logprobs": gen_logprobs,
        "advantages": advantages.float(),  # [N]
        "batch_num_tokens": torch.full((n,), float(loss_mask.sum().clamp(min=1))),  # [N]
    }
