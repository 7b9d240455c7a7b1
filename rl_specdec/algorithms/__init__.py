"""The GRPO algorithm: the loop and its pure parts (advantages, loss)."""

from rl_specdec.algorithms.advantages import group_advantages
from rl_specdec.algorithms.loss import ClippedPGLoss

__all__ = ["ClippedPGLoss", "group_advantages"]
