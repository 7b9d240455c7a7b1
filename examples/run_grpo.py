"""Train a policy with GRPO and speculative rollouts.

    python examples/run_grpo.py --config configs/grpo_spec.yaml [key=value ...]

Examples of overrides: grpo.max_steps=5  logger.log_dir=/tmp/run
policy.generation.vllm_kwargs.speculative_config=null  resume=true
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from rl_specdec.config import ConfigError, load_config, to_yaml


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML config, e.g. configs/grpo_spec.yaml")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(to_yaml(cfg))
        return 0

    from rl_specdec.algorithms.checkpoint import CheckpointDamaged
    from rl_specdec.algorithms.grpo import train
    from rl_specdec.generation import GenerationEngineDied, SamplingSelfCheckFailed
    from rl_specdec.policy import PolicyWorkerDied

    t0 = time.time()
    try:
        last = train(cfg)
    except ConfigError as e:  # e.g. more GPUs than the Ray cluster has, found before any actor started
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except (GenerationEngineDied, SamplingSelfCheckFailed, PolicyWorkerDied, CheckpointDamaged) as e:
        print(f"error: {e}", file=sys.stderr)  # the loop already logged the step and the last checkpoint
        return 1
    if not last:  # resume=true found the run already at grpo.max_steps
        print(f"nothing to do: the checkpoint in {cfg.logger.log_dir} is already at grpo.max_steps={cfg.grpo.max_steps}")
        return 0
    print(
        f"done in {time.time() - t0:.0f}s: reward {last['train/reward_mean']:.3f} accuracy {last['train/accuracy']:.3f}; "
        f"metrics in {cfg.logger.log_dir}/metrics.jsonl (plot: python -m rl_specdec.plot {cfg.logger.log_dir})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
