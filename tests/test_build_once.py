"""A cached build runs once per machine: concurrent callers wait for it (or, asked not to wait, skip it), a failed
build leaves nothing behind, and the prebuild step splits a list between two processes. Pure logic, no model."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest

from rl_specdec.toy.build import BuildBusy, build_once, not_waiting
from rl_specdec.toy.prebuild import build_all


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """The lock files go to the cache's own folder: a fresh one per test (the forked builders inherit it)."""
    monkeypatch.setenv("RL_SPECDEC_CACHE", str(tmp_path / "cache"))


def _make(log: Path, seconds: float = 0.0):
    def make(root: Path) -> None:
        with open(log, "a") as f:
            f.write(f"{root.name}\n")
        time.sleep(seconds)
        root.mkdir()
        (root / "DONE").write_text("ok\n")

    return make


def _build(root: str, log: str, seconds: float) -> None:
    build_once(Path(root), _make(Path(log), seconds), "test", log=lambda *_: None)


def _started(log: Path, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not (log.exists() and log.read_text()) and time.monotonic() < end:
        time.sleep(0.02)


def test_two_processes_that_need_one_folder_build_it_once(tmp_path):
    root, log = tmp_path / "model", tmp_path / "log"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_build, args=(str(root), str(log), 1.0)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0, 0]
    assert log.read_text().splitlines() == ["model"] and (root / "DONE").exists()


def test_a_caller_that_will_not_wait_is_told_and_build_all_waits_at_the_end(tmp_path):
    busy, free, log = tmp_path / "busy", tmp_path / "free", tmp_path / "log"
    other = multiprocessing.get_context("fork").Process(target=_build, args=(str(busy), str(log), 2.0))
    other.start()
    _started(log)
    with not_waiting(), pytest.raises(BuildBusy):
        build_once(busy, _make(log), "busy", log=lambda *_: None)
    order: list[str] = []

    def step(root: Path):
        def run():
            out = build_once(root, _make(log), root.name, log=lambda *_: None)
            order.append(root.name)
            return out

        return run

    assert build_all([step(busy), step(free)]) == [busy, free]  # the results in the order asked
    assert order == ["free", "busy"]  # the free one first, then the one the other process was building
    other.join(30)
    assert log.read_text().splitlines() == ["busy", "free"]  # each built once


def test_a_failed_build_leaves_no_folder_and_the_next_caller_builds_it(tmp_path):
    root, lines = tmp_path / "model", []

    def broken(path: Path) -> None:
        raise RuntimeError("out of disk")

    with pytest.raises(RuntimeError, match="out of disk"):
        build_once(root, broken, "broken", log=lines.append)
    assert not root.exists()
    build_once(root, _make(tmp_path / "log"), "the model", log=lines.append)
    assert (root / "DONE").exists()
    assert lines[-1].startswith("[build] the model: built in") and "building into" in lines[-2]


def test_the_prebuild_command_names_a_model_it_does_not_know_and_the_ones_it_does(capsys):
    from rl_specdec.toy.prebuild import main

    with pytest.raises(SystemExit) as e:
        main(["toy:nope"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "toy:nope" in err and "toy:wide-policy" in err and "Traceback" not in err
