"""Train a policy with GRPO and speculative rollouts.

    python examples/run_grpo.py --config configs/grpo_spec.yaml [key=value ...]

Overrides set any key of the config (docs/grpo.md lists them all), e.g.
  grpo.max_steps=5  logger.log_dir=/tmp/run  resume=true
Speculation, in one line (a speculative_config is replaced, never merged):
  policy.generation.vllm_kwargs.speculative_config=null           off
  policy.generation.vllm_kwargs.speculative_config.method=ngram   another method, from its defaults
  policy.generation.vllm_kwargs.speculative_config='{method: ngram, num_speculative_tokens: 3, prompt_lookup_max: 3}'
The console shows a progress bar, validation lines and errors; ``--verbose``
(or ``logger.level=info``) brings back vLLM's and Ray's logs.

SIGTERM (a scheduler's preemption) or Ctrl-C finishes the step in progress (or
drops it while it generates), checkpoints it, shuts everything down and exits
143 or 130 with one line: the checkpoint and the command that resumes from it.
A second signal, or ``checkpoint.grace_s`` seconds, exits at once.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
import time
from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _summary(path: Path) -> str:
    """The first sentence of a config's header comment."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("# ").strip())
    text = " ".join(lines)
    end = re.search(r"(?<!e\.g)(?<!i\.e)\.(\s|$)", text)
    return text if end is None else text[: end.start() + 1]


def _epilog() -> str:
    shipped = "\n".join(f"  {p.name:<28} {_summary(p)}" for p in sorted(CONFIGS.glob("*.yaml")))
    return (
        f"shipped configs (configs/):\n{shipped}\n\n"
        "outputs (logger.log_dir): metrics.jsonl (every logged key: docs/metrics.md), engine.yaml (what each engine\n"
        "  really runs), sysinfo.txt, checkpoints/, wandb/ (offline run: wandb sync <log_dir>/wandb/offline-run-*)\n"
        "plot: python -m rl_specdec.plot <log_dir> [<baseline log_dir>]\n"
        "docs: README.md, docs/grpo.md (config reference), docs/speculative_decoding.md (methods and their YAML)"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, epilog=_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help="YAML config, e.g. configs/grpo_spec.yaml")
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="check the config, print it as written (toy:policy, auto) and exit; builds no model",
    )
    parser.add_argument(
        "--resolved",
        action="store_true",
        help="with --print-config: build or find the models, print the config as resolved (model folders, device, "
        "precision, engine dtype) and the keyword arguments each engine receives",
    )
    parser.add_argument("--verbose", action="store_true", help="show vLLM's and Ray's logs (logger.level=info)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    overrides = list(args.overrides) + (["logger.level=info"] if args.verbose else [])

    from rl_specdec.metrics.console import configure_console

    configure_console("info" if args.verbose else "error")  # before anything imports vLLM
    from rl_specdec.vllm_ext import facts

    facts.use_file()  # what a config is checked against, read from a file once written: vLLM is not imported here
    from rl_specdec.config import ConfigError, load_config, load_config_as_written, to_yaml

    try:
        if args.print_config and not args.resolved:
            print(to_yaml(load_config_as_written(args.config, overrides)))
            return 0
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        return _print_resolved(cfg)
    configure_console(cfg.logger.level)
    return _run(cfg, args)


def _print_resolved(cfg) -> int:
    """The config with its models prepared, and what every engine receives (rl_specdec.config.engine_args)."""
    from omegaconf import OmegaConf

    from rl_specdec.config import ConfigError, engine_args, to_yaml
    from rl_specdec.rollout.engine_ext import EXTENSION
    from rl_specdec.toy.resolve import prepare_models

    try:
        prepare_models(cfg, log=lambda m: print(m, file=sys.stderr, flush=True))  # stdout stays YAML
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    engine = engine_args(cfg.policy.generation, cfg.policy.model_name, cfg.seed, EXTENSION)
    print(to_yaml(cfg))
    print("# what each engine receives (vllm.LLM keyword arguments):")
    print(OmegaConf.to_yaml({"engine_args": engine}))
    return 0


def _run(cfg, args: argparse.Namespace) -> int:
    """Train; one line on the console for the outcome, and the exit code (0 done, 1 error, 2 config error,
    130/143 stopped by a signal)."""
    from rl_specdec.config import ConfigError
    from rl_specdec.errors import (
        CheckpointDamaged,
        CheckpointWriteFailed,
        GenerationEngineDied,
        PolicyWorkerDied,
        ProcessDied,
        RunStopped,
        SamplingSelfCheckFailed,
        SpecDecodeCanaryTripped,
        WeightIntegrityError,
    )
    from rl_specdec.grpo.loop import train
    from rl_specdec.rollout.placement import stop_ray

    t0 = time.time()
    try:
        last = train(cfg, resume_command=resume_command(args))
    except RunStopped as e:  # SIGTERM or Ctrl-C: the last finished step is checkpointed, everything is shut down
        print(e.message, file=sys.stderr)
        return e.code
    except ConfigError as e:  # e.g. more GPUs than the Ray cluster has, found before any actor started
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except (
        GenerationEngineDied,
        SamplingSelfCheckFailed,
        PolicyWorkerDied,
        ProcessDied,
        CheckpointDamaged,
        CheckpointWriteFailed,
        WeightIntegrityError,
        SpecDecodeCanaryTripped,
    ) as e:
        print(f"error: {e}", file=sys.stderr)  # the loop already logged the step and the last checkpoint
        return 1
    finally:
        stop_ray()  # the local Ray instance, and every process it started, are gone before this process exits
    if not last:  # resume=true found the run already at grpo.max_steps
        print(
            f"nothing to do: the checkpoint in {cfg.logger.log_dir} is already at grpo.max_steps={cfg.grpo.max_steps}"
        )
        return 0
    held_out = f", held-out accuracy {last['val/accuracy']:.3f}" if last.get("val/accuracy") is not None else ""
    print(
        f"done in {time.time() - t0:.0f}s: train reward {last['train/reward_mean']:.3f}, train accuracy "
        f"{last['train/accuracy']:.3f}{held_out}; "
        f"metrics in {cfg.logger.log_dir}/metrics.jsonl (plot: python -m rl_specdec.plot {cfg.logger.log_dir})"
    )
    return 0


def resume_command(args: argparse.Namespace) -> str:
    """This command line with ``resume=true`` (instead of any ``resume=`` it had)."""
    words = ["python", sys.argv[0], "--config", args.config] + (["--verbose"] if args.verbose else [])
    words += [o for o in args.overrides if not o.startswith("resume=")] + ["resume=true"]
    return shlex.join(words)


if __name__ == "__main__":
    sys.exit(main())
