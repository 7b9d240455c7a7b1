"""The peer: TRL's ``GRPOTrainer`` on the same toy task, model, batch and step count.

Same policy checkpoint (the toy Qwen2 policy), tokenizer, training pool
(``task.kwargs`` of the config), batch (``num_prompts_per_step`` prompts x
``num_generations_per_prompt`` samples, one optimizer step per batch), sampling
(temperature, top_p, max_new_tokens), learning rate, clip and KL coefficient as
the rl_specdec config it is given. TRL generates with transformers'
``model.generate`` (its ``use_vllm`` modes need a CUDA vLLM build), so the
comparison is "TRL as it runs here" against rl_specdec's vLLM rollouts.

What differs and is not matched: TRL trains on every sample (rl_specdec drops
zero-advantage samples first) and pads generation to the longest sample of
the batch. The reward is the task's own verifier.

Time per step comes from a trainer callback (``on_step_begin`` to
``on_step_end``); rollout time from a timer around TRL's generation method, and
rollout tokens from its ``completions/mean_length`` log.

    python -m benchmarks.grpo.peer_trl --steps 5               # standalone, the default precision
    python -m benchmarks.grpo.peer_trl --steps 5 policy.precision=fp32
    (benchmarks/grpo/bench.py calls ``run_trl`` for its peer table)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks import bench_common


def run_trl(config_path: str, steps: int, out_dir: Path, log=print, overrides: list[str] | None = None) -> dict:
    """Train ``steps`` GRPO steps with TRL on the config with ``overrides``; returns per-step times and a summary."""
    os.environ.setdefault("WANDB_MODE", "disabled")
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from rl_specdec.config import load_config
    from rl_specdec.tasks import make_task
    from rl_specdec.toy.resolve import prepare_models

    cfg = prepare_models(load_config(config_path, overrides or []))
    g = cfg.grpo
    model_path = cfg.policy.model_name  # resolved to the toy checkpoint's folder by load_config
    task = make_task(cfg.task.name, **dict(cfg.task.kwargs))
    pool = task.pool() if getattr(task, "dataset_size", 0) else task.make_batch(seed=cfg.seed, n=1024)
    dataset = Dataset.from_list([{"prompt": s.prompt, "answer": s.answer} for s in pool])
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    eos = tokenizer.eos_token_id

    def sorting_reward(prompts, completions, answer, completion_ids, **_):
        return [task.score(c.strip(), a, eos in ids).reward for c, a, ids in zip(completions, answer, completion_ids)]

    B = g.num_prompts_per_step * g.num_generations_per_prompt
    args = trl_config(cfg, steps, out_dir)

    times: dict[str, list[float]] = {"step": [], "generate": []}
    logs: list[dict] = []

    class StepClock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            times["step"].append(time.perf_counter() - self.t0)

        def on_log(self, _args, state, control, logs=None, **k):
            if logs and "completions/mean_length" in logs:
                globals_logs.append(dict(logs))

    globals_logs = logs

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate_single_turn(self, *a, **k):  # TRL's rollout call
            t0 = time.perf_counter()
            try:
                return super()._generate_single_turn(*a, **k)
            finally:
                times["generate"].append(time.perf_counter() - t0)

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=sorting_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepClock()],
    )
    log(
        f"  TRL GRPOTrainer: {steps} steps, batch {B} ({g.num_prompts_per_step} prompts x "
        f"{g.num_generations_per_prompt}), transformers generate, {cfg.policy.precision}"
    )
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    rows = step_rows(times, logs, B)
    summary = summarize(rows, skip_first=1 if len(rows) > 1 else 0)
    summary.update(
        wall_s=wall, steps=steps, batch=B, generation="transformers.generate", trl_version=__import__("trl").__version__
    )
    return {"rows": rows, "summary": summary}


def trl_config(cfg, steps: int, out_dir: Path):
    """TRL's GRPOConfig for the same run as rl_specdec's ``cfg``: batch, lengths, sampling, optimizer, loss."""
    import torch
    from trl import GRPOConfig

    g, gen = cfg.grpo, cfg.policy.generation
    B = g.num_prompts_per_step * g.num_generations_per_prompt
    mb = min(cfg.policy.micro_batch_size, B)
    return GRPOConfig(
        output_dir=str(out_dir / "trl_out"),
        max_steps=steps,
        per_device_train_batch_size=mb,
        gradient_accumulation_steps=B // mb,  # one optimizer step per B completions, as in rl_specdec
        num_generations=g.num_generations_per_prompt,
        max_completion_length=gen.max_new_tokens,
        temperature=gen.temperature,
        top_p=gen.top_p,
        learning_rate=cfg.policy.learning_rate,
        weight_decay=cfg.policy.weight_decay,
        max_grad_norm=cfg.policy.max_grad_norm,
        lr_scheduler_type="constant",
        warmup_steps=0,
        beta=g.kl_coef,
        epsilon=g.clip_eps,
        num_iterations=1,
        scale_rewards="group" if g.normalize_std else "none",
        use_cpu=not torch.cuda.is_available(),
        bf16=cfg.policy.precision == "bf16-mixed",  # HF Trainer's bf16: autocast over fp32 weights, as bf16-mixed
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=cfg.seed,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def step_rows(times: dict[str, list[float]], logs: list[dict], B: int) -> list[dict]:
    """One row per TRL step: its time, its rollout's time, tokens and reward."""
    tokens = [lg["completions/mean_length"] * B for lg in logs]
    rows = []
    for i, t in enumerate(times["step"]):
        gt = times["generate"][i] if i < len(times["generate"]) else float("nan")
        tk = tokens[i] if i < len(tokens) else float("nan")
        rows.append(
            {
                "step": i + 1,
                "step_s": t,
                "generate_s": gt,
                "tokens": tk,
                "reward": logs[i].get("reward") if i < len(logs) else None,
            }
        )
    return rows


def summarize(rows: list[dict], skip_first: int = 1) -> dict:
    """Median step time, mean rollout time (as bench.py reports rl_specdec's), rollout
    tokens/s (total tokens / total rollout time); skips warm-up steps."""
    rs = rows[skip_first:] or rows
    gen = sum(r["generate_s"] for r in rs)
    return {
        "step_s": statistics.median(r["step_s"] for r in rs),
        "generate_s": statistics.fmean(r["generate_s"] for r in rs),
        "rollout_tokens_per_s": sum(r["tokens"] for r in rs) / gen if gen > 0 else float("nan"),
        "steps_measured": len(rs),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/grpo_base.yaml")
    p.add_argument("--steps", type=int, default=5)
    bench_common.add_out(p, "peer", "peer_trl.json")
    p.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. policy.precision=fp32")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res = run_trl(a.config, a.steps, out, log=lambda m: print(m, file=sys.stderr, flush=True), overrides=a.overrides)
    print(json.dumps(res["summary"], indent=1))
    (out / "peer_trl.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
