"""The two drafters that learn while the policy does, behind one interface that :class:`DrafterUpkeep` calls the
same way for both.

* :class:`DraftModelDrafter`: a ``draft_model`` drafter, distilled towards the policy in its own actor
  (:class:`~rl_specdec.drafter.trainer.RayDrafter`) on the step's rollouts and the policy's top-k log-probs
  vLLM returned with them; its weights and optimizer are checkpointed beside the policy's.
* :class:`PolicyHeadDrafter`: an EAGLE-3 head, trained by the policy's workers on the update's own forward
  (:mod:`rl_specdec.heads.training`); the rollouts ask for no log-probs, and its weights travel in the policy's
  checkpoint.

A step: :meth:`~OnlineDrafter.begin` with the step's rollouts after generation, :meth:`~OnlineDrafter.finish`
after the policy's refit (its metrics, {} when it did not step), then :meth:`~OnlineDrafter.weights` into every
engine.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Protocol

from rl_specdec.rollout import GenerationOutput


class OnlineDrafter(Protocol):
    top_k: int  # log-probs per generated token its step needs from the rollouts (0: none)

    def begin(self, step: int, prompt_ids: list[list[int]], out: GenerationOutput, pad_id: int) -> None: ...

    def finish(self) -> dict[str, float]: ...

    def weights(self) -> Any: ...

    def save(self, path: Path) -> None: ...

    def load(self, path: Path) -> bool: ...

    def shutdown(self) -> None: ...


def drafter_subset(n: int, max_sequences: int, step: int) -> list[int]:
    """Indices of the rollouts the drafter trains on at ``step``: all, or ``max_sequences`` of them at random
    (seeded by the step)."""
    if max_sequences <= 0 or max_sequences >= n:
        return list(range(n))
    return sorted(random.Random(step).sample(range(n), max_sequences))


class DraftModelDrafter:
    """A draft model distilled in its own actor; with ``overlap`` its step runs while the policy updates."""

    def __init__(self, trainer, training):
        self.trainer, self.training, self.top_k = trainer, training, training.top_k
        self._batch = None

    def begin(self, step: int, prompt_ids: list[list[int]], out: GenerationOutput, pad_id: int) -> None:
        from rl_specdec.drafter.trainer import distill_batch

        sequences = out.distill_spans(prompt_ids)  # [N] (ids, spans): a prompt's rollout, or an episode
        idx = drafter_subset(len(sequences), self.training.max_sequences, step)
        self._batch = distill_batch([sequences[i] for i in idx], self.top_k, pad_id)
        if self.training.overlap:
            self.trainer.train(self._batch)

    def finish(self) -> dict[str, float]:
        if self._batch is None:
            return {}
        if not self.training.overlap:
            self.trainer.train(self._batch)
        self._batch = None
        return self.trainer.result() or {}

    def weights(self):
        return self.trainer.state_dict_for_refit()

    def save(self, path: Path) -> None:
        self.trainer.save_checkpoint(str(path / "drafter"))

    def load(self, path: Path) -> bool:
        if not (path / "drafter").is_dir():
            return False
        self.trainer.load_checkpoint(str(path / "drafter"))
        return True

    def shutdown(self) -> None:
        self.trainer.shutdown()


class PolicyHeadDrafter:
    """An EAGLE-3 head that the policy's update trains; this side reads its result and its weights."""

    top_k = 0  # it learns from the policy's hidden states, not from the engines' log-probs

    def __init__(self, policy):
        self.policy, self.version, self._pending = policy, 0.0, False

    def begin(self, step: int, prompt_ids: list[list[int]], out: GenerationOutput, pad_id: int) -> None:
        self._pending = True  # the coming update trains it on these rollouts' forward

    def finish(self) -> dict[str, float]:
        """The head's step of this update; {} where it did not step (a schedule restored out of phase)."""
        if not self._pending:
            return {}
        self._pending = False
        r = self.policy.head_result()
        fresh, self.version = r.get("version", 0.0) > self.version, r.get("version", self.version)
        return r if fresh else {}

    def weights(self):
        return self.policy.head_state_dict_for_refit()

    def save(self, path: Path) -> None:
        """The head is in the policy's checkpoint; beside it, the version this side last refit, so a resumed run
        does not refit an old step's head as new."""
        (path / "drafter_head.json").write_text(json.dumps({"version": self.version}))

    def load(self, path: Path) -> bool:
        saved = path / "drafter_head.json"
        if saved.is_file():
            self.version = float(json.loads(saved.read_text())["version"])
        return True  # the head itself comes back with the policy

    def shutdown(self) -> None:
        self.policy = None  # the policy group owns the workers that hold the head
