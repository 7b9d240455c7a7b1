"""The suite's closing summary (tests/suite_budget.py): a warning past 60% of CI's limit, none below it."""

from suite_budget import CI_LIMIT_S, SLOWEST, budget_lines

FILES = {f"tests/test_{i}.py": float(i) for i in range(SLOWEST + 5)}


def test_a_run_past_60_percent_of_the_limit_warns_and_names_the_machine():
    lines = budget_lines(0.61 * CI_LIMIT_S, None, FILES, "AMD EPYC 2c AVX2")
    assert lines[0].startswith("WARNING") and "AMD EPYC 2c AVX2" in lines[0] and "54.9 min" in lines[0]


def test_the_time_since_ci_started_counts_install_and_lint():
    lines = budget_lines(0.5 * CI_LIMIT_S, 0.65 * CI_LIMIT_S, FILES, "m")
    assert lines[0].startswith("WARNING") and "since CI started" in lines[1]


def test_a_run_inside_the_budget_does_not_warn_and_lists_the_ten_slowest_files():
    lines = budget_lines(0.59 * CI_LIMIT_S, 0.59 * CI_LIMIT_S, FILES, "AMD EPYC 2c AVX-512")
    assert not any(line.startswith("WARNING") for line in lines)
    listed = [line.split()[-1] for line in lines[1:]]
    assert listed == [f"tests/test_{i}.py" for i in range(SLOWEST + 4, 4, -1)]
