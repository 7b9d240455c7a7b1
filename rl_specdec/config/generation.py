"""Settings of the generation side (the ``policy.generation`` and ``cluster`` keys)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Optional

from rl_specdec.config.serving import ServerConfig
from rl_specdec.vllm_ext.methods import method as method_row


@dataclass
class ClusterConfig:
    """Where Ray runs. ``address=None`` starts a local Ray instance."""

    address: Optional[str] = None  # e.g. "auto" or "ray://head:10001" to join an existing cluster
    num_cpus: Optional[int] = None  # CPUs for a local Ray instance (default: all)
    placement_strategy: str = "PACK"  # PACK | SPREAD | STRICT_PACK | STRICT_SPREAD


@dataclass
class DrafterTrainingConfig:
    """Online training of the drafter towards the policy: a draft_model by distillation (rl_specdec.drafter), an
    eagle3 head from the policy's own hidden states (rl_specdec.heads.training)."""

    enabled: bool = False
    # AdamW's learning rate; null: 1e-3 for a draft model, 1e-4 for an eagle3 head (a head built near the policy's
    # optimum; 1e-3 moved it away: acceptance fell step by step on the wide pair; docs/lab/heads.md,
    # "The first two GRPO invocations")
    learning_rate: Optional[float] = None
    steps_per_update: int = 1  # optimizer steps on each training step's rollouts
    every: int = 1  # train and refit the drafter every N GRPO steps
    top_k: int = 8  # policy log-probs per generated token, returned by vLLM with the rollouts (<= 20)
    micro_batch_size: int = 128
    # train on at most this many of a step's rollouts (a random subset, seeded by the step); 0: all.
    # The drafter's training competes with the policy's for the same cores on CPU: this bounds its cost.
    max_sequences: int = 0
    overlap: bool = True  # train in the drafter's own actor while the policy updates (draft_model)
    # eagle3: the head trains in the policy workers, on the update's forward (its hidden states and log-probs),
    # one head step per update; chain_steps drafting steps per position (training-time test: the k it learns)
    chain_steps: int = 3

    def lr_for(self, method: str) -> float:
        """``learning_rate``, its null resolved for ``method``."""
        return self.learning_rate if self.learning_rate is not None else (1e-4 if method_row(method).head else 1e-3)


@dataclass
class CanaryConfig:
    """Acceptance collapse right after a refit: see rl_specdec.drafter.canary."""

    action: str = "warn"  # warn | disable (speculation off for the rest of the run) | fail
    min_ratio: float = 0.5  # trips below min_ratio x the running median acceptance rate
    window: int = 20  # healthy steps in the running median


@dataclass
class SpeculationControlConfig:
    """k chosen while the engine runs: see rl_specdec.config.engine_args (draft_model, eagle3 and ngram)."""

    # off (vLLM's own k or schedule) | fixed (k settable at run time) | adaptive (the controller) |
    # auto (where run-time k can run with a drafter: draft_model or eagle3, a UniProc executor, no async
    # scheduling: fixed when draft_below is set, else adaptive; elsewhere off; config/speculation.py)
    mode: str = "off"
    k_max: Optional[int] = None  # the most k may be; default: speculative_config.num_speculative_tokens
    # k=0 steps skip the drafter (caught up before it next drafts: a draft model from the token ids, a head from
    # the policy's hidden states the plain step kept); false: vLLM's own path (slower, correct). null: true
    k0_fast_path: Optional[bool] = None
    # a concurrency threshold (fixed, adaptive): draft only while fewer requests than this run, k=0 from there up
    # (through the fast path); null: no threshold. With it, auto runs this rule instead of the controller.
    draft_below: Optional[int] = None
    # where the controller starts (adaptive): zero (warm up, then k=0 until a k>0 measures faster) | schedule
    # (each bucket at speculative_config's k or schedule, kept until measured otherwise); null: schedule when
    # speculative_config has num_speculative_tokens_per_batch_size, else zero
    start: Optional[str] = None
    buckets: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])  # batch-size bucket lower bounds
    explore: float = 0.03  # fraction of steps that try another k (adaptive)
    explore_steps: int = 4  # steps per exploration burst
    min_gain: float = 0.1  # a k>0 must be measured this much faster than k=0 in its bucket (adaptive)
    memory_steps: int = 200  # the step-cost model forgets with this horizon (steps)
    acceptance_memory: int = 2000  # the acceptance estimate forgets with this horizon (drafts)

    @property
    def fast_path(self) -> bool:
        """``k0_fast_path``, its null resolved (true)."""
        return self.k0_fast_path is not False


