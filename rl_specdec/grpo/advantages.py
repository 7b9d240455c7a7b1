"""Group-normalised advantages (GRPO).

For a prompt with G samples and rewards r_1..r_G, each sample's advantage is
(r_i - mean(r)) / (std(r) + eps) (or just r_i - mean(r) without std
normalisation). A group whose samples all scored the same gets advantage 0:
it carries no learning signal.
"""

from __future__ import annotations

import torch


def group_advantages(
    rewards: torch.Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """rewards [P*G] ordered prompt-major -> advantages [P*G]."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.view(-1, group_size).float()  # [P, G]
    centred = r - r.mean(dim=1, keepdim=True)  # [P, G]
    if normalize_std:
        centred = centred / (r.std(dim=1, keepdim=True, unbiased=False) + eps)
    return centred.view(-1)  # [P*G]
