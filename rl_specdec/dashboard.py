"""A saved wandb workspace for rl_specdec runs: learning, speculation, the tail, the on-policy check, phase times.

    python -m rl_specdec.dashboard --entity E --project P [--run logs/grpo_spec]

Runs are grouped by their wandb group (``logger.wandb.group``, by default the
run's name: grpo_spec, grpo_base, ...), so a speculative run and its baseline
sit side by side. Families of keys whose names depend on the run (acceptance
per draft position, k per batch-size bucket) are expanded from the keys of a
local run's ``metrics.jsonl`` (``--run``); a panel with none of its keys in
that run is left out, so no panel is empty. Needs the ``wandb-workspaces``
package (``pip install wandb-workspaces``, in the ``dashboard`` and ``dev`` extras) and a wandb login to save.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Panel:
    title: str
    keys: tuple[str, ...] = ()  # logged by every run the section is for
    families: tuple[str, ...] = ()  # key prefixes, expanded from a run's keys (e.g. spec_decode/acceptance_rate_pos_)
    optional: tuple[str, ...] = ()  # logged only with an opt-in feature (drafter training, run-time k)


SECTIONS: dict[str, tuple[Panel, ...]] = {
    "learning": (
        Panel("validation accuracy", ("val/accuracy",)),
        Panel("validation reward", ("val/reward",)),
        Panel("training reward", ("train/reward_mean",)),
    ),
    "speculation": (
        Panel("acceptance length", ("spec_decode/acceptance_length",)),
        Panel("acceptance rate", ("spec_decode/acceptance_rate",)),
        Panel("acceptance per draft position", families=("spec_decode/acceptance_rate_pos_",)),
        Panel("k per batch-size bucket", families=("spec_decode/k_bucket_",)),
        Panel("drafter version", optional=("drafter/version",)),
        Panel("drafter loss", optional=("drafter/loss",)),
        Panel("acceptance canary", optional=("spec_decode/canary",)),
    ),
    "the tail": (
        Panel(
            "time to 50/90/100% of rollouts done",
            ("generation/time_to_50pct_done", "generation/time_to_90pct_done", "generation/time_to_100pct_done"),
        ),
    ),
    "on-policy check": (Panel("log-prob mismatch", ("train/logprob_mismatch", "train/logprob_mismatch_max")),),
    "phase times": (
        Panel(
            "phase times (s)",
            ("timing/generation", "timing/train", "timing/refit", "timing/reward", "timing/step"),
            optional=("timing/validation", "timing/checkpoint", "timing/drafter_train", "timing/drafter_wait"),
        ),
    ),
}


def run_keys(log_dir: str | Path) -> set[str]:
    """Every key a run logged (its ``metrics.jsonl``)."""
    keys: set[str] = set()
    for line in (Path(log_dir) / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            keys |= set(json.loads(line))
    return keys


def _natural(key: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", key)]


def panel_keys(panel: Panel, available: set[str] | None) -> list[str]:
    """The keys a panel plots: its own, its optional ones and its families' members that ``available`` has
    (all of its own and optional ones when ``available`` is None)."""
    if available is None:
        return list(panel.keys + panel.optional)
    found = [k for k in panel.keys + panel.optional if k in available]
    for prefix in panel.families:
        found += sorted((k for k in available if k.startswith(prefix)), key=_natural)
    return found


def layout(available: set[str] | None) -> dict[str, list[tuple[str, list[str]]]]:
    """Section -> [(panel title, keys)], without empty panels or sections."""
    out = {}
    for section, panels in SECTIONS.items():
        rows = [(p.title, keys) for p in panels if (keys := panel_keys(p, available))]
        if rows:
            out[section] = rows
    return out


def build_workspace(entity: str, project: str, available: set[str] | None = None, name: str = "rl_specdec"):
    """The workspace object (``wandb_workspaces.workspaces.Workspace``); ``.save()`` creates it on wandb."""
    try:
        import wandb_workspaces.reports.v2 as wr
        import wandb_workspaces.workspaces as ws
    except ImportError as e:
        raise SystemExit(f"the dashboard needs the wandb-workspaces package: pip install wandb-workspaces ({e})")
    sections = [
        ws.Section(
            name=section,
            panels=[wr.LinePlot(title=title, x="step", y=keys) for title, keys in rows],
            is_open=True,
        )
        for section, rows in layout(available).items()
    ]
    return ws.Workspace(
        name=name,
        entity=entity,
        project=project,
        sections=sections,
        runset_settings=ws.RunsetSettings(groupby=[ws.Metric("Group")]),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entity", required=True, help="wandb team or user")
    parser.add_argument("--project", required=True, help="wandb project (logger.wandb.project)")
    parser.add_argument("--name", default="rl_specdec", help="the saved workspace's name")
    parser.add_argument("--run", default=None, help="a local run's log_dir, to expand key families from")
    parser.add_argument("--dry-run", action="store_true", help="print the sections and panels, save nothing")
    args = parser.parse_args(argv)
    available = run_keys(args.run) if args.run else None
    for section, rows in layout(available).items():
        print(f"{section}: " + "; ".join(f"{title} ({len(keys)})" for title, keys in rows))
    if args.dry_run:
        return 0
    workspace = build_workspace(args.entity, args.project, available, args.name).save()
    print(f"saved: {workspace.url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
