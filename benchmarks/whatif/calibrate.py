"""Calibration where we can measure: this CPU's constants, fitted once, and what they predict.

The CPU is one more device in the same cost model (:mod:`.costmodel`), with six
constants fitted jointly to every measured t(b, k) table given (JSON from
``benchmarks/rollout/cost_table.py``): its achieved bandwidth and FLOP/s, the per-step
overhead, the extra per speculative step, the per drafter-pass overhead, and
the host work per request and pass (sampling a token per request costs far
more here than on a GPU: spike 14's CPU fit charges 0.26 ms per request at
k=0, of which the toy's FLOPs explain a fraction). A constant the cells do not
determine (the bandwidth, where the toy's weights sit in cache) is flagged.
The fit minimises the squared relative error over all cells (Levenberg-Marquardt
in log space, from several starts). Every cell's residual is printed; a cell
that misses 15% is marked, never dropped.

With those constants :func:`predict_grpo` simulates the generation phase of each
training row of a run's metrics.jsonl and compares it with the row's
``timing/generation``.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np

from benchmarks.whatif import models as M
from benchmarks.whatif.costmodel import Pricer, Rows, _fwd, steady_row
from benchmarks.whatif.hardware import cpu_device
from benchmarks.whatif.workload import TOY_PAIRS, Pair, alpha_for_length

NAMES = ("bandwidth", "flops", "t_step", "t_spec", "t_pass", "t_req", "t_req_draft")
UNITS = ("GB/s", "GFLOP/s", "ms", "ms", "ms", "us", "us")
SCALE = (1e9, 1e9, 1e-3, 1e-3, 1e-3, 1e-6, 1e-6)
INITIAL = np.log([20e9, 30e9, 3e-3, 1e-3, 1e-3, 20e-6, 20e-6])
TOLERANCE = 0.15
DTYPE_BYTES = {"float32": 4.0, "float": 4.0, "bfloat16": 2.0, "float16": 2.0, "half": 2.0}
# Outside the engine steps a generate call spends ~0.07 s adding 512 requests and ~0.01 s at its end
# (docs/lab/run_time_k.md, "The default task", measured on this machine).
CALL_OVERHEAD_S, CALL_OVERHEAD_PER_REQUEST_S = 0.01, 0.07 / 512


def load_tables(paths: list[str]) -> list[dict]:
    return [dict(json.load(open(p)), _path=p) for p in paths]


def table_pair(tbl: dict, model_config: str | None = None, drafter_config: str | None = None, log=print) -> Pair:
    """The pair a table measured: its shapes (the given config.json, else the toy pair of that name, its depth
    set by the table's parameter count, else a stand-in widened to that count) and its acceptance (alpha_1
    flat, from the largest k measured)."""
    key = tbl["pair"]
    base = TOY_PAIRS.get(key)
    target = _shape(tbl, "policy", model_config, base and base.target, "target_params", M.TOY_LT_POLICY, log)
    drafter = _shape(tbl, "drafter", drafter_config, base and base.drafter, "drafter_params", M.TOY_LT_DRAFTER, log)
    acc = acceptance_lengths(tbl)
    alpha = alpha_for_length(acc[max(acc)], max(acc)) if acc else 0.8
    return Pair(key, target, drafter, "draft_model", alpha, 1.0, "the table's acceptance_length", True, tp=1)


def _shape(tbl, role, path, toy, params_key, like, log):
    key, params = tbl["pair"], float(tbl.get(params_key) or 0)
    if path:
        model = M.from_hf_config(path, f"{key} {role}")
    elif toy is not None:
        model = toy if not params else (M.with_layers_for(toy, params) or toy)
    elif params:
        log(f"  ! {key}: {role} shapes unknown, a stand-in widened to {params:.3g} parameters (give a config.json)")
        return M.like_toy_with_params(params, like, f"{key} {role}")
    else:
        raise ValueError(f"table of pair {key!r}: no {params_key} and no config.json for its {role}")
    if params and abs(model.total_params / params - 1) > 0.05:
        log(f"  ! {key}: {model.name} has {model.total_params:.3g} parameters in our shapes, the table {params:.3g}")
    return model


def acceptance_lengths(tbl: dict) -> dict[int, float]:
    """E[L(k)] the table measured, by k."""
    return {int(k): float(v) for k, v in (tbl.get("acceptance_length") or {}).items()}


def cell_k(cell: dict) -> tuple[str, int]:
    """(mode, k) of a cell: k "none" is the engine without a drafter; k = 0 the drafter's engine at k=0 (the fast
    path's plain step); k > 0 a speculative step that verifies and drafts k."""
    return ("none", 0) if str(cell["k"]) == "none" else ("auto", int(cell["k"]))


