"""Rollouts that outlive the step that generated them (``grpo.max_staleness=1``): stamped, bounded, carried.

A :class:`Rollouts` holds one step's P×G outputs and, per sample, the policy version that generated it (the
number of updates in the engines' weights then). :func:`unusable` says why a step must not train on them (too
old for the bound, generated for another step or other prompts, missing the drafter's top-k log-probs);
:func:`save_rollouts` and :func:`load_rollouts` carry them in a checkpoint (``rollouts.json``). Also the
step's ``train/staleness*`` and ``timing/overlap`` (:func:`overlap_fraction`). No Ray, no engines.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl_specdec.rollout import GenerationOutput
from rl_specdec.rollout.serving.episodes import EpisodeOutput

ROLLOUTS_FILE = "rollouts.json"


@dataclass
class Rollouts:
    step: int  # the 0-based step that trains on them
    prompt_ids: list[list[int]]  # [P*G]
    out: GenerationOutput
    versions: list[int]  # per sample: updates in the weights that generated it

    def staleness(self) -> list[int]:
        """Per sample: updates between the weights that generated it and those its step trains (W_step)."""
        return [self.step - v for v in self.versions]

    @property
    def seconds(self) -> float:
        """The generate call's time on its slowest engine."""
        return max(self.out.per_engine_time_s, default=0.0)


def unusable(
    ro: Rollouts, step: int, bound: int, prompt_ids: list[list[int]], want_top: bool, n: int | None = None
) -> str | None:
    """Why step ``step`` must not train on ``ro`` (None: it may). ``n``: the step's rollouts, when its prompts are
    not token ids (episodes, whose prompts the servers render: ``prompt_ids`` is [] for both)."""
    n = len(prompt_ids) if n is None else n
    if ro.step != step:
        return f"they were generated for step {ro.step + 1}"
    if ro.prompt_ids != prompt_ids or len(ro.out) != n or len(ro.versions) != n:
        return "their prompts are not this step's (another task or batch size)"
    stale = ro.staleness()
    if max(stale) > bound or min(stale) < 0:
        return f"they are {max(stale)} updates old (grpo.max_staleness={bound})"
    if want_top and ro.out.top_logprobs is None:
        return "they lack the top-k log-probs the drafter trains on"
    return None


def staleness_metrics(ro: Rollouts, trained: list[int]) -> dict[str, float]:
    """``train/staleness`` (mean) and ``train/staleness_max`` over the samples trained on."""
    stale = [ro.staleness()[i] for i in trained]
    return {"train/staleness": sum(stale) / len(stale), "train/staleness_max": float(max(stale))}


def save_rollouts(folder: Path, ro: Rollouts) -> None:
    """``<folder>/rollouts.json``: everything a resumed step needs to train on them as the first run would."""
    out = dataclasses.asdict(ro.out)
    _convert_top(out, lambda tops: [list(map(list, t.items())) for t in tops])
    data = {"step": ro.step, "versions": ro.versions, "prompt_ids": ro.prompt_ids, "output": out}
    with open(folder / ROLLOUTS_FILE, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())


def load_rollouts(folder: Path) -> Rollouts | None:
    """The rollouts a checkpoint carries (None if it carries none)."""
    if not (folder / ROLLOUTS_FILE).is_file():
        return None
    data: dict[str, Any] = json.loads((folder / ROLLOUTS_FILE).read_text())
    out = data["output"]
    _convert_top(out, lambda tops: [{int(k): v for k, v in t} for t in tops])
    output = EpisodeOutput.from_dict(out) if "episodes" in out else GenerationOutput(**out)
    return Rollouts(data["step"], data["prompt_ids"], output, data["versions"])


def _convert_top(out: dict[str, Any], convert) -> None:
    """Each list of top-k dicts in an output's dict, samples' and episode turns', through ``convert``: JSON keys
    are strings, so token ids travel as [id, log-prob] pairs."""
    if out.get("top_logprobs") is not None:
        out["top_logprobs"] = [convert(sample) for sample in out["top_logprobs"]]
    for turn in (t for x in out.get("episodes", []) for t in x["turns"]):
        if turn.get("top_logprobs") is not None:
            turn["top_logprobs"] = convert(turn["top_logprobs"])


def _merged(spans: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    """``spans`` cut to [lo, hi], sorted, overlapping ones joined."""
    out: list[tuple[float, float]] = []
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in spans):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def overlap_fraction(
    first: list[tuple[float, float]], second: list[tuple[float, float]], window: tuple[float, float]
) -> float:
    """The fraction of ``window`` during which both something of ``first`` and something of ``second`` ran."""
    lo, hi = window
    if hi <= lo:
        return 0.0
    a, b = _merged(first, lo, hi), _merged(second, lo, hi)
    both, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        both += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return both / (hi - lo)
