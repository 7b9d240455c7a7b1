"""One vLLM *async* engine (``AsyncLLM``) inside one Ray actor, optionally behind an HTTP server.

The async worker is for rollouts that should not wait for the slowest sample
(multi-turn environments, agents, asynchronous RL): ``generate_async`` yields
every sample as soon as it finishes, and vLLM's own OpenAI server, mounted on
the same engine (:mod:`rl_specdec.rollout.serving.server`), lets environments talk
to it over HTTP while the trainer still gets token ids and log-probs.

It builds on :class:`~rl_specdec.rollout.worker.VllmWorkerBase` like the
synchronous worker and has the same method names, so the one group class
(:class:`~rl_specdec.rollout.group.VllmGeneration`) drives both; its
methods are ``async`` (Ray runs the actor on one event loop).

Where the engine runs, and the CPU fix: ``AsyncLLM`` always runs its engine
core in a separate process (it ignores ``VLLM_ENABLE_V1_MULTIPROCESSING``),
started with ``spawn`` inside a Ray actor, so a patch applied in the actor
never reaches the sampler. On CPU the worker therefore passes the executor
class of :mod:`~rl_specdec.vllm_ext.worker` as
``distributed_executor_backend``; it applies the fixes (sampling, compile
cache) in the engine-core process. Weights cross to that process packed (:mod:`~rl_specdec.rollout.weights`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, AsyncIterator, Sequence

from rl_specdec.config.generation import GenerationConfig
from rl_specdec.config.serving import ServerConfig
from rl_specdec.rollout.interfaces import SamplingSettings
from rl_specdec.rollout.runtime_k.startup import drive, install_script
from rl_specdec.rollout.worker import VllmWorkerBase
from rl_specdec.vllm_ext import platform


def per_prompt(value, n: int, name: str) -> list:
    """``value`` for each of ``n`` prompts: a list of n entries, or one value repeated."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n


