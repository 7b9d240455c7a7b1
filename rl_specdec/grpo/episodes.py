"""Multi-turn rollouts: a task's episodes, G plays each, through the engines' OpenAI servers.

Each play runs in its own environment (``task.environment(episode)``: reset, then step per model turn) with the
real ``openai`` client (rl_specdec/rollout/serving/episodes.py), spread over the engines' servers and run
concurrently. The server splices the model's own tokens into every later prompt, and each turn checks that it
did, so a trajectory is the episode's token ids with each model turn's span and the engines' log-probs: the loss
covers the model's tokens only, never a tool result or a user turn. The reward is the environment's.

A draft model trained online distils on every model turn, in the episode's full context: the rollouts then ask
the servers for the policy's top-k log-probs per token (``return_tokens_as_token_ids``, keyed by id).

``spec_decode/*`` are the engines' counter deltas around the step's episodes (the servers serve nothing else
meanwhile), so they cover every turn; ``generation/time_to_*`` time the episodes, and ``episodes/*`` describe
them (:func:`episode_metrics`).

Episode i is played on engine ``i % E``. When an engine dies mid-step its episodes fail with the client's
connection error; once the group finds the engine's process gone, :class:`~rl_specdec.errors.EnginesLost` goes
up to the run's one decision (rl_specdec/grpo/recovery.py), and its ``redo`` plays every episode of the dead
engines again, from reset and with the same seeds, on their replacements. The other engines' episodes are kept;
none is kept in part. ``spec_decode/*`` then count the kept work: the survivors' and the replay's.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Callable

import torch

from rl_specdec.errors import EnginesLost, GenerationEngineDied
from rl_specdec.grpo.batch import Trajectory
from rl_specdec.grpo.sources import SAMPLING_CHECK_SEED, VAL_SEED, Request, Scored, group_request, step_prompts
from rl_specdec.metrics import aggregate_spec_decode_counters, compute_spec_decode_metrics
from rl_specdec.metrics.counters import counters_delta
from rl_specdec.rollout import GenerationOutput, SamplingSettings
from rl_specdec.rollout.serving.episodes import EpisodeOutput, EpisodeResult, per_turn_counters, run_episodes


class PendingEpisodes:
    """A step's episodes playing in a thread of their own while the driver trains (one step off-policy): what
    :class:`~rl_specdec.rollout.pending.PendingGeneration` is to single-turn rollouts. The thread is a daemon:
    episodes a stop dropped never hold the process's exit (the engines they talk to are shut down)."""

    def __init__(self, play: Callable[[], EpisodeOutput]):
        self.launched_at = time.perf_counter()
        self._out: EpisodeOutput | None = None
        self._error: Exception | None = None
        self._finished = threading.Event()
        threading.Thread(target=self._run, args=(play,), name="episodes", daemon=True).start()

    def _run(self, play: Callable[[], EpisodeOutput]) -> None:
        try:
            self._out = play()
        except Exception as e:  # noqa: BLE001  raised where the result is asked for: the run decides there
            self._error = e
        finally:
            self._finished.set()

    def done(self) -> bool:
        return self._finished.is_set()

    def result(self) -> EpisodeOutput:
        """Wait for every episode (a signal's handler still runs meanwhile: the wait is interruptible)."""
        self._finished.wait()
        if self._error is not None:
            raise self._error
        assert self._out is not None
        return self._out


