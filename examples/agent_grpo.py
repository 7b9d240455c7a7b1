"""GRPO on a tool-using agent task, through vLLM's OpenAI server, with speculative decoding on.

The task (rl_specdec/tasks/lookup.py): the user names a key; the model
must call the ``lookup`` tool with it (hermes style,
``<tool_call>{"name":"lookup","arguments":{"key":"a"}}</tool_call>``), the
environment answers with a ``tool`` message carrying the key's hidden value,
and the model must answer with that value. Reward 1 for the exact value
followed by EOS, else 0.

Every episode talks to the engine as an agent would: the real
``openai.AsyncOpenAI`` client, ``tools=[...]``, ``tool_calls`` parsed by
vLLM's hermes parser, the assistant message sent back as returned. The
server splices the model's own tokens into each next prompt, so the last
turn's ``prompt_token_ids + generation_token_ids`` is the whole episode as
the model produced it. The loss covers both model turns (the call and the
answer) with the engine's log-probs; the prompt and the tool result are
context only. ``logprob_mismatch`` (mean |log p_train - log p_gen| over the
model's tokens) is the on-policy check.

The policy is the tool toy (rl_specdec/toy/tools.py), built on first use
(about 3 minutes on 2 cores, then cached). Its SFT data answers half of the
episodes with a guessed value and no tool call, so it starts out calling the
tool about half of the time (held-out success about 0.3); GRPO has to teach it
to use the tool. Held-out success is measured at temperature 1 before and after
training. Each step line also counts the episodes whose answer turn's prompt
starts with the model's own tool-call turn (``spliced``).

    python examples/agent_grpo.py                  # 30 steps, about 4 minutes after the build
    python examples/agent_grpo.py --spec ngram --seed 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

SERVER = {"served_model_name": "tooltoy", "tool_call_parser": "hermes", "enable_auto_tool_choice": True}


def held_out(base_url: str, task, n: int, seed: int) -> dict[str, float]:
    """Success, tool-call and right-key rates over ``n`` held-out episodes at temperature 1."""
    from rl_specdec.tasks.lookup import play_many

    xs = asyncio.run(
        play_many(base_url, SERVER["served_model_name"], task, task.validation_batch(seed, n), seed=10_000 + seed)
    )
    return {k: sum(float(x[k]) for x in xs) / n for k in ("correct", "called", "right_key")}


def fmt(m: dict[str, float]) -> str:
    return f"success {m['correct']:.2f} (tool called {m['called']:.2f}, right key {m['right_key']:.2f})"


def grpo_step(gen, policy, loss_fn, base_url: str, task, step: int, args) -> str:
    """One step: rollouts through the server, advantages, a policy update, refit. Returns its log line."""
    import torch

    from rl_specdec.grpo import group_advantages
    from rl_specdec.grpo.batch import Trajectory, build_train_batch
    from rl_specdec.metrics import aggregate_spec_decode_counters, compute_spec_decode_metrics
    from rl_specdec.tasks.lookup import play_many

    ts = time.time()
    episodes = task.make_batch(args.seed * 1_000_003 + step, args.episodes)
    before = aggregate_spec_decode_counters(gen.engine_counters())  # the engine serves only this step
    xs = asyncio.run(
        play_many(
            base_url,
            SERVER["served_model_name"],
            task,
            episodes,
            group=args.group,
            seed=args.seed * 7919 + step * 10_007,
        )
    )
    spec = compute_spec_decode_metrics(before, aggregate_spec_decode_counters(gen.engine_counters()))
    t_gen = time.time() - ts
    rewards = torch.tensor([x["reward"] for x in xs])  # [P*G]
    two = [x for x in xs if len(x["prompts"]) == 2]  # the tool was called: prompt 2 must extend turn 1's exact ids
    spliced = sum(
        x["prompts"][1][: len(x["prompts"][0]) + len(x["turns"][0][1])] == x["prompts"][0] + x["turns"][0][1]
        for x in two
    )
    batch = build_train_batch(
        [Trajectory(x["ids"], x["turns"]) for x in xs], group_advantages(rewards, args.group), args.pad_id
    )
    m = policy.train_step(batch, loss_fn)
    gen.update_weights(policy.state_dict_for_refit())
    line = (
        f"step {step + 1}/{args.steps}: reward {rewards.mean():.3f} tool called "
        f"{sum(x['called'] for x in xs) / len(xs):.2f} "
        f"right key {sum(x['right_key'] for x in xs) / len(xs):.2f} spliced {spliced}/{len(two)} model tokens "
        f"{int(batch['loss_mask'].sum())} "
        f"logprob_mismatch {m['logprob_mismatch']:.2e} gen {t_gen:.1f}s step {time.time() - ts:.1f}s"
    )
    if spec:
        line += f" acceptance_length {spec['spec_decode/acceptance_length']:.2f}"
    return line


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--episodes", type=int, default=16, help="episodes per step")
    ap.add_argument("--group", type=int, default=8, help="plays per episode (GRPO group size)")
    ap.add_argument("--eval", type=int, default=128, help="held-out episodes before and after")
    ap.add_argument("--spec", choices=["draft_model", "ngram", "none"], default="draft_model")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON line with the results at the end")
    ap.add_argument("--verbose", action="store_true", help="vLLM's and Ray's logs on the console")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from rl_specdec.metrics.console import configure_console

    configure_console("info" if args.verbose else "error")  # before anything imports vLLM
    from rl_specdec.vllm_ext import facts

    facts.use_file()  # what a config is checked against, read from a file once written

    from rl_specdec.config import ClusterConfig, PolicyConfig, generation_config
    from rl_specdec.grpo import ClippedPGLoss
    from rl_specdec.policy import PolicyGroup
    from rl_specdec.rollout.group import AsyncVllmGeneration
    from rl_specdec.toy.presets import toy_engine_kwargs, usable_cores
    from rl_specdec.toy.tools import ToolToyConfig, build_tool_tokenizer, build_tool_toy

    t0 = time.time()
    cfg = ToolToyConfig()
    toy, tok, task = build_tool_toy(cfg), build_tool_tokenizer(), cfg.task()
    args.pad_id = tok.pad_token_id
    spec = {
        "draft_model": {"method": "draft_model", "model": str(toy.drafter), "num_speculative_tokens": 3},
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1},
        "none": None,
    }[args.spec]
    cores = usable_cores()
    gen = AsyncVllmGeneration(
        str(toy.policy),
        generation_config(
            str(toy.policy), toy_engine_kwargs(speculative_config=spec), num_engines=1, cpus_per_engine=cores
        ),
        ClusterConfig(num_cpus=cores),
        seed=args.seed,
        server=SERVER,
    )
    policy = None
    try:
        (base_url,) = gen.base_urls()
        print(
            f"engine up in {gen.start_s:.0f}s, serving {base_url} (speculation: {args.spec}, tool parser: hermes)",
            flush=True,
        )
        if spec is not None:  # refuse to train on a sampler that is not lossless
            report = gen.check_sampling([tok.encode("<tools>lookup</tools>a=")] * 64, max_tokens=48, seed=args.seed)
            print(f"sampling self-check passed: {report.summary()}", flush=True)
        before = held_out(base_url, task, args.eval, args.seed)
        print(f"held-out before: {fmt(before)} over {args.eval} episodes, temperature 1", flush=True)
        policy = PolicyGroup(
            PolicyConfig(
                model_name=str(toy.policy), device="cpu", precision="fp32", learning_rate=args.lr, num_threads=cores
            ),
            seed=args.seed,
        )
        loss_fn = ClippedPGLoss(clip_eps=0.2)
        for step in range(args.steps):
            print(grpo_step(gen, policy, loss_fn, base_url, task, step, args), flush=True)
        after = held_out(base_url, task, args.eval, args.seed)
        print(f"held-out after:  {fmt(after)} over {args.eval} episodes (before: {before['correct']:.2f})", flush=True)
    finally:
        if policy is not None:
            policy.shutdown()
        gen.shutdown()
        import ray

        ray.shutdown()
    print(f"done in {time.time() - t0:.0f}s")
    if args.json:
        print(json.dumps({"seed": args.seed, "steps": args.steps, "spec": args.spec, "before": before, "after": after}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
