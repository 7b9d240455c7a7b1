"""The trainable torch policy (a Ray actor) and the interface the loop uses."""

from rl_specdec.policy.worker import LossFn, PolicyInterface, PolicyWorker, RayPolicy, token_logprobs_and_entropy

__all__ = ["LossFn", "PolicyInterface", "PolicyWorker", "RayPolicy", "token_logprobs_and_entropy"]
