"""How long does a run's driver take to check its config before anything starts, with and without the facts file?

    python -m benchmarks.studies.driver_start                  # 3 rounds, the default config (~2 min, 2 cores)

Each measurement is a fresh Python process that does what ``examples/run_grpo.py`` does before it starts Ray:
``load_config`` (vLLM's gate, the probes of the features the config uses, ``vllm_kwargs`` against vLLM's
declarations) and the backend check. Variants, alternating within each round:

* ``facts file``: the store on (``rl_specdec.vllm_ext.facts``), its file written by an earlier process (as
  from the second run on after an install);
* ``live``: the store off: vLLM is imported to answer each check (every start before the store existed).

Columns: the process's wall time from start to exit, and whether it imported vLLM.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.bench_common import add_out, cores_and_load, log, markdown_report

ROOT = Path(__file__).resolve().parents[2]
CHILD = """
import sys
from rl_specdec.metrics.console import configure_console
configure_console("error")
from rl_specdec.vllm_ext import facts
facts.use_file({on})
from rl_specdec.config import load_config
from rl_specdec.config.load import check_runs_here
check_runs_here(load_config({config!r}))
print(json.dumps({{"vllm_imported": "vllm" in sys.modules}}))
"""
VARIANTS = {"facts file": True, "live": False}


def _once(config: str, on: bool) -> dict:
    t0 = time.monotonic()
    code = "import json\n" + CHILD.format(on=on, config=config)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    wall = time.monotonic() - t0
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return {"wall_s": wall, **json.loads(out.stdout.strip().splitlines()[-1])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/grpo_spec.yaml")
    p.add_argument("--repeats", type=int, default=3, help="rounds; each runs every variant once, alternating")
    add_out(p, "driver_start")
    args = p.parse_args(argv)
    _once(args.config, True)  # writes the file where it is missing
    rows = []
    title = "A driver's config check, with and without the facts file"
    with markdown_report(args.out, "driver_start.md", title) as out:
        cores, load = cores_and_load()
        print(f"{args.config}, {cores} cores, load average {load:.2f} at the start\n")
        for r in range(args.repeats):
            for name, on in VARIANTS.items() if r % 2 == 0 else reversed(VARIANTS.items()):
                res = _once(args.config, on)
                rows.append({"variant": name, "round": r, **res})
                log(f"{name} {r}: {res['wall_s']:.1f}s")
        (out / "driver_start.json").write_text(json.dumps(rows, indent=1))
        print("| variant | wall s, each round | median | imports vLLM |")
        print("|---|---|---:|---|")
        for name in VARIANTS:
            mine = [x for x in rows if x["variant"] == name]
            walls = ", ".join(f"{x['wall_s']:.1f}" for x in mine)
            med = statistics.median(x["wall_s"] for x in mine)
            print(f"| {name} | {walls} | {med:.1f} | {'yes' if any(x['vllm_imported'] for x in mine) else 'no'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
