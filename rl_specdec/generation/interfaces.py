"""The rollout interface: what the RL loop may ask of a generation backend.

Kept as small as verl's ``BaseRollout``: generate, update weights, sleep,
wake up, shut down, plus a counter read for metrics. Only token ids cross this
boundary in either direction; tokenisation belongs to the caller.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class SamplingSettings:
    """Per-call sampling settings (a subset of vLLM's ``SamplingParams``)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None  # request i is sampled with seed + i: reproducible under any sharding
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int = 0  # 0: the sampled token's log-prob only; K > 0: also the top K


@dataclass
class GenerationOutput:
    """Results in input order; lists are per prompt."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]  # log-prob of each generated token under the policy
    finish_reasons: list[str]  # "stop" (EOS / stop token) or "length"
    top_logprobs: list[list[dict[int, float]]] | None = None  # only when logprobs > 0
    per_engine_time_s: list[float] = field(default_factory=list)
    # Per sample: seconds from its engine's start of the call to the sample's last
    # token (vLLM's per-request timestamps). Shows the long tail: when 50/90/100%
    # of a step's rollouts were done. Empty where the engine does not report it.
    finish_time_s: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

    def time_until_done(self, fraction: float) -> float | None:
        """Seconds until ``fraction`` of the samples had finished (None without finish times).

        ``time_until_done(1.0)`` is the slowest sample: the long tail that the
        whole step waits for.
        """
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        if not self.finish_time_s:
            return None
        times = sorted(self.finish_time_s)
        return times[max(math.ceil(fraction * len(times)) - 1, 0)]

    def select(self, indices: list[int]) -> "GenerationOutput":
        """The outputs at ``indices``, in that order."""
        return GenerationOutput(
            token_ids=[self.token_ids[i] for i in indices],
            logprobs=[self.logprobs[i] for i in indices],
            finish_reasons=[self.finish_reasons[i] for i in indices],
            top_logprobs=None if self.top_logprobs is None else [self.top_logprobs[i] for i in indices],
            per_engine_time_s=list(self.per_engine_time_s),
            finish_time_s=[self.finish_time_s[i] for i in indices] if self.finish_time_s else [],
        )


class RolloutEngine(Protocol):
    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingSettings) -> GenerationOutput: ...

    def update_weights(self, state_dict: dict[str, Any]) -> None: ...

    def get_metrics(self) -> list[dict[str, Any]]: ...

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...

    def shutdown(self) -> None: ...
