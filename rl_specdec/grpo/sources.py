"""Where a step's rollouts come from: prompts answered in one turn (:class:`PromptSource`), or episodes of several
turns played through the engines' OpenAI servers (:class:`~rl_specdec.grpo.episodes.EpisodeSource`).

A source gives a step's request (deterministic in the run's seed and the step, so a resumed run sees exactly the
batches it would have seen), generates it, and turns the output into trajectories (token ids, and each model
turn with the engines' log-probs), one reward per trajectory, and metrics of its own. The step, its schedule and
the loop call either source the same way (:class:`RolloutSource`); only token ids cross the generation boundary,
and text exists only where a task verifies answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from rl_specdec.grpo.batch import Trajectory
from rl_specdec.rollout import GenerationOutput, SamplingSettings
from rl_specdec.tasks import Sample, encode_prompts

SEED_STRIDE = 1_000_003  # prime: the seeds of two runs (seed, seed + 1) never meet for step < 1e6
STEP_SAMPLING_STRIDE = 10_007  # prime: a step's sampling seeds (this + i for request i) stay apart from the next step's
VAL_SEED = 10**9 + 7  # held-out problems: a seed no training step reaches
SAMPLING_CHECK_SEED = VAL_SEED + 1  # the start-up sampling check's problems


def prompt_seed(seed: int, step: int) -> int:
    """The task's seed for step ``step``'s problems: a pure function of the run's seed and the step."""
    return seed * SEED_STRIDE + step


def sampling_seed(seed: int, step: int) -> int:
    """The engines' seed for step ``step``'s rollouts (request i is sampled with this + i)."""
    return seed * SEED_STRIDE + step * STEP_SAMPLING_STRIDE


def step_prompts(run, step: int) -> list[Any]:
    """Step ``step``'s P problems (or episodes), drawn from the task by the step's seed."""
    return run.task.make_batch(seed=prompt_seed(run.cfg.seed, step), n=run.cfg.grpo.num_prompts_per_step)


@dataclass
class Request:
    """One step's rollouts, asked for."""

    step: int
    samples: list[Any]  # [P*G]: each problem (or episode) repeated G times, group-major
    prompt_ids: list[list[int]]  # [P*G]; [] for episodes, whose prompts the servers render
    sampling: SamplingSettings


@dataclass
class Scored:
    """What the update trains on: one trajectory and one reward per rollout."""

    trajectories: list[Trajectory]  # [P*G]
    rewards: torch.Tensor  # [P*G]
    correct: torch.Tensor  # [P*G]
    metrics: dict[str, float]  # the source's own (episodes: turns, tool calls, the model's share of tokens)


class RolloutSource(Protocol):
    def request(self, step: int) -> Request: ...

    def generate(self, request: Request) -> GenerationOutput: ...

    def submit(self, request: Request) -> Any:
        """The generation started, ahead of its step (one step off-policy: grpo/pipeline.py): ``result()``,
        ``done()`` and ``launched_at``."""
        ...

    def scored(self, request: Request, out: GenerationOutput) -> Scored: ...

    def held_out(self, n: int, sampling: SamplingSettings) -> tuple[torch.Tensor, torch.Tensor]:
        """Rewards [n] and correct [n] on the held-out problems (validation)."""
        ...

    def check_prompts(self, n: int) -> list[list[int]]:
        """``n`` held-out first prompts as token ids (the start-up sampling check)."""
        ...


def group_request(run, step: int, samples: list[Any], prompt_ids: list[list[int]]) -> Request:
    """Step ``step``'s request: each of the P ``samples`` (and its prompt ids) repeated G times, with the step's
    sampling seeds, and the policy's top-k log-probs when the drafter trains on them."""
    G = run.cfg.grpo.num_generations_per_prompt
    sampling = SamplingSettings.from_config(
        run.cfg.policy.generation, seed=sampling_seed(run.cfg.seed, step), logprobs=run.drafter.top_k(step)
    )
    repeated = [ids for ids in prompt_ids for _ in range(G)]  # [P*G]
    return Request(step, [s for s in samples for _ in range(G)], repeated, sampling)


def decode_response(tokenizer, ids: list[int], finish_reason: str) -> str:
    if finish_reason == "stop" and ids and ids[-1] == tokenizer.eos_token_id:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=True)


def score(run, samples: list[Sample], out: GenerationOutput) -> tuple[torch.Tensor, torch.Tensor]:
    """rewards [N], correct [N] for responses aligned with ``samples``."""
    rewards, correct = [], []
    for s, ids, reason in zip(samples, out.token_ids, out.finish_reasons):
        r = run.task.score(decode_response(run.tokenizer, ids, reason), s.answer, reason == "stop")
        rewards.append(r.reward)
        correct.append(float(r.correct))
    return torch.tensor(rewards), torch.tensor(correct)


class PromptSource:
    """Single-turn rollouts: the task's prompts, each answered once by the engines."""

    def __init__(self, run):
        self.run = run

    def request(self, step: int) -> Request:
        run, samples = self.run, step_prompts(self.run, step)
        return group_request(run, step, samples, encode_prompts(run.task, run.tokenizer, samples))

    def generate(self, request: Request) -> GenerationOutput:
        return self.run.generation.generate(request.prompt_ids, request.sampling)

    def submit(self, request: Request) -> Any:
        return self.run.generation.submit(request.prompt_ids, request.sampling)

    def scored(self, request: Request, out: GenerationOutput) -> Scored:
        rewards, correct = score(self.run, request.samples, out)  # [P*G], [P*G]
        trajectories = [
            Trajectory.single_turn(p, ids, lps) for p, ids, lps in zip(request.prompt_ids, out.token_ids, out.logprobs)
        ]
        return Scored(trajectories, rewards, correct, {})

    def held_out(self, n: int, sampling: SamplingSettings) -> tuple[torch.Tensor, torch.Tensor]:
        run = self.run
        samples = run.task.validation_batch(seed=VAL_SEED, n=n)
        out = run.generation.generate(encode_prompts(run.task, run.tokenizer, samples), sampling)
        return score(run, samples, out)

    def check_prompts(self, n: int) -> list[list[int]]:
        run = self.run
        return encode_prompts(run.task, run.tokenizer, run.task.validation_batch(seed=SAMPLING_CHECK_SEED, n=n))
