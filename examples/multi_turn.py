"""Multi-turn GRPO through the OpenAI-compatible server, with speculative decoding on.

The environment is a two-turn game in the toy digit language:

    turn 1  user: "3141"        the model should answer the digits sorted: "1134"
    turn 2  user: "27"          now all the user's digits so far, sorted:  "112347"

Each answer is scored by the sorting task (1 for an exact answer that ends
with EOS, else 0), and the reward is the mean over the two turns. The toy
policy was trained on single prompts only: it sorts turn 1 right about a
third of the time but merges in turn 2 about 1% of the time, so a reward on
the final answer alone would be zero for almost every group.

Each episode talks to the engine over HTTP with the ``openai`` client, as an
agent environment would. The assistant message of turn 1 goes back to the
server as returned (with its ``prompt_token_ids`` / ``generation_token_ids``),
so the server splices the model's own tokens into turn 2's prompt. The
trajectory for training is then simply turn 2's ``prompt_token_ids +
generation_token_ids``: both turns' model tokens sit in it at known
positions, with the log-probs the engine reported. ``logprob_mismatch``
(mean |log p_train - log p_gen| over both turns' tokens) is the on-policy
check.

    python examples/multi_turn.py --steps 2
    python examples/multi_turn.py --steps 5 --spec ngram --prompts 8
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time

import torch

# ---- the environment -------------------------------------------------------------------------------


def make_episode(rng: random.Random, len1: tuple[int, int], len2: tuple[int, int]) -> tuple[str, str]:
    a = "".join(rng.choice("0123456789") for _ in range(rng.randint(*len1)))
    b = "".join(rng.choice("0123456789") for _ in range(rng.randint(*len2)))
    return a, b


async def play(client, model: str, a: str, b: str, max_tokens: int, seed: int) -> dict:
    """Two chat turns; returns the final trajectory and its reward inputs."""
    msgs = [{"role": "user", "content": a}]
    r1 = await client.chat.completions.create(
        model=model, messages=msgs, max_tokens=max_tokens, temperature=1.0, seed=seed
    )
    m1 = r1.choices[0].message.to_dict()  # keeps prompt_token_ids / generation_token_ids
    msgs += [m1, {"role": "user", "content": b}]
    r2 = await client.chat.completions.create(
        model=model, messages=msgs, max_tokens=max_tokens, temperature=1.0, seed=seed + 1
    )
    m2 = r2.choices[0].message.to_dict()
    p1, g1 = m1["prompt_token_ids"], m1["generation_token_ids"]
    p2, g2 = m2["prompt_token_ids"], m2["generation_token_ids"]
    assert p2[: len(p1) + len(g1)] == p1 + g1, "the server did not keep turn 1's tokens"
    return {
        "ids": p2 + g2,
        # (start, generated ids, their log-probs) for each model turn in the final sequence
        "turns": [(len(p1), g1, m1["generation_log_probs"]), (len(p2), g2, m2["generation_log_probs"])],
        # (answer, wanted answer, stopped on EOS) per turn
        "answers": [
            (m1["content"], "".join(sorted(a)), r1.choices[0].finish_reason == "stop"),
            (m2["content"], "".join(sorted(a + b)), r2.choices[0].finish_reason == "stop"),
        ],
    }


async def rollouts(
    base_url: str,
    model: str,
    episodes: list[tuple[str, str]],
    group: int,
    max_tokens: int,
    seed: int,
    concurrency: int = 32,
):
    from openai import AsyncOpenAI

    sem = asyncio.Semaphore(concurrency)
    async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120.0) as client:

        async def one(i: int, a: str, b: str):
            async with sem:
                return await play(client, model, a, b, max_tokens, seed + 2 * i)

        jobs = [one(i * group + j, a, b) for i, (a, b) in enumerate(episodes) for j in range(group)]
        return await asyncio.wait_for(asyncio.gather(*jobs), timeout=600)


# ---- GRPO pieces ---------------------------------------------------------------------------------------


def trajectory(x: dict):
    """The final sequence, with each model turn's ids and log-probs (the loss covers both turns)."""
    from rl_specdec.grpo.batch import Trajectory

    return Trajectory(x["ids"], x["turns"])


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4, help="episodes (games) per step")
    ap.add_argument("--group", type=int, default=8, help="samples per game (GRPO group size)")
    ap.add_argument("--spec", choices=["draft_model", "ngram", "none"], default="draft_model")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--len1", type=int, nargs=2, default=(4, 6), metavar=("MIN", "MAX"), help="digits in turn 1")
    ap.add_argument("--len2", type=int, nargs=2, default=(1, 2), metavar=("MIN", "MAX"), help="digits added in turn 2")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)

    import ray

    from rl_specdec.config import PolicyConfig, generation_config
    from rl_specdec.policy import PolicyGroup
    from rl_specdec.rollout.group import AsyncVllmGeneration
    from rl_specdec.toy.build import build_tokenizer, build_toy_models
    from rl_specdec.toy.presets import TOY_CHAT_TEMPLATE, toy_engine_kwargs, usable_cores

    t0 = time.time()
    toy = build_toy_models()
    tok = build_tokenizer()
    spec = {
        "draft_model": {"method": "draft_model", "model": str(toy.drafter), "num_speculative_tokens": 3},
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1},
        "none": None,
    }[args.spec]
    cores = usable_cores()
    ray.init(address="local", num_cpus=cores, include_dashboard=False, log_to_driver=False)
    gen = AsyncVllmGeneration(
        str(toy.policy),
        generation_config(
            str(toy.policy), toy_engine_kwargs(speculative_config=spec), num_engines=1, cpus_per_engine=cores
        ),
        seed=args.seed,
        server={"chat_template": TOY_CHAT_TEMPLATE, "served_model_name": "toy"},
    )
    policy = None
    try:
        (base_url,) = gen.base_urls()
        print(f"engine up in {gen.start_s:.0f}s, serving {base_url} (speculation: {args.spec})", flush=True)
        if spec is not None:  # refuse to train on a sampler that is not lossless
            report = gen.check_sampling([tok.encode("31")] * 64, max_tokens=12, seed=args.seed)
            print(f"sampling self-check passed: {report.summary()}", flush=True)
        policy = PolicyGroup(
            PolicyConfig(
                model_name=str(toy.policy), device="cpu", precision="fp32", learning_rate=args.lr, num_threads=cores
            ),
            seed=args.seed,
        )
        for step in range(args.steps):
            trajs = _step(args, step, gen, base_url, policy, tok)
        x = trajs[0]
        print(
            f"example trajectory: {tok.decode(x['ids'])!r} (want {x['answers'][0][1]!r}, then {x['answers'][1][1]!r})"
        )
    finally:
        if policy is not None:
            policy.shutdown()
        gen.shutdown()
        ray.shutdown()
    print(f"done in {time.time() - t0:.0f}s")
    return 0


