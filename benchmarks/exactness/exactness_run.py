"""One exactness run's results on disk, saved after every generate call, so that a run stopped for any reason
loses nothing and ``--resume`` goes on adding tokens to it (a million tokens on the wide pair take hours of a
2-core machine; they may be gathered over several invocations).

A run is two files: ``exactness_<pair>[_<drafter>]_<time>.json`` (the settings, each mode's summary and
counters, its worst tokens, and what the tallies need to go on) and the ``.npz`` beside it (every checked
token's |engine - trainer|, and each sequence's mean). Both are written to a temporary name and then renamed,
so a run killed while saving keeps its previous state.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from benchmarks.exactness import exactness_check as ec

# the settings a resumed run takes from its file (what it checks must not change half-way)
KEPT = ("pair", "drafter", "seed", "modes", "set", "perturb_target")
COUNTERS = ("tokens", "calls", "generate_s", "catch_up_tokens")


class Run:
    def __init__(self, path: Path, results: dict, tallies: dict[str, ec.Tally], shares: dict[str, float]):
        self.path, self.results, self.tallies, self.shares = path, results, tallies, shares
        self.info = {m: results["counters"][m] for m in results["settings"]["modes"]}
        self.stops = None  # the run's StopSignals while it runs (rl_specdec.grpo.stop)

    @classmethod
    def new(cls, args, shares: dict[str, float], machine: str) -> Run:
        name = f"exactness_{args.pair}{'' if args.drafter == 'draft_model' else '_' + args.drafter}"
        path = Path(args.out) / f"{name}_{time.strftime('%Y%m%d_%H%M%S')}.json"
        settings = {k: getattr(args, k) for k in KEPT}
        results = {
            "pair": args.pair,
            "drafter": args.drafter,
            "seed": args.seed,
            "machine": machine,
            "settings": settings,
            "invocations": [],
            "counters": {m: dict.fromkeys(COUNTERS, 0) for m in args.modes},
            "modes": {},
            "state": {},
        }
        run = cls(path, results, {m: ec.Tally() for m in args.modes}, shares)
        run.start(args)
        return run

    @classmethod
    def resume(cls, path: Path, args, shares: dict[str, float], machine: str) -> Run:
        if not path.exists() or not path.with_suffix(".npz").exists():
            raise SystemExit(f"--resume {path}: no such run (it needs the .json and the .npz beside it)")
        results = json.loads(path.read_text())
        arrays = np.load(path.with_suffix(".npz"))
        for k, v in results["settings"].items():  # the file's settings, whatever the command line said
            setattr(args, k, v)
        tallies = {}
        for m in results["settings"]["modes"]:
            st = results["state"].get(m)
            saved = {a: arrays[f"{m}/{a}"] for a in ("diffs", "seq_means")} if st else None
            tallies[m] = ec.Tally.restore(st, saved) if st else ec.Tally()
        if results["machine"] != machine:
            results["machine"] += f"; resumed on {machine}"
        run = cls(path, results, tallies, shares)
        run.start(args)
        return run

    def start(self, args) -> None:
        self.results["tokens"] = args.tokens  # the target: a resumed run may raise it
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        self.results["invocations"].append({"started": time.strftime("%Y-%m-%d %H:%M:%S"), "load_avg_start": load})
        print(f"load average at start: {load:.2f}", flush=True)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def budget(self, mode: str, args) -> int:
        """The mode's share of ``--tokens`` (the shares of the modes run, made to add up to 1)."""
        return max(1, int(args.tokens * self.shares[mode] / sum(self.shares[m] for m in args.modes)))

    def time_share(self, mode: str, args) -> float:
        """The mode's share of ``--minutes``, among the modes this invocation still has to run."""
        left = [m for m in args.modes if self.info[m]["tokens"] < self.budget(m, args)] or [mode]
        return self.shares[mode] / sum(self.shares[m] for m in left)

    def save(self) -> dict:
        """Summaries, the bound and the tallies' state, written atomically; returns the results."""
        res, arrays = self.results, {}
        for m, tally in self.tallies.items():
            if not tally.diffs:
                continue
            info = self.info[m]
            rate = info["tokens"] / max(info["generate_s"], 1e-9)
            res["modes"][m] = {**tally.report(), **info, "tokens_per_s": rate}
            res["state"][m], arr = tally.state()
            arrays.update({f"{m}/{k}": v for k, v in arr.items()})
        control = res["modes"].get("none", {}).get("max")
        if control is not None:
            scale = max(r.get("logprob_scale", 0.0) for r in res["modes"].values())
            res["bound"] = ec.bound(control, scale)
        res["invocations"][-1]["saved"] = time.strftime("%Y-%m-%d %H:%M:%S")
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, self.path.with_suffix(".npz"))
        tmp.write_text(json.dumps(res, indent=1))
        os.replace(tmp, self.path)
        return res
