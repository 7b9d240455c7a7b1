"""Hooks that observe and steer the fast path from inside the engine, and the start-up self-check built on them.

:class:`SelfCheckHooks` (a fast-path listener) can, per engine step, set k from a
plan (k changing *within* a generate call), record each verify step's first
draft (the drafter's guess given the true prefix, to compare a caught-up drafter
with one that ran at every step), and count drafter and rejection-sampler calls
made during plain steps.

:class:`SelfCheck` proves the k=0 fast path on the live engine at start-up,
so that a vLLM upgrade that changes the private surface it relies on fails
loudly instead of silently. The worker generates, greedy, the same prompts
twice: once with k = k_max from the first step (the reference), once with
k = 0 for the first k_max + 2 engine steps and k_max after (plain
steps, then a drafter catch-up). The check fails unless

* the outputs are identical (the worker compares them),
* plain steps ran and called neither the drafter nor the rejection sampler,
* the drafter was caught up, and its first drafts agree with the reference's
  at :data:`MIN_AGREEMENT` of at least :data:`MIN_COMPARED` common positions
  (without catch-up the toy's agree at ~70%); not for ngram, which keeps no state to catch up.
"""

from __future__ import annotations

from rl_specdec.vllm_ext.model_runner import count_plain_step_calls, first_drafts

# Greedy with ignore_eos, so no request stops early: 8 requests of 32 tokens (batch > 1, so the catch-up runs
# across requests) leave at least 8 x (32 - k_max - 2) / (k_max + 1) verify steps after the plain ones, far above
# MIN_COMPARED; the check is a start-up cost of every engine with run-time k, a few seconds on the real model.
CHECK_PROMPTS = 8
CHECK_TOKENS = 32
MIN_AGREEMENT = 0.9
MIN_COMPARED = 8


class SelfCheckHooks:
    """A listener on the fast path for the self-check: k after a planned number of steps, first-draft
    records, and counts of drafter and rejection-sampler calls made during plain steps."""

    def __init__(self, fastpath, set_uniform_k):
        self.fp, self.set_k = fastpath, set_uniform_k
        self.plan: list[tuple[int, int]] = []  # (after this many more steps, uniform k)
        self.record = False
        self.first_drafts: dict[tuple[int, ...], dict[int, int]] = {}
        self.plain_calls = {"drafter": 0, "rejection_sampler": 0}
        self._steps = 0
        self._unwrap = None

    def __call__(self, done, so) -> None:
        self._steps += 1
        while self.plan and self._steps >= self.plan[0][0]:
            self.set_k(self.plan.pop(0)[1])
        if self.record:
            for prompt, pos, tok in first_drafts(self.fp.runner, so, self.fp.step_start):
                self.first_drafts.setdefault(prompt, {})[pos] = tok

    def set_plan(self, plan: list[tuple[int, int]]) -> None:
        self._steps, self.plan = 0, sorted((int(n), int(k)) for n, k in plan)

    def take_drafts(self) -> dict:
        out, self.first_drafts = self.first_drafts, {}
        return out

    def count_plain_calls(self, on: bool) -> None:
        """Count drafter proposals and rejection-sampler calls made during plain steps (instance wrappers)."""
        if self._unwrap is not None:
            self._unwrap()
            self._unwrap = None
        if on:
            self._unwrap = count_plain_step_calls(self.fp, self.plain_calls)


def agreement(reference: dict, test: dict) -> tuple[int, int]:
    """(equal, compared): first drafts at the positions both runs drafted."""
    same = total = 0
    for prompt, drafts in test.items():
        ref = reference.get(prompt, {})
        for pos, tok in drafts.items():
            if pos in ref:
                total += 1
                same += tok == ref[pos]
    return same, total


class SelfCheck:
    """The engine's half of the start-up check; the worker generates between :meth:`phase` calls."""

    def __init__(self, fastpath, hooks: SelfCheckHooks, set_uniform_k, k_max: int, vocab_size: int):
        self.fp, self.hooks, self.set_k, self.k_max = fastpath, hooks, set_uniform_k, k_max
        self.prompts = [[(2 + 5 * i + 3 * j) % vocab_size for j in range(6)] for i in range(CHECK_PROMPTS)]
        self.reference: dict = {}
        self.stats0: dict = {}

    def phase(self, name: str):
        """Phases "reference" and "switch" prepare a generate call (they return the prompts); "verdict"
        returns the problems."""
        h = self.hooks
        if name == "reference":
            self.set_k(self.k_max)
            h.set_plan([])
            h.record = True
            h.take_drafts()
            return self.prompts
        if name == "switch":
            self.reference = h.take_drafts()
            self.set_k(0)
            # k_max + 2 plain steps: where every draft is accepted, verify steps then start at the
            # reference's positions (1 + m (k_max + 1)), so the first drafts of both runs can be compared
            h.set_plan([(self.k_max + 2, self.k_max)])
            h.count_plain_calls(True)
            self.stats0 = dict(self.fp.stats)
            return self.prompts
        if name == "verdict":
            return self._verdict()
        raise ValueError(f"unknown self-check phase {name!r}")

    def _verdict(self) -> list[str]:
        h = self.hooks
        drafts = h.take_drafts()
        h.record = False
        h.count_plain_calls(False)
        d = {k: self.fp.stats[k] - self.stats0.get(k, 0) for k in self.fp.stats}
        problems = []
        if d["plain_steps"] == 0:
            problems.append("no step ran as a plain step at k=0")
        problems += [f"{n} plain step call(s) to the {what}" for what, n in h.plain_calls.items() if n]
        if not self.fp.needs_catch_up:  # ngram: no drafter state to catch up; its drafts come from the token ids
            return problems
        if d["catch_up_tokens"] == 0:
            problems.append("the drafter was never caught up after the plain steps")
        same, total = agreement(self.reference, drafts)
        if total < MIN_COMPARED or same < MIN_AGREEMENT * total:
            problems.append(
                "after catch-up the drafter's first drafts agree with a drafter that ran every step at "
                f"{same}/{total} positions"
            )
        return problems
