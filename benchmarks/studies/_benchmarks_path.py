"""Imported first by every study that uses the benchmarks' tools: running ``python benchmarks/studies/<name>.py``
puts only this folder on sys.path, and the studies import benchmarks/'s modules (rollout, step_records, whatif,
bench_runs) as siblings, as the tools themselves do."""

from __future__ import annotations

import sys
from pathlib import Path

STUDIES = Path(__file__).resolve().parent
BENCHMARKS = STUDIES.parent
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(1, str(BENCHMARKS))  # after the study's own folder
