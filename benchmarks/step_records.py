"""An engine extension for benchmarks: the package's, plus one RPC that returns (and clears) the engine steps
the run-time-k fast path recorded (its StepRecords, as dicts). Engines load it by name
(``benchmarks.step_records.StepRecordExtension``), so the benchmarks package must be importable in Ray's workers:
:func:`importable` puts the repository's root on PYTHONPATH before Ray starts."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from rl_specdec.rollout.engine_ext import RlSpecdecExtension

NAME = f"{__name__}.StepRecordExtension"


class StepRecordExtension(RlSpecdecExtension):
    def rl_specdec_step_records(self) -> list[dict]:
        st = self._spec()
        if "_step_records" not in self.__dict__:
            records: list[dict] = []
            self.__dict__["_step_records"] = records
            st.fp.listeners.append(lambda done, so: records.append(dataclasses.asdict(done)))
        out = list(self.__dict__["_step_records"])
        self.__dict__["_step_records"].clear()
        return out


def importable() -> None:
    """The repository's root (the folder that holds ``benchmarks/``) on PYTHONPATH, for the Ray workers and engine
    processes started after this call: they import the benchmarks' modules (extensions, a study's actor code) as
    ``benchmarks.<...>``, whatever their working folder."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    root = str(Path(__file__).resolve().parents[1])
    if root not in paths:
        paths.insert(0, root)
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)


def engine_group(extension: bool):
    """VllmGeneration, with this extension in its engines when ``extension``."""
    from rl_specdec.rollout.group import VllmGeneration
    from rl_specdec.rollout.worker import VllmWorker

    if not extension:
        return VllmGeneration

    class Worker(VllmWorker):
        extension = NAME

    class Group(VllmGeneration):
        worker_cls = Worker

    return Group
