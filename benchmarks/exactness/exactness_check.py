"""The exactness check's host side, shared by benchmarks/exactness/exactness.py and tests/test_exactness.py.

* :func:`recompute` scores sampled tokens as the GRPO trainer scores them: the rollouts right-padded into the
  train batch (``grpo.batch.build_train_batch``), cut into length-sorted micro-batches of
  ``policy.micro_batch_size``, each trimmed to its longest sequence, through the trainer's own
  ``token_logprobs_and_entropy``; :func:`recompute_alone` scores one sequence with no padding (to tell a
  trainer-side cause from an engine-side one);
* :func:`token_contexts` turns the engine steps recorded by ``exactness_engine`` into each sampled token's
  context: the engine step that emitted it, the k of the steps before, the batch size, where in the step's
  emitted tokens it sat (an accepted draft or the step's own sample), and whether a drafter catch-up ran;
* :func:`summary` and :func:`bound`: the distribution of |engine - trainer| and the bound a run must meet,
  derived from the dtype and from the control without speculation.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np
import torch

HISTORY = 6  # engine steps of k kept in a token's context


def recompute(model, prompts, completions, micro_batch_size: int, pad_id: int) -> list[list[float]]:
    """log p(completion_t | prompt, completion_<t) per token, batched as the GRPO trainer batches (fp32)."""
    from rl_specdec.grpo.batch import Trajectory, build_train_batch
    from rl_specdec.policy.scoring import token_logprobs_and_entropy

    trajs = [Trajectory.single_turn(p, c, [0.0] * len(c)) for p, c in zip(prompts, completions)]
    batch = build_train_batch(trajs, torch.zeros(len(trajs)), pad_id)
    lengths = batch["attention_mask"].sum(1)
    order = torch.argsort(lengths, descending=True, stable=True)
    out: list[list[float]] = [[] for _ in trajs]
    with torch.no_grad():
        for s in range(0, len(trajs), micro_batch_size):
            idx = order[s : s + micro_batch_size]
            t = int(lengths[idx].max())
            ids, mask = batch["input_ids"][idx, :t], batch["attention_mask"][idx, :t]
            logp, _ = token_logprobs_and_entropy(model, ids, mask)
            for row, i in enumerate(idx.tolist()):
                n = len(prompts[i])
                out[i] = logp[row, n - 1 : n - 1 + len(completions[i])].tolist()
    return out


def recompute_alone(model, prompt: list[int], completion: list[int]) -> list[float]:
    """The same scores for one sequence on its own (no padding, no other sequence in the forward)."""
    return recompute(model, [prompt], [completion], 1, 0)[0]


def request_index(req_ids) -> dict[str, int]:
    """vLLM's request id ("<counter>-<suffix>") -> its index in the call (requests are numbered in order)."""
    return {rid: i for i, rid in enumerate(sorted(req_ids, key=lambda r: int(str(r).split("-")[0])))}


def token_contexts(steps: list[dict], lengths: list[int]) -> list[list[dict]]:
    """Per request, per sampled token: where and how the engine sampled it (see the module's docstring)."""
    index = request_index({rid for s in steps for rid in s["reqs"]})
    out: list[list[dict]] = [[] for _ in lengths]
    last_catch: dict[str, int] = {}
    for si, s in enumerate(steps):
        hist = [p["k_next"] for p in steps[max(0, si - HISTORY) : si + 1]]
        for rid, (start, scheduled, drafts, emitted, caught) in s["reqs"].items():
            i = index[rid]
            for j in range(emitted):
                if len(out[i]) >= lengths[i]:
                    break
                out[i].append(
                    {
                        "step": si,
                        "k_history": hist,
                        "plain": s["plain"],
                        "batch": len(s["reqs"]),
                        "k_verified": drafts,
                        "accepted_draft": j < emitted - 1,
                        "index_in_step": j,
                        "position": start + scheduled - drafts + j,  # the sequence's index of this token
                        "catch_up_before_drafts": last_catch.get(rid, 0),
                    }
                )
            last_catch[rid] = caught
    return out


def kind(ctx: dict) -> str:
    """A token's kind, for the per-kind maxima."""
    if ctx["plain"]:
        return "plain step"
    if ctx["k_verified"] == 0:  # a prefill, or a k=0 step through vLLM's path (k0_fast_path=false)
        return "step with no drafts"
    if ctx["catch_up_before_drafts"]:
        return "drafts after a catch-up"
    return "accepted draft" if ctx["accepted_draft"] else "verify step's own sample"


def summary(diffs: np.ndarray) -> dict[str, float]:
    if diffs.size == 0:
        return {"tokens": 0}
    q = np.quantile(diffs, [0.5, 0.99, 0.9999])
    return {
        "tokens": int(diffs.size),
        "max": float(diffs.max()),
        "p99.99": float(q[2]),
        "p99": float(q[1]),
        "median": float(q[0]),
        "mean": float(diffs.mean()),
    }


