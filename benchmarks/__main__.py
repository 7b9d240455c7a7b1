"""python -m benchmarks <command> [args]: one entry point to the benchmarks, one command per question.

    python -m benchmarks --help              # the commands, each with the question it answers
    python -m benchmarks grpo --quick        # the shipped default against no speculation, small
    python -m benchmarks <command> --help    # a command's own options

Each command writes its report (markdown, JSON, plots where it draws them) to results/<command> unless --out
says otherwise, headed by the machine it ran on. Run it from the repository's root. The one-off studies behind
docs' experiments are in benchmarks/studies/, each run as python -m benchmarks.studies.<name> (benchmarks/README.md
maps them).
"""

from __future__ import annotations

import importlib
import sys
from typing import NamedTuple


class Command(NamedTuple):
    module: str  # its module, by its full name (benchmarks.<folder>.<module>)
    function: str  # its entry point: function(argv) -> exit status or None
    question: str  # what it answers, for --help


COMMANDS: dict[str, Command] = {
    "grpo": Command(
        "benchmarks.grpo.bench", "grpo_main", "How much faster is a GRPO step with speculation? Variants side by side"
    ),
    "paired": Command(
        "benchmarks.grpo.paired",
        "main",
        "How much faster is GRPO with a variant's generation, on one trajectory (same weights and prompts)?",
    ),
    "staleness": Command(
        "benchmarks.grpo.bench", "staleness_main", "Does a frozen drafter go stale while the policy trains?"
    ),
    "peer": Command(
        "benchmarks.grpo.bench", "peer_main", "How does a step compare with TRL's GRPOTrainer on the same task?"
    ),
    "rollout": Command(
        "benchmarks.rollout.rollout", "main", "Which speculation method and k generate fastest, per batch size?"
    ),
    "cost-table": Command(
        "benchmarks.rollout.cost_table", "main", "What does an engine step cost at batch b and k drafts, measured?"
    ),
    "batch-sweep": Command(
        "benchmarks.rollout.batch_sweep",
        "main",
        "At which batch sizes does a config's speculation pay on its own model and task? (and the k schedule)",
    ),
    "gpu-whatif": Command(
        "benchmarks.gpu.gpu_whatif", "main", "What would speculation buy on a GPU? (a model, not a measurement)"
    ),
    "gpu-torch": Command(
        "benchmarks.gpu.gpu_torch", "main", "How fast are the train step and decode kernels on this GPU?"
    ),
    "gpu-head": Command(
        "benchmarks.gpu.gpu_head", "main", "What does training an EAGLE-3 head online cost a step on this GPU?"
    ),
    "refit": Command(
        "benchmarks.refit.refit", "main", "What does handing the weights to the engines cost, whole or bucketed?"
    ),
    "exactness": Command(
        "benchmarks.exactness.exactness", "main", "Is every sampled token's log-prob the trainer's while k changes?"
    ),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [__doc__.strip(), "", "commands:"]
    lines += [f"  {name:<{width}}  {c.question}" for name, c in COMMANDS.items()]
    return "\n".join(lines) + "\n"


def quiet_console() -> None:
    """vLLM, Ray and transformers at ERROR in this process and the engines it starts, as run_grpo.py's default
    (RL_SPECDEC_LOG_LEVEL=info shows their lines); before the command's module can import vLLM."""
    import os

    from rl_specdec.metrics.console import LEVEL_ENV, configure_console

    configure_console(os.environ.get(LEVEL_ENV, "error").lower())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        sys.stdout.write(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        sys.stderr.write(f"python -m benchmarks: unknown command {name!r}; choose from {', '.join(COMMANDS)}\n")
        return 2
    cmd = COMMANDS[name]
    sys.argv = [f"python -m benchmarks {name}", *rest]  # the tool's --help and errors name the command
    quiet_console()
    from rl_specdec.vllm_ext import facts

    facts.use_file()  # what configs are checked against, from this installation's file once written
    status = getattr(importlib.import_module(cmd.module), cmd.function)(rest)
    return status or 0


if __name__ == "__main__":
    sys.exit(main())
