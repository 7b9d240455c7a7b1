"""A second try: the chat word problems of :mod:`rl_specdec.tasks.arithmetic` as episodes of up to ``tries``
model turns, for a real chat model.

The model answers the problem (one user turn, through its own chat template, as the single-turn task sends it).
A right answer ends the episode with reward 1. A wrong or unfinished one is answered by a user turn,
``feedback`` ("That is not right..."), and the model tries again on the whole conversation, its first answer
spliced in as its own tokens; a right answer there earns ``retry_reward``, less than a first try's, so GRPO
still prefers the first try right. The last try's wrong answer ends the episode with 0. ``correct`` (the
success rate, ``val/accuracy``) counts a right answer at any try; ``episodes/first_try_correct`` the first
try's alone, and ``episodes/tries`` the tries taken.

The server renders every turn with the model's chat template, so a task's ``chat_template_kwargs`` would not
reach it: they are refused here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rl_specdec.errors import ConfigError
from rl_specdec.tasks.arithmetic import ArithmeticChatTask
from rl_specdec.tasks.base import EnvStep, Sample

FEEDBACK = "That is not right. Read the problem again, then give the final answer as \\boxed{N}."


@dataclass
class RetryArithmeticTask(ArithmeticChatTask):
    """:class:`~rl_specdec.tasks.arithmetic.ArithmeticChatTask`'s problems, each an episode of up to ``tries``
    answers with ``feedback`` between them (see the module doc)."""

    tries: int = 2
    retry_reward: float = 0.5
    feedback: str = FEEDBACK

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tries < 1:
            raise ConfigError(f"task.kwargs.tries={self.tries} must be >= 1 (the answers an episode may give)")
        if not 0.0 <= self.retry_reward <= 1.0:
            raise ConfigError(f"task.kwargs.retry_reward={self.retry_reward} must be within [0, 1]")
        if self.chat_template_kwargs:
            raise ConfigError(
                "task.kwargs.chat_template_kwargs: the episodes' turns are rendered by the engines' server, which "
                "does not receive them; remove the key (or set them in the model's own chat template)"
            )

    def environment(self, sample: Sample) -> RetryEnv:
        return RetryEnv(self, sample)


class RetryEnv:
    """One problem: an answer, and after a wrong one the feedback and another answer, up to ``task.tries``."""

    def __init__(self, task: RetryArithmeticTask, sample: Sample):
        self.task, self.sample, self.turn = task, sample, 0

    def reset(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        system = [{"role": "system", "content": self.task.system_prompt}] if self.task.system_prompt else []
        return [*system, {"role": "user", "content": self.sample.prompt}], []

    def step(self, message: dict[str, Any], finish_reason: str) -> EnvStep:
        self.turn += 1
        score = self.task.score(message.get("content") or "", self.sample.answer, finish_reason == "stop")
        first = self.turn == 1
        info = {"first_try_correct": float(first and score.correct), "tries": float(self.turn)}
        if score.correct:
            return EnvStep([], score.reward * (1.0 if first else self.task.retry_reward), True, True, info)
        if self.turn >= self.task.tries:
            return EnvStep([], 0.0, True, False, info)
        return EnvStep([{"role": "user", "content": self.task.feedback}], 0.0, False, False, info)
