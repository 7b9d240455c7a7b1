"""A run that pays for a drafter and drafts nothing says so, once, within its first few steps.

A drafter costs before it drafts: a head or a draft model is built at first use and loaded into every engine,
and one that trains online adds its update to every step. A schedule that drafts only while few requests run
drafts nothing where the batch never thins out that far (every rollout running to the token cap together), and
the acceptance canary may turn speculation off. Either way the run's throughput is plain sampling's while it
still pays. :class:`NeverDrafted` reads each step's ``spec_decode/*`` metrics and, when none of the first
``steps`` steps drafted, warns naming the cause it can see and the config change that stops the cost.
"""

from __future__ import annotations

import re

FIRST_STEPS = 3
KEY = "policy.generation"
_BUCKET = re.compile(r"^spec_decode/k_bucket_(\d+)_(\d+)$")


class NeverDrafted:
    """Watches the first ``steps`` steps of a run whose drafter costs something (``pays``: what it costs)."""

    def __init__(self, pays: str | None, trains: bool = False, steps: int = FIRST_STEPS):
        self.pays, self.trains, self.steps, self.left = pays, trains, steps, steps if pays else 0
        self.fewest: float | None = None  # the fewest running requests any engine step held, over the steps seen
        self.drafting: set[tuple[int, int]] = set()  # batch-size buckets where run-time k drafted (k > 0)
        self.buckets: set[tuple[int, int]] = set()
        self.draft_steps = 0.0  # the largest share of engine steps that ran the drafter, over the steps seen

    @classmethod
    def for_run(cls, cfg) -> NeverDrafted:
        gen = cfg.policy.generation
        spec = gen.speculation
        pays = []
        if spec is not None and spec.model is not None:
            pays.append(
                ("an " if spec.method[0] in "aeiou" else "a ")
                + f"{spec.method} drafter in every engine (built at first use)"
            )
        if spec is not None and gen.drafter_training.enabled:
            pays.append("its online update every " + ("step" if gen.drafter_training.every == 1 else "few steps"))
        return cls(" and ".join(pays) or None, trains=spec is not None and gen.drafter_training.enabled)

    def observe(self, spec: dict[str, float], speculating: bool) -> str | None:
        """One step's ``spec_decode/*`` (empty: nothing drafted); the warning, at most once, else None."""
        if self.left <= 0:
            return None
        if spec.get("spec_decode/num_drafts", 0.0) > 0:
            self.left = 0  # it drafts: nothing to say, and nothing more to watch
            return None
        self._note(spec)
        self.left -= 1
        if self.left > 0:
            return None
        cause, fix = self._cause(speculating)
        return (
            f"speculation drafted nothing in the first {self.steps} steps (spec_decode/num_drafts 0 each step), "
            f"while the run pays for {self.pays}: {cause}. {fix}"
        )

    def _note(self, spec: dict[str, float]) -> None:
        f = spec.get("spec_decode/fewest_running_requests")
        if f is not None:
            self.fewest = f if self.fewest is None else min(self.fewest, f)
        self.draft_steps = max(self.draft_steps, spec.get("spec_decode/drafted_step_fraction", 0.0))
        for key, k in spec.items():
            m = _BUCKET.match(key)
            if m:
                self.buckets.add((int(m[1]), int(m[2])))
                if k > 0:
                    self.drafting.add((int(m[1]), int(m[2])))

    def _cause(self, speculating: bool) -> tuple[str, str]:
        stop = f"remove {KEY}.vllm_kwargs.speculative_config (no drafter)"
        if self.trains:
            stop = f"set {KEY}.drafter_training.enabled=false (no update), or {stop}"
        if not speculating:
            return (
                "the acceptance canary turned speculation off (acceptance_canary.action=disable; its warning above "
                "gives the acceptance it saw)",
                f"To stop paying for it: {stop}; acceptance_canary.action=warn keeps speculation on",
            )
        if self.buckets and not self.drafting:
            return ("run-time k chose k=0 at every batch size (no k measured faster)", f"To stop paying for it: {stop}")
        top = max((hi for _, hi in self.drafting), default=None)
        ranges = ", ".join(f"{lo}" if lo == hi else f"{lo}-{hi}" for lo, hi in _merged(sorted(self.drafting)))
        if top is not None and self.fewest is not None and self.fewest > top:
            return (
                f"the schedule drafts only at {ranges} running requests, and no engine step ran fewer than "
                f"{self.fewest:.0f} (rollouts run to the token cap together)",
                f"Draft where the batch runs ({KEY}.vllm_kwargs.speculative_config.num_speculative_tokens_per_batch_"
                f"size with k > 0 up to {self.fewest:.0f} requests, where that pays), lower {KEY}.max_new_tokens so "
                f"the tail thins out; to stop paying for it: {stop}",
            )
        if top is not None and self.fewest is not None:
            ran = (
                f"up to {self.draft_steps:.0%} of a step's engine steps ran the drafter and it proposed no token"
                if self.draft_steps > 0
                else "no engine step ran the drafter there"
            )
            return (
                f"the batch did fall to {self.fewest:.0f} running requests, inside the schedule's drafting range "
                f"({ranges}), but {ran}",
                f"Check the drafter ({KEY}.vllm_kwargs.speculative_config.model) and the schedule "
                f"(num_speculative_tokens_per_batch_size); to stop paying for it: {stop}",
            )
        return (
            "the engines drafted no token (no run-time k report says why)",
            f"Check the schedule (num_speculative_tokens_per_batch_size); to stop paying for it: {stop}",
        )


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent batch-size buckets as one range (1 and 2-3: 1-3)."""
    out: list[tuple[int, int]] = []
    for lo, hi in ranges:
        if out and lo == out[-1][1] + 1:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out
