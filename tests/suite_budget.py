"""The suite's time against CI's budget, printed at the end of every run: its wall time, the ten slowest test
files, and the machine's label.

CI (``.ci/run``) has 90 minutes for the install, the lint and the tests on whatever machine it lands on, and the
same suite takes about three times as long on a CPU without AVX-512. Landing must not depend on which machine CI
drew, so nothing here fails a run: past 60% of the limit it prints a warning to cut the suite before it stops
fitting. ``.ci/run`` exports ``CI_STARTED`` (seconds since the epoch) so that the install and the lint count too.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict

CI_LIMIT_S = 90 * 60
WARN_SHARE = 0.60
SLOWEST = 10

_started = time.time()
_by_file: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report) -> None:
    """Each phase's seconds (setup, call, teardown), summed by file; under pytest-xdist the controller gets
    every worker's reports, so the sums are the whole suite's."""
    _by_file[report.nodeid.split("::", 1)[0]] += report.duration


def budget_lines(wall_s: float, ci_s: float | None, by_file: dict[str, float], label: str) -> list[str]:
    """The summary's lines; a warning first when the run (``ci_s``, else ``wall_s``) passed the share."""
    spent = ci_s if ci_s is not None else wall_s
    lines = []
    if spent > WARN_SHARE * CI_LIMIT_S:
        lines.append(
            f"WARNING: this run took {spent / 60:.1f} min on {label}, past {WARN_SHARE:.0%} of CI's "
            f"{CI_LIMIT_S // 60}-minute limit: cut the suite (share engines, merge starts) before it stops landing"
        )
    since = f", {ci_s / 60:.1f} min since CI started" if ci_s is not None else ""
    lines.append(f"the suite: {wall_s / 60:.1f} min on {label}{since}; slowest files (seconds, both workers summed):")
    for path, secs in sorted(by_file.items(), key=lambda kv: -kv[1])[:SLOWEST]:
        lines.append(f"  {secs:7.1f}  {path}")
    return lines


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if hasattr(config, "workerinput") or not _by_file:  # a pytest-xdist worker: the controller reports
        return
    from rl_specdec.sysinfo import machine_label

    ci_started = os.environ.get("CI_STARTED")
    ci_s = time.time() - float(ci_started) if ci_started else None
    terminalreporter.section("suite budget")
    for line in budget_lines(time.time() - _started, ci_s, _by_file, machine_label()):
        terminalreporter.write_line(line, yellow=line.startswith("WARNING"))
