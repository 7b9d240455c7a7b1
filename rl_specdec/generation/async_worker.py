"""One vLLM *async* engine (``AsyncLLM``) inside one Ray actor, optionally behind an HTTP server.

The async worker is the variant of :class:`~rl_specdec.generation.vllm_worker.VllmWorker`
for rollouts that should not wait for the slowest sample (multi-turn
environments, agents, asynchronous RL): ``generate_async`` yields every
sample as soon as it finishes, and an optional OpenAI-compatible server
(:mod:`rl_specdec.generation.server`) lets environments talk to the engine
over HTTP while the trainer still gets token ids and log-probs.

Methods (all ``async``; Ray runs the actor on one event loop):

* ``start_engine(model, vllm_kwargs, seed, cpu_bind, env_vars, server)``
* ``generate_async(prompt_token_ids, sampling, offset, extra)``: an async generator of
  ``(index, sample)``; call it with ``.options(num_returns="streaming")``;
* ``generate(...)``: the same samples gathered in input order (the shape
  ``VllmWorker.generate`` returns, so :class:`AsyncVllmGeneration` reuses
  ``VllmGeneration``'s batch methods);
* ``get_metrics()``: the spec-decode counters in vLLM's names, as ``VllmWorker``;
* ``update_weights_async`` (refit with vLLM's ``reload_weights`` in the engine
  core, then a prefix-cache reset), ``reset_prefix_cache_async``, ``sleep_async``,
  ``wake_up_async`` (``SleepNotSupported`` on CPU), ``report_base_url``,
  ``num_inflight``, ``shutdown``. The names without ``_async`` are aliases
  (``VllmGeneration`` calls those).

Where the engine runs, and the CPU fix
--------------------------------------
``AsyncLLM`` always runs its engine core in a separate process (it ignores
``VLLM_ENABLE_V1_MULTIPROCESSING``), and inside a Ray actor vLLM starts that
process with ``spawn``. A patch applied in the actor therefore never reaches
the code that samples. vLLM's CPU platform also turns the in-core ``uni``
executor into ``mp`` (a third process) when multiprocessing is on.

So on CPU the worker hands vLLM a custom executor class through the public
``distributed_executor_backend`` engine argument:
:class:`CpuFixedUniProcExecutor`, a ``UniProcExecutor`` whose
``_init_executor`` calls :func:`~rl_specdec.generation.cpu_patches.apply_cpu_spec_decode_fixes`
first. The class is pickled by reference, so the engine-core process imports
this module and applies the fix before vLLM's worker registers its CPU kernel
overrides. A worker extension (:class:`EngineProbe`, the public
``worker_extension_cls`` argument) reports from inside the engine-core process
whether the fix is in place and whether the rejection sampler's expand path is
right; ``start_engine`` returns those facts and
``VllmGeneration.check_sampling`` refuses to go on if they are wrong.

Refit: ``AsyncLLM.collective_rpc("reload_weights", kwargs={"weights_iterator": ...})``
does not work as it does for the in-process ``LLM``: the arguments cross to the
engine-core process through vLLM's msgpack IPC, which encodes a tensor as
``(dtype, shape, buffer)`` but decodes untyped utility arguments as plain
lists (``'list' object has no attribute 'dtype'`` in ``load_weights``). So the
worker packs the state dict into ``(name, dtype, shape, bytes)`` tuples
(:func:`pack_state_dict`) and the worker extension rebuilds the tensors and
calls vLLM's own ``reload_weights(weights_iterator=..., is_checkpoint_format=True)``
in the engine-core process. The prefix cache is reset afterwards. This copies
the weights through a socket: fine for the toy and small models on CPU; on
GPUs the transport to add is CUDA IPC or NCCL, as for the synchronous engine.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from typing import Any, AsyncIterator, Iterator, Sequence

from rl_specdec.generation.config import ClusterConfig, GenerationConfig
from rl_specdec.generation.interfaces import SamplingSettings
from rl_specdec.generation.spec_config import ConfigError
from rl_specdec.generation.vllm_worker import VllmWorker, spec_counters

logger = logging.getLogger(__name__)

EXECUTOR_NAME = "CpuFixedUniProcExecutor"


# ---- code that runs in the engine-core process ---------------------------------------------


def _make_executor_class():
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    class CpuFixedUniProcExecutor(UniProcExecutor):
        """``UniProcExecutor`` that applies the CPU expand fix in its own process before the worker starts."""

        def _init_executor(self) -> None:
            from rl_specdec.generation.cpu_patches import apply_cpu_spec_decode_fixes

            apply_cpu_spec_decode_fixes()
            super()._init_executor()

    CpuFixedUniProcExecutor.__module__ = __name__
    CpuFixedUniProcExecutor.__qualname__ = EXECUTOR_NAME
    return CpuFixedUniProcExecutor


def __getattr__(name: str):
    # Built on first use so that importing this module does not import vLLM
    # (the driver only needs the actor class); pickle finds it by this name.
    if name == EXECUTOR_NAME:
        cls = _make_executor_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class EngineProbe:
    """Mixed into vLLM's worker (``worker_extension_cls``); its methods run in the engine-core process."""

    def rl_specdec_engine_facts(self) -> dict[str, Any]:
        from vllm.platforms import current_platform

        from rl_specdec.generation import cpu_patches

        on_cpu = current_platform.is_cpu()
        return {
            "engine_pid": os.getpid(),
            "cpu_expand_patched": bool(cpu_patches._state["patched"]),
            "expand_path_ok": cpu_patches.expand_path_is_correct() if on_cpu else True,
        }

    def rl_specdec_reload_weights(self, packed: list[tuple[str, str, list[int], bytes]]) -> int:
        """Rebuild the state dict sent by :func:`pack_state_dict` and hand it to vLLM's ``reload_weights``."""
        weights = unpack_state_dict(packed)
        self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        return len(weights)


