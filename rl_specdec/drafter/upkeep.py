"""The drafter's life in the GRPO loop: online training, refit, the acceptance canary, the never-drafted watch.

Per step (see docs/speculative_decoding.md, "The drafter's lifecycle"), for either drafter that learns online
(:mod:`rl_specdec.drafter.online`: a draft model in its own actor, or an EAGLE-3 head in the policy's update):

1. the rollouts of a step that trains the drafter ask vLLM for the log-probs it learns from
   (:meth:`DrafterUpkeep.top_k`: the policy's top-k for a draft model, none for a head);
2. right after generation the canary checks the step's acceptance rate (:meth:`check`), and the drafter is
   given the step's rollouts (:meth:`after_generation`; a draft model with ``overlap`` starts training in its
   own actor while the policy updates);
3. after the policy's refit, the drafter's step is finished and its weights are refit into every engine,
   verified like the policy's (:meth:`after_refit`).

At set-up the engines get the trainer's drafter (:meth:`sync`); checkpoints carry it (:meth:`save`, :meth:`load`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from rl_specdec.config import RunConfig
from rl_specdec.drafter.canary import AcceptanceCanary
from rl_specdec.drafter.online import DraftModelDrafter, OnlineDrafter, PolicyHeadDrafter
from rl_specdec.drafter.watch import NeverDrafted
from rl_specdec.errors import SpecDecodeCanaryTripped, SpeculationTurnedOff
from rl_specdec.metrics.logger import Timer
from rl_specdec.rollout import GenerationOutput, RolloutEngine

logger = logging.getLogger(__name__)


class DrafterUpkeep:
    """The drafter's part of each step; ``drafter`` (an :class:`~rl_specdec.drafter.online.OnlineDrafter`, None
    where nothing trains online) is called the same way whichever kind it is."""

    def __init__(self, cfg: RunConfig, drafter: OnlineDrafter | None = None):
        gen = cfg.policy.generation
        self.training, self.drafter = gen.drafter_training, drafter
        c = gen.acceptance_canary
        self.canary, self.action = AcceptanceCanary(min_ratio=c.min_ratio, window=c.window), c.action
        self.speculating = gen.speculation is not None
        self.watch = NeverDrafted.for_run(cfg)
        self._began = False

    @classmethod
    def create(cls, cfg: RunConfig, on_gpu: bool, policy=None) -> "DrafterUpkeep":
        gen = cfg.policy.generation
        if not gen.drafter_training.enabled:
            return cls(cfg)
        if gen.speculation.is_head:
            return cls(cfg, PolicyHeadDrafter(policy))
        from rl_specdec.drafter import RayDrafter

        trainer = RayDrafter(
            gen.speculation.model,
            gen.drafter_training,
            cfg.policy.precision,
            cfg.seed,
            num_gpus=0.5 if on_gpu else 0,
            engine_dtype=gen.vllm_kwargs["dtype"],
        )
        return cls(cfg, DraftModelDrafter(trainer, gen.drafter_training))

    # ---- per step --------------------------------------------------------------------------
    def trains_at(self, step: int) -> bool:
        return self.drafter is not None and self.speculating and (step + 1) % self.training.every == 0

    def top_k(self, step: int) -> int:
        """Log-probs per generated token the rollouts must return (0: none; a head learns from the policy's
        update, not from the engines' log-probs, so its rollouts ask for none and pay nothing for them)."""
        return self.drafter.top_k if self.trains_at(step) else 0

    def check(self, spec_metrics: dict[str, float]) -> dict[str, float]:
        """The acceptance canary on this step's rollouts (every step follows a refit); before it, whether a
        drafter the run pays for drafted at all in its first steps. A trip with ``action=disable`` raises
        :class:`~rl_specdec.errors.SpeculationTurnedOff`: turning the engines' speculation off is the run's
        fault handler's to do (:mod:`rl_specdec.grpo.recovery`)."""
        never = self.watch.observe(spec_metrics, self.speculating)
        if never:
            logger.warning("%s", never)
        if not self.speculating or not spec_metrics or not spec_metrics.get("spec_decode/num_draft_tokens"):
            return {}
        judged = self.canary.observe_counts(
            spec_metrics["spec_decode/num_accepted_tokens"], spec_metrics["spec_decode/num_draft_tokens"]
        )
        if judged is None or not judged[1]:
            return {"spec_decode/canary": 0.0}
        rate = judged[0]
        message = self.canary.message(rate)
        if self.action == "fail":
            raise SpecDecodeCanaryTripped(message + " Stopping (acceptance_canary.action=fail).")
        if self.action == "disable":
            self.speculating = False
            raise SpeculationTurnedOff(
                message + " Speculation is off for the rest of the run (acceptance_canary.action=disable): k=0"
                " through the k=0 fast path (speculation_control on), or the engines restarted without a drafter."
                " A resumed run starts with speculation on again.",
                {"spec_decode/canary": 1.0},
            )
        logger.warning("%s", message)
        return {"spec_decode/canary": 1.0}

    def after_generation(self, step: int, prompt_ids: list[list[int]], out: GenerationOutput, pad_id: int) -> None:
        if self.trains_at(step):
            self.drafter.begin(step, prompt_ids, out, pad_id)
            self._began = True

    def after_refit(self, generation: RolloutEngine | None, timer: Timer) -> dict[str, float]:
        """Finish the drafter's step and refit it into the engines; its metrics ({} on steps without one).

        ``generation`` None: finish the step but leave the engines as they are (a stop dropped rollouts they are
        still generating; the checkpoint holds the new drafter, and a resumed run loads it into its engines)."""
        if not self._began:
            return {}
        self._began = False
        with timer("drafter_wait"):  # the part of the drafter's step on the critical path
            result = self.drafter.finish()
        if not result:  # a head whose update did not step (a schedule restored out of phase): nothing new
            return {}
        if generation is not None:
            with timer("drafter_refit"):
                generation.update_weights(self.drafter.weights(), target="drafter")
        return {
            **{f"drafter/{k}": v for k, v in result.items() if k != "time_s"},
            "timing/drafter_train": result["time_s"],
        }

    # ---- set-up, checkpoints, shutdown ---------------------------------------------------------
    def sync(self, generation: RolloutEngine) -> None:
        """Put the trainer's drafter into every engine (before the first rollout, and after a resume)."""
        if self.drafter is not None:
            generation.update_weights(self.drafter.weights(), target="drafter")

    def save(self, path: Path) -> None:
        if self.drafter is not None:
            self.drafter.save(path)

    def load(self, path: Path) -> None:
        if self.drafter is not None and not self.drafter.load(path):
            logger.warning(
                "checkpoint %s has no drafter (drafter_training was off): continuing with the configured drafter",
                path,
            )

    def shutdown(self) -> None:
        if self.drafter is not None:
            self.drafter.shutdown()
