"""How long does the default config's engine take to start, cold and warm, and does vLLM's compile cache load?

    python -m benchmarks.studies.engine_start                                # fix, nofix; 2 rounds (~15 min, 2 cores)
    python -m benchmarks.studies.engine_start --variants fix,aot_off,eager --decode

Each start is a fresh Python process that builds the engine as an engine actor does
(``VllmWorker.start_engine``: in-process engine, the CPU fixes, the run-time k self-check), without Ray.
Each variant has its own cache folders (``VLLM_CACHE_ROOT``, ``TORCHINDUCTOR_CACHE_DIR``) under
``--out``; a round empties them, starts once (cold), then again (warm). Variants:

* ``fix``: as shipped; on CPU ``rl_specdec.vllm_ext.compile_cache`` lets vLLM load its compile cache;
* ``nofix``: that fix off (``RL_SPECDEC_DISABLE_COMPILE_CACHE_FIX=1``): vLLM 0.32's loader fails on CPU
  and the model is compiled again at every start;
* ``aot_off``: vLLM's ahead-of-time compile off (``VLLM_USE_AOT_COMPILE=0``): torch.compile at every
  start, from Inductor's own caches;
* ``eager``: no compile (``enforce_eager=true``);
* ``thawed``, ``eager_thawed``: ``fix`` and ``eager`` without the worker's heap freeze before ``vllm.LLM(...)``
  (``VllmWorker.freeze_heap``), so each garbage collection vLLM's loader runs walks every imported object.

Columns: ``start`` is what the group logs as the engine's start (``start_engine``); ``LLM()`` is vLLM's
engine construction in it (load, compile, warm-up); ``rest`` is the imports and CPU-fix probes before it
and the run-time k self-check after it; ``models`` is how many compiled models were loaded from the cache
and how many compiled afresh. ``--decode`` adds decode tokens/s at batch 64 and batch 1 (40 tokens at
temperature 1, EOS ignored, median of 3 calls after one warm-up).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.bench_common import add_out, cores_and_load, log, markdown_report

ROOT = Path(__file__).resolve().parents[2]
THAWED = "BENCH_ENGINE_START_THAWED"  # the child skips the worker's heap freeze before vllm.LLM(...)
VARIANTS = {  # name -> (environment, config overrides)
    "fix": ({}, []),
    "nofix": ({"RL_SPECDEC_DISABLE_COMPILE_CACHE_FIX": "1"}, []),
    "aot_off": ({"VLLM_USE_AOT_COMPILE": "0", "RL_SPECDEC_DISABLE_COMPILE_CACHE_FIX": "1"}, []),
    "eager": ({}, ["policy.generation.vllm_kwargs.enforce_eager=true"]),
    "thawed": ({THAWED: "1"}, []),
    "eager_thawed": ({THAWED: "1"}, ["policy.generation.vllm_kwargs.enforce_eager=true"]),
}
RESULT = "RESULT "


def _decode_rates(worker) -> dict[str, float]:
    from rl_specdec.rollout import SamplingSettings
    from rl_specdec.tasks.sorting import SortingTask
    from rl_specdec.toy.build import build_tokenizer

    tok = build_tokenizer()
    prompts = [tok.encode(s.prompt) for s in SortingTask().make_batch(seed=5, n=64)]
    sampling = SamplingSettings(max_tokens=40, temperature=1.0, seed=0, ignore_eos=True)
    out = {}
    for batch in (64, 1):
        worker.generate(prompts[:batch], sampling, 0)  # warm-up
        times = [worker.generate(prompts[:batch], sampling, 0)["time_s"] for _ in range(3)]
        out[f"b{batch}"] = batch * sampling.max_tokens / statistics.median(times)
    return out


def child(config: str, overrides: list[str], decode: bool) -> None:
    """One engine start in this process; prints its figures as one JSON line."""
    from rl_specdec.config.load import load_config
    from rl_specdec.rollout.worker import VllmWorker
    from rl_specdec.toy.resolve import prepare_models

    cfg = prepare_models(load_config(config, overrides))
    worker = VllmWorker()
    worker.freeze_heap = not os.environ.get(THAWED)
    info = worker.start_engine(cfg.policy.model_name, cfg.policy.generation, cfg.seed, None)
    result = {"start_s": info["start_s"], "llm_s": info["llm_s"], "compile_cache": info["compile_cache"]}
    if decode:
        result["decode"] = _decode_rates(worker)
    print(RESULT + json.dumps(result), flush=True)


def _start(args, variant: str, cache: Path, log_path: Path) -> dict:
    env_extra, overrides = VARIANTS[variant]
    env = {
        **os.environ,
        **env_extra,
        "VLLM_CACHE_ROOT": str(cache / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.studies.engine_start",
        "--child",
        "--config",
        args.config,
        *(["--decode"] if args.decode else []),
    ]
    proc = subprocess.run(
        [*cmd, "--", *overrides], cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout, check=False
    )
    log_path.write_text(proc.stdout + proc.stderr)
    line = next((x for x in proc.stdout.splitlines() if x.startswith(RESULT)), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"{variant}: the engine start failed (exit {proc.returncode}); see {log_path}")
    return json.loads(line[len(RESULT) :])


def measure(args) -> list[dict]:
    """Rounds of cold-then-warm starts, the variants in alternating order from round to round."""
    out, rows = Path(args.out), []
    for r in range(args.repeats):
        order = args.variants if r % 2 == 0 else args.variants[::-1]
        for variant in order:
            cache = out / "cache" / variant
            shutil.rmtree(cache, ignore_errors=True)
            for kind in ("cold", "warm"):
                _, load = cores_and_load()
                res = _start(args, variant, cache, out / f"{variant}_{kind}_{r}.log")
                rows.append({"variant": variant, "cache": kind, "round": r, "load": load, **res})
                log(f"{variant} {kind} {r}: start {res['start_s']:.1f}s, LLM() {res['llm_s']:.1f}s, load {load:.2f}")
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| variant | cache | round | load avg | start s | LLM() s | rest s | models loaded/compiled "
        "| decode b64 tok/s | decode b1 tok/s |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for x in rows:
        cc, dec = x["compile_cache"], x.get("decode", {})
        rates = " | ".join(f"{dec[b]:.0f}" if b in dec else "-" for b in ("b64", "b1"))
        lines.append(
            f"| {x['variant']} | {x['cache']} | {x['round']} | {x['load']:.2f} | {x['start_s']:.1f} | "
            f"{x['llm_s']:.1f} | {x['start_s'] - x['llm_s']:.1f} | {cc['loaded']}/{cc['compiled']} | {rates} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="fix,nofix", help=f"comma-separated, of {sorted(VARIANTS)}")
    p.add_argument("--repeats", type=int, default=2, help="rounds of cold-then-warm starts per variant")
    p.add_argument("--config", default="configs/grpo_spec.yaml")
    p.add_argument("--decode", action="store_true", help="also decode tokens/s at batch 64 and 1")
    p.add_argument("--timeout", type=int, default=900, help="seconds per engine start")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    add_out(p, "engine_start", "report .md, .json, one log per start, the caches")
    args = p.parse_args(argv)
    if args.child:
        child(args.config, args.overrides, args.decode)
        return 0
    args.variants = args.variants.split(",")
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variants {unknown}; known: {sorted(VARIANTS)}")
    with markdown_report(args.out, "engine_start.md", "Engine start: cold and warm") as out:
        rows = measure(args)
        (out / "engine_start.json").write_text(json.dumps(rows, indent=1))
        print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