def cell_rows(tbl: dict, pair: Pair) -> Rows:
    """One steady-step row per measured cell."""
    rows = [
        steady_row(c["b"], cell_k(c)[1], float(c.get("context_mean", 0.0)), cell_k(c)[0], pair) for c in tbl["cells"]
    ]
    return Rows(*[np.concatenate([getattr(r, f) for r in rows]) for f in Rows.__dataclass_fields__])


def device_of(theta: np.ndarray, dtype: str = "float32"):
    return cpu_device(*np.exp(theta), bytes_per_param=DTYPE_BYTES.get(str(dtype).lower(), 4.0))


def predict_cells(theta: np.ndarray, prepared: list) -> np.ndarray:
    return np.concatenate(
        [Pricer(device_of(theta, t.get("dtype", "float32")), pair).rows(rows) for t, pair, rows in prepared]
    )


def _lm(fun, x0: np.ndarray, prior: float = 1e-2, iters: int = 200) -> np.ndarray:
    """Levenberg-Marquardt on fun(x) (residuals) with a weak pull to x0 (so an unidentified constant stays put)."""
    res = lambda x: np.concatenate([fun(x), prior * (x - x0)])  # noqa: E731
    x, lam = x0.copy(), 1e-2
    r = res(x)
    cost = r @ r
    for _ in range(iters):
        J = np.stack([(res(x + h) - r) / 1e-6 for h in np.eye(len(x)) * 1e-6], axis=1)
        A, g = J.T @ J, J.T @ r
        step = -np.linalg.solve(A + lam * np.diag(np.diag(A) + 1e-12), g)
        r2 = res(x + step)
        if r2 @ r2 < cost:
            done = cost - r2 @ r2 < 1e-12
            x, r, cost, lam = x + step, r2, r2 @ r2, lam / 3
            if done:
                break
        else:
            lam *= 4
            if lam > 1e8:
                break
    return x


def fit(tables: list[dict], model_config=None, drafter_config=None, log=print):
    """(theta, prepared, measured, predicted): the CPU constants (log) fitted to every cell of every table."""
    prepared = [(t, p, cell_rows(t, p)) for t in tables for p in [table_pair(t, model_config, drafter_config, log)]]
    meas = np.array([float(c["step_s"]) for t in tables for c in t["cells"]])
    fun = lambda th: predict_cells(th, prepared) / meas - 1.0  # noqa: E731
    starts = [INITIAL + np.log(d) for d in ([1] * 7, [0.1, 0.3, 1, 1, 1, 0.1, 0.1], [10, 3, 0.3, 1, 1, 10, 10])]
    best = min((_lm(fun, s) for s in starts), key=lambda th: float(np.sum(fun(th) ** 2)))
    return best, prepared, meas, predict_cells(best, prepared)


def _sse_with(theta, prepared, meas, i: int, factor: float) -> float:
    th = theta.copy()
    th[i] += np.log(factor)
    return float(np.sum((predict_cells(th, prepared) / meas - 1) ** 2))


