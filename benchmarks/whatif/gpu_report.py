"""The tables of a GPU measurement (``benchmarks/gpu/gpu_torch.py``) beside what the cost model predicts.

Three checks of the GPU cost model's constants (docs/lab/gpu.md, "The model"), from measured passes rather than
assumptions:

* the train phase's MFU (``Device.mfu``, assumed 0.40) from rl_specdec's own train step, and the trainer's
  peak memory against the estimate in ``configs/qwen3_1p7b_one_gpu.yaml``'s header;
* the decode kernels: every measured pass against :func:`.costmodel.forward_time` with the datasheet
  constants and assumed efficiencies, then with ``eta_bw`` and ``t_layer`` fitted to the two models' batch-1
  passes and ``eta_flops`` to the target's largest one;
* speculation's speed-up per (b, k) from the measured passes plus the model's host constants (``t_step``,
  ``t_spec``, ``t_pass``, ``t_req``: no vLLM ran), beside the model's own prediction.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from benchmarks.whatif import costmodel as C
from benchmarks.whatif import hardware as H
from benchmarks.whatif import models as M
from benchmarks.whatif import workload as W

HOST_FREE = dict(t_step=0.0, t_spec=0.0, t_pass=0.0, t_req=0.0, t_req_draft=0.0)
TRAIN_FLOPS = {"train_s": 8.0, "logprobs_s": 2.0}  # per parameter and token: policy fwd+bwd + reference fwd; a fwd


def device_of(machine: dict) -> H.Device:
    name = machine.get("name", "")
    for dev in (H.H200, H.H100, H.A100, H.L40S, H.H20):
        if dev.name.split()[0] in name:
            return dev
    raise SystemExit(f"gpu_report: no datasheet device matches {name!r}; add it to benchmarks/whatif/hardware.py")


def shape_of(data: dict, name: str) -> M.ModelConfig:
    return M.ModelConfig(**data["shapes"][name])


def predicted(dev: H.Device, shape: M.ModelConfig, r: dict) -> float:
    """The model's kernel time of one measured pass (no host work)."""
    n = r["tokens"]
    return float(C.forward_time(dev, shape, n, r["b"] * r["ctx"], n * r["ctx"], r["logits"]))


def fit(dev: H.Device, data: dict, rows: list[dict]) -> H.Device:
    """``eta_bw`` and ``t_layer`` from both models' batch-1 passes (weights and KV read, and a floor per
    layer: two equations), then ``eta_flops`` from the target's largest pass, taken as compute-bound in its
    GEMMs and memory-bound in attention (its dense FLOPs over the time the KV read and the floor leave)."""
    ones = [r for r in rows if r["b"] == 1 and r["k"] == 0]
    A, y = [], []
    for r in ones:
        s = shape_of(data, r["model"])
        bytes_ = s.dense_params * dev.bytes_per_param + s.kv_bytes_per_token(dev.bytes_per_param) * (r["ctx"] + 1)
        A.append([bytes_ / dev.bandwidth, s.layers])
        y.append(r["seconds"])
    (inv_eta, t_layer), *_ = np.linalg.lstsq(np.array(A), np.array(y), rcond=None)
    fitted = replace(dev, eta_bw=1.0 / inv_eta, t_layer=max(float(t_layer), 0.0))
    big = max((r for r in rows if r["role"] == "target"), key=lambda r: r["tokens"])
    s = shape_of(data, big["model"])
    c = C.fwd_const(fitted, s)
    kv_read = c.kv * (big["b"] * big["ctx"] + big["tokens"])  # the KV read and written, at the fitted bandwidth
    flops = 2.0 * (
        s.dense_params * big["tokens"] - (s.lm_vocab or s.vocab) * s.hidden * (big["tokens"] - big["logits"])
    )
    return replace(fitted, eta_flops=flops / (dev.flops * max(big["seconds"] - kv_read - c.floor, 1e-9)))


