"""Tables, the published anchors beside our predictions, and the plot."""

from __future__ import annotations

import numpy as np

from benchmarks.whatif import costmodel as C
from benchmarks.whatif.experiments import speedups
from benchmarks.whatif.hardware import Device
from benchmarks.whatif.workload import Pair

ANCHORS = [
    # (what, their figure, source, device, pair, our policies to show)
    (
        "SkyRL, MTP, 8xH100",
        "rollout 2.03x, step 1.62x, E[L] 3.32",
        "SkyRL's report, quoted second-hand (model not stated there)",
        "H100 SXM",
        "8B+MTP",
        ["k=4", "k=5"],
    ),
    (
        "NeMo-RL, EAGLE-3, Qwen3-8B, k=3",
        "rollout 1.77x (RL-Zero), 1.53x (RL-Think); E[L] 2.05-2.47",
        "arXiv 2604.26779 (32 GB200)",
        "GB200 (per GPU)",
        "8B+EAGLE3",
        ["k=3"],
    ),
    (
        "NeMo-RL, EAGLE-3, Qwen3-8B, k=5",
        "rollout 1.44x (RL-Zero), 0.84x (RL-Think)",
        "a summary of arXiv 2604.26779 (not checked against the paper)",
        "GB200 (per GPU)",
        "8B+EAGLE3",
        ["k=5"],
    ),
    (
        "verl, MTP, H20",
        "rollout -50% (slower; k not stated)",
        "verl's report, quoted second-hand",
        "H20",
        "8B+MTP",
        ["k=1", "k=2", "k=3", "vLLM schedule"],
    ),
    (
        "NVIDIA's NeMo-RL study, 8B synchronous",
        "rollout 1.8x",
        "arXiv 2604.26779 (the paper of row 2)",
        "GB200 (per GPU)",
        "8B+EAGLE3",
        ["k=3"],
    ),
]