def report(theta, prepared, meas, pred) -> str:
    """The fitted constants and every cell's residual (a miss beyond TOLERANCE is marked)."""
    lines = [
        "Fitted CPU constants (one fit over every table; 'how determined': the rise in squared error when the",
        "constant alone is halved or doubled; below 5% the cells do not pin it down):",
    ]
    sse = float(np.sum((pred / meas - 1) ** 2))
    for i, (n, u, s, v) in enumerate(zip(NAMES, UNITS, SCALE, np.exp(theta))):
        rise = min(_sse_with(theta, prepared, meas, i, f) for f in (0.5, 2.0)) / max(sse, 1e-12) - 1
        lines.append(
            f"  {n:10s} {v / s:10.3f} {u:8s} how determined: {max(rise, 0.0):+.0%}"
            + ("  (NOT DETERMINED)" if rise < 0.05 else "")
        )
    res = pred / meas - 1
    i = 0
    for t, _, _ in prepared:
        n = len(t["cells"])
        lines += ["", residual_matrix(t, meas[i : i + n], pred[i : i + n])]
        i += n
    ok = int(np.sum(np.abs(res) <= TOLERANCE))
    lines.append(
        f"\n{ok} of {len(res)} cells within {TOLERANCE:.0%}; RMS relative error {np.sqrt(np.mean(res**2)):.1%}, "
        f"largest {np.max(np.abs(res)):.1%}."
    )
    lines += direct_checks(theta, prepared)
    return "\n".join(lines)


def residual_matrix(tbl: dict, meas: np.ndarray, pred: np.ndarray) -> str:
    """One table's cells as b x k: predicted / measured - 1 (a miss beyond TOLERANCE marked MISS)."""
    ks = list(dict.fromkeys(str(c["k"]) for c in tbl["cells"]))
    bs = list(dict.fromkeys(int(c["b"]) for c in tbl["cells"]))
    cell = {(int(c["b"]), str(c["k"])): p / m - 1 for c, m, p in zip(tbl["cells"], meas, pred)}
    fmt = lambda r: "" if r is None else f"{r * 100:+.1f}%" + (" MISS" if abs(r) > TOLERANCE else "")  # noqa: E731
    head = f"Residuals of {tbl['pair']} ({tbl.get('_path', '')}), predicted / measured - 1, by b and k:\n\n"
    rows = [f"| {b} | " + " | ".join(fmt(cell.get((b, k))) for k in ks) + " |" for b in bs]
    return head + "\n".join([f"| b | {' | '.join(ks)} |", "|---" * (len(ks) + 1) + "|"] + rows)


def direct_checks(theta, prepared) -> list[str]:
    """The tables' single measurements (a drafter pass, a target step at batch 1) beside the model: not fitted."""
    out = []
    for t, pair, _ in prepared:
        dev = device_of(theta, t.get("dtype", "float32"))
        pr = Pricer(dev, pair)
        ctx = float(np.mean([c.get("context_mean", 0) for c in t["cells"] if c["b"] == 1] or [0]))
        if t.get("drafter_pass_s"):
            p = dev.t_pass + dev.t_req_draft + _fwd(pr.D, 1.0, ctx, ctx, 1.0, max)
            out.append(
                f"  {t['pair']}: drafter pass measured {t['drafter_pass_s'] * 1e3:.2f} ms, model {p * 1e3:.2f} ms"
            )
        if t.get("target_step_b1_s"):
            p = dev.t_step + dev.t_req + _fwd(pr.T, 1.0, ctx, ctx, 1.0, max)
            out.append(
                f"  {t['pair']}: target step at b=1 measured {t['target_step_b1_s'] * 1e3:.2f} ms, "
                f"model {p * 1e3:.2f} ms"
            )
    return ["", "Out-of-fit checks:"] + out if out else []


def save_constants(path: str, theta) -> None:
    json.dump(dict(zip(NAMES, map(float, np.exp(theta)))), open(path, "w"), indent=1)


def load_constants(path: str) -> np.ndarray:
    d = json.load(open(path))
    return np.log([d[n] for n in NAMES])


def with_acceptance(pair: Pair, length: float | None, k: int) -> Pair:
    """The pair with a flat alpha whose E[L(k)] is a run's measured acceptance length."""
    return replace(pair, alpha1=alpha_for_length(length, k)) if length and k else pair