class AsyncVllmWorker(VllmWorkerBase):
    """Holds one ``vllm.v1.engine.async_llm.AsyncLLM``. Wrapped with ``ray.remote`` by the group."""

    def __init__(self):
        self.engine = None
        self.server = None

    async def start_engine(
        self, model: str, config: GenerationConfig, seed: int, cpu_bind: str | None, server: ServerConfig | None = None
    ) -> dict[str, Any]:
        """Build the engine (and the HTTP server when ``server`` is given); returns start-up facts."""
        t0 = time.time()
        self._prepare_process(config, cpu_bind, server=server is not None)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        kwargs = self._engine_kwargs(config, model, seed, asynchronous=True)
        self.engine, self.seed = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs)), seed
        self._note_platform()
        await self._drive(self._control_script(config, seed))
        facts = (await self.engine.collective_rpc("rl_specdec_engine_facts"))[0]
        info = self._start_info(t0, cpu_bind, facts, (await self.engine.collective_rpc("rl_specdec_settings"))[0])
        info["base_url"] = None
        if server is not None:
            from rl_specdec.rollout.serving.server import start_openai_server

            self.server = await start_openai_server(self.engine, server)
            info["base_url"] = self.server.base_url
        return info

    # ---- generation ---------------------------------------------------------------------
    async def _run(self, prompt_token_ids: list[int], params) -> list[dict[str, Any]]:
        from vllm.inputs import TokensPrompt

        final = None
        async for out in self.engine.generate(
            TokensPrompt(prompt_token_ids=list(prompt_token_ids)), params, uuid.uuid4().hex
        ):
            final = out
        if final is None:
            raise RuntimeError("the engine finished the request without an output (aborted?)")
        want_top = bool(params.logprobs)
        return [self._sample(c, want_top) for c in sorted(final.outputs, key=lambda c: c.index)]

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
        ``{"min_tokens": 4}``), likewise shared or per prompt. ``sample``:
        ``token_ids``, ``logprobs``, ``finish_reason``, ``top_logprobs`` and
        ``spec_counters``. Request i is seeded with ``seed + offset + i``, as in
        the synchronous worker. If the consumer stops early, the unfinished
        requests are aborted.
        """
        from vllm.sampling_params import RequestOutputKind

        n = len(prompt_token_ids)
        settings, extras = per_prompt(sampling, n, "sampling"), per_prompt(extra, n, "extra")
        queue: asyncio.Queue = asyncio.Queue()

        async def one(i: int, p: list[int]) -> None:
            try:
                params = self._sampling_params(
                    settings[i], offset + i, extras[i], output_kind=RequestOutputKind.FINAL_ONLY
                )
                res: Any = (await self._run(p, params))[0]
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
        self,
        prompt_token_ids: list[list[int]],
        sampling: SamplingSettings,
        offset: int = 0,
        extra: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """All samples in input order, in the synchronous worker's layout."""
        t0 = time.time()
        results: dict[int, dict[str, Any]] = {}
        done: dict[int, float] = {}  # seconds from the call's start until each sample finished
        async for i, s in self.generate_async(prompt_token_ids, sampling, offset, extra):
            results[i], done[i] = s, time.time() - t0
        order = [offset + i for i in range(len(prompt_token_ids))]
        result = self._batch_result(
            [results[i] for i in order], time.time() - t0, [done[i] for i in order], sampling.logprobs > 0
        )
        if self.control_on:
            result["spec_control"] = (await self.engine_rpc("rl_specdec_spec_report"))[0]
        return result

    # ---- run-time k ---------------------------------------------------------------------
    async def _drive(self, script) -> Any:
        """Run a run-time k start-up script against this engine (as the synchronous worker does)."""
        return None if script is None else await drive(script, self._answer)

    async def _answer(self, request: tuple) -> Any:
        if request[0] == "rpc":
            return (await self.engine_rpc(request[1], *request[2]))[0]
        return (await self.generate(request[1], self._check_sampling(1)[0], 0))["token_ids"]

    async def engine_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call a method of the engine's extension in the engine-core process (``collective_rpc``)."""
        return await self.engine.collective_rpc(method, args=args, kwargs=kwargs or None)

    async def set_speculation(self, k: int) -> list[int]:
        """k (0: off) everywhere, or the controller's cap; see ``RolloutEngine.set_speculation``."""
        return (await self.engine_rpc("rl_specdec_spec_set_k_max", int(k)))[0]

    async def check_spec_control(self) -> dict[str, Any] | None:
        """Run the start-up self-check of run-time k again (raises ConfigError if the fast path fails it)."""
        return await self._drive(install_script(self.control, self.seed) if self.control_on else None)

    async def engine_counters(self) -> dict[str, Any]:
        """vLLM's cumulative spec-decode counters in this process's registry (all traffic, HTTP included)."""
        from rl_specdec.metrics.counters import counters_from_snapshot

        return counters_from_snapshot(platform.metrics_snapshot())

    # ---- weights and lifecycle ------------------------------------------------------------
    async def update_weights(self, state_dict: dict[str, Any], target: str = "policy") -> dict[str, Any]:
        """As the synchronous worker's; the weights cross to the engine-core process packed."""
        from rl_specdec.rollout.weights import pack

        t0 = time.time()
        report = (await self.engine.collective_rpc("rl_specdec_load_weights", args=(pack(state_dict), target)))[0]
        if not report["problems"]:
            await self.engine.reset_prefix_cache()
        return {**report, "time_s": time.time() - t0}

    async def begin_reload(self, target: str = "policy") -> dict[str, Any]:
        return (await self.engine.collective_rpc("rl_specdec_begin_reload", args=(target,)))[0]

    async def load_bucket(self, bucket: dict[str, Any]) -> dict[str, Any]:
        from rl_specdec.rollout.weights import pack

        return (await self.engine.collective_rpc("rl_specdec_load_bucket", args=(pack(bucket),)))[0]

    async def end_reload(self) -> dict[str, Any]:
        report = (await self.engine.collective_rpc("rl_specdec_end_reload"))[0]
        await self.engine.reset_prefix_cache()
        return report

    async def reset_prefix_cache(self) -> None:
        await self.engine.reset_prefix_cache()

    async def sleep(self, level: int = 1) -> None:
        self._require_sleep()
        await self.engine.sleep(level)

    async def wake_up(self) -> None:
        self._require_sleep()
        await self.engine.wake_up()

    async def num_inflight(self) -> int:
        """Requests submitted to the engine (by ``generate_async`` or the server) and not finished yet."""
        return self.engine.get_num_unfinished_requests()

    async def report_base_url(self) -> str | None:
        """``http://127.0.0.1:PORT/v1``, or None when the worker has no server."""
        return self.server.base_url if self.server is not None else None

    async def shutdown(self) -> None:
        """Stop the server and the engine (its engine-core process exits)."""
        if self.server is not None:
            await self.server.stop()
            self.server = None
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
