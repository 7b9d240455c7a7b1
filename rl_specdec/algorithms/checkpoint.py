"""Atomic checkpoints: a step is either fully on disk or not at all.

Each save writes into ``<dir>/.tmp-step_NNNNNN`` and renames it to
``<dir>/step_NNNNNN`` only after the policy, optimizer and trainer state are
written, so a crash while saving leaves the last good checkpoint untouched.
Only the newest ``keep`` checkpoints are kept.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any


class CheckpointManager:
    def __init__(self, directory: str, keep: int = 2):
        self.dir = Path(directory)
        self.keep = keep

    def _complete(self) -> list[Path]:
        if not self.dir.is_dir():
            return []
        done = [p for p in self.dir.glob("step_*") if (p / "trainer_state.json").is_file()]
        return sorted(done, key=lambda p: int(p.name.split("_")[1]))

    def latest(self) -> tuple[Path, dict[str, Any]] | None:
        done = self._complete()
        if not done:
            return None
        return done[-1], json.loads((done[-1] / "trainer_state.json").read_text())

    def save(self, step: int, save_policy, state: dict[str, Any]) -> Path:
        """``save_policy(path)`` writes the model and optimizer into ``path``."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in self.dir.glob(".tmp-step_*"):  # left by a crash mid-save
            shutil.rmtree(stale, ignore_errors=True)
        final = self.dir / f"step_{step:06d}"
        tmp = self.dir / f".tmp-step_{step:06d}"
        save_policy(str(tmp))
        with open(tmp / "trainer_state.json", "w") as f:
            json.dump(state, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        for old in self._complete()[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        return final
