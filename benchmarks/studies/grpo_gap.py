"""Where a GRPO generation phase on the wide pair spends its time, engine step by engine step.

A check of the calibration (docs/lab/gpu.md, "How good the calibration is"): do the engine
steps of a GRPO generation phase with speculation cost what the cost table
(benchmarks/rollout/cost_table.py) says, and does the phase accept as its mean
acceptance length says? This replays the wide workload's generation calls
(configs/grpo_spec_wide.yaml: its prompts, 4 x 8 samples a step, its sampling
settings and engine, the untrained policy) on engines alive side by side,
calls interleaved:

* ``base``: the engine of configs/grpo_base_wide.yaml (no speculation);
* ``native k=4``: vLLM's own draft_model path at k=4 (``speculation_control.mode=off``), as the
  ``wide k=4`` GRPO runs ran;
* ``fixed k=4`` and ``fixed k=0``: the run-time-k engine at k=4 and at k=0 (the fast path), the path the
  cost table measures.

For the run-time-k engines every engine step is recorded (its batch, its verified drafts, the time from
its start to the next step's start; benchmarks/step_records.py). The table printed gives, per variant, the
wall time, the time in engine steps, the cost table's price of the same decode steps (t(b, k) at each
step's batch, linear between the table's batch sizes) over their measured time, and the tokens each
request gained per step in the tail (at most 2 requests running) and in the bulk. Every record is kept in
``--out``::

    python -m benchmarks.studies.grpo_gap --steps 5 --seeds 0,1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks.rollout.rollout import cores_and_load, log
from benchmarks.step_records import engine_group, importable

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "docs/data/cost_table_wide.json"
CONTROL = "policy.generation.speculation_control"
SPEC = "policy.generation.vllm_kwargs.speculative_config"
VARIANTS = {  # name -> (config, overrides, run-time k or None)
    "base": ("configs/grpo_base_wide.yaml", [], None),
    "native k=4": ("configs/grpo_spec_wide.yaml", [f"{CONTROL}.mode=off", f"{SPEC}.num_speculative_tokens=4"], None),
    "fixed k=4": ("configs/grpo_spec_wide.yaml", [f"{CONTROL}.mode=fixed"], 4),
    "fixed k=0": ("configs/grpo_spec_wide.yaml", [f"{CONTROL}.mode=fixed"], 0),
}


def start(name: str):
    from rl_specdec.config import load_config
    from rl_specdec.toy.resolve import prepare_models

    path, overrides, k = VARIANTS[name]
    cfg = prepare_models(load_config(str(ROOT / path), overrides))
    g = engine_group(k is not None)(cfg.policy.model_name, cfg.policy.generation, cfg.cluster, seed=0)
    if k is not None:
        g.set_speculation(k)
        g.engine_rpc("rl_specdec_step_records")
    return cfg, g


def workload(cfg, step: int, seed: int):
    from rl_specdec.grpo.run import prepare_task
    from rl_specdec.grpo.step import prompt_seed, sampling_seed
    from rl_specdec.rollout import SamplingSettings
    from rl_specdec.tasks import encode_prompts

    tokenizer, task = prepare_task(cfg)
    samples = task.make_batch(seed=prompt_seed(seed, step), n=cfg.grpo.num_prompts_per_step)
    ids = [p for p in encode_prompts(task, tokenizer, samples) for _ in range(cfg.grpo.num_generations_per_prompt)]
    return ids, SamplingSettings.from_config(cfg.policy.generation, seed=sampling_seed(seed, step))


TAIL = 2  # running requests at most: a step of the tail
RECORD_KEYS = ("b", "tokens", "k_verify", "k_next", "ctx", "plain", "continuing", "catch_up", "emitted", "period_s")


def price(table: dict, b: int, k: int) -> float:
    """t(b, k) from the cost table, linear in b between its batch sizes (``none`` for a plain step)."""
    key = "none" if k is None else str(k)
    cells = sorted((c["b"], c["step_s"]) for c in table["cells"] if c["k"] == key)
    bs, ts = zip(*cells)
    return float(np.interp(b, bs, ts))


def one_call(name: str, g, ids, sampling, table: dict) -> dict:
    t0 = time.perf_counter()
    out = g.generate(ids, sampling)
    wall = time.perf_counter() - t0
    tokens = sum(len(t) for t in out.token_ids)
    row = {"variant": name, "wall_s": wall, "tokens": tokens, "max_len": max(len(t) for t in out.token_ids)}
    if VARIANTS[name][2] is None:
        return row
    recs = g.engine_rpc("rl_specdec_step_records")[0]
    decode = [r for r in recs if r["tokens"] <= r["b"] * (1 + r["k_verify"])]  # no prefill chunk in the step
    row["steps"] = len(recs)
    row["steps_s"] = sum(r["period_s"] for r in recs if r["period_s"])
    row["priced_s"] = sum(price(table, r["b"], r["k_verify"] if not r["plain"] else 0) for r in decode)
    row["decode_s"] = sum(r["period_s"] for r in decode if r["period_s"])
    row["b_mean"] = statistics.fmean(r["b"] for r in recs)
    row["b1_steps"] = sum(r["b"] == 1 for r in recs)
    row["emitted_per_step"] = sum(r["emitted"] for r in recs) / max(1, sum(r["b"] for r in recs))
    for name, sel in (("tail", [r for r in recs if r["b"] <= TAIL]), ("bulk", [r for r in recs if r["b"] > TAIL])):
        row[f"{name}_emitted"], row[f"{name}_request_steps"] = sum(r["emitted"] for r in sel), sum(r["b"] for r in sel)
    row["records"] = [{k: r[k] for k in RECORD_KEYS} for r in recs]
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--variants", default=";".join(VARIANTS))
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/grpo_gap.json"))
    args = ap.parse_args(argv)
    cores, load = cores_and_load()
    log(f"cores {cores}, load average at start {load:.2f}")
    from rl_specdec.toy.wide import build_wide_models

    build_wide_models(log=log)
    import ray

    importable()
    ray.init(num_cpus=2 * len(VARIANTS), include_dashboard=False, log_to_driver=False)  # engines side by side
    table = json.loads(TABLE.read_text())
    names = args.variants.split(";")
    engines = {n: start(n) for n in names}
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for step in range(args.steps):
            cfg = engines[names[0]][0]
            ids, sampling = workload(cfg, step, seed)
            order = names[step % len(names) :] + names[: step % len(names)]
            for n in order:
                rows.append({"seed": seed, "step": step + 1, **one_call(n, engines[n][1], ids, sampling, table)})
                shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in rows[-1].items() if k != "records"}
                log("  " + json.dumps(shown))
    for _, g in engines.values():
        g.shutdown()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print(summary(rows, names))


def summary(rows: list[dict], names: list[str]) -> str:
    """Per variant: wall time against the first variant; for the run-time-k engines, the steps' time, the cost
    table's price of the same steps, and tokens per request and step in the tail and in the bulk."""
    head = ["variant", "calls", "wall s", f"speed-up vs {names[0]}", "steps", "in steps s", "priced s"]
    head.append("priced / measured")
    lines = ["| " + " | ".join(head + [f"tokens/request-step, <= {TAIL} running", "with more running"]) + " |"]
    lines.append("|" + "---|" * (len(head) + 2))
    base = sum(r["wall_s"] for r in rows if r["variant"] == names[0])
    for n in names:
        rs = [r for r in rows if r["variant"] == n]
        wall = sum(r["wall_s"] for r in rs)
        cells = [n, str(len(rs)), f"{wall:.2f}", f"{base / wall:.2f}x"] + [""] * 6
        if "steps" in rs[0]:
            priced, dec = sum(r["priced_s"] for r in rs), sum(r["decode_s"] for r in rs)
            cells[4:7] = [str(sum(r["steps"] for r in rs)), f"{sum(r['steps_s'] for r in rs):.2f}", f"{priced:.2f}"]
            cells[7] = f"{priced / dec:.2f}"
            for i, part in ((8, "tail"), (9, "bulk")):
                steps = sum(r[f"{part}_request_steps"] for r in rs)
                cells[i] = f"{sum(r[f'{part}_emitted'] for r in rs) / steps:.2f}" if steps else "-"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
