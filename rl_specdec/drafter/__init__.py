"""The drafter's life while the policy learns: online training, refits, the acceptance canary, the never-drafted watch.

Two drafters train online (``drafter_training``): a ``draft_model`` drafter, distilled towards the policy in its own
actor (:mod:`rl_specdec.drafter.trainer`), and an EAGLE-3 head, trained from the policy's hidden states inside the
policy's update (:mod:`rl_specdec.heads.training`). :mod:`rl_specdec.drafter.upkeep` runs either after each step.
"""

from rl_specdec.drafter.trainer import DrafterTrainer, RayDrafter, distill_batch

__all__ = ["DrafterTrainer", "RayDrafter", "distill_batch"]