def fmt_x(v: float) -> str:
    return f"{v:.2f}x"


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A markdown table."""
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def acceptance_table(pairs: list[Pair]) -> str:
    rows = [
        [p.key, p.method, f"{p.alpha1:.2f}", f"{p.decay:.2f}"]
        + [f"{p.expected_length(k):.2f}" for k in range(1, 7)]
        + [p.acceptance_source]
        for p in pairs
    ]
    return table(["pair", "method", "alpha_1", "decay"] + [f"E[L({k})]" for k in range(1, 7)] + ["source"], rows)


def speedup_tables(results: dict, devices: list[Device]) -> str:
    """Per pair: policies x devices, generation speed-up (step speed-up)."""
    out = []
    for pk, by_dev in results.items():
        names = [d.name for d in devices if d.name in by_dev]
        sp = {d: speedups(by_dev[d]) for d in names}
        base = [
            f"{by_dev[d]['cells']['none'].gen:.1f} s + {by_dev[d]['cells']['none'].train:.1f} s (tp {by_dev[d]['tp']})"
            for d in names
        ]
        rows = [["none: generation + train"] + base]
        for pol in by_dev[names[0]]["cells"]:
            if pol != "none":
                rows.append(
                    [pol] + [f"{fmt_x(sp[d][pol][0])} ({fmt_x(sp[d][pol][1])})" if pol in sp[d] else "-" for d in names]
                )
        if any(by_dev[d].get("head_train") for d in names):
            rows.append(
                ["the head trained online: + s a step (best step speed-up then)"]
                + [head_row(by_dev[d], sp[d]) for d in names]
            )
        out.append(f"\n### {pk}: generation speed-up (step speed-up) against no speculation\n")
        out.append(table(["policy"] + names, rows))
    return "\n".join(out)


def head_row(dev_result: dict, sp: dict) -> str:
    """What training the head online adds to every step (C.head_train_time), and the best policy's step
    speed-up once it is added."""
    head, cells = dev_result["head_train"], dev_result["cells"]
    best = max((n for n in cells if n != "none"), key=lambda n: sp[n][1])
    step = cells["none"].step / (cells[best].step + head)
    return f"+{head:.2f} s ({best}: {fmt_x(step)})"


def best_fixed(sp: dict) -> tuple[str, float]:
    fixed = {n: v[0] for n, v in sp.items() if n.startswith("k=")}
    n = max(fixed, key=fixed.get)
    return n, fixed[n]


def _verdict(sp: dict, ctl: str | None, lost: list, best: float) -> str:
    if not ctl:
        return "-"
    c = sp[ctl][0]
    loss = "LOSES to no speculation" if c < 0.99 else ("avoids the loss" if lost else "no loss to avoid")
    return f"{loss}; {c / best - 1:+.0%} against the best fixed k"


def controller_tables(results: dict, devices: list[Device]) -> str:
    """The k the controller settled on per bucket, and where speculation loses."""
    rows, loss_rows = [], []
    for pk, by_dev in results.items():
        for d in devices:
            if d.name not in by_dev or d.anchor_only:
                continue
            cells = by_dev[d.name]["cells"]
            ctl = next((n for n in cells if n.startswith("controller")), None)
            sp = speedups(by_dev[d.name])
            if ctl:
                b = cells[ctl].extra.get("buckets", [])
                ks = " ".join(f"{lo}-{hi}:{k}" if lo != hi else f"{lo}:{k}" for lo, hi, k in b)
                base = by_dev[d.name]["cells"]["none"].gen
                times = cells[ctl].extra.get("phase_times") or [cells[ctl].gen]
                spread = f" ({base / max(times):.2f}-{base / min(times):.2f})" if len(times) > 1 else ""
                rows.append([pk, d.name, ks, fmt_x(sp[ctl][0]) + spread])
            bn, bv = best_fixed(sp)
            wn = min((n for n in sp if n.startswith("k=")), key=lambda n: sp[n][0])
            lost = [n for n, v in sp.items() if v[0] < 0.99 and n != ctl]
            verdict = _verdict(sp, ctl, lost, bv)
            loss_rows.append(
                [
                    pk,
                    d.name,
                    f"{bn} {fmt_x(bv)}",
                    f"{wn} {fmt_x(sp[wn][0])}",
                    ", ".join(lost) or "none",
                    fmt_x(sp[ctl][0]) if ctl else "-",
                    verdict,
                ]
            )
    t1 = table(
        ["pair", "device", "controller's k per bucket (batch sizes: k)", "its generation speed-up (range over phases)"],
        rows,
    )
    t2 = table(
        [
            "pair",
            "device",
            "best fixed k",
            "worst fixed k",
            "policies that lose (< 0.99x)",
            "controller",
            "controller: the loss, and the best fixed k",
        ],
        loss_rows,
    )
    return "### The k the controller settles on\n\n" + t1 + "\n\n### Where speculation loses\n\n" + t2


def anchor_table(results: dict, pairs: dict) -> str:
    rows = []
    for what, fig, src, dev, pk, pols in ANCHORS:
        r = results.get(pk, {}).get(dev)
        if r is None:
            continue
        sp = speedups(r)

        def el(p):
            return f" (E[L] {pairs[pk].expected_length(int(p[2:])):.2f})" if p.startswith("k=") else ""

        ours = "; ".join(f"{p}{el(p)}: {fmt_x(sp[p][0])} / {fmt_x(sp[p][1])}" for p in pols if p in sp)
        rows.append([what, fig, f"{dev}, {pk}", ours, src])
    return table(["published", "their figure", "our closest configuration", "predicted rollout / step", "source"], rows)


def plot(path: str, pairs: list[Pair], devices: list[Device], ctx_per_seq: float, tps: dict) -> None:
    """Steady-state decode speed-up against batch size, best k in 1..6, one panel per pair, one line per device
    (its tensor parallel as in the tables), drawn up to the batch whose KV still fits in its memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bs = np.unique(np.round(np.logspace(0, np.log10(512), 40)).astype(int))
    fig, axes = plt.subplots(1, len(pairs), figsize=(4.2 * len(pairs), 3.8), sharey=True)
    for ax, pair in zip(np.atleast_1d(axes), pairs):
        for dev in devices:
            tp = tps.get((pair.key, dev.name), 1)
            B = dev.bytes_per_param
            room = tp * (dev.memory * C.MEM_FRACTION - C.ACTIVATIONS)
            room -= (pair.target.total_params + pair.drafter.dense_params) * B
            per_seq = ctx_per_seq * (pair.target.kv_bytes_per_token(B) + pair.drafter.kv_bytes_per_token(B))
            fit = bs[bs <= room / per_seq]
            y = [max(C.steady_speedup(dev, pair, b, k, ctx_per_seq, tp) for k in range(1, 7)) for b in fit]
            ax.plot(fit, y, label=f"{dev.name}" + (f" (tp {tp})" if tp > 1 else ""))
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_title(pair.key)
        ax.set_xlabel("running requests (batch)")
        ax.legend(fontsize=7)
    np.atleast_1d(axes)[0].set_ylabel(f"decode speed-up, best k (context {ctx_per_seq:.0f})")
    fig.suptitle("Predicted by the roofline model (not measured): steady decode speed-up against batch size")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sensitivity_table(sens: dict, batches) -> str:
    """Best fixed k (and k=3) per per-engine batch."""
    keys = list(dict.fromkeys((p, d) for p, d, _ in sens))
    rows = []
    for p, d in keys:
        cells = []
        for B in batches:
            sp = {n: v for n, v in sens[(p, d, B)].items() if n.startswith("k=")}
            best = max(sp, key=sp.get)
            cells.append(f"{best} {fmt_x(sp[best])}, k=3 {fmt_x(sp['k=3'])}")
        rows.append([p, d] + cells)
    return table(["pair", "device"] + [f"batch {B}: best fixed k, k=3" for B in batches], rows)
