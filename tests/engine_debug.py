"""Test-only hooks into a running engine's run-time k: never shipped in the package's engine.

:class:`DebugExtension` is rl_specdec's worker extension plus one RPC,
``rl_specdec_spec_debug``, that steers the k=0 fast path from inside the
engine: k per engine step from a cycle (in and out of the fast path all the
time), k after a planned number of steps (k changing *within* a generate
call), recording each verify step's first draft, switching the drafter
catch-up off (the negative control of the catch-up tests) and cutting it
into small pieces. Engines get it through the worker classes below, whose
``extension`` names it; the groups start actors of those classes.
"""

from __future__ import annotations

from typing import Any

from rl_specdec.rollout import SamplingSettings
from rl_specdec.rollout.engine_ext import RlSpecdecExtension
from rl_specdec.rollout.group import AsyncVllmGeneration, VllmGeneration
from rl_specdec.rollout.runtime_k.selfcheck import agreement
from rl_specdec.rollout.serving.async_worker import AsyncVllmWorker
from rl_specdec.rollout.worker import VllmWorker

EXTENSION = f"{__name__}.DebugExtension"
GREEDY = SamplingSettings(max_tokens=40, temperature=0.0)


class Cycle:
    """A fast-path listener: uniform k from a list, one entry per engine step."""

    def __init__(self, set_k):
        self.set_k, self.ks, self.steps = set_k, None, 0

    def __call__(self, done, so) -> None:
        self.steps += 1
        if self.ks:
            self.set_k(self.ks[self.steps % len(self.ks)])


class DebugExtension(RlSpecdecExtension):
    def rl_specdec_spec_debug(self, **kw) -> dict[str, Any]:
        """``cycle`` (uniform k per step from a list, None: stop), ``plan`` ([(steps, k)]: k after that many
        steps), ``record_drafts`` (bool), ``catch_up`` (bool), ``max_catch_up_tokens`` (int), ``record_steps``
        (True: from now on). Returns the first drafts recorded so far, the fast path's counters and the engine
        steps recorded since the last call ([requests scheduled, drafts made for the next step, plain])."""
        st = self._spec()
        if "_rl_debug_cycle" not in self.__dict__:
            self.__dict__["_rl_debug_cycle"] = Cycle(st.set_uniform)
            st.fp.listeners.append(self.__dict__["_rl_debug_cycle"])
        if "cycle" in kw:
            self.__dict__["_rl_debug_cycle"].ks = list(kw["cycle"]) if kw["cycle"] else None
        if "plan" in kw:
            st.hooks.set_plan(kw["plan"])
        if "record_drafts" in kw:
            st.hooks.record = bool(kw["record_drafts"])
        if "catch_up" in kw:
            st.fp.catch_up_on = bool(kw["catch_up"])
        if "max_catch_up_tokens" in kw:
            st.fp.max_catch_up_tokens = int(kw["max_catch_up_tokens"])
        steps = self.__dict__.setdefault("_rl_debug_steps", [])
        if kw.get("record_steps") and not self.__dict__.get("_rl_debug_recording"):
            self.__dict__["_rl_debug_recording"] = True
            st.fp.listeners.append(lambda done, so: steps.append([done.b, done.k_next, done.plain]))
        # plain lists cross any RPC
        drafts = [[list(prompt), sorted(d.items())] for prompt, d in st.hooks.take_drafts().items()]
        taken, steps[:] = list(steps), []
        return {"first_drafts": drafts, "stats": dict(st.fp.stats), "steps": taken}


class DebugVllmWorker(VllmWorker):
    extension = EXTENSION


class DebugAsyncVllmWorker(AsyncVllmWorker):
    extension = EXTENSION


class DebugVllmGeneration(VllmGeneration):
    worker_cls = DebugVllmWorker


class DebugAsyncVllmGeneration(AsyncVllmGeneration):
    worker_cls = DebugAsyncVllmWorker


def debug(g, **kw) -> dict:
    """The debug RPC on the group's first engine."""
    return g.engine_rpc("rl_specdec_spec_debug", **kw)[0]


