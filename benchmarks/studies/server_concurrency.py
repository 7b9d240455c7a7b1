"""Requests/s and latency of the OpenAI server under 1, 16 and 64 concurrent chat clients: the
hand-written server that vLLM's app replaced ("legacy") against vLLM's own app ("vllm"), side by side.

Both servers are mounted on the **same** engine (one async engine actor, the toy
policy, ``--spec`` speculation), on the same event loop, so the engine settings
are the same by construction and a load that drifts during the run hits both.
The legacy server is not part of the package any more: it is read from git
history (``--legacy-rev``) and run through a small adapter that gives it the
backend methods it used (``generate_tokens``, ``tokenizer``, ``model_name``,
``max_model_len``, ``vocab_size``).

For each concurrency level C, C closed-loop clients (httpx) send chat requests
back to back until ``max(--min-requests, C * --rounds)`` are answered: sorting
prompts, temperature 1, seeded, at most ``--max-tokens`` new tokens. Both
servers return the token ids and log-probs (the new one through its RL
defaults). Cells run in A B B A order (alternating which comes first), after
one untimed pass over every cell (vLLM's CPU backend pays a one-off cost per
new batch shape). Also reported: the CPU time the actor process (HTTP server
and AsyncLLM's output handling) and the engine-core process spend per
request, which is far less sensitive to other load than wall-clock figures.

Nothing else should run on the machine meanwhile.

    python -m benchmarks.studies.server_concurrency
    python -m benchmarks.studies.server_concurrency --repeats 3 --out results/server_ab
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rl_specdec.rollout.group import AsyncVllmGeneration
from rl_specdec.rollout.serving.async_worker import AsyncVllmWorker

REPO = Path(__file__).resolve().parents[2]
LEGACY_REV = "f0082a6"  # the last commit with the hand-written server (then rl_specdec/generation/server.py)
LEGACY_PATH = "rl_specdec/generation/server.py"
SERVERS = ("legacy", "vllm")


class LegacyBackend:
    """What the legacy server asked of its engine, over the worker's public ``_run``."""

    def __init__(self, worker: AsyncVllmWorker, model_name: str):
        from transformers import AutoTokenizer

        mc = worker.engine.model_config
        self.worker, self.model_name, self.model_path = worker, model_name, mc.model
        self.tokenizer = AutoTokenizer.from_pretrained(mc.tokenizer)
        self.max_model_len, self.vocab_size = int(mc.max_model_len), int(mc.get_vocab_size())

    async def generate_tokens(self, prompt_token_ids: list[int], params: dict) -> list[dict]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return await self.worker._run(
            prompt_token_ids, SamplingParams(**params, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
        )


class ABWorker(AsyncVllmWorker):
    """The async worker with the legacy server mounted beside vLLM's app, on the same engine and loop."""

    async def start_engine(self, model, config, seed, cpu_bind, server=None, legacy_source: str = ""):
        import types

        info = await super().start_engine(model, config, seed, cpu_bind, server)
        mod = types.ModuleType("rl_specdec_legacy_server")
        sys.modules[mod.__name__] = mod  # pydantic and dataclasses resolve annotations through it
        exec(compile(legacy_source, f"{LEGACY_REV}:{LEGACY_PATH}", "exec"), mod.__dict__)
        cfg = mod.ServerConfig(chat_template=server.chat_template, served_model_name=server.served_model_name)
        self.legacy = await mod.start_server(LegacyBackend(self, server.served_model_name), cfg)
        info["base_url"] = {"legacy": self.legacy.base_url, "vllm": self.server.base_url}
        return info

    async def shutdown(self) -> None:
        if getattr(self, "legacy", None) is not None:
            await self.legacy.stop()
            self.legacy = None
        await super().shutdown()


class ABGeneration(AsyncVllmGeneration):
    worker_cls = ABWorker

    def __init__(self, model, config, cluster, server: dict, legacy_source: str):
        from rl_specdec.config import ServerConfig

        server_config = ServerConfig.from_dict(server)
        self._start(model, config, cluster, 0, {"server": server_config, "legacy_source": legacy_source})


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_level(
    url: str, prompts: list[str], concurrency: int, n: int, max_tokens: int, seed: int, timeout: float
) -> dict:
    import httpx

    latencies: list[float] = []
    next_i = 0

    async def client_loop(client):
        nonlocal next_i
        while next_i < n:
            i, next_i = next_i, next_i + 1
            body = {
                "model": "toy",
                "messages": [{"role": "user", "content": prompts[i % len(prompts)]}],
                "max_tokens": max_tokens,
                "temperature": 1.0,
                "seed": seed + i,
            }
            t = time.perf_counter()
            r = await client.post(url + "/chat/completions", json=body)
            latencies.append(time.perf_counter() - t)
            r.raise_for_status()
            m = r.json()["choices"][0]["message"]
            assert m["generation_token_ids"] and len(m["generation_log_probs"]) == len(m["generation_token_ids"])

    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        t0 = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(client_loop(client) for _ in range(concurrency))), timeout=10 * timeout)
        wall = time.perf_counter() - t0
    return {
        "concurrency": concurrency,
        "requests": n,
        "wall_s": wall,
        "requests_per_s": n / wall,
        "latencies": latencies,
    }


