"""The trainable torch policy: one worker process, or a data-parallel group of Ray actors, behind one interface."""

from rl_specdec.errors import PolicyWorkerDied
from rl_specdec.policy.group import PolicyGroup
from rl_specdec.policy.interface import LossFn, PolicyInterface
from rl_specdec.policy.scoring import token_logprobs_and_entropy
from rl_specdec.policy.worker import PolicyWorker

__all__ = ["LossFn", "PolicyGroup", "PolicyInterface", "PolicyWorker", "PolicyWorkerDied", "token_logprobs_and_entropy"]
