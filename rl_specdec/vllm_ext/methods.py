"""What each speculation method is, and what rl_specdec does with it: the one table that the config's checks, the
engine hooks and the drafter's upkeep read.

vLLM's own list of methods (``declarations.speculative_methods``) decides which names load; this table says, for the
names rl_specdec knows, where the drafts come from and which of rl_specdec's parts run with them. A method vLLM
declares that is not here (a newer one) loads with no capability: vLLM runs its own k, and nothing here trains,
refits or times its drafter. Nothing in this module imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

NO_MODEL_TO_TRAIN = "proposes from the prompt and history: there is no drafter model to train"


@dataclass(frozen=True)
class Method:
    name: str
    # where the drafts come from: "drafter" (a model of its own, speculative_config.model), "tokens" (the request's
    # own token ids, no model), "policy" (layers inside the policy's checkpoint: MTP), or "" (not known here)
    source: str = ""
    head: bool = False  # drafts from the target's hidden states (EAGLE-3): trains in the policy's workers
    # its drafter model has the policy's vocabulary (a head may draft over a smaller one of its own: its d2t map)
    policy_vocabulary: bool = False
    cpu: bool = False  # run by rl_specdec on vLLM's CPU backend: the ones its losslessness tests start there
    runtime_k: bool = False  # k set while the engine runs, k=0 steps as plain steps (rl_specdec.vllm_ext.model_runner)
    # run-time k turned on by speculation_control.mode=auto, and the controller (mode=adaptive): its model of a
    # step's cost and acceptance was made and tested on drafters
    controller: bool = False
    async_scheduling: bool = False  # vLLM 0.32 runs async scheduling with it (vllm/config/vllm.py)
    trains_online: bool = False  # drafter_training can train it (a draft model distilled, a head on the update)
    why_not_trained: str = ""  # for drafter_training's error, where it cannot
    package: str = ""  # a package it needs beyond vLLM
    defaults: tuple[
        tuple[str, Any], ...
    ] = ()  # what `speculative_config.method=<name>` on the command line starts from

    @property
    def drafter_model(self) -> bool:
        """A separate torch model proposes (speculative_config.model), which refits and the catch-up reach."""
        return self.source == "drafter"

    @property
    def model_free(self) -> bool:
        return self.source == "tokens"


_DRAFTED = (("num_speculative_tokens", 3), ("draft_sample_method", "probabilistic"))
_TABLE = (
    Method("draft_model", "drafter", policy_vocabulary=True, cpu=True, runtime_k=True, controller=True,
           async_scheduling=True, trains_online=True, defaults=_DRAFTED),
    Method("eagle3", "drafter", head=True, cpu=True, runtime_k=True, controller=True, async_scheduling=True,
           trains_online=True, defaults=_DRAFTED),
    Method("eagle", "drafter", async_scheduling=True, defaults=_DRAFTED,
           why_not_trained="trains on the target's hidden states, which vLLM's rollouts do not return; refit a head "
           "trained elsewhere"),
    Method("medusa", "drafter"),
    Method("mlp_speculator", "drafter"),
    Method("dflash", "drafter", async_scheduling=True),
    Method("dspark", "drafter", async_scheduling=True),
    Method("ngram", "tokens", cpu=True, runtime_k=True, why_not_trained=NO_MODEL_TO_TRAIN,
           defaults=(("num_speculative_tokens", 3), ("prompt_lookup_max", 4), ("prompt_lookup_min", 2))),
    Method("ngram_gpu", "tokens", async_scheduling=True, why_not_trained=NO_MODEL_TO_TRAIN),
    Method("suffix", "tokens", cpu=True, package="arctic-inference", defaults=(("num_speculative_tokens", 8),),
           why_not_trained="proposes from a suffix tree of past outputs: there is no drafter model to train"),
    Method("mtp", "policy", defaults=(("num_speculative_tokens", 1), ("draft_sample_method", "probabilistic")),
           why_not_trained="its heads are part of the policy checkpoint and are refit with the policy"),
    Method("extract_hidden_states", async_scheduling=True),
)  # fmt: skip
METHODS = {m.name: m for m in _TABLE}


def method(name: str | None) -> Method:
    """The table's row for ``name``; a name it does not hold (None, or one newer than this table) has none of the
    capabilities."""
    return METHODS.get(name or "", Method(name or ""))


def names(has: Callable[[Method], bool]) -> list[str]:
    """The methods with a capability, in the table's order (for error messages and docs)."""
    return [m.name for m in _TABLE if has(m)]
