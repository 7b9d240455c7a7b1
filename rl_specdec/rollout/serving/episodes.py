"""Episodes of several turns played through the engines' OpenAI servers, with an environment's reset and step.

An :class:`~rl_specdec.tasks.base.Environment` is a task's one episode: ``reset`` gives the first messages and
the tools (the OpenAI function schema), ``step`` takes the model's turn (the assistant message as the server
returned it, tool calls parsed by vLLM's parser) and gives the observations that follow it (tool results, a
user's reply), a reward, and whether the episode is done.

:func:`run_episode` plays one with the real ``openai`` client. The server splices the model's own tokens into
each next prompt (rl_specdec/rollout/serving/prefix.py), so every prompt must begin with the previous prompt and
the ids generated after it: that is checked at every turn, and a prompt that does not is a
:class:`~rl_specdec.errors.PrefixSpliceError`, never a silent retokenisation. The episode's token ids are then
the last prompt plus its generation, and each model turn is a span of them with the engine's log-probs.

Bounds: ``max_turns`` model turns, and ``max_episode_tokens`` (prompt and generation); an episode that reaches
either ends with the reward of its last step. :func:`run_episodes` plays a step's episodes concurrently, spread
over the engines' servers, each pinned to one server by its index.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from rl_specdec.errors import PrefixSpliceError
from rl_specdec.metrics.counters import aggregate_spec_decode_counters, counters_from_histogram
from rl_specdec.rollout.interfaces import GenerationOutput
from rl_specdec.tasks.base import Environment, EnvStep


@dataclass
class Turn:
    start: int  # where the turn's ids begin in the episode's token ids
    ids: list[int]
    logprobs: list[float]
    finish_reason: str
    tool_calls: int  # tool calls vLLM's parser found in it
    top_logprobs: list[dict[int, float]] | None = None  # per id, the policy's top-k next-token log-probs
    spec_counters: dict[str, Any] | None = None  # this turn's own spec-decode counters (None: no speculation)


@dataclass
class EpisodeResult:
    token_ids: list[int]  # the whole episode: the last prompt and its generation
    turns: list[Turn]
    prompts: list[list[int]]  # each turn's prompt, as the server rendered and spliced it
    reward: float
    correct: bool
    info: dict[str, float]
    done_s: float  # seconds from the step's start to this episode's end

    @property
    def model_tokens(self) -> int:
        return sum(len(t.ids) for t in self.turns)


@dataclass
class EpisodeOutput(GenerationOutput):
    """A step's episodes as one generation's output: per episode, the model's tokens of all its turns (their
    lengths and log-probs), the last turn's finish reason, and when the episode ended."""

    episodes: list[EpisodeResult] = field(default_factory=list)

    @classmethod
    def of(cls, xs: list[EpisodeResult], seconds: float, spec: dict[str, Any]) -> "EpisodeOutput":
        with_top = bool(xs) and all(t.top_logprobs is not None for x in xs for t in x.turns)
        return cls(
            token_ids=[[i for t in x.turns for i in t.ids] for x in xs],
            logprobs=[[lp for t in x.turns for lp in t.logprobs] for x in xs],
            top_logprobs=[[d for t in x.turns for d in t.top_logprobs] for x in xs] if with_top else None,
            finish_reasons=[x.turns[-1].finish_reason for x in xs],
            per_engine_time_s=[seconds],
            finish_time_s=[x.done_s for x in xs],
            spec_counters=spec,
            episodes=xs,
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EpisodeOutput":
        """The output that ``dataclasses.asdict`` gave ``d`` (a checkpoint's rollouts.json), episodes and all."""
        xs = [EpisodeResult(**{**x, "turns": [Turn(**t) for t in x["turns"]]}) for x in d["episodes"]]
        return cls(**{**d, "episodes": xs})

    def distill_spans(self, prompt_ids: list[list[int]]) -> list[tuple[list[int], list[tuple[int, list]]]]:
        """Per episode, its token ids and each model turn's (start, top-k log-probs): tool results and the
        environment's replies are context the drafter reads, never targets."""
        return [(x.token_ids, [(t.start, t.top_logprobs or []) for t in x.turns]) for x in self.episodes]


def per_turn_counters(xs: list[EpisodeResult]) -> list[dict[str, Any]]:
    """Per turn index, the spec-decode counters of the episodes' turns there ({} each without speculation)."""
    n = max((len(x.turns) for x in xs), default=0)
    return [aggregate_spec_decode_counters(x.turns[i].spec_counters for x in xs if len(x.turns) > i) for i in range(n)]


def top_logprobs_of(choice) -> list[dict[int, float]]:
    """The top-k log-probs of each generated token, keyed by token id (asked for with
    ``return_tokens_as_token_ids``, so each token reads ``token_id:N``)."""
    content = choice.logprobs.content if choice.logprobs is not None else None
    if content is None:
        raise ValueError("the server returned no log-probs: serve with rl_specdec's app (server.rl_defaults: true)")
    return [{int(c.token.removeprefix("token_id:")): c.logprob for c in pos.top_logprobs} for pos in content]


def turn_counters(response) -> dict[str, Any] | None:
    """The turn's own spec-decode counters: the acceptance histogram vLLM puts in the response's
    ``metrics.speculative_decoding`` (engine argument ``per_request_spec_decode_metrics``, single-sequence
    requests). The engine's counters cannot tell turns apart: an episode's second turn runs beside others' first."""
    spec = ((getattr(response, "model_extra", None) or {}).get("metrics") or {}).get("speculative_decoding")
    return counters_from_histogram(spec["acceptance_histogram"], spec["num_draft_tokens"]) if spec else None


def check_splice(prompts: list[list[int]], turns: list[Turn], prompt: list[int]) -> None:
    """The next ``prompt`` begins with the last prompt and the ids the model generated after it."""
    if not prompts:
        return
    prefix = prompts[-1] + turns[-1].ids
    if prompt[: len(prefix)] != prefix:
        at = next((i for i, (a, b) in enumerate(zip(prompt, prefix)) if a != b), min(len(prompt), len(prefix)))
        raise PrefixSpliceError(
            f"turn {len(prompts) + 1}'s prompt does not begin with turn {len(prompts)}'s prompt and the model's own "
            f"{len(turns[-1].ids)} ids (first difference at position {at} of {len(prefix)}): the server did not "
            "splice the model's tokens into the history; serve with rl_specdec's app (server.rl_defaults: true)"
        )


async def run_episode(
    client, model: str, env: Environment, *, seed: int, temperature: float, max_turns: int, max_tokens, **limits
) -> EpisodeResult:
    """One episode through ``client`` (an ``openai.AsyncOpenAI``); ``max_tokens``: per turn, an int or one per turn.
    ``limits``: ``max_episode_tokens``, ``extra_body`` (turn -> request fields), ``started`` (perf_counter),
    ``top_logprobs`` (K > 0: each turn keeps the policy's top-K log-probs per token, for a drafter to learn)."""
    messages, tools = env.reset()
    prompts: list[list[int]] = []
    turns: list[Turn] = []
    step = EnvStep([], 0.0, False)
    for t in range(max_turns):
        budget = max_tokens if isinstance(max_tokens, int) else max_tokens[min(t, len(max_tokens) - 1)]
        extra, top = limits.get("extra_body"), limits.get("top_logprobs", 0)
        body = {**(extra(t) if extra else {}), **({"return_tokens_as_token_ids": True} if top else {})}
        request = {"model": model, "messages": messages, "temperature": temperature, "seed": seed + t}
        request.update(max_tokens=budget, extra_body=body or None, **({"tools": tools} if tools else {}))
        if top:
            request.update(logprobs=True, top_logprobs=top)
        r = await client.chat.completions.create(**request)
        choice = r.choices[0]
        msg = choice.message.to_dict()  # keeps prompt_token_ids / generation_token_ids / generation_log_probs
        prompt, ids = msg["prompt_token_ids"], msg["generation_token_ids"]
        check_splice(prompts, turns, prompt)
        prompts.append(prompt)
        calls = len(msg.get("tool_calls") or [])
        tops = top_logprobs_of(choice) if top else None
        lps, spec = msg["generation_log_probs"], turn_counters(r)
        turns.append(Turn(len(prompt), ids, lps, choice.finish_reason, calls, tops, spec))
        step = env.step(msg, choice.finish_reason)
        if step.done or len(prompt) + len(ids) >= limits.get("max_episode_tokens", 1 << 30):
            break
        messages = [*messages, msg, *step.observations]
    started = limits.get("started", time.perf_counter())
    return EpisodeResult(
        prompts[-1] + turns[-1].ids, turns, prompts, step.reward, step.correct, step.info, time.perf_counter() - started
    )


async def run_episodes(
    base_urls: list[str], model: str, envs: Mapping[int, Environment], *, seed: int, concurrency: int = 32, **kw
) -> list[EpisodeResult | BaseException]:
    """The episodes of ``envs`` (the step's episode index -> its environment), in the mapping's order: episode i
    goes to server ``i % len(base_urls)`` and is seeded ``seed + i * max_turns``, so an episode played again is
    played as before; at most ``concurrency`` run at once per server. An episode that raised gives its
    exception in its place, once every other episode has ended: the caller decides what it means."""
    from openai import AsyncOpenAI

    api_key, timeout = kw.pop("api_key", None) or "unused", kw.pop("timeout", 600.0)
    kw.setdefault("started", time.perf_counter())
    clients = [AsyncOpenAI(base_url=u, api_key=api_key, max_retries=0, timeout=120.0) for u in base_urls]
    gates = [asyncio.Semaphore(concurrency) for _ in base_urls]

    async def one(i: int, env: Environment) -> EpisodeResult:
        k = i % len(clients)
        async with gates[k]:
            return await run_episode(clients[k], model, env, seed=seed + i * kw["max_turns"], **kw)

    try:
        plays = (one(i, e) for i, e in envs.items())
        return await asyncio.wait_for(asyncio.gather(*plays, return_exceptions=True), timeout=timeout)
    finally:
        for c in clients:
            await c.close()