def gb(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def measured_device(data: dict) -> H.Device:
    """The measuring GPU with its kernel constants (``eta_bw``, ``t_layer``, ``eta_flops``) fitted to the
    measured passes; its host constants and MFU stay the assumed ones."""
    dev = device_of(data["machine"])
    fitted = fit(dev, data, [r for r in data["decode"] if not r.get("eager")])
    src = f"fitted to the decode passes measured on an {data['machine']['name']} (benchmarks/gpu/gpu_torch.py)"
    sources = {**dev.sources, "eta_bw, eta_flops, t_layer": src}
    return replace(fitted, name=f"{dev.name} (kernels measured)", sources=sources)


def train_table(data: dict, dev: H.Device) -> list[str]:
    out = [
        "| precision | micro-batch | train step (s) | tokens/s | MFU (8 N per token) | log-prob pass (s) | MFU (2 N) "
        "| peak memory (GB) | loaded (GB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["train"]:
        mfu = lambda key: (  # noqa: E731
            f"{TRAIN_FLOPS[key] * r['params'] * r['tokens'] / r[key] / dev.flops:.2f}" if r.get(key) else "-"
        )
        lp = f"{r['logprobs_s']:.3f}" if r.get("logprobs_s") else "-"
        out.append(
            f"| {r['precision']} | {r['micro_batch_size']} | {r['train_s']:.3f} | {r['tokens'] / r['train_s']:,.0f} "
            f"| {mfu('train_s')} | {lp} | {mfu('logprobs_s')} | {gb(r['peak_gb'])} | {gb(r['loaded_gb'])} |"
        )
    return out


def pass_table(data: dict, rows: list[dict], devs: dict[str, H.Device], role: str) -> list[str]:
    ks = sorted({r["k"] for r in rows if r["role"] == role})
    head = f"| b | {' | '.join(f'k={k}' for k in ks)} |"
    out = [f"{role}: measured ms (measured / {' , '.join(devs)} prediction)", "", head, "|---" * (len(ks) + 1) + "|"]
    for b in sorted({r["b"] for r in rows}):
        cells = []
        for k in ks:
            r = next(x for x in rows if x["role"] == role and x["b"] == b and x["k"] == k)
            s = shape_of(data, r["model"])
            ratios = ", ".join(f"{r['seconds'] / predicted(d, s, r):.2f}" for d in devs.values())
            cells.append(f"{r['seconds'] * 1e3:.2f} ({ratios})")
        out.append(f"| {b} | {' | '.join(cells)} |")
    return out


def speedups(data: dict, rows: list[dict], dev: H.Device, pair: W.Pair) -> list[str]:
    """E[L(k)] t(b, none) / t(b, k) from the measured passes, the model's host constants added; the model's
    own figure beside it."""
    t = {(r["role"], r["b"], r["k"]): r["seconds"] for r in rows}
    ks = sorted({r["k"] for r in rows if r["k"] > 0})
    out = [
        f"| b | {' | '.join(f'k={k}' for k in ks)} | best k, measured passes | best k, model |",
        "|---" * (len(ks) + 3) + "|",
    ]
    for b in sorted({r["b"] for r in rows}):
        base = dev.t_step + dev.t_req * b + t[("target", b, 0)]
        cells, best, model_best = [], (1.0, 0), (1.0, 0)
        for k in ks:
            draft = t[("drafter", b, k)] + (k - 1) * t[("drafter", b, 0)] + k * (dev.t_pass + dev.t_req_draft * b)
            step = dev.t_step + dev.t_req * b + t[("target", b, k)] + dev.t_spec + draft
            s = pair.expected_length(k) * base / step
            m = C.steady_speedup(dev, pair, b, k, data["args"]["ctx"])
            cells.append(f"{s:.2f} ({m:.2f})")
            best, model_best = max(best, (s, k)), max(model_best, (m, k))
        out.append(
            f"| {b} | {' | '.join(cells)} | k={best[1]} {best[0]:.2f}x | k={model_best[1]} {model_best[0]:.2f}x |"
        )
    return out


def kernel_table(data: dict, rows: list[dict], top: int = 8) -> list[str]:
    """Each model's batch-1 pass by kernel: where the time over the weights' read goes."""
    out = []
    for role in ("target", "drafter"):
        ks = [r for r in data.get("kernels", []) if r["role"] == role]
        if not ks:
            continue
        s = shape_of(data, ks[0]["model"])
        total = sum(r["us"] for r in ks)
        graphed = next(r["seconds"] for r in rows if r["role"] == role and r["b"] == 1 and r["k"] == 0)
        out += [
            f"\n{role} ({s.name}), batch 1: kernels {total / 1e3:.2f} ms of device time "
            f"({total / s.layers:.1f} us per layer), {sum(r['launches'] for r in ks)} launches; "
            f"the graphed pass {graphed * 1e3:.2f} ms\n",
            "| kernel | launches | us | share |",
            "|---|---|---|---|",
        ]
        out += [f"| {r['kernel'][:70]} | {r['launches']} | {r['us']:.0f} | {r['us'] / total:.0%} |" for r in ks[:top]]
    return out


def print_report(data: dict) -> None:
    m = data["machine"]
    print(f"# {m.get('name', m['device'])}, torch {m['torch']}, transformers {m.get('transformers', '-')}\n")
    dev = device_of(m) if m["device"] == "cuda" else H.H200
    if data["train"]:
        print(f"## The train side: {data['train'][0]['shape']}, {data['train'][0]['seqs']} rollouts of up to "
              f"{data['train'][0]['max_len']} tokens ({data['train'][0]['tokens']:,} tokens), MFU against "
              f"{dev.flops / 1e12:.0f} TFLOP/s dense bf16 (the cost model assumes {H.H200.mfu:.2f})\n")  # fmt: skip
        print("\n".join(train_table(data, dev)) + "\n")
    rows = [r for r in data["decode"] if not r.get("eager")]
    if not rows:
        return
    fitted = fit(dev, data, rows)
    print(f"## The decode passes, {rows[0]['ctx']} tokens of context per sequence, CUDA graphs: {rows[0]['graph']}\n")
    print(f"fitted: eta_bw {fitted.eta_bw:.2f} (assumed {dev.eta_bw:.2f}), t_layer {fitted.t_layer * 1e6:.1f} us "
          f"(assumed {dev.t_layer * 1e6:.1f}), eta_flops {fitted.eta_flops:.2f} "
          f"(assumed {dev.eta_flops:.2f})\n")  # fmt: skip
    devs = {"assumed": replace(dev, **HOST_FREE), "fitted": replace(fitted, **HOST_FREE)}
    for role in ("target", "drafter"):
        print("\n".join(pass_table(data, rows, devs, role)) + "\n")
    one = {r["role"]: r["seconds"] for r in rows if r["b"] == 1 and r["k"] == 0}
    pred = {role: predicted(devs["assumed"], shape_of(data, r["model"]), r) for role in one
            for r in rows if r["role"] == role and r["b"] == 1 and r["k"] == 0}  # fmt: skip
    print(f"target pass / drafter pass at batch 1: measured {one['target'] / one['drafter']:.1f}x, "
          f"model {pred['target'] / pred['drafter']:.1f}x\n")  # fmt: skip
    for r in data["decode"]:
        if r.get("eager"):
            g = next(x for x in rows if x["role"] == r["role"] and x["b"] == r["b"] and x["k"] == 0)
            print(
                f"eager {r['role']} b={r['b']}: {r['seconds'] * 1e3:.2f} ms against {g['seconds'] * 1e3:.2f} ms graphed"
            )
    print("\n".join(kernel_table(data, rows)))
    pair = W.PAIRS["8B+0.6B"]
    print(f"\n## Speed-up per (b, k) of {pair.key}: measured passes + the model's host constants (the model's "
          f"own figure in brackets)\n")  # fmt: skip
    print("\n".join(speedups(data, rows, dev, pair)))