def first_drafts(g, prompts, first_k: int, catch_up: bool = True, max_tokens: int = 1 << 30):
    """Greedy run (``GREEDY``): k=first_k for 8 engine steps, then 3.

    Returns (tokens, {prompt: {position: first draft}})."""
    debug(
        g, catch_up=catch_up, max_catch_up_tokens=max_tokens, record_drafts=True, plan=[(8, 3)] if first_k != 3 else []
    )
    g.set_speculation(first_k)
    out = g.generate(prompts, GREEDY)
    rec = debug(g, record_drafts=False, catch_up=True, max_catch_up_tokens=1 << 30, plan=[])["first_drafts"]
    g.set_speculation(3)
    return out.token_ids, {tuple(p): dict(d) for p, d in rec}


def check_catch_up_is_exact(g, prompts, min_compared: int, control_below: float) -> None:
    """After 8 plain steps the caught-up drafter's first drafts equal, at every position both runs verified, those
    of a run at k=3 throughout, whole and in pieces of at most 7 tokens, with the greedy tokens unchanged; without
    the catch-up (the negative control) fewer than ``control_below`` of them agree."""
    ref_tokens, ref = first_drafts(g, prompts, 3)
    runs = {
        "catch-up": first_drafts(g, prompts, 0),
        "catch-up in pieces of <= 7 tokens": first_drafts(g, prompts, 0, max_tokens=7),
        "no catch-up": first_drafts(g, prompts, 0, catch_up=False),
    }
    for name, (tokens, _) in runs.items():
        assert tokens == ref_tokens, name
    for name in ("catch-up", "catch-up in pieces of <= 7 tokens"):
        same, total = agreement(ref, runs[name][1])
        assert total >= min_compared and same == total, (name, same, total)
    same, total = agreement(ref, runs["no catch-up"][1])
    assert total >= min_compared and same < control_below * total, f"without catch-up: {same}/{total} agree"


CYCLE = [0, 3, 0, 0, 2, 1, 0, 3, 3, 0]  # k per engine step: in and out of k=0 all the time


def check_k_changing_is_lossless(
    g,
    plain: list[list[int]],
    prompt: list[int],
    hf_policy,
    tol: float = 1e-4,
    tokens: int | None = None,
    per_call: int = 100,
) -> None:
    """Temperature-1 samples of ``prompt`` (``tokens`` each, ``DIST_TOKENS`` by default) from four calls of
    ``per_call`` (k=3, k=0, k cycling every step, k=2 then 3 within the call) follow the policy's distribution
    (against ``plain``, samples without speculation) and carry its log-probs (within ``tol`` of transformers')."""
    import numpy as np

    from conftest import DIST_TOKENS, hf_token_logprobs, position_test

    tokens = tokens or DIST_TOKENS
    samples, logprobs = [], []
    try:
        for i, (k, hooks) in enumerate([(3, {}), (0, {}), (3, {"cycle": CYCLE}), (2, {"plan": [(4, 3)]})]):
            g.set_speculation(k)
            debug(g, **hooks)
            sampling = SamplingSettings(max_tokens=tokens, temperature=1.0, seed=2000 + 100 * i, logprobs=0)
            out = g.generate([prompt] * per_call, sampling)
            debug(g, cycle=None, plan=[])
            samples += out.token_ids
            logprobs += list(zip(out.token_ids, out.logprobs))
    finally:
        g.set_speculation(3)
    p, per_pos = position_test(plain, samples, n_pos=tokens)
    assert p > 1e-3, f"k changed at run time changes what is sampled (adjusted p={p:.2e}; per position {per_pos})"
    worst = max(
        float(np.max(np.abs(np.array(lp) - np.array(hf_token_logprobs(hf_policy, prompt, ids)))))
        for ids, lp in logprobs[::8]
    )
    assert worst < tol, f"sampled log-probs differ from the policy's: {worst:.2e}"


def perturbed_head(head_path, scale: float = 4.0, seed: int = 0) -> dict:
    """An EAGLE-3 head's vLLM state dict with noise of ``scale`` times each tensor's spread added (a head refit
    that drafts worse)."""
    import torch

    from rl_specdec.heads.eagle3 import load_head

    gen = torch.Generator().manual_seed(seed)
    sd = load_head(head_path).vllm_state_dict()
    return {k: v + scale * v.std() * torch.randn(v.shape, generator=gen) for k, v in sd.items()}


__all__ = ["CYCLE", "GREEDY", "agreement", "check_k_changing_is_lossless", "debug", "first_drafts", "perturbed_head"]
