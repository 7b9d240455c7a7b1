"""The drafter's life in the GRPO loop: online training, refit, and the acceptance canary.

Per step (see docs/speculative_decoding.md, "The drafter's lifecycle"):

1. the rollouts of a step that trains the drafter ask vLLM for the policy's
   top-k log-probs (:meth:`DrafterUpkeep.top_k`);
2. right after generation the canary checks the step's acceptance rate
   (:meth:`check`), and with ``overlap`` the drafter starts training in its
   own actor while the policy updates (:meth:`after_generation`);
3. after the policy's refit, the drafter's step is joined (or run, without
   ``overlap``) and its weights are refit into every engine, verified like
   the policy's (:meth:`after_refit`).

At set-up the engines get the trainer's drafter (:meth:`sync`); checkpoints
carry the drafter's weights and optimizer (:meth:`save`, :meth:`load`).
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

from rl_specdec.config import RunConfig
from rl_specdec.drafter.canary import AcceptanceCanary
from rl_specdec.drafter.watch import NeverDrafted
from rl_specdec.errors import SpecDecodeCanaryTripped
from rl_specdec.metrics.logger import Timer
from rl_specdec.rollout import GenerationOutput, RolloutEngine

logger = logging.getLogger(__name__)
HEAD_STEP = "head"  # the pending batch of a step whose head learns inside the policy's update


def drafter_subset(n: int, max_sequences: int, step: int) -> list[int]:
    """Indices of the rollouts the drafter trains on at ``step``: all, or ``max_sequences`` of them at random
    (seeded by the step)."""
    if max_sequences <= 0 or max_sequences >= n:
        return list(range(n))
    return sorted(random.Random(step).sample(range(n), max_sequences))


class PolicyHead:
    """The trainer :class:`DrafterUpkeep` drives, for an EAGLE-3 head that learns inside the policy's update.

    Nothing to start or to train here: the policy workers train the head on the update's forward
    (rl_specdec.policy.head) and keep it in the policy's checkpoints."""

    def __init__(self, policy):
        self.policy, self.version = policy, 0.0

    def train(self, batch) -> None:
        pass  # the policy's update trained it

    def result(self) -> dict[str, float]:
        r = self.policy.head_result()
        fresh, self.version = r.get("version", 0.0) > self.version, r.get("version", self.version)
        return r if fresh else {}

    def state_dict_for_refit(self):
        return self.policy.head_state_dict_for_refit()

    def save_checkpoint(self, path: str) -> None:
        pass  # in the policy's checkpoint

    def load_checkpoint(self, path: str) -> None:
        pass

    def shutdown(self) -> None:
        pass


class DrafterUpkeep:
    def __init__(self, cfg: RunConfig, trainer=None):
        gen = cfg.policy.generation
        self.training, self.trainer = gen.drafter_training, trainer
        c = gen.acceptance_canary
        self.canary, self.action = AcceptanceCanary(min_ratio=c.min_ratio, window=c.window), c.action
        self.speculating = gen.speculation is not None
        self.watch = NeverDrafted.for_run(cfg)
        self._batch = None

    @classmethod
    def create(cls, cfg: RunConfig, on_gpu: bool, policy=None) -> "DrafterUpkeep":
        trainer = None
        if cfg.policy.generation.drafter_training.enabled:
            from rl_specdec.drafter import RayDrafter

            spec = cfg.policy.generation.speculation
            if spec.is_head:
                return cls(cfg, PolicyHead(policy))
            trainer = RayDrafter(
                spec.model,
                cfg.policy.generation.drafter_training,
                cfg.policy.precision,
                cfg.seed,
                num_gpus=0.5 if on_gpu else 0,
                engine_dtype=cfg.policy.generation.vllm_kwargs["dtype"],
            )
        return cls(cfg, trainer)

    # ---- per step --------------------------------------------------------------------------
    def trains_at(self, step: int) -> bool:
        return self.trainer is not None and self.speculating and (step + 1) % self.training.every == 0

    def top_k(self, step: int) -> int:
        """Log-probs per generated token the rollouts must return (0: none). A head learns from the policy's
        update, not from the engines' log-probs: its rollouts ask for none, and pay nothing for them."""
        return self.training.top_k if self.trains_at(step) and not isinstance(self.trainer, PolicyHead) else 0

    def check(self, spec_metrics: dict[str, float], generation: RolloutEngine) -> dict[str, float]:
        """The acceptance canary on this step's rollouts (every step follows a refit); before it, whether a
        drafter the run pays for drafted at all in its first steps."""
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
            # fresh engines without a drafter; this step's refit (phase 6) gives them the trainer's weights
            generation.disable_speculation()
            self.speculating = False
            message += (
                " Speculation is off for the rest of the run (acceptance_canary.action=disable): k=0 through the"
                " k=0 fast path (speculation_control on), or the engines restarted without a drafter."
                " A resumed run starts with speculation on again."
            )
        logger.warning("%s", message)
        return {"spec_decode/canary": 1.0}

    def after_generation(self, step: int, prompt_ids: list[list[int]], out: GenerationOutput, pad_id: int) -> None:
        if self.trains_at(step) and isinstance(self.trainer, PolicyHead):
            self._batch = HEAD_STEP  # it learns from the policy's update, not from the rollouts' log-probs
        elif self.trains_at(step):
            from rl_specdec.drafter import distill_batch

            idx = drafter_subset(len(prompt_ids), self.training.max_sequences, step)
            pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
            self._batch = distill_batch(
                pick(prompt_ids), pick(out.token_ids), pick(out.top_logprobs), self.training.top_k, pad_id
            )
            if self.training.overlap:
                self.trainer.train(self._batch)

    def after_refit(self, generation: RolloutEngine | None, timer: Timer) -> dict[str, float]:
        """Finish the drafter's step and refit it into the engines; its metrics ({} on steps without one).

        ``generation`` None: finish the step but leave the engines as they are (a stop dropped rollouts they are
        still generating; the checkpoint holds the new drafter, and a resumed run loads it into its engines)."""
        if self._batch is None:
            return {}
        with timer("drafter_wait"):  # the part of the drafter's step on the critical path
            if not self.training.overlap:
                self.trainer.train(self._batch)
            result = self.trainer.result()
        self._batch = None
        if not result:  # a head whose update did not step (a schedule restored out of phase): nothing new
            return {}
        if generation is not None:
            with timer("drafter_refit"):
                generation.update_weights(self.trainer.state_dict_for_refit(), target="drafter")
        return {
            **{f"drafter/{k}": v for k, v in result.items() if k != "time_s"},
            "timing/drafter_train": result["time_s"],
        }

    # ---- set-up, checkpoints, shutdown ---------------------------------------------------------
    def sync(self, generation: RolloutEngine) -> None:
        """Put the trainer's drafter into every engine (before the first rollout, and after a resume)."""
        if self.trainer is not None:
            generation.update_weights(self.trainer.state_dict_for_refit(), target="drafter")

    def save(self, path: Path) -> None:
        if self.trainer is not None:
            self.trainer.save_checkpoint(str(path / "drafter"))

    def load(self, path: Path) -> None:
        if self.trainer is None or isinstance(self.trainer, PolicyHead):  # a head comes back with the policy
            return
        if (path / "drafter").is_dir():
            self.trainer.load_checkpoint(str(path / "drafter"))
        else:
            logger.warning(
                "checkpoint %s has no drafter (drafter_training was off): continuing with %s",
                path,
                "the configured drafter",
            )

    def shutdown(self) -> None:
        if self.trainer is not None:
            self.trainer.shutdown()
