"""The lookup task: an agent has to call a tool to answer, through an OpenAI client.

Each episode holds a hidden table (one random value per key). The user names
a key; the model must call the ``lookup`` tool with that key, the environment
answers with a ``tool`` message carrying the key's value, and the model must
then answer with that value and stop. Values are drawn per episode, so they
cannot be memorised: the model has to copy the key into its call and the
tool's result into its answer.

Episodes talk to a server the way agent environments do: the real
``openai.AsyncOpenAI`` client, ``tools=[LOOKUP_TOOL]`` on every request, the
assistant message sent back as returned (``message.to_dict()``, which keeps
``prompt_token_ids``/``generation_token_ids``), then the tool result. The
server splices the model's own tokens into the next prompt, so the last
turn's ``prompt_token_ids + generation_token_ids`` is the whole episode as the
model produced it; :func:`play` returns where each model turn sits in it.

Reward: 1.0 when the final answer is exactly the value and the model stopped
on EOS, else 0.0 (no call, a malformed call, the wrong key, a wrong answer).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from rl_specdec.tasks.base import EnvStep, TaskReward

KEYS = "abcdefghijklmnopqrstuvwxyz"
DIGITS = "0123456789"
NOT_FOUND = "none"  # the tool's answer for a key that is not in the table

LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "the hidden value of a key",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
    },
}


def model_tool_call(key: str) -> str:
    """The tool call as the toy model is taught to write it (hermes style, compact JSON)."""
    return '<tool_call>{"name":"lookup","arguments":{"key":"' + key + '"}}</tool_call>'


@dataclass(frozen=True)
class Episode:
    key: str
    table: tuple[tuple[str, str], ...]  # (key, value) for every key of the alphabet

    @property
    def value(self) -> str:
        return dict(self.table)[self.key]

    def lookup(self, key: Any) -> str:
        return dict(self.table).get(key, NOT_FOUND) if isinstance(key, str) else NOT_FOUND


@dataclass
class LookupTask:
    """Episodes (a key and its table) and the verifier.

    ``key_len``/``value_len``: characters per key/value; one-letter keys come from the
    first ``num_keys`` letters of the alphabet.
    """

    key_len: int = 1
    value_len: int = 3
    num_keys: int = 26
    validation_offset: int = 1_000_003  # validation seeds never meet training seeds

    def sample_episode(self, rng: random.Random) -> Episode:
        if self.key_len == 1:
            keys = list(KEYS[: self.num_keys])
        else:
            keys = sorted({"".join(rng.choice(KEYS) for _ in range(self.key_len)) for _ in range(26)})
        table = tuple((k, "".join(rng.choice(DIGITS) for _ in range(self.value_len))) for k in keys)
        return Episode(key=rng.choice(keys), table=table)

    def make_batch(self, seed: int, n: int) -> list[Episode]:
        rng = random.Random(seed)
        return [self.sample_episode(rng) for _ in range(n)]

    def validation_batch(self, seed: int, n: int) -> list[Episode]:
        return self.make_batch(seed + self.validation_offset, n)

    def score(self, answer: str | None, episode: Episode, finished: bool) -> TaskReward:
        correct = finished and answer == episode.value
        return TaskReward(reward=float(correct), correct=correct)

    def environment(self, episode: Episode) -> "LookupEnv":
        return LookupEnv(self, episode)


class LookupEnv:
    """One lookup episode: the model's first turn may call the tool (answered with the key's value), its second
    answers; an answer without a call ends the episode at once."""

    def __init__(self, task: LookupTask, episode: Episode):
        self.task, self.episode, self.turn, self.call_key, self.called = task, episode, 0, None, False

    def reset(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        return [{"role": "user", "content": self.episode.key}], [LOOKUP_TOOL]

    def step(self, message: dict[str, Any], finish_reason: str) -> EnvStep:
        self.turn += 1
        calls = message.get("tool_calls") or []
        if self.turn == 1 and calls:
            self.called, results = True, []
            for call in calls:
                key = _call_key(call)
                self.call_key = key if self.call_key is None else self.call_key
                results.append({"role": "tool", "tool_call_id": call["id"], "content": self.episode.lookup(key)})
            return EnvStep(results, 0.0, False, info=self._info())
        answered = self.turn == 2 and not calls
        score = self.task.score(message.get("content") if answered else None, self.episode, finish_reason == "stop")
        return EnvStep([], score.reward, True, score.correct, self._info())

    def _info(self) -> dict[str, float]:
        return {"called": float(self.called), "right_key": float(self.call_key == self.episode.key)}


def _call_key(call: dict[str, Any]) -> Any:
    """The ``key`` argument of a ``lookup`` call (None for another tool or arguments that are not JSON)."""
    try:
        args = json.loads(call["function"]["arguments"] or "{}")
    except json.JSONDecodeError:
        return None
    return args.get("key") if call["function"]["name"] == "lookup" and isinstance(args, dict) else None


async def play(
    client,
    model: str,
    task: LookupTask,
    episode: Episode,
    *,
    seed: int,
    temperature: float = 1.0,
    max_tokens=(48, 8),
    extra_body=None,
) -> dict[str, Any]:
    """One episode: the model calls the tool, gets the result, answers.

    Returns ``ids`` (the whole episode's token ids, as the last turn's prompt plus
    its generation), ``turns`` (``(start, generated ids, log-probs)`` per model turn
    in ``ids``), ``reward``/``correct``, ``called`` (a tool call was parsed) and
    ``right_key``. ``extra_body(turn)``, if given, adds request fields per turn.
    """
    from rl_specdec.rollout.serving.episodes import run_episode

    x = await run_episode(
        client,
        model,
        task.environment(episode),
        seed=seed,
        temperature=temperature,
        max_turns=2,
        max_tokens=list(max_tokens),
        extra_body=extra_body,
    )
    return {
        "ids": x.token_ids,
        "turns": [(t.start, t.ids, t.logprobs) for t in x.turns],
        "prompts": x.prompts,
        "reward": x.reward,
        "correct": x.correct,
        "called": bool(x.info["called"]),  # vLLM's parser found a tool call in turn 1
        "right_key": bool(x.info["right_key"]),
    }
