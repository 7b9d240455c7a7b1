"""Train a policy with GRPO and speculative rollouts.

    python examples/run_grpo.py --config configs/grpo_spec.yaml [key=value ...]

Examples of overrides: grpo.max_steps=5  logger.log_dir=/tmp/run
policy.generation.vllm_kwargs.speculative_config=null  resume=true
The console shows a progress bar, validation lines and errors; ``--verbose``
(or ``logger.level=info``) brings back vLLM's and Ray's logs.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML config, e.g. configs/grpo_spec.yaml")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--verbose", action="store_true", help="show vLLM's and Ray's logs (logger.level=info)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    args = parser.parse_args(argv)
    overrides = list(args.overrides) + (["logger.level=info"] if args.verbose else [])

    from rl_specdec.metrics.console import configure_console

    configure_console("info" if args.verbose else "error")  # before anything imports vLLM
    from rl_specdec.config import ConfigError, load_config, to_yaml

    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(to_yaml(cfg))
        return 0
    configure_console(cfg.logger.level)

    from rl_specdec.errors import (
        CheckpointDamaged,
        GenerationEngineDied,
        PolicyWorkerDied,
        SamplingSelfCheckFailed,
        SpecDecodeCanaryTripped,
        WeightIntegrityError,
    )
    from rl_specdec.grpo.loop import train

    t0 = time.time()
    try:
        last = train(cfg)
    except ConfigError as e:  # e.g. more GPUs than the Ray cluster has, found before any actor started
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except (
        GenerationEngineDied,
        SamplingSelfCheckFailed,
        PolicyWorkerDied,
        CheckpointDamaged,
        WeightIntegrityError,
        SpecDecodeCanaryTripped,
    ) as e:
        print(f"error: {e}", file=sys.stderr)  # the loop already logged the step and the last checkpoint
        return 1
    if not last:  # resume=true found the run already at grpo.max_steps
        print(
            f"nothing to do: the checkpoint in {cfg.logger.log_dir} is already at grpo.max_steps={cfg.grpo.max_steps}"
        )
        return 0
    print(
        f"done in {time.time() - t0:.0f}s: reward {last['train/reward_mean']:.3f} accuracy "
        f"{last['train/accuracy']:.3f}; "
        f"metrics in {cfg.logger.log_dir}/metrics.jsonl (plot: python -m rl_specdec.plot {cfg.logger.log_dir})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
