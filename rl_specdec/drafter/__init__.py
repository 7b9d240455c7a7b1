"""Online drafter training: keep a ``draft_model`` drafter on-policy while the policy learns.

See :mod:`rl_specdec.drafter.trainer` for the loss, the data and where it runs.
"""

from rl_specdec.drafter.trainer import DrafterTrainer, RayDrafter, distill_batch

__all__ = ["DrafterTrainer", "RayDrafter", "distill_batch"]