class EpisodeSource:
    """The run's multi-turn task, played through the engines' servers (a :class:`~rl_specdec.grpo.sources.
    RolloutSource`: with ``grpo.max_staleness=1`` the next step's episodes play while this step trains)."""

    def __init__(self, run):
        self.run = run

    def request(self, step: int) -> Request:
        return group_request(self.run, step, step_prompts(self.run, step), [])

    def generate(self, request: Request) -> EpisodeOutput:
        return self._play(request.samples, request.sampling)

    def submit(self, request: Request) -> PendingEpisodes:
        return PendingEpisodes(lambda: self._play(request.samples, request.sampling))

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
        t0 = time.perf_counter()
        before = self.run.generation.engine_counters()  # [E] cumulative, per engine
        return self._gather(episodes, sampling, list(range(len(episodes))), [None] * len(episodes), before, {}, t0)

    def _gather(self, episodes, sampling, todo: list[int], out: list, before: list, kept: dict, t0: float):
        """Play episodes ``todo`` into ``out``. ``before``: each engine's counters when they began; ``kept``: the
        counters of work kept from an earlier round (engines that survived a death)."""
        engines, run = self.run.generation, self.run
        plays = {i: run.task.environment(episodes[i]) for i in todo}  # a fresh environment: an episode from reset
        failed = {}
        for i, x in zip(todo, asyncio.run(self._episodes(plays, sampling, t0))):
            if isinstance(x, BaseException):
                failed[i] = x
            else:
                out[i] = x
        if failed:
            raise self._lost(episodes, sampling, failed, out, before, kept, t0)
        try:
            after = engines.engine_counters()
        except GenerationEngineDied as e:  # an engine died after its episodes ended, before they were counted
            dead, n = engines.dead_engines(), engines.num_engines
            if not (failed := {i: e for i in todo if i % n in dead}):
                raise
            raise self._lost(episodes, sampling, failed, out, before, kept, t0) from e
        deltas = [counters_delta(b, a) for b, a in zip(before, after)]
        return EpisodeOutput.of(out, time.perf_counter() - t0, aggregate_spec_decode_counters([kept, *deltas]))

    def _lost(self, episodes, sampling, failed: dict[int, BaseException], out: list, before, kept, t0):
        """The error to raise for episodes that failed: :class:`~rl_specdec.errors.EnginesLost` when each failed
        because its engine's process is gone (its ``redo`` plays every episode of the dead engines again, from
        reset, with the same seeds, and keeps the others), else the first episode's own error."""
        import openai

        engines = self.run.generation
        n, first = engines.num_engines, failed[min(failed)]
        gone = all(isinstance(e, (openai.APIConnectionError, GenerationEngineDied)) for e in failed.values())
        dead = engines.dead_engines() if gone else []
        if not dead or any(i % n not in dead for i in failed):
            return next(e for i, e in sorted(failed.items()) if i % n not in dead)

        def redo() -> EpisodeOutput:
            now = engines.engine_counters()  # the replacements' first counters, and what the survivors did
            survived = [counters_delta(before[j], now[j]) for j in range(n) if j not in dead]
            again = [i for i in range(len(episodes)) if i % n in dead]
            for i in again:
                out[i] = None  # never half-kept: a dead engine's finished episodes are played again too
            return self._gather(
                episodes, sampling, again, out, now, aggregate_spec_decode_counters([kept, *survived]), t0
            )

        lost = EnginesLost(
            f"vLLM engine(s) {dead} died with {len(failed)} episode(s) in flight ({type(first).__name__}: {first}). "
            "Check the actor's log above (out of memory? killed?); resume=true continues from the last checkpoint.",
            dead,
            redo,
        )
        lost.__cause__ = first
        return lost

    async def _episodes(self, plays: dict[int, Any], sampling: SamplingSettings, t0: float) -> list:
        run, gen = self.run, self.run.cfg.policy.generation
        return await run_episodes(
            run.generation.base_urls(),
            gen.server.served_model_name or run.cfg.policy.model_name,
            plays,
            seed=sampling.seed if sampling.seed is not None else 0,
            temperature=sampling.temperature,
            max_turns=run.cfg.task.max_turns,
            max_tokens=gen.max_new_tokens,
            max_episode_tokens=run.cfg.task.max_episode_tokens,
            api_key=gen.server.api_key,
            top_logprobs=sampling.logprobs,
            started=t0,
        )


def rewards(xs: list[EpisodeResult]) -> tuple[torch.Tensor, torch.Tensor]:
    """The episodes' rewards [N] and whether each succeeded [N]."""
    return torch.tensor([x.reward for x in xs], dtype=torch.float), torch.tensor([float(x.correct) for x in xs])


def episode_metrics(xs: list[EpisodeResult]) -> dict[str, float]:
    """``episodes/*``: turns per episode, the share with a tool call, the model's share of the episodes' tokens,
    the mean response length of each turn, and the mean of every fact the environment reports; with speculation,
    ``spec_decode/turn_<i>_*`` from each turn's own counters."""
    n = len(xs)
    out = {
        "episodes/turns_mean": sum(len(x.turns) for x in xs) / n,
        "episodes/tool_call_rate": sum(any(t.tool_calls for t in x.turns) for x in xs) / n,
        "episodes/model_token_share": sum(x.model_tokens for x in xs) / max(1, sum(len(x.token_ids) for x in xs)),
    }
    for i in range(max(len(x.turns) for x in xs)):
        lengths = [len(x.turns[i].ids) for x in xs if len(x.turns) > i]
        out[f"episodes/turn_{i + 1}_response_length_mean"] = sum(lengths) / len(lengths)
    for i, counters in enumerate(per_turn_counters(xs)):
        m = compute_spec_decode_metrics(None, counters)
        keys = ("num_drafts", "acceptance_rate", "acceptance_length")  # each turn's own, as the step's are
        out.update({f"spec_decode/turn_{i + 1}_{k}": m[f"spec_decode/{k}"] for k in keys if f"spec_decode/{k}" in m})
    for key in sorted({k for x in xs for k in x.info}):
        out[f"episodes/{key}"] = sum(x.info.get(key, 0.0) for x in xs) / n
    return out