SCHEDULE_END = 1 << 16  # the dynamic-k schedule covers every batch size vLLM may run (it clips to max_num_seqs)
Schedule = tuple[tuple[int, int, int], ...]  # (first batch size, last batch size, k)


SPEC_KEY = "policy.generation.vllm_kwargs.speculative_config"


def _spec_error(name: str, value: Any, what: str):
    from rl_specdec.errors import ConfigError

    return ConfigError(f"{SPEC_KEY}.{name}={value!r} {what}")


def _sequence(v: Any) -> bool:
    return isinstance(v, Sequence) and not isinstance(v, (str, bytes))


def _schedule(entries: Any) -> Schedule | None:
    """``num_speculative_tokens_per_batch_size`` as integer triples (first batch size, last batch size, k)."""
    if not entries:
        return None

    def triple(e: Any) -> bool:
        return _sequence(e) and len(e) == 3 and all(isinstance(x, int) and not isinstance(x, bool) for x in e)

    ok = _sequence(entries) and all(triple(e) for e in entries)
    if not ok:
        raise _spec_error(
            "num_speculative_tokens_per_batch_size",
            entries,
            "must be a list of [first batch size, last batch size, k] integer triples, e.g. [[1, 3, 2], [4, 1024, 0]]",
        )
    return tuple(tuple(e) for e in entries)


@dataclass(frozen=True)
class Speculation:
    """A validated ``speculative_config``, typed. ``options``: its other keys, as vLLM takes them
    (``draft_sample_method``, ``prompt_lookup_max``, ``draft_load_config``, ...)."""

    method: str
    k: int  # num_speculative_tokens: the most tokens drafted per step (a schedule's largest k)
    model: str | None = None  # the drafter's folder or hub id; None for model-free methods (ngram, suffix)
    schedule: Schedule | None = None  # num_speculative_tokens_per_batch_size, as written
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def from_vllm(cls, spec: Mapping[str, Any] | None) -> Speculation | None:
        """The object of a validated ``speculative_config`` (None: no speculation)."""
        if spec is None:
            return None
        rest = {k: v for k, v in spec.items() if v is not None}
        method, model = rest.pop("method", None), rest.pop("model", None)
        for name, v in (("method", method), ("model", model)):
            if v is not None and not isinstance(v, str):
                raise _spec_error(name, v, "must be a string")
        schedule = _schedule(rest.pop("num_speculative_tokens_per_batch_size", None))
        k = rest.pop("num_speculative_tokens", None)
        if k is not None and (isinstance(k, bool) or not isinstance(k, int)):
            raise _spec_error("num_speculative_tokens", k, "must be an integer (the most tokens drafted a step: 3)")
        k = k if k is not None else max(e[2] for e in schedule or ((1, 1, 1),))
        return cls(method, k, model, schedule, MappingProxyType(rest))

    @property
    def is_head(self) -> bool:
        """An EAGLE-3 head: it drafts from the policy's hidden states and trains in the policy's workers."""
        return method_row(self.method).head

    def to_vllm(self, control: Optional[SpeculationControlConfig] = None) -> dict[str, Any]:
        """The ``speculative_config`` an engine starts with; ``control`` (run-time k on): dynamic-k mode at k_max,
        the schedule the lookup starts from (``draft_below`` makes it k below the threshold, 0 from it up)."""
        out: dict[str, Any] = {"method": self.method, "num_speculative_tokens": self.k, **self.options}
        if self.model is not None:
            out["model"] = self.model
        schedule = [list(e) for e in self.schedule] if self.schedule else None
        if control is not None:
            out["num_speculative_tokens"] = max(int(control.k_max or self.k), self.k)
            schedule = schedule or [[1, SCHEDULE_END, self.k]]
            if control.draft_below is not None:
                schedule = [[1, control.draft_below - 1, self.k], [control.draft_below, SCHEDULE_END, 0]]
        if schedule is not None:
            out["num_speculative_tokens_per_batch_size"] = schedule
        return out

    def settings(self) -> dict[str, Any]:
        """What was asked for, in the flat keys an engine's read-back uses (``speculative/<key>``)."""
        return {f"speculative/{k}": v for k, v in self.to_vllm().items()}