def measure(g: ABGeneration, prompts: list[str], args) -> dict[tuple[str, int], list[dict]]:
    """Every (server, level) cell, A B B A per level and repeat; repetition 0 is an untimed warm-up."""
    info = g.engine_info[0]
    urls, actor, engine = info["base_url"], info["actor_pid"], info["engine_pid"]
    cells: dict[tuple[str, int], list[dict]] = {}
    for rep in range(args.repeats + 1):
        for c in args.concurrency:
            n = max(args.min_requests, c * args.rounds)
            first, second = SERVERS if rep % 2 else SERVERS[::-1]
            for server in (first, second, second, first):
                a0, e0 = cpu_s(actor), cpu_s(engine)
                row = asyncio.run(
                    run_level(urls[server], prompts, c, n, args.max_tokens, args.seed + 1000 * c + rep, args.timeout)
                )
                row.update(server=server, rep=rep, load1=os.getloadavg()[0])
                row.update(actor_cpu_ms=1000 * (cpu_s(actor) - a0) / n, engine_cpu_ms=1000 * (cpu_s(engine) - e0) / n)
                print(
                    json.dumps(
                        {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items() if k != "latencies"}
                    ),
                    flush=True,
                )
                if rep > 0:
                    cells.setdefault((server, c), []).append(row)
    return cells


def summarise(cells: dict[tuple[str, int], list[dict]], levels: list[int]) -> tuple[list[dict], str]:
    rows = []
    for c in levels:
        for server in SERVERS:
            reps = cells[(server, c)]
            lat = sorted(x for r in reps for x in r["latencies"])
            rows.append(
                {
                    "server": server,
                    "concurrency": c,
                    "requests": len(lat),
                    "requests_per_s": statistics.median(r["requests_per_s"] for r in reps),
                    "latency_p50_s": lat[len(lat) // 2],
                    "latency_p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
                    "actor_cpu_ms": statistics.median(r["actor_cpu_ms"] for r in reps),
                    "engine_cpu_ms": statistics.median(r["engine_cpu_ms"] for r in reps),
                    "runs": [round(r["requests_per_s"], 2) for r in reps],
                }
            )
    legacy = {r["concurrency"]: r["requests_per_s"] for r in rows if r["server"] == "legacy"}
    lines = [
        "| server | concurrent | requests | req/s (median) | vs legacy | p50 (s) | p99 (s) | actor CPU ms/req | "
        "engine CPU ms/req | req/s per run |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['server']} | {r['concurrency']} | {r['requests']} | {r['requests_per_s']:.2f} | "
            f"{r['requests_per_s'] / legacy[r['concurrency']]:.2f}x | "
            f"{r['latency_p50_s']:.3f} | {r['latency_p99_s']:.3f} | {r['actor_cpu_ms']:.1f} | "
            f"{r['engine_cpu_ms']:.1f} | {', '.join(map(str, r['runs']))} |"
        )
    return rows, "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", choices=["draft_model", "ngram", "none"], default="draft_model")
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 16, 64])
    ap.add_argument("--rounds", type=int, default=2, help="requests per client at each level")
    ap.add_argument("--min-requests", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="timed A B B A blocks per level (after one untimed)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=300.0, help="per-request client timeout (s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--legacy-rev", default=LEGACY_REV, help="the git revision to read the legacy server from")
    ap.add_argument("--out", default=None, help="folder for results.json and table.md")
    args = ap.parse_args(argv)

    from rl_specdec.config import ClusterConfig, generation_config
    from rl_specdec.tasks.sorting import SortingTask
    from rl_specdec.toy.build import build_toy_models
    from rl_specdec.toy.presets import TOY_CHAT_TEMPLATE, toy_engine_kwargs, usable_cores

    legacy_source = subprocess.check_output(
        ["git", "-C", str(REPO), "show", f"{args.legacy_rev}:{LEGACY_PATH}"], text=True
    )
    toy = build_toy_models()
    spec = {
        "draft_model": {"method": "draft_model", "model": str(toy.drafter), "num_speculative_tokens": 3},
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1},
        "none": None,
    }[args.spec]
    # the template adds "="
    prompts = [s.prompt[:-1] for s in SortingTask(max_len=24).make_batch(seed=args.seed + 17, n=64)]
    cores, load0 = usable_cores(), os.getloadavg()
    print(f"load average at start: {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} ({cores} cores)", flush=True)
    server = {"chat_template": TOY_CHAT_TEMPLATE, "served_model_name": "toy"}
    g = ABGeneration(
        str(toy.policy),
        generation_config(
            str(toy.policy), toy_engine_kwargs(speculative_config=spec), num_engines=1, cpus_per_engine=cores
        ),
        ClusterConfig(num_cpus=cores),
        server,
        legacy_source,
    )
    try:
        cells = measure(g, prompts, args)
    finally:
        import ray

        g.shutdown()
        ray.shutdown()
    rows, table = summarise(cells, args.concurrency)
    note = (
        f"speculation {args.spec}, max_tokens={args.max_tokens}, temperature 1, {cores} cores, {args.repeats} timed A "
        "B B A blocks "
        f"per level, both servers on one engine; legacy = {args.legacy_rev}; load average before {load0[0]:.1f}, "
        f"after {os.getloadavg()[0]:.1f}"
    )
    print(table + "\n" + note)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"rows": rows, "args": vars(args), "note": note}, indent=2))
        (out / "table.md").write_text(table + "\n\n" + note + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
