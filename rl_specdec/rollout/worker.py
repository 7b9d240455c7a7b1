"""vLLM engines inside Ray actors: one base, and the synchronous engine.

:class:`VllmWorkerBase` holds what every engine actor does the same way:
report where it landed, prepare its process (environment, CPU cores), turn
:class:`SamplingSettings` into vLLM's ``SamplingParams``, turn vLLM's outputs
into plain dicts (token ids, log-probs, finish reasons, and the call's
spec-decode counters), and refuse sleep where vLLM has none.
:class:`VllmWorker` runs a synchronous ``vllm.LLM`` on top of it; the async
actor (:mod:`rl_specdec.rollout.serving.async_worker`) runs ``AsyncLLM``.

The actor is created cheaply first, so the group can learn which node and
host it landed on; ``start_engine`` then builds the engine with the CPU cores
the group assigned to it. Everything that crosses the actor boundary is token
ids, floats and plain dicts.

Whatever runs inside the engine (the weight reload, the start-up facts,
run-time k) is a method of :class:`~rl_specdec.rollout.engine_ext.RlSpecdecExtension`,
reached with ``collective_rpc``. With ``speculation_control`` on, the engine
is started in vLLM's dynamic-k mode, the fast path is installed and proven by
the start-up self-check (:meth:`VllmWorkerBase._control_script`, driven by each
worker), and every ``generate`` result carries the engine's report of the call
(``spec_control``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from typing import Any

from rl_specdec.config.engine_args import engine_args
from rl_specdec.config.generation import GenerationConfig, SpeculationControlConfig
from rl_specdec.errors import SleepNotSupported
from rl_specdec.metrics.console import LEVEL_ENV as QUIET_ENV
from rl_specdec.metrics.counters import aggregate_spec_decode_counters, counters_from_requests, counters_from_snapshot
from rl_specdec.rollout.engine_ext import EXTENSION
from rl_specdec.rollout.interfaces import SamplingSettings
from rl_specdec.rollout.runtime_k.startup import CHECK_TOKENS, drive, install_script
from rl_specdec.vllm_ext import check_vllm, platform


class VllmWorkerBase:
    """What every engine actor shares. Subclasses add the engine itself."""

    extension: str = EXTENSION  # vLLM's worker_extension_cls (tests start engines with a subclass of it)
    platform = "unknown"
    sleep_available = False
    control: SpeculationControlConfig | None = None  # run-time k, when installed (mode fixed or adaptive)

    @property
    def control_on(self) -> bool:
        return self.control is not None

    # ---- placement and process set-up ------------------------------------------------
    def placement(self) -> dict[str, Any]:
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "host": socket.gethostname(),
            "ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "host_cpus": len(os.sched_getaffinity(0)),
        }

    def _prepare_process(self, config: GenerationConfig, cpu_bind: str | None, server: bool = False) -> None:
        """Environment for vLLM, set before it is imported (and inherited by an engine-core process), and the
        version gate. ``GenerationConfig.env_vars`` are already set: the group starts the actor with them.
        """
        if cpu_bind is not None:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind
        if QUIET_ENV in os.environ:  # the console level (rl_specdec.metrics.console), also for what vLLM logs on import
            logging.getLogger("vllm").setLevel(os.environ[QUIET_ENV])
        check_vllm(config.allow_untested_vllm, config.vllm_hook_features(server))

    def _engine_kwargs(
        self, config: GenerationConfig, model: str, seed: int, asynchronous: bool = False
    ) -> dict[str, Any]:
        """What this engine receives (:func:`rl_specdec.config.engine_args.engine_args`), with this actor's
        extension class and console level."""
        quiet = logging.getLevelName(os.environ.get(QUIET_ENV, "INFO")) > logging.INFO
        return engine_args(config, model, seed, self.extension, quiet=quiet, asynchronous=asynchronous)

    def _note_platform(self) -> None:
        self.sleep_available = platform.sleep_available()
        self.platform = platform.device_type()

    def _start_info(
        self, t0: float, cpu_bind: str | None, facts: dict[str, Any], settings: dict[str, Any]
    ) -> dict[str, Any]:
        return {
            "settings": settings,
            "start_s": time.time() - t0,
            "cpu_expand_patched": facts["cpu_expand_patched"],
            "expand_path_ok": facts["expand_path_ok"],
            "compile_cache": facts["compile_cache"],
            "engine_pid": facts["engine_pid"],
            "actor_pid": os.getpid(),
            "platform": self.platform,
            "cpu_bind": cpu_bind,
        }

    def _control_script(self, config: GenerationConfig, seed: int):
        """Run-time k's start-up (rl_specdec.rollout.runtime_k.startup), or None where it is off."""
        self.control = config.speculation_control if config.runtime_k_on() else None
        return install_script(self.control, seed) if self.control_on else None

    @staticmethod
    def _check_sampling(n: int):
        return [SamplingSettings(max_tokens=CHECK_TOKENS, temperature=0.0, ignore_eos=True)] * n

    # ---- requests and results --------------------------------------------------------
    @staticmethod
    def _sampling_params(
        sampling: SamplingSettings, seed_index: int, extra: dict[str, Any] | None = None, **fixed: Any
    ):
        """vLLM ``SamplingParams`` for request ``seed_index`` of a call (seeded ``seed + seed_index``)."""
        from vllm import SamplingParams

        kwargs: dict[str, Any] = dict(
            n=1,
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            seed=None if sampling.seed is None else sampling.seed + seed_index,
            stop_token_ids=list(sampling.stop_token_ids),
            logprobs=sampling.logprobs,
            ignore_eos=sampling.ignore_eos,
            detokenize=False,
        )
        return SamplingParams(**{**kwargs, **fixed, **(extra or {})})  # extra wins: per-request overrides

    @staticmethod
    def _sample(c, want_top: bool) -> dict[str, Any]:
        """One vLLM ``CompletionOutput`` as a plain dict."""
        ids = list(c.token_ids)
        return {
            "token_ids": ids,
            "logprobs": [step[t].logprob for step, t in zip(c.logprobs or [], ids)],
            "finish_reason": "stop" if c.finish_reason == "stop" else str(c.finish_reason),
            "top_logprobs": [{k: v.logprob for k, v in step.items()} for step in c.logprobs] if want_top else None,
            "spec_counters": counters_from_requests([platform.spec_decode_metrics(c)]),
        }

    @staticmethod
    def _batch_result(
        samples: list[dict[str, Any]], time_s: float, finish_time_s: list[float], want_top: bool
    ) -> dict[str, Any]:
        """One call's samples (in input order) in the layout ``GenerationOutput.concat`` joins."""
        return {
            "token_ids": [s["token_ids"] for s in samples],
            "logprobs": [s["logprobs"] for s in samples],
            "finish_reasons": [s["finish_reason"] for s in samples],
            "top_logprobs": [s["top_logprobs"] for s in samples] if want_top else None,
            "time_s": time_s,
            "finish_time_s": finish_time_s,
            "spec_counters": aggregate_spec_decode_counters(s["spec_counters"] for s in samples),
        }

    def _require_sleep(self) -> None:
        if not self.sleep_available:
            raise SleepNotSupported(
                f"vLLM sleep mode is not available on the {self.platform} platform "
                "(it needs CUDA/ROCm/XPU and enable_sleep_mode=true in vllm_kwargs); "
                "on CPU the engine simply stays resident."
            )