@dataclass
class EngineRestartConfig:
    """An engine whose process dies is replaced and the run goes on (rl_specdec.grpo.recovery).

    The last finished step is checkpointed first either way; a new engine takes the dead one's bundle, gets
    the trainer's weights (and the drafter's), verified, and generates the dead engine's share again.
    """

    enabled: bool = True  # false: an engine's death stops the run (after that checkpoint)
    max_restarts: int = 3  # replacements per run; one more death stops it
    max_per_hour: int = 3  # replacements within any hour; a host that keeps killing engines stops the run


@dataclass
class GenerationConfig:
    """One data-parallel group of vLLM engines."""

    num_engines: int = 1
    cpus_per_engine: int = 1  # CPU bundle per engine (also the cores bound to its OpenMP threads)
    max_new_tokens: int = 64
    # The trainer scores the unmodified policy, so training samples from it: load refuses anything else.
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    # Sample the first batch with top-k log-probs at start-up and refuse to
    # continue if the emitted tokens are not distributed as the policy says.
    self_check: bool = True
    # Environment variables of each engine's process, set when the process starts (Ray
    # runtime_env), so LD_PRELOAD and OpenMP settings take effect.
    env_vars: dict[str, str] = field(default_factory=dict)
    # vLLM may run a setting other than the one asked for (on CPU it turns async_scheduling
    # off). false: warn once per such setting; true: stop before the first step.
    strict_engine_settings: bool = False
    # rl_specdec's engine hooks are written for one vLLM release (rl_specdec.vllm_ext.WRITTEN_FOR); another
    # release stops the run at start-up unless this is true (a hook that moved stops it regardless).
    allow_untested_vllm: bool = False
    drafter_training: DrafterTrainingConfig = field(default_factory=DrafterTrainingConfig)
    acceptance_canary: CanaryConfig = field(default_factory=CanaryConfig)
    speculation_control: SpeculationControlConfig = field(default_factory=SpeculationControlConfig)
    engine_restart: EngineRestartConfig = field(default_factory=EngineRestartConfig)
    # null: engines without HTTP. Set: async engines, each serving vLLM's OpenAI app (docs/multi_turn.md lists the
    # keys); a multi-turn task's episodes are played through it
    server: Optional[ServerConfig] = None
    # vLLM's engine arguments, speculative_config included, validated at load; rl_specdec.config.engine_args
    # builds what an engine receives from them.
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def speculation(self) -> Speculation | None:
        """``vllm_kwargs.speculative_config`` typed and frozen (None: no speculation). The dict stays vLLM's shape
        for the YAML and the printed config; every reader outside ``rl_specdec.config`` takes this instead.

        Typed once and kept beside the dict it came from: nothing edits that dict in place (a change replaces it,
        as :meth:`set_drafter_model` does), so the object is rebuilt only when the dict is another one."""
        raw = self.vllm_kwargs.get("speculative_config")
        kept = self.__dict__.get("_typed")  # not a field: OmegaConf, equality and the printed config ignore it
        if kept is None or kept[0] is not raw:
            kept = self.__dict__["_typed"] = (raw, Speculation.from_vllm(raw))
        return kept[1]

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles (Ray) leave the typed object behind: it holds a read-only mapping, and a copy types
        its own dict again on first read."""
        return {k: v for k, v in self.__dict__.items() if k != "_typed"}

    def set_drafter_model(self, model: str) -> None:
        """The drafter's name replaced by its folder (rl_specdec.toy.resolve.prepare_models)."""
        self.vllm_kwargs["speculative_config"] = {**self.vllm_kwargs["speculative_config"], "model": model}

    def without_speculation(self) -> GenerationConfig:
        """These settings with speculation off (what a group restarts with when speculation is turned off)."""
        kw = {k: v for k, v in self.vllm_kwargs.items() if k != "speculative_config"}
        return dataclasses.replace(self, vllm_kwargs=kw)

    def runtime_k_on(self) -> bool:
        """Run-time k is installed: ``speculation_control`` is on and the engines speculate."""
        return self.speculation_control.mode != "off" and self.speculation is not None

    def vllm_hook_features(self, server: bool = False) -> tuple[str, ...]:
        """The groups of vLLM hooks an engine with these settings uses (``rl_specdec.vllm_ext.FEATURES``)."""
        trains_head = self.speculation is not None and self.speculation.is_head and self.drafter_training.enabled
        features = ("core",) + (("runtime_k",) if self.runtime_k_on() else ()) + (("heads",) if trains_head else ())
        return features + (("server",) if server else ())
