"""Atomic, verified checkpoints: a step is either fully on disk and intact, or not used.

Each save writes into ``<dir>/.tmp-step_NNNNNN`` and renames it to
``<dir>/step_NNNNNN`` only after the policy, optimizer and trainer state are
written, so a crash while saving leaves the last good checkpoint untouched.
Before the rename, ``manifest.json`` records the size and sha256 of every
file. :meth:`CheckpointManager.latest` checks them: a damaged checkpoint (a
truncated or edited file, a missing one) is named in a warning and skipped for
the newest intact one; if none is intact it stops with a message, instead of a
deserialisation traceback deep in the policy. Only the newest ``keep``
checkpoints are kept.

A save that fails while writing (a full disk, a quota, a read-only folder)
removes its half-written folder and raises
:class:`~rl_specdec.errors.CheckpointWriteFailed`, naming the folder and the
free space there; the checkpoints before it are untouched (old ones are pruned
only after a save succeeds).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

from rl_specdec.errors import CheckpointDamaged, CheckpointWriteFailed, PolicyWorkerDied

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
# What a failed write raises: the OS's error, or the writers' own wrappers of it. torch.save reports a full
# disk as a RuntimeError ("unexpected pos ..."), safetensors as a SafetensorError ("No space left on device").
# Through a Ray actor each arrives as an instance of its own class (RayTaskError.as_instanceof_cause).
WRITE_ERRORS: tuple[type[BaseException], ...] = (OSError, RuntimeError, SafetensorError)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(root: Path) -> None:
    manifest = {str(p.relative_to(root)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in _files(root)}
    with open(root / MANIFEST, "w") as f:
        json.dump({"files": manifest}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def verify(root: Path) -> str | None:
    """``None`` if every file the manifest lists is there with its size and sha256, else what is wrong."""
    if not (root / MANIFEST).exists():
        logger.warning(
            "checkpoint %s has no %s (written by an older rl_specdec): its files cannot be verified", root, MANIFEST
        )
        return None
    try:
        files = json.loads((root / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} is missing or unreadable ({type(e).__name__}: {e})"
    for rel, want in files.items():
        p = root / rel
        if not p.is_file():
            return f"{rel} is missing"
        size = p.stat().st_size
        if size != want["bytes"]:
            return f"{rel} has {size} bytes, {want['bytes']} were written"
        if _sha256(p) != want["sha256"]:
            return f"{rel} does not match its sha256 ({want['sha256'][:12]}...)"
    return None


class CheckpointManager:
    def __init__(self, directory: str, keep: int = 2):
        self.dir = Path(directory)
        self.keep = keep
        self._verified: dict[Path, str | None] = {}  # checkpoint -> problem (None: intact); a folder is checked once

    def _complete(self) -> list[Path]:
        if not self.dir.is_dir():
            return []
        done = [p for p in self.dir.glob("step_*") if (p / "trainer_state.json").is_file()]
        return sorted(done, key=lambda p: int(p.name.split("_")[1]))

    def _problem(self, path: Path) -> str | None:
        if path not in self._verified:
            self._verified[path] = verify(path)
        return self._verified[path]

    def latest(self) -> tuple[Path, dict[str, Any]] | None:
        """The newest intact checkpoint and its trainer state; ``None`` if there is no checkpoint.

        Damaged ones are skipped with a warning that names the file; if every
        checkpoint is damaged, :class:`CheckpointDamaged` says so.
        """
        done = self._complete()
        damaged = []
        for path in reversed(done):
            problem = self._problem(path)
            if problem is None:
                for bad, why in damaged:
                    logger.warning(
                        "checkpoint %s is damaged: %s. Falling back to the newest intact checkpoint, %s",
                        bad,
                        why,
                        path.name,
                    )
                return path, json.loads((path / "trainer_state.json").read_text())
            damaged.append((path, problem))
        if damaged:
            detail = "; ".join(f"{p}: {problem}" for p, problem in damaged)
            raise CheckpointDamaged(
                f"no intact checkpoint in {self.dir}: {detail}. Restore the files, or move the folder away and start "
                "without resume=true."
            )
        return None

    def path(self, step: int) -> Path:
        return self.dir / f"step_{step:06d}"

    def has(self, step: int) -> bool:
        """Whether the checkpoint of ``step`` is on disk, complete and intact."""
        return self.path(step) in self._complete() and self._problem(self.path(step)) is None

    def save(self, step: int, save_policy, state: dict[str, Any]) -> Path:
        """``save_policy(path)`` writes the model and optimizer into ``path``.

        A write that fails (:data:`WRITE_ERRORS`) removes the half-written folder and raises
        :class:`CheckpointWriteFailed`; any other error removes it too and propagates as it is.
        """
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in self.dir.glob(".tmp-step_*"):  # left by a crash mid-save
            shutil.rmtree(stale, ignore_errors=True)
        final, tmp = self.path(step), self.dir / f".tmp-step_{step:06d}"
        try:
            save_policy(str(tmp))
            with open(tmp / "trainer_state.json", "w") as f:
                json.dump(state, f, indent=2)
                f.flush()
                os.fsync(f.fileno())
            write_manifest(tmp)
        except BaseException as e:
            failed = isinstance(e, WRITE_ERRORS) and not isinstance(e, PolicyWorkerDied)
            free = _free_space(self.dir) if failed else ""  # before the half-written folder goes: what filled it
            shutil.rmtree(tmp, ignore_errors=True)
            if failed:
                raise CheckpointWriteFailed(self._write_failed(final, e, free)) from e
            raise
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        self._verified[final] = None  # just written and hashed
        for old in self._complete()[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
            self._verified.pop(old, None)
        return final

    def _write_failed(self, final: Path, e: BaseException, free: str) -> str:
        cause = getattr(e, "cause", None) or e  # a Ray actor's error carries the original one
        kept = [p.name for p in self._complete()]
        return (
            f"could not write checkpoint {final.name} into {self.dir}: {type(cause).__name__}: {cause}. "
            f"{free} when it failed. The half-written folder was removed; "
            f"{'the checkpoints there are intact: ' + ', '.join(kept) if kept else 'there is no earlier checkpoint'}. "
            "Free some space there (or point checkpoint.dir at a disk with room) and continue with resume=true; "
            "checkpoint.on_error=warn trains on when a checkpoint cannot be written"
        )


def _free_space(folder: Path) -> str:
    try:
        usage = shutil.disk_usage(folder)
    except OSError as e:
        return f"its free space could not be read ({e})"
    return f"{usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.1f} MiB on that disk"
