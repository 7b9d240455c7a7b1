"""Multi-turn rollouts: a task's episodes, G plays each, through the engines' OpenAI servers.

Each play runs in its own environment (``task.environment(episode)``: reset, then step per model turn) with the
real ``openai`` client (rl_specdec/rollout/serving/episodes.py), spread over the engines' servers and run
concurrently. The server splices the model's own tokens into every later prompt, and each turn checks that it
did, so a trajectory is the episode's token ids with each model turn's span and the engines' log-probs: the loss
covers the model's tokens only, never a tool result or a user turn. The reward is the environment's.

``spec_decode/*`` are the engines' counter deltas around the step's episodes (the servers serve nothing else
meanwhile), so they cover every turn; ``generation/time_to_*`` time the episodes, and ``episodes/*`` describe
them (:func:`episode_metrics`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from rl_specdec.grpo.batch import Trajectory
from rl_specdec.grpo.sources import SAMPLING_CHECK_SEED, VAL_SEED, Request, Scored, group_request, step_prompts
from rl_specdec.metrics import aggregate_spec_decode_counters
from rl_specdec.metrics.counters import counters_delta
from rl_specdec.rollout import GenerationOutput, SamplingSettings
from rl_specdec.rollout.serving.episodes import EpisodeResult, run_episodes


@dataclass
class EpisodeOutput(GenerationOutput):
    """A step's episodes as one generation's output: per episode, the model's tokens of all its turns (their
    lengths and log-probs), the last turn's finish reason, and when the episode ended."""

    episodes: list[EpisodeResult] = field(default_factory=list)

    @classmethod
    def of(cls, xs: list[EpisodeResult], seconds: float, spec: dict[str, Any]) -> "EpisodeOutput":
        return cls(
            token_ids=[[i for t in x.turns for i in t.ids] for x in xs],
            logprobs=[[lp for t in x.turns for lp in t.logprobs] for x in xs],
            finish_reasons=[x.turns[-1].finish_reason for x in xs],
            per_engine_time_s=[seconds],
            finish_time_s=[x.done_s for x in xs],
            spec_counters=spec,
            episodes=xs,
        )


class EpisodeSource:
    """The run's multi-turn task, played through the engines' servers (a :class:`~rl_specdec.grpo.sources.
    RolloutSource` that runs sequentially: it has no ``submit``, and one step off-policy is refused at load)."""

    def __init__(self, run):
        self.run = run

    def request(self, step: int) -> Request:
        return group_request(self.run, step, step_prompts(self.run, step), [])

    def generate(self, request: Request) -> EpisodeOutput:
        return self._play(request.samples, request.sampling)

    def scored(self, request: Request, out: GenerationOutput) -> Scored:
        xs = out.episodes  # an EpisodeOutput: this source's own
        trajectories = [Trajectory(x.token_ids, [(t.start, t.ids, t.logprobs) for t in x.turns]) for x in xs]
        return Scored(trajectories, *rewards(xs), episode_metrics(xs))

    def held_out(self, n: int, sampling: SamplingSettings) -> tuple[torch.Tensor, torch.Tensor]:
        return rewards(self._play(self.run.task.validation_batch(seed=VAL_SEED, n=n), sampling).episodes)

    def check_prompts(self, n: int) -> list[list[int]]:
        """The held-out episodes' first prompts, rendered by the tokenizer's chat template with their tools."""
        run, out = self.run, []
        for episode in run.task.validation_batch(seed=SAMPLING_CHECK_SEED, n=n):
            messages, tools = run.task.environment(episode).reset()
            ids = run.tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True)
            out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
        return out

    def _play(self, episodes: list[Any], sampling: SamplingSettings) -> EpisodeOutput:
        """Every episode in its own environment, across the engines' servers; the engines' counter deltas."""
        run, gen = self.run, self.run.cfg.policy.generation
        server, engines = gen.server, run.generation
        before = aggregate_spec_decode_counters(engines.engine_counters())
        t0 = time.perf_counter()
        xs = asyncio.run(
            run_episodes(
                engines.base_urls(),
                server.served_model_name or run.cfg.policy.model_name,
                [run.task.environment(e) for e in episodes],
                seed=sampling.seed if sampling.seed is not None else 0,
                temperature=sampling.temperature,
                max_turns=run.cfg.task.max_turns,
                max_tokens=gen.max_new_tokens,
                max_episode_tokens=run.cfg.task.max_episode_tokens,
                api_key=server.api_key,
                started=t0,
            )
        )
        spec = counters_delta(before, aggregate_spec_decode_counters(engines.engine_counters()))
        return EpisodeOutput.of(xs, time.perf_counter() - t0, spec)


def rewards(xs: list[EpisodeResult]) -> tuple[torch.Tensor, torch.Tensor]:
    """The episodes' rewards [N] and whether each succeeded [N]."""
    return torch.tensor([x.reward for x in xs], dtype=torch.float), torch.tensor([float(x.correct) for x in xs])


def episode_metrics(xs: list[EpisodeResult]) -> dict[str, float]:
    """``episodes/*``: turns per episode, the share with a tool call, the model's share of the episodes' tokens,
    the mean response length of each turn, and the mean of every fact the environment reports."""
    n = len(xs)
    out = {
        "episodes/turns_mean": sum(len(x.turns) for x in xs) / n,
        "episodes/tool_call_rate": sum(any(t.tool_calls for t in x.turns) for x in xs) / n,
        "episodes/model_token_share": sum(x.model_tokens for x in xs) / max(1, sum(len(x.token_ids) for x in xs)),
    }
    for i in range(max(len(x.turns) for x in xs)):
        lengths = [len(x.turns[i].ids) for x in xs if len(x.turns) > i]
        out[f"episodes/turn_{i + 1}_response_length_mean"] = sum(lengths) / len(lengths)
    for key in sorted({k for x in xs for k in x.info}):
        out[f"episodes/{key}"] = sum(x.info.get(key, 0.0) for x in xs) / n
    return out