def bound(control_max: float, logprob_scale: float, dtype: torch.dtype = torch.float32, c: float = 16.0) -> float:
    """What |engine - trainer| may reach with speculation: 10x the worst of the control without it, or c ulps of
    the dtype at the log-probs' scale, whichever is larger (a floor for a control that happens to agree
    exactly). A stale KV entry or a token scored at the wrong position is off by the log-prob's own scale."""
    return max(10.0 * control_max, c * torch.finfo(dtype).eps * max(1.0, logprob_scale))


@dataclass
class Tally:
    """One mode's |engine - trainer| over all its calls, the maxima per token kind, and the worst tokens."""

    keep: int = 10
    diffs: list[np.ndarray] = field(default_factory=list)
    by_kind: dict[str, list] = field(default_factory=dict)  # kind -> [tokens, max]
    worst: list[tuple[float, int, dict]] = field(default_factory=list)  # a min-heap of (diff, tiebreak, token)
    seq_means: list[float] = field(default_factory=list)  # mean |diff| of each sequence
    scale: float = 0.0
    _n: int = 0
    _seen: set = field(default_factory=set)

    def add(self, call: int, prompts, tokens, engine_lp, trainer_lp, contexts=None) -> np.ndarray:
        d_all = []
        for i, (e, t) in enumerate(zip(engine_lp, trainer_lp)):
            d = np.abs(np.asarray(e, dtype=np.float64) - np.asarray(t, dtype=np.float64))
            d_all.append(d)
            if d.size:  # a stale KV entry would raise every later token of its sequence, not one token
                self.seq_means.append(float(d.mean()))
            self.scale = max(self.scale, float(np.max(np.abs(t), initial=0.0)))
            ctxs = contexts[i] if contexts else []
            for j, ctx in enumerate(ctxs[: len(d)]):
                k = self.by_kind.setdefault(kind(ctx), [0, 0.0])
                k[0], k[1] = k[0] + 1, max(k[1], float(d[j]))
            for j in np.argsort(-d)[: self.keep]:
                ctx = ctxs[j] if j < len(ctxs) else {}
                item = {"call": call, "request": i, "token": int(j), "engine": float(e[j]), "trainer": float(t[j])}
                seq = {"prompt": list(prompts[i]), "completion": list(tokens[i])}
                self._push(float(d[j]), {**item, **ctx, "prompt_len": len(prompts[i]), "sequence": seq})
        flat = np.concatenate(d_all) if d_all else np.zeros(0)
        self.diffs.append(flat.astype(np.float32))
        return flat

    def _push(self, d: float, item: dict) -> None:
        # GRPO repeats each prompt: identical samples of one call score alike; keep one of them
        key = (
            item["call"],
            tuple(item["sequence"]["prompt"]),
            tuple(item["sequence"]["completion"][: item["token"] + 1]),
        )
        if key in self._seen:
            return
        self._seen.add(key)
        self._n += 1
        entry = (d, self._n, {"diff": d, **item})
        if len(self.worst) < self.keep:
            heapq.heappush(self.worst, entry)
        elif d > self.worst[0][0]:
            heapq.heapreplace(self.worst, entry)

    def explain(self, model) -> None:
        """Score each worst token's sequence on its own (``alone``): a trainer log-prob that moves with the
        batch it was scored in points at the trainer's side, not the engine's."""
        for _, _, w in sorted(self.worst, key=lambda w: -w[0])[:3]:
            if "alone" not in w:
                seq = w["sequence"]
                w["alone"] = recompute_alone(model, seq["prompt"], seq["completion"])[w["token"]]

    def state(self) -> tuple[dict, dict[str, np.ndarray]]:
        """What :meth:`restore` needs to go on adding calls: a JSON part and the arrays (saved apart)."""
        worst = [[d, n, item] for d, n, item in self.worst]
        js = {"by_kind": self.by_kind, "worst_heap": worst, "scale": self.scale, "n": self._n}
        diffs = np.concatenate(self.diffs) if self.diffs else np.zeros(0, np.float32)
        self.diffs = [diffs]  # saved after every call: concatenate each call's tokens once, not on every save
        return js, {"diffs": diffs, "seq_means": np.asarray(self.seq_means, dtype=np.float64)}

    @classmethod
    def restore(cls, js: dict, arrays: dict[str, np.ndarray]) -> Tally:
        t = cls(by_kind=js["by_kind"], scale=js["scale"], seq_means=arrays["seq_means"].tolist(), _n=js["n"])
        t.diffs = [arrays["diffs"].astype(np.float32)]
        t.worst = [(d, n, item) for d, n, item in js["worst_heap"]]
        heapq.heapify(t.worst)
        return t

    def report(self) -> dict:
        all_d = np.concatenate(self.diffs) if self.diffs else np.zeros(0)
        worst = [w[2] for w in sorted(self.worst, key=lambda w: -w[0])]
        means = np.asarray(self.seq_means)
        seqs = {"sequences": int(means.size), "worst_sequence_mean": float(means.max(initial=0.0))}
        seqs["median_sequence_mean"] = float(np.median(means)) if means.size else 0.0
        return {**summary(all_d), **seqs, "logprob_scale": self.scale, "max_by_kind": self.by_kind, "worst": worst}
