"""Build the models a session will need in one step, before its first use of any: ``python -m rl_specdec.toy.prebuild``.

    python -m rl_specdec.toy.prebuild                                  # every model in EVERY
    python -m rl_specdec.toy.prebuild toy:policy pkg:smollm2-135m-instruct

The embedded toys, their EAGLE-3 heads and the packaged model's conversion are built the first time a run names
them, once per machine (:func:`rl_specdec.toy.build.build_once`). Built one by one as tests or runs reach them, two
processes that start together wait on each other's builds. This step builds a list at once instead, and two
processes that run it together split the list: each takes the next model that nobody is building (a model whose
own source another process is building counts as taken), and waits only for what is left at the end. Each build
prints a line when it starts and one with its time.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

from rl_specdec.toy.build import BuildBusy, not_waiting

T = TypeVar("T")

# The longest first (the long-tail pair: 4-8 minutes on 2 cores), then sources before what is built from them, so
# that two processes find independent work first.
EVERY = (
    "toy:longtail-policy",
    "toy:policy",
    "pkg:smollm2-135m-instruct",
    "toy:eagle3",
    "toy:wide-policy",
    "pkg:smollm2-135m-instruct-eagle3",
    "toy:wide-eagle3",
    "toy:tools-policy",
)


def build_free(builds: Iterable[Callable[[], T]]) -> dict[int, T]:
    """{index: result} of each zero-argument build that no other process is building, nor a source of it."""
    out = {}
    with not_waiting():
        for i, build in enumerate(builds):
            try:
                out[i] = build()
            except BuildBusy:
                pass  # another process builds it
    return out


def build_all(builds: Iterable[Callable[[], T]]) -> list[T]:
    """Each zero-argument build's result, in order; a build whose folder (or a source of it) another process is
    building is put off until the others are done, then waited for."""
    builds = list(builds)
    out = build_free(builds)
    return [out[i] if i in out else build() for i, build in enumerate(builds)]


def prebuild(names: Iterable[str] = EVERY, log: Callable[[str], None] = print) -> dict[str, str]:
    """{name: folder} for each model name (``toy:*``, ``pkg:*``), built where it is not cached yet."""
    from rl_specdec.toy.resolve import model_folder

    names = list(dict.fromkeys(names))
    return dict(zip(names, build_all(functools.partial(model_folder, name, log) for name in names)))


def main(argv: list[str] | None = None) -> int:
    from rl_specdec.errors import ConfigError

    ap = argparse.ArgumentParser(prog="python -m rl_specdec.toy.prebuild", description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", default=list(EVERY), help=f"model names (default: {' '.join(EVERY)})")
    args = ap.parse_args(argv)
    t0 = time.time()
    try:
        folders = prebuild(args.names, log=lambda m: print(m, flush=True))
    except ConfigError as e:
        ap.error(str(e))
    for name, folder in folders.items():
        print(f"{name}: {folder}")
    print(f"ready in {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
