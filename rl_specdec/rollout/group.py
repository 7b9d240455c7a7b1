"""A data-parallel group of vLLM engines in Ray actors: one class for both engine kinds.

:class:`VllmGeneration` reserves one placement-group bundle per engine
(:mod:`~rl_specdec.rollout.placement`), starts one actor of its
``worker_cls`` in each, assigns disjoint CPU cores to engines that share a
host, and builds the engines. A batch of token-id prompts is cut into
contiguous shards, one per engine, generated concurrently, and gathered back
in input order together with each engine's spec-decode counters for the call.

:class:`AsyncVllmGeneration` is the same group with the async actor; it only
adds what is async: samples streamed as they finish (``iter_generate``) and
the engines' HTTP base URLs.

A failed start (placement, actor or engine) leaves no actor and no placement
group behind.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Iterable, Iterator, Sequence

import ray
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rl_specdec.config.generation import ClusterConfig, GenerationConfig
from rl_specdec.config.serving import ServerConfig, check_reasoning_parser
from rl_specdec.errors import EnginesLost, SamplingSelfCheckFailed
from rl_specdec.rollout import weights
from rl_specdec.rollout.engines import EngineSlots, other_process_died
from rl_specdec.rollout.interfaces import GenerationOutput, SamplingSettings
from rl_specdec.rollout.pending import PendingGeneration
from rl_specdec.rollout.sampling_guard import CalibrationReport, calibration_report
from rl_specdec.rollout.serving.async_worker import AsyncVllmWorker, per_prompt
from rl_specdec.rollout.worker import VllmWorker

logger = logging.getLogger(__name__)


@ray.remote(num_cpus=0)
class _Checksummer:
    """Computes the sender's checksum of a refit beside the engines' loads.

    An actor, not a task: Ray reaps idle task workers after a second, so a task
    per refit started a fresh process (and imported torch) every step, 1.7 s.
    """

    def checksum(self, state_dict: dict[str, Any]) -> str:
        return weights.checksum(state_dict)


class VllmGeneration(EngineSlots):
    """The rollout engine: N vLLM engines, one per Ray actor (a :class:`RolloutEngine`)."""

    worker_cls: type = VllmWorker
    actor_options: dict[str, Any] = {}

    def __init__(self, model: str, config: GenerationConfig, cluster: ClusterConfig | None = None, seed: int = 0):
        self._hold(model, config, cluster or ClusterConfig(), seed, {})
        self._start()

    # ---- RolloutEngine ----------------------------------------------------------------
    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingSettings) -> GenerationOutput:
        return self.submit(prompt_token_ids, sampling).result()

    def submit(self, prompt_token_ids: list[list[int]], sampling: SamplingSettings) -> PendingGeneration:
        """Start :meth:`generate` on every engine and return at once; ``.result()`` collects its output."""
        shards = self._shards(len(prompt_token_ids))

        def shard(i: int) -> ray.ObjectRef:  # engine i's share; request j is seeded seed + j, wherever it runs
            return self.workers[i].generate.remote(prompt_token_ids[shards[i]], sampling, shards[i].start)

        refs = [shard(i) for i in range(len(shards))]
        return PendingGeneration(refs, sampling.logprobs > 0, lambda r: self._gather(r, shard))

    def check_sampling(
        self,
        prompt_token_ids: list[list[int]],
        max_tokens: int,
        top_k: int = 5,
        seed: int = 0,
        min_p_value: float = 1e-6,
    ) -> CalibrationReport:
        """Sample at temperature 1 and refuse (raise) if the tokens are not distributed as the policy says.

        See :mod:`rl_specdec.rollout.sampling_guard`. Also fails when an engine's
        rejection-sampler expand path is broken on this platform.
        """
        broken = [i for i, info in enumerate(self.engine_info) if not info["expand_path_ok"]]
        if broken:
            raise SamplingSelfCheckFailed(
                f"engines {broken}: vLLM's rejection-sampler expand kernel returns wrong values on this platform, "
                "so speculative sampling at temperature > 0 would not be lossless."
            )
        sampling = SamplingSettings(max_tokens=max_tokens, temperature=1.0, seed=seed, logprobs=top_k)

        def judged(out: GenerationOutput) -> CalibrationReport:
            return self._calibrated(out, top_k, min_p_value)

        try:
            out = self.generate(prompt_token_ids, sampling)
        except EnginesLost as lost:  # the report is made from the call's whole output, once it is redone
            raise lost.then(judged) from lost.__cause__
        return judged(out)

    @staticmethod
    def _calibrated(out: GenerationOutput, top_k: int, min_p_value: float) -> CalibrationReport:
        report = calibration_report(out.token_ids, out.top_logprobs, top_k)
        if report.p_value < min_p_value:
            raise SamplingSelfCheckFailed(
                "sampled tokens are not distributed as the policy's probabilities say (" + report.summary() + "). "
                "Speculative decoding is changing what is sampled here; refusing to train. "
                "Turn speculation off (policy.generation.vllm_kwargs.speculative_config=null) or fix the engine."
            )
        return report

    def update_weights(self, state_dict: dict[str, Any] | ray.ObjectRef, target: str = "policy") -> float:
        """Refit every engine's target model (or its drafter) from an HF-named state dict or an ObjectRef to one.

        The dict is put in Ray's object store once and every engine reads it from
        there. Fail-closed: an engine that cannot take every tensor loads none and
        this raises ``WeightIntegrityError`` naming the engine and the tensor; so
        does a checksum that differs from the sender's. Returns seconds.
        """
        ref = state_dict if isinstance(state_dict, ray.ObjectRef) else ray.put(state_dict)
        sent = self._checksummer_actor().checksum.remote(ref)  # what was sent, computed beside the engines' loads
        reports = self._get([w.update_weights.remote(ref, target) for w in self.workers])
        weights.verify_reports(reports, target, ray.get(sent))
        return max(r["time_s"] for r in reports)

    def update_weights_buckets(
        self, buckets: Iterable[dict[str, Any] | ray.ObjectRef], target: str = "policy"
    ) -> float:
        """Refit from a stream of ObjectRefs of state-dict pieces (``PolicyInterface.state_dict_buckets``).

        Every engine loads each bucket as it comes (vLLM's layerwise reload, opened once
        and closed after the last bucket), so neither the object store nor an engine
        needs a second copy of the whole model. Verified bucket by bucket (names, shapes,
        the sender's checksum) and at the end (nothing missing); a problem raises
        ``WeightIntegrityError`` naming the engine and the tensor. Unlike
        :meth:`update_weights`, buckets before a refused one stay loaded: the run stops.
        Returns seconds.
        """
        t0 = time.time()
        try:
            begun = self._get([w.begin_reload.remote(target) for w in self.workers])
            self._load_stream(buckets, target, begun)
        finally:
            ends = self._get([w.end_reload.remote() for w in self.workers])
        weights.verify_reports(ends, target, None, streamed=True)
        return time.time() - t0

    def _load_stream(self, buckets, target: str, begun) -> None:
        try:
            weights.verify_reports(begun, target, None)
            for piece in buckets:
                ref = piece if isinstance(piece, ray.ObjectRef) else ray.put(piece)
                sent = self._checksummer_actor().checksum.remote(ref)
                reports = self._get([w.load_bucket.remote(ref) for w in self.workers])
                weights.verify_reports(reports, target, ray.get(sent), streamed=True)
                del ref, piece  # the policy's stream runs ahead only a few buckets: let this one go
        except RayActorError as e:  # the stream's sender died (an engine's death comes through _get, named)
            if self._is_engine(e):
                raise
            raise other_process_died(e) from e

    def _checksummer_actor(self):
        if self._checksummer is None:
            self._checksummer = _Checksummer.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self.pg)
            ).remote()
        return self._checksummer

    def reset_prefix_cache(self) -> None:
        self._get([w.reset_prefix_cache.remote() for w in self.workers])

    @property
    def control_on(self) -> bool:
        """Run-time k is installed: ``speculation_control`` is on and the engines speculate."""
        return self.config.runtime_k_on()

    def set_speculation(self, k_max: int) -> None:
        """At most ``k_max`` drafted tokens from now on, in every engine; 0 turns speculation off at no cost.

        Needs ``speculation_control.mode`` fixed (k becomes ``k_max`` everywhere) or
        adaptive (the controller never chooses more than ``k_max``).
        """
        if not self.control_on:
            raise RuntimeError(
                "set_speculation needs run-time k: set policy.generation.speculation_control.mode to fixed or adaptive "
                "(speculation_control.mode=off runs vLLM's k as configured)"
            )
        self._get([w.set_speculation.remote(int(k_max)) for w in self.workers])
        self.k_max = int(k_max)

    def check_spec_control(self) -> None:
        """Run every engine's start-up self-check of the k=0 fast path again; raises ConfigError where it fails."""
        self._get([w.check_spec_control.remote() for w in self.workers])

    def engine_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method`` of every engine's extension (``collective_rpc``); one result per engine.
        For tools and tests."""
        return [r[0] for r in self._get([w.engine_rpc.remote(method, *args, **kwargs) for w in self.workers])]

    def disable_speculation(self) -> None:
        """Speculation off for good. With run-time k (``speculation_control`` on): k=0 in
        every engine, which runs vLLM's plain path through the k=0 fast path, with no
        restart. Otherwise every engine restarts without ``speculative_config``
        (:meth:`restart`): vLLM's own non-speculative path. The new engines load the model
        path's weights (or dummy ones): refit them before the next rollout.
        """
        if self.control_on:  # run-time k: k=0 through the fast path, no restart
            self.set_speculation(0)
            return
        self.restart(self.config.without_speculation())

    def engine_counters(self) -> list[dict[str, Any]]:
        """Each engine's cumulative spec-decode counters (all its traffic); for tools and tests.

        A step's own counters come with its output (``GenerationOutput.spec_counters``).
        """
        return self._get([w.engine_counters.remote() for w in self.workers])

    def sleep(self, level: int = 1) -> None:
        self._get([w.sleep.remote(level) for w in self.workers])

    def wake_up(self) -> None:
        self._get([w.wake_up.remote() for w in self.workers])


class AsyncVllmGeneration(VllmGeneration):
    """N async engines, one per Ray actor, each optionally serving HTTP."""

    worker_cls = AsyncVllmWorker
    actor_options = {"max_concurrency": 1000}

    def __init__(
        self,
        model: str,
        config: GenerationConfig,
        cluster: ClusterConfig | None = None,
        seed: int = 0,
        server: ServerConfig | dict[str, Any] | None = None,
    ):
        """``server``: a :class:`~rl_specdec.config.serving.ServerConfig` (or its fields as a dict); None: no HTTP."""
        if isinstance(server, dict):
            server = ServerConfig.from_dict(server)
        if server is not None:  # load-time errors, before any actor starts
            server.check()
            check_reasoning_parser(server, config.vllm_kwargs.get("reasoning_parser"))
        self._hold(model, config, cluster or ClusterConfig(), seed, {"server": server})
        self._start()

    def base_urls(self) -> list[str | None]:
        """Each engine's OpenAI base URL (``http://127.0.0.1:PORT/v1``), None where it has no server."""
        return self._get([w.report_base_url.remote() for w in self.workers])

    def iter_generate(
        self,
        prompt_token_ids: list[list[int]],
        sampling: SamplingSettings | Sequence[SamplingSettings],
        extra: dict[str, Any] | Sequence[dict[str, Any]] | None = None,
    ) -> Iterator[tuple[int, dict[str, Any]]]:
        """Yield ``(index, sample)`` in the order samples finish, across all engines.

        Prompts are sharded as in ``generate``; ``index`` is the prompt's index in
        ``prompt_token_ids``. ``sampling``/``extra`` are shared or one per prompt.
        Stopping the iteration early cancels the rest.
        """
        n = len(prompt_token_ids)
        settings, extras = per_prompt(sampling, n, "sampling"), per_prompt(extra, n, "extra")
        pending = [
            w.generate_async.options(num_returns="streaming").remote(
                prompt_token_ids[s], settings[s], s.start, extras[s]
            )
            for w, s in zip(self.workers, self._shards(n))
        ]
        try:
            while pending:
                ready, _ = ray.wait(pending, num_returns=1)
                try:
                    ref = next(ready[0])
                except StopIteration:
                    pending.remove(ready[0])
                    continue
                yield self._get(ref)
        finally:
            for g in pending:
                ray.cancel(g)  # a finished stream ignores it
