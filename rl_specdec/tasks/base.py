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

from dataclasses import dataclass, field
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


@dataclass
class EnvStep:
    """What an environment answers to a model turn."""

    observations: list[dict[str, Any]]  # the messages after the model's (tool results, a user's reply)
    reward: float
    done: bool
    correct: bool = False  # for the success rate (validation's val/accuracy)
    info: dict[str, float] = field(default_factory=dict)  # per-episode facts the task reports (their means logged)


class Environment(Protocol):
    """One episode of a multi-turn task (rl_specdec/rollout/serving/episodes.py plays it through the server)."""

    def reset(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The first messages, and the tools (OpenAI function schema; [] for none)."""
        ...

    def step(self, message: dict[str, Any], finish_reason: str) -> EnvStep:
        """The model's turn (the assistant message as the server returned it, tool calls parsed by vLLM)."""
        ...


class EpisodeTask(Protocol):
    """A multi-turn task: episodes drawn from a seed, each played in its own environment."""

    def make_batch(self, seed: int, n: int) -> list[Any]: ...

    def validation_batch(self, seed: int, n: int) -> list[Any]: ...

    def environment(self, episode: Any) -> Environment: ...
