"""One vLLM engine inside one Ray actor.

The actor is created cheaply first (``VllmWorker()``), so the group can learn
which node and host it landed on, then ``start_engine`` builds the engine with
the CPU cores the group assigned to it. Everything that crosses the actor
boundary is token ids, floats and plain dicts.

Refit goes through vLLM's public RPC: ``LLM.collective_rpc("reload_weights")``
reloads the *target* model from a Hugging Face state dict; the speculative
drafter is a separate model in the worker and is not touched. The prefix cache
is reset afterwards, because cached KV computed with the old weights is wrong
for the new ones.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from rl_specdec.generation.interfaces import SamplingSettings

SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)
SPEC_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_counters(metrics) -> dict[str, Any]:
    """The spec-decode counters of a vLLM metrics snapshot, in vLLM's own names."""
    out: dict[str, Any] = {}
    for m in metrics:
        if m.name in SPEC_COUNTERS:
            out[m.name] = out.get(m.name, 0.0) + float(m.value)
        elif m.name == SPEC_PER_POS:
            vals = [float(v) for v in m.values]
            prev = out.get(m.name, [0.0] * len(vals))
            out[m.name] = [a + b for a, b in zip(prev, vals)]
    return out


class SleepNotSupported(RuntimeError):
    pass


class VllmWorker:
    """Holds one ``vllm.LLM``. Wrapped with ``ray.remote`` by the group."""

    def placement(self) -> dict[str, Any]:
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "host": socket.gethostname(),
            "ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "host_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
        }

    def start_engine(
        self,
        model: str,
        vllm_kwargs: dict[str, Any],
        seed: int,
        cpu_bind: str | None,
        env_vars: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """Build the engine; returns start-up facts (time, patches, platform)."""
        t0 = time.time()
        os.environ.update({k: str(v) for k, v in (env_vars or {}).items()})
        # In-process engine core: the CPU fix below reaches it, and
        # collective_rpc passes Python objects without serialising them.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if cpu_bind is not None:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind
        from rl_specdec.generation.cpu_patches import apply_cpu_spec_decode_fixes, expand_path_is_correct

        patched = apply_cpu_spec_decode_fixes()

        from vllm import LLM
        from vllm.platforms import current_platform

        kwargs = dict(vllm_kwargs)
        kwargs["disable_log_stats"] = False  # LLM.get_metrics() needs stat logging
        self.llm = LLM(model=model, seed=seed, **kwargs)
        self.has_spec = kwargs.get("speculative_config") is not None
        self.sleep_available = current_platform.is_sleep_mode_available()
        self.platform = str(current_platform.device_type)
        expand_ok = expand_path_is_correct() if current_platform.is_cpu() else True
        return {
            "start_s": time.time() - t0,
            "cpu_expand_patched": patched,
            "expand_path_ok": expand_ok,
            "platform": self.platform,
            "cpu_bind": cpu_bind,
        }

    # ---- generation -------------------------------------------------------
    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingSettings, offset: int) -> dict[str, Any]:
        """Generate for this shard. ``offset`` is the shard's index in the batch (for per-request seeds)."""
        from vllm import SamplingParams

        t0 = time.time()
        t0_mono = time.monotonic()  # vLLM's per-request timestamps are time.monotonic() in the engine core
        params = [
            SamplingParams(
                n=1,
                max_tokens=sampling.max_tokens,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                seed=None if sampling.seed is None else sampling.seed + offset + i,
                stop_token_ids=list(sampling.stop_token_ids),
                logprobs=sampling.logprobs,
                detokenize=False,
            )
            for i in range(len(prompt_token_ids))
        ]
        prompts = [{"prompt_token_ids": list(p)} for p in prompt_token_ids]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        time_s = time.time() - t0
        token_ids, logprobs, reasons, tops, finish = [], [], [], [], []
        for o in outs:
            stats = o.metrics  # RequestStateStats (stat logging is on)
            done = getattr(stats, "last_token_ts", 0.0) if stats is not None else 0.0
            finish.append(min(max(done - t0_mono, 0.0), time_s) if done else time_s)
            c = o.outputs[0]
            ids = list(c.token_ids)
            token_ids.append(ids)
            lps = [step[t].logprob for step, t in zip(c.logprobs, ids)]
            logprobs.append(lps)
            reasons.append("stop" if c.finish_reason == "stop" else str(c.finish_reason))
            if sampling.logprobs > 0:
                tops.append([{k: v.logprob for k, v in step.items()} for step in c.logprobs])
        return {
            "token_ids": token_ids,
            "logprobs": logprobs,
            "finish_reasons": reasons,
            "top_logprobs": tops if sampling.logprobs > 0 else None,
            "time_s": time_s,
            "finish_time_s": finish,
        }

    # ---- metrics ----------------------------------------------------------
    def get_metrics(self) -> dict[str, Any]:
        """Cumulative spec-decode counters in vLLM's own names ({} without speculation)."""
        return spec_counters(self.llm.get_metrics()) if self.has_spec else {}

    # ---- weights and lifecycle -------------------------------------------
    def update_weights(self, state_dict: dict[str, Any]) -> float:
        """Load a Hugging Face-named state dict into the target model. Returns seconds."""
        t0 = time.time()
        self.llm.collective_rpc(
            "reload_weights",
            kwargs={"weights_iterator": list(state_dict.items()), "is_checkpoint_format": True},
        )
        self.llm.reset_prefix_cache()
        return time.time() - t0

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def _require_sleep(self) -> None:
        if not self.sleep_available:
            raise SleepNotSupported(
                f"vLLM sleep mode is not available on the {self.platform} platform "
                "(it needs CUDA/ROCm/XPU and enable_sleep_mode=true in vllm_kwargs); "
                "on CPU the engine simply stays resident."
            )

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