def pack_state_dict(state_dict: dict[str, Any]) -> list[tuple[str, str, list[int], bytes]]:
    """``(name, dtype, shape, raw bytes)`` per tensor: plain types that survive vLLM's msgpack IPC.

    ``AsyncLLM.collective_rpc`` encodes a tensor argument as ``(dtype, shape,
    buffer index)`` but decodes untyped utility arguments as plain lists, so
    tensors cannot be passed as they are.
    """
    import torch

    out = []
    for name, t in state_dict.items():
        t = t.detach().to("cpu").contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        out.append((name, dtype, list(t.shape), t.view(torch.uint8).numpy().tobytes() if t.numel() else b""))
    return out


def unpack_state_dict(packed) -> list[tuple[str, Any]]:
    import torch

    weights = []
    for name, dtype, shape, data in packed:
        dt = getattr(torch, dtype)
        if len(data) == 0:
            t = torch.empty(shape, dtype=dt)
        else:
            t = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dt).view(shape)
        weights.append((name, t))
    return weights


# ---- the actor --------------------------------------------------------------------------------


def _per_prompt(value, n: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n


def _sample_dict(c, want_top: bool) -> dict[str, Any]:
    ids = list(c.token_ids)
    lps = [step[t].logprob for step, t in zip(c.logprobs or [], ids)]
    return {
        "token_ids": ids,
        "logprobs": lps,
        "finish_reason": "stop" if c.finish_reason == "stop" else str(c.finish_reason),
        "top_logprobs": [{k: v.logprob for k, v in step.items()} for step in c.logprobs] if want_top else None,
    }


class AsyncVllmWorker:
    """Holds one ``vllm.v1.engine.async_llm.AsyncLLM``. Wrapped with ``ray.remote`` by the group."""

    placement = VllmWorker.placement
    _require_sleep = VllmWorker._require_sleep

    def __init__(self):
        self.engine = None
        self.server = None
        self.inflight = 0  # requests submitted to the engine and not finished yet

    async def start_engine(
        self,
        model: str,
        vllm_kwargs: dict[str, Any],
        seed: int,
        cpu_bind: str | None,
        env_vars: dict[str, str] | None = None,
        server: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Build the engine (and the HTTP server when ``server`` is given); returns start-up facts."""
        t0 = time.time()
        os.environ.update({k: str(v) for k, v in (env_vars or {}).items()})
        if cpu_bind is not None:  # inherited by the engine-core process
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        kwargs = dict(vllm_kwargs)
        kwargs["disable_log_stats"] = False  # the spec-decode counters need stat logging
        on_cpu = current_platform.is_cpu()
        if on_cpu:
            world = int(kwargs.get("tensor_parallel_size", 1)) * int(kwargs.get("pipeline_parallel_size", 1))
            if world > 1 or kwargs.get("distributed_executor_backend") not in (None, "uni"):
                raise ConfigError(
                    "the async engine on CPU runs one worker in the engine-core process (so the CPU "
                    "sampling fix reaches it): remove tensor_parallel_size/pipeline_parallel_size/"
                    "distributed_executor_backend from vllm_kwargs, or use the synchronous engine."
                )
            kwargs["distributed_executor_backend"] = __getattr__(EXECUTOR_NAME)
        probe = self.probe = kwargs.get("worker_extension_cls") is None
        if probe:
            kwargs["worker_extension_cls"] = f"{__name__}.EngineProbe"
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, seed=seed, **kwargs))
        self.has_spec = kwargs.get("speculative_config") is not None
        self.sleep_available = current_platform.is_sleep_mode_available()
        self.platform = str(current_platform.device_type)
        self.model_path = model
        self.max_model_len = int(self.engine.model_config.max_model_len)
        self.vocab_size = int(self.engine.model_config.get_vocab_size())
        facts = (await self.engine.collective_rpc("rl_specdec_engine_facts"))[0] if probe else {}
        if not probe and on_cpu:
            logger.warning(
                "vllm_kwargs.worker_extension_cls is set, so the engine core cannot report whether the CPU "
                "sampling fix is in place (and refit is unavailable); rely on check_sampling's chi-square test"
            )
        info = {
            "start_s": time.time() - t0,
            "cpu_expand_patched": facts.get("cpu_expand_patched"),
            "expand_path_ok": facts.get("expand_path_ok", True),
            "engine_pid": facts.get("engine_pid"),
            "actor_pid": os.getpid(),
            "platform": self.platform,
            "cpu_bind": cpu_bind,
            "base_url": None,
        }
        if server is not None:
            from transformers import AutoTokenizer

            from rl_specdec.generation.server import ServerConfig, start_server

            cfg = ServerConfig(**server)
            self.tokenizer = AutoTokenizer.from_pretrained(kwargs.get("tokenizer") or model)
            self.model_name = cfg.served_model_name or model
            self.server = await start_server(self, cfg)
            info["base_url"] = self.server.base_url
        return info

    # ---- generation ---------------------------------------------------------------------
    def _params(self, sampling: SamplingSettings, index: int, extra: dict[str, Any] | None = None):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=1,
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            seed=None if sampling.seed is None else sampling.seed + index,
            stop_token_ids=list(sampling.stop_token_ids),
            logprobs=sampling.logprobs,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
            **(extra or {}),
        )

    async def _run(self, prompt_token_ids: list[int], params) -> list[dict[str, Any]]:
        from vllm.inputs import TokensPrompt

        final = None
        self.inflight += 1
        try:
            async for out in self.engine.generate(TokensPrompt(prompt_token_ids=list(prompt_token_ids)), params, uuid.uuid4().hex):
                final = out
        finally:
            self.inflight -= 1
        if final is None:
            raise RuntimeError("the engine finished the request without an output (aborted?)")
        want_top = bool(params.logprobs)
        return [_sample_dict(c, want_top) for c in sorted(final.outputs, key=lambda c: c.index)]

    async def generate_tokens(self, prompt_token_ids: list[int], params: dict[str, Any]) -> list[dict[str, Any]]:
        """The HTTP server's entry: ``params`` are ``vllm.SamplingParams`` keyword arguments."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return await self._run(prompt_token_ids, SamplingParams(**params, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY))

    async def generate_async(
        self,
        prompt_token_ids: list[list[int]],
        sampling: SamplingSettings | Sequence[SamplingSettings],
        offset: int = 0,
        extra: dict[str, Any] | Sequence[dict[str, Any]] | None = None,
    ) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        """Yield ``(offset + i, sample)`` for each prompt as soon as its sample is done.

        ``sampling`` is one :class:`SamplingSettings` for all prompts or one per
        prompt; ``extra`` adds ``vllm.SamplingParams`` arguments (e.g.
        ``{"ignore_eos": True}``), likewise shared or per prompt. ``sample``:
        ``token_ids``, ``logprobs`` (of each generated token), ``finish_reason``
        ("stop" or "length") and ``top_logprobs`` (when ``logprobs > 0``, else
        None). Request i is seeded with ``seed + offset + i``, as in the
        synchronous worker. If the consumer stops early, the unfinished requests
        are aborted.
        """
        n = len(prompt_token_ids)
        settings = _per_prompt(sampling, n, "sampling")
        extras = _per_prompt(extra, n, "extra")
        queue: asyncio.Queue = asyncio.Queue()

        async def one(i: int, p: list[int]) -> None:
            try:
                res: Any = (await self._run(p, self._params(settings[i], offset + i, extras[i])))[0]
            except BaseException as e:  # noqa: BLE001  (handed to the consumer)
                res = e
            queue.put_nowait((offset + i, res))

        tasks = [asyncio.ensure_future(one(i, p)) for i, p in enumerate(prompt_token_ids)]
        try:
            for _ in tasks:
                index, res = await queue.get()
                if isinstance(res, BaseException):
                    raise res
                yield index, res
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()  # AsyncLLM.generate aborts a cancelled request

    async def generate(
        self, prompt_token_ids: list[list[int]], sampling: SamplingSettings, offset: int = 0, extra: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """All samples in input order, in ``VllmWorker.generate``'s layout."""
        t0 = time.time()
        results: dict[int, dict[str, Any]] = {}
        done: dict[int, float] = {}  # seconds from the call's start until each sample finished
        async for i, s in self.generate_async(prompt_token_ids, sampling, offset, extra):
            results[i], done[i] = s, time.time() - t0
        ordered = [results[offset + i] for i in range(len(prompt_token_ids))]
        return {
            "token_ids": [s["token_ids"] for s in ordered],
            "logprobs": [s["logprobs"] for s in ordered],
            "finish_reasons": [s["finish_reason"] for s in ordered],
            "top_logprobs": [s["top_logprobs"] for s in ordered] if sampling.logprobs > 0 else None,
            "time_s": time.time() - t0,
            "finish_time_s": [done[offset + i] for i in range(len(prompt_token_ids))],
        }

    # ---- metrics --------------------------------------------------------------------------
    async def get_metrics(self) -> dict[str, Any]:
        """Cumulative spec-decode counters in vLLM's own names ({} without speculation).

        AsyncLLM records them in this (the front-end) process's Prometheus registry.
        """
        if not self.has_spec:
            return {}
        from vllm.v1.metrics.reader import get_metrics_snapshot

        return spec_counters(get_metrics_snapshot())

    # ---- weights and lifecycle ------------------------------------------------------------
    async def update_weights_async(self, state_dict: dict[str, Any]) -> float:
        """Load a Hugging Face-named state dict into the target model, then reset the prefix cache."""
        t0 = time.time()
        if not self.probe:
            raise RuntimeError(
                "refit of the async engine goes through the rl_specdec worker extension "
                "(vllm_kwargs.worker_extension_cls must be unset)"
            )
        # vLLM's reload_weights, run in the engine-core process (see pack_state_dict for why packed)
        await self.engine.collective_rpc("rl_specdec_reload_weights", args=(pack_state_dict(state_dict),))
        await self.engine.reset_prefix_cache()
        return time.time() - t0

    async def reset_prefix_cache_async(self) -> None:
        await self.engine.reset_prefix_cache()

    async def sleep_async(self, level: int = 1) -> None:
        self._require_sleep()
        await self.engine.sleep(level)

    async def wake_up_async(self) -> None:
        self._require_sleep()
        await self.engine.wake_up()

    async def num_inflight(self) -> int:
        """Requests submitted to the engine (by ``generate_async`` or the server) and not finished yet."""
        return self.inflight

    async def report_base_url(self) -> str | None:
        """``http://127.0.0.1:PORT/v1``, or None when the worker has no server."""
        return self.server.base_url if self.server is not None else None

    async def server_stats(self) -> dict[str, int]:
        if self.server is None:
            return {}
        st = self.server.app.state
        return {"num_requests": st.num_requests, "num_errors": st.num_errors}

    async def shutdown(self) -> None:
        """Stop the server and the engine (its engine-core process exits)."""
        if self.server is not None:
            await self.server.stop()
            self.server = None
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    # VllmGeneration calls these names
    update_weights = update_weights_async
    reset_prefix_cache = reset_prefix_cache_async
    sleep = sleep_async
    wake_up = wake_up_async


# ---- the group ----------------------------------------------------------------------------------


def _group_base():
    from rl_specdec.generation.vllm_generation import VllmGeneration

    return VllmGeneration


class AsyncVllmGeneration(_group_base()):
    """N async engines, one per Ray actor, each optionally serving HTTP.

    Placement, core binding, batch ``generate`` (in input order),
    ``check_sampling``, metrics, refit, sleep and shutdown are
    :class:`~rl_specdec.generation.vllm_generation.VllmGeneration`'s;
    this class adds :meth:`iter_generate` (samples as they finish, across
    engines) and :meth:`base_urls`.
    """

    def __init__(
        self,
        model: str,
        config: GenerationConfig,
        cluster: ClusterConfig | None = None,
        seed: int = 0,
        server: "ServerConfig | dict[str, Any] | None" = None,
    ):
        import dataclasses

        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from rl_specdec.generation.server import ServerConfig
        from rl_specdec.generation.vllm_generation import assign_cpu_binds, init_ray, reserve_engine_bundles

        if isinstance(server, ServerConfig):
            server.check()
            server = dataclasses.asdict(server)
        elif server is not None:
            ServerConfig(**server).check()
        self.config = config
        self.model = model
        cluster = cluster or ClusterConfig()
        init_ray(cluster)
        n = config.num_engines
        self.pg, on_gpu = reserve_engine_bundles(config, cluster, "async num_engines")
        actor_cls = ray.remote(AsyncVllmWorker)
        self.workers = [
            actor_cls.options(
                num_cpus=0 if on_gpu else config.cpus_per_engine,
                num_gpus=0,
                max_concurrency=1000,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=i),
            ).remote()
            for i in range(n)
        ]
        self.placements = ray.get([w.placement.remote() for w in self.workers])
        binds = assign_cpu_binds(self.placements, config.cpus_per_engine) if not on_gpu else [None] * n
        t0 = time.time()
        try:
            self.engine_info = self._get(
                [
                    w.start_engine.remote(model, config.vllm_kwargs, seed, b, dict(config.env_vars), server)
                    for w, b in zip(self.workers, binds)
                ]
            )
        except BaseException:
            self.shutdown()
            raise
        self.start_s = time.time() - t0

    def base_urls(self) -> list[str | None]:
        """Each engine's OpenAI base URL (``http://127.0.0.1:PORT/v1``), None where it has no server."""
        import ray

        return ray.get([w.report_base_url.remote() for w in self.workers])

    def iter_generate(
        self,
        prompt_token_ids: list[list[int]],
        sampling: SamplingSettings | Sequence[SamplingSettings],
        extra: dict[str, Any] | Sequence[dict[str, Any]] | None = None,
    ) -> Iterator[tuple[int, dict[str, Any]]]:
        """Yield ``(index, sample)`` in the order samples finish, across all engines.

        Prompts are sharded as in ``generate``; ``index`` is the prompt's index in
        ``prompt_token_ids``. ``sampling``/``extra`` as in
        ``AsyncVllmWorker.generate_async`` (shared or one per prompt). Stopping
        the iteration early cancels the rest.
        """
        import ray

        from rl_specdec.generation.vllm_generation import shard_sizes

        n = len(prompt_token_ids)
        settings = _per_prompt(sampling, n, "sampling")
        extras = _per_prompt(extra, n, "extra")
        gens, start = [], 0
        for w, size in zip(self.workers, shard_sizes(n, self.num_engines)):
            if size:
                sl = slice(start, start + size)
                gens.append(
                    w.generate_async.options(num_returns="streaming").remote(prompt_token_ids[sl], settings[sl], start, extras[sl])
                )
            start += size
        pending = list(gens)
        try:
            while pending:
                ready, _ = ray.wait(pending, num_returns=1)
                g = ready[0]
                try:
                    ref = next(g)
                except StopIteration:
                    pending.remove(g)
                    continue
                yield self._get(ref)
        finally:
            for g in pending:
                try:
                    ray.cancel(g)
                except Exception:
                    pass