def _step(args: argparse.Namespace, step: int, gen, base_url: str, policy, tok) -> list[dict]:
    """One GRPO step: play the games over HTTP, score both turns, train, refit; prints one line, returns the
    trajectories."""
    from rl_specdec.grpo import ClippedPGLoss, group_advantages
    from rl_specdec.grpo.batch import build_train_batch
    from rl_specdec.metrics import aggregate_spec_decode_counters, compute_spec_decode_metrics
    from rl_specdec.tasks.sorting import SortingTask

    task = SortingTask(max_len=24)
    ts = time.time()
    rng = random.Random(args.seed * 1_000_003 + step)
    episodes = [make_episode(rng, args.len1, args.len2) for _ in range(args.prompts)]
    before = aggregate_spec_decode_counters(gen.engine_counters())  # the engine serves only this step
    trajs = asyncio.run(
        rollouts(base_url, "toy", episodes, args.group, args.max_tokens, seed=args.seed * 7919 + step * 10_007)
    )
    spec_m = compute_spec_decode_metrics(before, aggregate_spec_decode_counters(gen.engine_counters()))
    t_gen = time.time() - ts
    scores = [[task.score(*ans) for ans in x["answers"]] for x in trajs]  # [P*G][2 turns]
    rewards = torch.tensor([sum(s.reward for s in sc) / len(sc) for sc in scores])  # [P*G]
    adv = group_advantages(rewards, args.group)  # [P*G]
    batch = build_train_batch([trajectory(x) for x in trajs], adv, tok.pad_token_id)
    m = policy.train_step(batch, ClippedPGLoss(clip_eps=0.2))
    gen.update_weights(policy.state_dict_for_refit())
    acc1 = sum(sc[0].correct for sc in scores) / len(scores)
    acc2 = sum(sc[1].correct for sc in scores) / len(scores)
    ntok = sum(len(ids) for x in trajs for _, ids, _ in x["turns"])
    line = (
        f"step {step + 1}/{args.steps}: reward {rewards.mean():.3f} accuracy turn 1 {acc1:.2f} turn 2 "
        f"{acc2:.2f} "
        f"model tokens {ntok} logprob_mismatch {m['logprob_mismatch']:.2e} "
        f"gen {t_gen:.1f}s step {time.time() - ts:.1f}s"
    )
    if spec_m:
        line += f" acceptance_length {spec_m['spec_decode/acceptance_length']:.2f}"
    print(line, flush=True)
    return trajs


if __name__ == "__main__":
    sys.exit(main())
