"""Metrics out: wandb (offline by default), a JSONL file, and phase timers.

Metrics are flat dicts with ``/`` prefixes (``train/``, ``timing/``,
``spec_decode/``, ...). Every step is appended to ``<log_dir>/metrics.jsonl``
as one JSON object with a ``step`` key and flushed at once, so a killed run
keeps every finished step. wandb groups panels by prefix, so the
``spec_decode/*`` panels sit together in their own section.
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any


class Timer:
    """Collects ``timing/<phase>`` seconds for one step, and when each phase ran (:attr:`spans`)."""

    def __init__(self):
        self.times: dict[str, float] = {}
        self.spans: list[tuple[str, float, float]] = []  # (phase, start, end) on time.perf_counter's clock

    @contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            t1 = time.perf_counter()
            self.times[f"timing/{phase}"] = self.times.get(f"timing/{phase}", 0.0) + t1 - t0
            self.spans.append((phase, t0, t1))

    def pop(self) -> dict[str, float]:
        out, self.times, self.spans = self.times, {}, []
        return out


def _jsonable(v: Any):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if hasattr(v, "item"):
        return _jsonable(v.item())
    return v


class MetricsLogger:
    def __init__(self, log_dir: str, config: dict[str, Any], wandb_cfg: Any = None, resume: bool = False):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.log_dir / "metrics.jsonl"
        if not resume and self.path.exists():
            self.path.unlink()
        self.run = None
        if wandb_cfg is not None and wandb_cfg.enabled and wandb_cfg.mode != "disabled":
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self.run = wandb.init(
                project=wandb_cfg.project,
                entity=wandb_cfg.entity,
                name=wandb_cfg.name,
                group=wandb_cfg.group or wandb_cfg.name,
                tags=list(wandb_cfg.tags) or None,
                notes=wandb_cfg.notes,
                mode=wandb_cfg.mode,
                dir=str(self.log_dir),
                config=config,
                resume="allow" if resume else None,
                id=self._run_id(resume),
            )
            self.run.define_metric("step")
            self.run.define_metric("*", step_metric="step")

    def _run_id(self, resume: bool) -> str | None:
        """One wandb run id per log_dir, so resume=true continues the same run."""
        f = self.log_dir / "wandb_run_id"
        if resume and f.exists():
            return f.read_text().strip()
        rid = uuid.uuid4().hex[:8]
        f.write_text(rid)
        return rid

    def truncate_after(self, step: int) -> None:
        """On resume: drop JSONL lines of steps after the checkpoint (they will be redone).

        Written whole under a temporary name, then renamed: a signal or a crash meanwhile leaves the old file."""
        if not self.path.exists():
            return
        keep = [
            line for line in self.path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step
        ]
        self.write_file(self.path.name, "".join(line + "\n" for line in keep))

    def add_config(self, values: dict[str, Any]) -> None:
        """Add to the wandb run's config (e.g. what the engines really run, under ``engine/``)."""
        if self.run is not None:
            self.run.config.update(values, allow_val_change=True)

    def write_file(self, name: str, text: str) -> Path:
        """A file in the run's log folder, written whole (temporary name, then rename)."""
        path = self.log_dir / name
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
        return path

    def logged_steps(self) -> set[int]:
        """Steps that have a row in metrics.jsonl."""
        if not self.path.exists():
            return set()
        return {json.loads(line)["step"] for line in self.path.read_text().splitlines() if line.strip()}

    def log(self, metrics: dict[str, Any], step: int) -> None:
        row = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
        if self.run is not None:
            self.run.log(row)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
