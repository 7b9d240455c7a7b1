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

import asyncio
import json
import random
from dataclasses import dataclass
from typing import Any

from rl_specdec.tasks.base import TaskReward

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


def _turn(msg: dict[str, Any], finish_reason: str) -> dict[str, Any]:
    return {
        "prompt": msg["prompt_token_ids"],
        "ids": msg["generation_token_ids"],
        "logprobs": msg["generation_log_probs"],
        "finish_reason": finish_reason,
    }


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
    msgs: list[dict[str, Any]] = [{"role": "user", "content": episode.key}]
    turns, call_key = [], None
    for t in range(2):
        r = await client.chat.completions.create(
            model=model,
            messages=msgs,
            tools=[LOOKUP_TOOL],
            temperature=temperature,
            seed=seed + t,
            max_tokens=max_tokens[t],
            extra_body=extra_body(t) if extra_body else None,
        )
        choice = r.choices[0]
        msg = choice.message.to_dict()  # keeps prompt_token_ids / generation_token_ids / generation_log_probs
        turns.append(_turn(msg, choice.finish_reason))
        calls = msg.get("tool_calls") or []
        if t == 1 or not calls:
            break
        msgs.append(msg)
        for call in calls:
            try:
                args = json.loads(call["function"]["arguments"] or "{}")
            except json.JSONDecodeError:
                args = {}
            key = args.get("key") if call["function"]["name"] == "lookup" and isinstance(args, dict) else None
            call_key = key if call_key is None else call_key
            msgs.append({"role": "tool", "tool_call_id": call["id"], "content": episode.lookup(key)})
    answered = len(turns) == 2 and not msg.get("tool_calls")
    score = task.score(msg.get("content") if answered else None, episode, turns[-1]["finish_reason"] == "stop")
    last = turns[-1]
    return {
        "ids": last["prompt"] + last["ids"],
        "turns": [(len(x["prompt"]), x["ids"], x["logprobs"]) for x in turns],
        "prompts": [x["prompt"] for x in turns],
        "reward": score.reward,
        "correct": score.correct,
        "called": len(turns) == 2,  # vLLM's parser found a tool call in turn 1
        "right_key": call_key == episode.key,
    }


async def play_many(
    base_url: str,
    model: str,
    task: LookupTask,
    episodes: list[Episode],
    *,
    seed: int,
    group: int = 1,
    concurrency: int = 32,
    api_key: str = "unused",
    timeout: float = 600.0,
    **kw,
) -> list[dict[str, Any]]:
    """``group`` plays of every episode (episode-major order), ``concurrency`` at a time, with ``AsyncOpenAI``."""
    from openai import AsyncOpenAI

    sem = asyncio.Semaphore(concurrency)
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120.0) as client:

        async def one(i: int, ep: Episode):
            async with sem:
                return await play(client, model, task, ep, seed=seed + 2 * i, **kw)

        jobs = [one(i * group + j, ep) for i, ep in enumerate(episodes) for j in range(group)]
        return await asyncio.wait_for(asyncio.gather(*jobs), timeout=timeout)
