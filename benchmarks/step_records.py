"""An engine extension for benchmarks: the package's, plus one RPC that returns (and clears) the engine steps
the run-time-k fast path recorded (its StepRecords, as dicts). Engines load it by name, so the benchmarks
folder must be importable in Ray's workers: :func:`importable` puts it on PYTHONPATH before Ray starts."""

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


def importable(*folders: Path) -> None:
    """This folder (and ``folders``: a study's own, for its modules the actors load) on PYTHONPATH, for the Ray
    workers and engine processes started after this call."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    for here in (str(Path(f).resolve()) for f in (Path(__file__).parent, *folders)):
        if here not in paths:
            paths.insert(0, here)
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