class VllmWorker(VllmWorkerBase):
    """Holds one synchronous ``vllm.LLM`` whose engine core runs in this actor's process.

    In-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the CPU fix applied here
    reaches the sampler, and ``collective_rpc`` hands the extension Python
    objects (the state dict) without serialising them.
    """

    freeze_heap = True  # before vLLM's loader runs (:func:`_freeze_heap`); a study of engine start turns it off

    def start_engine(self, model: str, config: GenerationConfig, seed: int, cpu_bind: str | None) -> dict[str, Any]:
        """Build the engine; returns start-up facts (time, ``llm_s`` of it in ``vllm.LLM()``, CPU fix, platform,
        cores)."""
        t0 = time.time()
        self._prepare_process(config, cpu_bind)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from rl_specdec.vllm_ext.compile_cache import apply_compile_cache_fix
        from rl_specdec.vllm_ext.cpu_sampler import apply_cpu_spec_decode_fixes

        apply_cpu_spec_decode_fixes()
        apply_compile_cache_fix()
        from vllm import LLM

        if self.freeze_heap:
            _freeze_heap()
        kwargs, t_llm = self._engine_kwargs(config, model, seed), time.time()
        self.llm, self.seed = LLM(**kwargs), seed
        llm_s = time.time() - t_llm
        self._note_platform()
        self._drive(self._control_script(config, seed))
        facts, settings = (self.llm.collective_rpc(m)[0] for m in ("rl_specdec_engine_facts", "rl_specdec_settings"))
        return {**self._start_info(t0, cpu_bind, facts, settings), "llm_s": llm_s}

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingSettings, offset: int) -> dict[str, Any]:
        """Generate for this shard. ``offset`` is the shard's index in the batch (for per-request seeds)."""
        t0 = time.time()
        t0_mono = time.monotonic()  # vLLM's per-request timestamps are time.monotonic() in the engine core
        params = [self._sampling_params(sampling, offset + i) for i in range(len(prompt_token_ids))]
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompt_token_ids], params, use_tqdm=False)
        time_s = time.time() - t0
        finish = []
        for o in outs:
            done = platform.last_token_time(o)
            finish.append(time_s if done is None else min(max(done - t0_mono, 0.0), time_s))
        want_top = sampling.logprobs > 0
        result = self._batch_result([self._sample(o.outputs[0], want_top) for o in outs], time_s, finish, want_top)
        if self.control_on:
            result["spec_control"] = self.engine_rpc("rl_specdec_spec_report")[0]
        return result

    def _drive(self, script) -> Any:
        """Run a run-time k start-up script against this engine (None: nothing to run)."""
        if script is None:
            return None

        async def answer(request):
            return self._answer(request)

        return asyncio.run(drive(script, answer))

    def _answer(self, request: tuple) -> Any:
        if request[0] == "rpc":
            return self.engine_rpc(request[1], *request[2])[0]
        params = [self._sampling_params(s, 0) for s in self._check_sampling(len(request[1]))]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in request[1]], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def engine_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call a method of the engine's extension (``collective_rpc``); for run-time k, tools and tests."""
        return self.llm.collective_rpc(method, args=args, kwargs=kwargs or None)

    def set_speculation(self, k: int) -> list[int]:
        """k (0: off) everywhere, or the controller's cap; see ``RolloutEngine.set_speculation``."""
        return self.engine_rpc("rl_specdec_spec_set_k_max", int(k))[0]

    def check_spec_control(self) -> dict[str, Any] | None:
        """Run the start-up self-check of run-time k again (raises ConfigError if the fast path fails it)."""
        return self._drive(install_script(self.control, self.seed) if self.control_on else None)

    def engine_counters(self) -> dict[str, Any]:
        """vLLM's cumulative spec-decode counters over the engine's life (all traffic); {} without speculation."""
        return counters_from_snapshot(self.llm.get_metrics())

    def update_weights(self, state_dict: dict[str, Any], target: str = "policy") -> dict[str, Any]:
        """Load an HF-named state dict into the target model or the drafter; reset the prefix cache.

        Returns the engine's report (``loaded``, ``checksum``, ``problems``, ``time_s``).
        """
        t0 = time.time()
        report = self.llm.collective_rpc("rl_specdec_load_weights", args=(list(state_dict.items()), target))[0]
        if not report["problems"]:
            self.llm.reset_prefix_cache()  # cached KV computed with the old weights is wrong for the new ones
        return {**report, "time_s": time.time() - t0}

    # a streamed refit (VllmGeneration.update_weights_buckets): begin, one call per bucket, end
    def begin_reload(self, target: str = "policy") -> dict[str, Any]:
        return self.llm.collective_rpc("rl_specdec_begin_reload", args=(target,))[0]

    def load_bucket(self, bucket: dict[str, Any]) -> dict[str, Any]:
        return self.llm.collective_rpc("rl_specdec_load_bucket", args=(list(bucket.items()),))[0]

    def end_reload(self) -> dict[str, Any]:
        report = self.llm.collective_rpc("rl_specdec_end_reload")[0]
        self.llm.reset_prefix_cache()  # new weights, partly or wholly: cached KV is stale either way
        return report

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        self._require_sleep()
        self.llm.sleep(level=level)

    def wake_up(self) -> None:
        self._require_sleep()
        self.llm.wake_up()

    def shutdown(self) -> None:
        """Drop the engine; the group then kills this actor (and its process)."""
        import gc

        self.llm = None
        gc.collect()


def _freeze_heap() -> None:
    """Leave what the imports built out of every later garbage collection. vLLM's loader collects after each model
    it loads; over the heap torch, transformers and vLLM leave behind, each collection takes about half a second on
    2 cores, most of a toy engine's construction. vLLM freezes the heap itself once its engine is built, and
    unfreezes it when the engine shuts down."""
    import gc

    gc.collect()
    gc.freeze()
