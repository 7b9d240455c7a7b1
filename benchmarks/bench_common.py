"""What every benchmark command shares: where its results go, the machine line that heads its report, and the
log and load-average checks. ``python -m benchmarks <command>`` writes to ``results/<command>`` unless
``--out`` says otherwise; each report's first line names the machine (``rl_specdec.sysinfo.machine_label``),
because a figure means nothing without the machine it was measured on."""

from __future__ import annotations

import contextlib
import io
import os
import platform
import sys
from pathlib import Path

RESULTS = "results"


def default_out(command: str) -> str:
    """The folder a command writes its report (markdown, JSON, plots) to when ``--out`` is not given."""
    return f"{RESULTS}/{command}"


def add_out(p, command: str, what: str = "report .md, .json") -> None:
    """The shared ``--out`` option of a command's parser (or argument group)."""
    p.add_argument("--out", default=default_out(command), help=f"results folder ({what}; default: %(default)s)")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


_warned_load = False


def cores_and_load() -> tuple[int, float]:
    """Usable cores and the 1-minute load average; warns (once per process) when
    another job is running, because every timing would be off."""
    global _warned_load
    from rl_specdec.toy.presets import usable_cores

    cores = usable_cores()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    if load > 0.5 * cores and not _warned_load:
        log(f"WARNING: load average {load:.2f} on {cores} cores: another job is running, numbers will be noisy")
        _warned_load = True
    return cores, load


def header(versions: bool = True) -> str:
    """The machine line of a report: its label, CPU model, usable cores and memory, the vLLM and torch versions
    (``versions``) and the load average now, e.g. "AMD EPYC 2c AVX-512: AMD EPYC, 2 cores, 8 GiB; vLLM 0.32.0,
    torch 2.9.0; load average at start 0.12"."""
    from rl_specdec.sysinfo import cpu_model, machine_label

    cores, load = cores_and_load()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    head = f"{machine_label()}: {cpu_model() or platform.processor()}, {cores} cores, {mem:.0f} GiB"
    if versions:
        import torch
        import vllm

        head += f"; vLLM {vllm.__version__}, torch {torch.__version__}"
    return f"{head}; load average at start {load:.2f}"


@contextlib.contextmanager
def markdown_report(out: str | Path, name: str, title: str, head: str | None = None):
    """Print as usual, and keep a copy of everything printed in ``<out>/<name>``, under ``# title`` and the
    machine line (``head``, default :func:`header` without versions): for the commands whose tables are printed."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    copy, stdout = io.StringIO(), sys.stdout

    class Tee(io.TextIOBase):
        def write(self, s: str) -> int:
            copy.write(s)
            return stdout.write(s)

        def flush(self) -> None:
            stdout.flush()

    head = head or header(versions=False)
    print(f"_{head}_\n")
    sys.stdout = Tee()
    try:
        yield out
    finally:
        sys.stdout = stdout
        (out / name).write_text(f"# {title}\n\n_{head}_\n\n{copy.getvalue()}")
        log(f"report: {out / name}")
