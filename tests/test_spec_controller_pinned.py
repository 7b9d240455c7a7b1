"""The adaptive controller's decisions on two seeded synthetic runs, pinned (pure logic: no vLLM, no Ray).

A refactor of the controller must leave every number here unchanged; a deliberate change of its behaviour
updates them (``decisions`` gives the new ones). Each run covers the warm-up, the bursts that check the model's
verdict, random exploration and the decisions; one starts from k=0, one from a schedule.
"""

from __future__ import annotations

from test_spec_controller import CPU, chosen, controller, run, settings
from test_spec_controller_start import from_schedule


def decisions(ctl, calls: int) -> list[tuple[int, int, list[int]]]:
    """Per generate call on the CPU table: (lookups pushed, steps in a burst, each bucket's k at its end)."""
    counts, step = [0, 0], ctl.step

    def counted(rec, b):
        new = step(rec, b)
        counts[0] += new is not None
        counts[1] += ctl.burst is not None
        return new

    ctl.step, out = counted, []
    for seed in range(calls):
        counts[:] = [0, 0]
        run(CPU, p_accept=0.85, ctl=ctl, calls=1, seed=seed)
        out.append((counts[0], counts[1], chosen(ctl)))
    return out


def test_decisions_from_zero_are_pinned():
    assert decisions(controller(settings(), initial_k=2), calls=6) == [
        (18, 58, [0, 0, 0, 0, 0, 4, 0]),  # the warm-up: every step in a burst until the model is ready
        (9, 13, [0, 0, 0, 0, 0, 0, 0]),
        (7, 10, [0, 0, 4, 4, 0, 0, 0]),
        (5, 8, [0, 4, 4, 3, 0, 0, 0]),
        (6, 8, [0, 4, 4, 0, 0, 0, 0]),
        (5, 5, [0, 4, 0, 0, 0, 0, 0]),
    ]


def test_decisions_from_a_schedule_are_pinned():
    assert decisions(from_schedule([4, 4, 3, 3, 2, 0, 0], start="schedule"), calls=6) == [
        (2, 4, [4, 4, 3, 3, 2, 0, 0]),  # the schedule holds while the warm-up's bursts come out of the budget
        (5, 6, [4, 4, 3, 1, 2, 0, 0]),
        (9, 12, [4, 4, 4, 4, 3, 0, 0]),
        (3, 4, [4, 4, 4, 4, 4, 0, 0]),
        (2, 0, [4, 4, 4, 3, 4, 0, 0]),
        (5, 6, [4, 4, 4, 3, 3, 0, 0]),
    ]
