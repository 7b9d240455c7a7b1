"""What a task provides to the GRPO loop: prompts and a verifier.

A new task implements the :class:`Task` protocol (see docs/grpo.md):
``make_batch(seed, n)`` returns ``n`` training problems deterministically from
a seed, ``validation_batch(seed, n)`` held-out problems, and
``score(response, answer, finished)`` turns one decoded response into a
reward. Tasks see text; the loop converts with the policy's tokenizer, so the
generation engine only ever sees token ids. A task may also define
``encode_prompt(tokenizer, prompt) -> list[int]`` (e.g. to apply a chat
template, :mod:`rl_specdec.tasks.arithmetic`); without it a prompt is
``tokenizer.encode(prompt)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Sample:
    prompt: str
    answer: str


@dataclass(frozen=True)
class TaskReward:
    reward: float
    correct: bool


class Task(Protocol):
    def make_batch(self, seed: int, n: int) -> list[Sample]: ...

    def validation_batch(self, seed: int, n: int) -> list[Sample]: ...

    def score(self, response: str, answer: str, finished: bool) -> TaskReward: ...


def encode_prompts(task: Any, tokenizer: Any, samples: list[Sample]) -> list[list[int]]:
    """The prompts' token ids: the task's ``encode_prompt`` where it has one, else ``tokenizer.encode``."""
    encode = getattr(task, "encode_prompt", None)
    if encode is None:
        return [tokenizer.encode(s.prompt) for s in samples]
    return [encode(tokenizer, s.prompt) for s in samples]
