"""GRPO: the loop (:mod:`.loop`), one step in phases (:mod:`.step`), the run's parts (:mod:`.run`), and
the pure pieces: advantages, the loss, the train batch, checkpoints."""

from rl_specdec.grpo.advantages import group_advantages
from rl_specdec.grpo.loss import ClippedPGLoss

__all__ = ["ClippedPGLoss", "group_advantages"]
