"""Metrics out: wandb (offline by default), a JSONL file, and phase timers.

Metrics are flat dicts with ``/`` prefixes (``train/``, ``timing/``,
``spec_decode/``, ...). Every step is appended to ``<log_dir>/metrics.jsonl``
as one JSON object with a ``step`` key and flushed at once, so a killed run
keeps every finished step. wandb groups panels by prefix, so the
``spec_decode/*`` panels sit together in their own section.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any


THIRD_PARTY_LOGGERS = ("vllm", "ray", "transformers", "urllib3", "httpx", "uvicorn", "wandb")
LEVEL_ENV = "RL_SPECDEC_LOG_LEVEL"


def configure_console(level: str = "error") -> None:
    """A quiet console: vLLM, Ray and transformers log at ``level``; rl_specdec's own lines always show.

    Call it before vLLM is first imported: vLLM reads ``VLLM_LOGGING_LEVEL``
    when it is imported. Ray workers get the same level through
    :func:`worker_env` (``init_ray`` passes it as the job's runtime env).
    """
    name = level.upper()
    os.environ[LEVEL_ENV] = name
    os.environ["VLLM_LOGGING_LEVEL"] = name
    os.environ["TRANSFORMERS_VERBOSITY"] = level.lower()
    logging.basicConfig(level=getattr(logging, name), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(getattr(logging, name))
    for lib in THIRD_PARTY_LOGGERS:
        logging.getLogger(lib).setLevel(getattr(logging, name))
    logging.getLogger("rl_specdec").setLevel(logging.INFO)


def console_level() -> int:
    """The level :func:`configure_console` set (WARNING if it was not called)."""
    return getattr(logging, os.environ.get(LEVEL_ENV, "WARNING"))


def worker_env() -> dict[str, str]:
    """Environment for Ray workers (engines, policy) that matches the console level; {} if none was set.

    Above INFO the workers' progress bars (weight loading, checkpoint writing),
    Python warnings and torch's C++ warnings are off as well; the driver's own
    progress bar is unaffected.
    """
    if LEVEL_ENV not in os.environ:
        return {}
    name = os.environ[LEVEL_ENV]
    env = {LEVEL_ENV: name, "VLLM_LOGGING_LEVEL": name, "TRANSFORMERS_VERBOSITY": name.lower()}
    if getattr(logging, name) > logging.INFO:
        env.update({"TQDM_DISABLE": "1", "PYTHONWARNINGS": "ignore", "TORCH_CPP_LOG_LEVEL": "ERROR"})
    return env


class Timer:
    """Collects ``timing/<phase>`` seconds for one step."""

    def __init__(self):
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.times[f"timing/{phase}"] = self.times.get(f"timing/{phase}", 0.0) + time.perf_counter() - t0

    def pop(self) -> dict[str, float]:
        out, self.times = self.times, {}
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
                name=wandb_cfg.name,
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
        """On resume: drop JSONL lines of steps after the checkpoint (they will be redone)."""
        if not self.path.exists():
            return
        keep = [line for line in self.path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in keep))

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
