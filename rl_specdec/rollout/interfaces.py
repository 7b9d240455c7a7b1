"""The rollout interface: what the RL loop may ask of a generation backend.

Kept as small as verl's ``BaseRollout``: generate, check that sampling is
lossless, update weights, reset the prefix cache, cap speculation, sleep,
wake up, shut down.
Only token ids cross this boundary in either direction; tokenisation belongs
to the caller. Speculative-decoding counters travel *with* each output
(:attr:`GenerationOutput.spec_counters`), so a step's ``spec_decode/*``
metrics describe exactly that step's requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from rl_specdec.metrics.counters import aggregate_spec_decode_counters
from rl_specdec.rollout.sampling_guard import CalibrationReport

if TYPE_CHECKING:  # typing only: the config module imports nothing from here
    from rl_specdec.config.generation import GenerationConfig


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
    ignore_eos: bool = False  # run to max_tokens past EOS: for benchmarks that need a fixed batch, never for RL

    @classmethod
    def from_config(cls, gen: "GenerationConfig", *, seed: int | None = None, **overrides: Any) -> "SamplingSettings":
        """The rollout settings of ``policy.generation`` (``overrides`` e.g. ``temperature=0.0`` for validation)."""
        base = {
            "max_tokens": gen.max_new_tokens,
            "temperature": gen.temperature,
            "top_p": gen.top_p,
            "top_k": gen.top_k,
        }
        return cls(**{**base, "seed": seed, **overrides})


@dataclass
class GenerationOutput:
    """Results in input order; lists are per prompt."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]  # log-prob of each generated token under the policy
    finish_reasons: list[str]  # "stop" (EOS / stop token) or "length"
    top_logprobs: list[list[dict[int, float]]] | None = None  # only when logprobs > 0
    per_engine_time_s: list[float] = field(default_factory=list)
    # Per sample: seconds from its engine's start of the call to the sample's last
    # token. Shows the long tail: when 50/90/100% of a step's rollouts were done.
    finish_time_s: list[float] = field(default_factory=list)
    # This call's spec-decode counters summed over its requests and engines, in
    # vLLM's names (rl_specdec.metrics.counters); {} without speculation.
    spec_counters: dict[str, Any] = field(default_factory=dict)
    # Per engine, what run-time k did during this call (speculation_control on; [] otherwise):
    # k per batch-size bucket, predicted and realised tokens/s (rl_specdec.metrics.control_metrics).
    spec_control: list[dict[str, Any]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

    @classmethod
    def concat(cls, parts: Sequence[dict[str, Any]], with_top: bool) -> "GenerationOutput":
        """Join engine shards (each a worker's result dict, in input order)."""
        out = cls(token_ids=[], logprobs=[], finish_reasons=[], top_logprobs=[] if with_top else None)
        for p in parts:
            out.token_ids += p["token_ids"]
            out.logprobs += p["logprobs"]
            out.finish_reasons += p["finish_reasons"]
            if with_top:
                out.top_logprobs += p["top_logprobs"]
            out.per_engine_time_s.append(p["time_s"])
            out.finish_time_s += p["finish_time_s"]
        out.spec_counters = aggregate_spec_decode_counters(p.get("spec_counters") for p in parts)
        out.spec_control = [p["spec_control"] for p in parts if p.get("spec_control")]
        return out

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

    def distill_spans(self, prompt_ids: list[list[int]]) -> list[tuple[list[int], list[tuple[int, list]]]]:
        """Per sample, what a drafter distils on: its token ids and the spans of generated tokens, each
        ``(start, top-k log-probs)``; here one span after the prompt."""
        tops = self.top_logprobs or [[] for _ in self.token_ids]
        return [(p + r, [(len(p), t)]) for p, r, t in zip(prompt_ids, self.token_ids, tops)]

    def select(self, indices: list[int]) -> "GenerationOutput":
        """The outputs at ``indices``, in that order (the counters stay the whole call's)."""
        return GenerationOutput(
            token_ids=[self.token_ids[i] for i in indices],
            logprobs=[self.logprobs[i] for i in indices],
            finish_reasons=[self.finish_reasons[i] for i in indices],
            top_logprobs=None if self.top_logprobs is None else [self.top_logprobs[i] for i in indices],
            per_engine_time_s=list(self.per_engine_time_s),
            finish_time_s=[self.finish_time_s[i] for i in indices] if self.finish_time_s else [],
            spec_counters=dict(self.spec_counters),
            spec_control=list(self.spec_control),
        )


class RolloutEngine(Protocol):
    """Everything the RL loop calls on a generation backend."""

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingSettings) -> GenerationOutput: ...

    def submit(self, prompt_token_ids: list[list[int]], sampling: SamplingSettings) -> Any:
        """Start ``generate`` and return at once: a handle with ``done()`` and ``result()`` (the output)."""
        ...

    def check_sampling(
        self, prompt_token_ids: list[list[int]], max_tokens: int, top_k: int = 5, seed: int = 0
    ) -> CalibrationReport:
        """Raise ``SamplingSelfCheckFailed`` unless temperature-1 samples follow the policy."""
        ...

    def update_weights(self, state_dict: Any, target: str = "policy") -> float:
        """Load HF-named weights into every engine's target model (or ``target="drafter"``: its drafter).

        Verified: raises ``WeightIntegrityError`` unless every engine holds what was sent. Returns seconds.
        """
        ...

    def update_weights_buckets(self, buckets: Any, target: str = "policy") -> float:
        """The same, from an iterable of state-dict pieces (or ObjectRefs to them), loaded one at a time.

        Verified per piece and at the end. Returns seconds.
        """
        ...

    def reset_prefix_cache(self) -> None: ...

    def disable_speculation(self) -> None:
        """Speculation off for good: the engines run without a drafter from now on.

        The engines may come back with the weights of the model path, not the
        trainer's: the caller refits them (``update_weights``) before the next rollout.
        """
        ...

    def set_speculation(self, k_max: int) -> None:
        """Draft at most ``k_max`` tokens from now on (0: speculation off, at no cost); raises where k is not
        settable."""
        ...

    def sleep(self, level: int = 1) -> None: ...

    def wake_up(self) -> None: ...

    def shutdown(self) -> None: ...
