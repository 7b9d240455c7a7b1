"""The torch side on one GPU, measured (no vLLM there): the policy worker's train step and log-prob pass at
Qwen3-1.7B's shape, as ``configs/qwen3_1p7b_one_gpu.yaml``'s trainer runs them, and the decode kernels of
the GPU cost model's pair (a Qwen3-8B target, a Qwen3-0.6B drafter) under CUDA graphs, beside what that cost
model predicts for the same passes (docs/lab/gpu.md, "Measured on an H200: the torch side").

The models are random-initialised at their config.json shapes (benchmarks/whatif/models.py): nothing is
downloaded, and neither time nor memory depends on the weights' values.

    python -m benchmarks gpu-torch                  # on a GPU: under 2 min on an H200 (results/gpu-torch)
    python -m benchmarks gpu-torch --report results/gpu-torch/gpu_torch.json   # anywhere: the tables, the model
    python -m benchmarks gpu-torch --smoke --out /tmp/gpu_smoke      # CPU: tiny shapes through the same code
    python -m benchmarks gpu-torch --parts train --policy-shape smollm2-135m --seqs 64 --max-len 138 \
        --prompt-len 74 --precisions fp32 bf16-mixed --micro-batch-sizes 8 64 --steps 3   # the real model's step

*The train side* is rl_specdec's own ``PolicyWorker`` (started from a saved folder, so ``from_pretrained``,
the frozen reference and AdamW are the real ones) on a batch of ``--seqs`` GRPO rollouts of up to
``--max-len`` tokens (two of them at full length), ``ClippedPGLoss``, per precision; peak memory is
``torch.cuda.max_memory_allocated`` over the step, with the micro-batch sizes of ``--micro-batch-sizes``.

*The decode side* is a plain-torch decoder of each model's shape (RMSNorm, fused QKV, attention of every
new token over ``--ctx`` tokens of KV cache per sequence, SwiGLU, LM head), one CUDA graph per pass, timed
with CUDA events: the kernels of a vLLM step without its host work (scheduler, sampler, input preparation),
which the cost model prices separately (``t_step``, ``t_spec``, ``t_pass``, ``t_req``; docs/lab/gpu.md,
"The model").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, replace

import torch
import torch.nn.functional as F

from benchmarks import bench_common
from benchmarks.whatif import models as M

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
KS = (0, 1, 2, 3, 4, 5)
SMOKE_TARGET = M.ModelConfig("smoke target", 2, 64, 4, 2, 16, 128, 512, False, "smoke")
SMOKE_DRAFTER = M.ModelConfig("smoke drafter", 1, 32, 2, 1, 16, 64, 512, True, "smoke")


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def peak_reset(dev: torch.device, free: bool = False) -> None:
    if dev.type == "cuda":
        if free:
            torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)


def peak_gb(dev: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(dev) / 1e9 if dev.type == "cuda" else None


# ----------------------------------------------------------------------------------------------------------
# the train side: rl_specdec's PolicyWorker at a real shape


def save_random_qwen3(shape: M.ModelConfig, path: str, dev: torch.device) -> None:
    """A randomly initialised Qwen3 of ``shape``, saved in bf16 where ``from_pretrained`` finds it."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        tie_word_embeddings=shape.tied,
        max_position_embeddings=40960,
    )
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path)
    del model


def grpo_batch(n: int, max_len: int, prompt_len: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """``n`` rollouts of a ``prompt_len``-token prompt, two of them ``max_len`` long, the rest uniform in
    length; random tokens, generation log-probs and advantages (the trainer's cost does not depend on them)."""
    from rl_specdec.grpo.batch import Trajectory, build_train_batch

    g = torch.Generator().manual_seed(seed)
    lengths = [max_len] * min(n, 2) + torch.randint(prompt_len + 8, max_len + 1, (max(n - 2, 0),), generator=g).tolist()
    trajectories = []
    for length in lengths:
        ids = torch.randint(10, vocab, (length,), generator=g).tolist()
        lps = (-0.1 - torch.rand(length - prompt_len, generator=g)).tolist()
        trajectories.append(Trajectory.single_turn(ids[:prompt_len], ids[prompt_len:], lps))
    return build_train_batch(trajectories, torch.randn(n, generator=g), pad_id=0)


def timed(dev: torch.device, fn, *args):
    sync(dev)
    t0 = time.perf_counter()
    out = fn(*args)
    sync(dev)
    return out, time.perf_counter() - t0


def measure_worker(args, w, batch, loss_fn, dev: torch.device, row: dict) -> list[dict]:
    """Per micro-batch size: a warm-up train step (the first one creates AdamW's state), then ``--steps``
    timed train steps (each with its peak memory) and, at the first size, as many log-prob passes."""
    rows = []
    for j, mbs in enumerate(args.micro_batch_sizes):
        w.config = replace(w.config, micro_batch_size=mbs)
        w.train_step(batch, loss_fn)
        for i in range(args.steps):
            peak_reset(dev)
            _, train_s = timed(dev, w.train_step, batch, loss_fn)
            peak = peak_gb(dev)
            logp_s = timed(dev, w.get_logprobs, batch)[1] if j == 0 else None
            rows.append(dict(row, micro_batch_size=mbs, repeat=i, train_s=train_s, logprobs_s=logp_s, peak_gb=peak))
            print(f"  {row['precision']} micro-batch {mbs}: train {train_s:.3f} s, log-probs {logp_s} s, peak {peak}")
    return rows


def train_side(args, shape: M.ModelConfig, dev: torch.device) -> list[dict]:
    """Per precision, a worker started from a saved random model (with its frozen reference, as
    ``grpo.log_kl`` keeps one), measured by :func:`measure_worker`."""
    from rl_specdec.config import PolicyConfig
    from rl_specdec.grpo import ClippedPGLoss
    from rl_specdec.policy import PolicyWorker

    loss_fn = ClippedPGLoss(0.2, kl_coef=0.0)
    batch = grpo_batch(args.seqs, args.max_len, args.prompt_len, shape.vocab, seed=0)
    row = dict(shape=shape.name, params=shape.total_params, tokens=int(batch["attention_mask"].sum()), seqs=args.seqs,
               max_len=args.max_len)  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as path:
        save_random_qwen3(shape, path, dev)
        for precision in args.precisions:
            cfg = PolicyConfig(model_name=path, device=dev.type, precision=precision, learning_rate=1e-6,
                               micro_batch_size=args.micro_batch_sizes[0], gpus_per_worker=0)  # fmt: skip
            peak_reset(dev, free=True)
            w = PolicyWorker(cfg, keep_reference=True)
            load_s = timed(dev, w.start)[1]
            rows += measure_worker(args, w, batch, loss_fn, dev, dict(row, precision=precision, load_s=load_s,
                                                                       loaded_gb=peak_gb(dev)))  # fmt: skip
            del w
            peak_reset(dev, free=True)
    return rows


# ----------------------------------------------------------------------------------------------------------
# the decode side: one pass of a model's shape, kernels only


def attn_in(x, n1, w_qkv, heads: int, kv_heads: int, head_dim: int):
    """x [b, q, hidden] -> the queries grouped per KV head [b, kv heads, g q, d] (g = heads / kv heads: a KV
    head's query heads and tokens attend as one block, as decode kernels do GQA), and k, v [b, kv heads, q, d]."""
    b, q_len, h = x.shape
    g = heads // kv_heads
    qkv = F.rms_norm(x, (h,), n1) @ w_qkv.T  # [b, q, (heads + 2 kv heads) d]
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q = q.reshape(b, q_len, kv_heads, g, head_dim).permute(0, 2, 3, 1, 4).reshape(b, kv_heads, g * q_len, head_dim)
    k = k.reshape(b, q_len, kv_heads, head_dim).transpose(1, 2)  # [b, kv heads, q, d]
    v = v.reshape(b, q_len, kv_heads, head_dim).transpose(1, 2)
    return q, k, v


def attn_out_mlp(x, a, w_o, n2, w_gu, w_down):
    """The residual stream after attention's output projection and the SwiGLU MLP; a [b, kv heads, g q, d]."""
    b, q_len, h = x.shape
    kvh, d = a.shape[1], a.shape[3]
    g = a.shape[2] // q_len
    a = a.reshape(b, kvh, g, q_len, d).permute(0, 3, 1, 2, 4).reshape(b, q_len, kvh * g * d)
    x = x + a @ w_o.T
    gate, up = (F.rms_norm(x, (h,), n2) @ w_gu.T).chunk(2, -1)
    return x + (F.silu(gate) * up) @ w_down.T  # [b, q, hidden]


class Decoder:
    """Random bf16 weights of ``shape`` and a KV cache of ``max_seqs`` x (``ctx`` + 8) tokens per layer.
    ``compile``: the two parts of a layer around the cache write and attention go through torch.compile
    (inductor fuses the norms, the residual adds, SiLU x up and the reshapes, as vLLM's compiled layers do)."""

    def __init__(self, shape: M.ModelConfig, max_seqs: int, ctx: int, dev: torch.device, compile: bool = False):
        s, dtype = shape, torch.bfloat16
        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        r = lambda *d: torch.empty(*d, device=dev, dtype=dtype).normal_(0.0, 0.02)  # noqa: E731
        one = lambda: torch.ones(s.hidden, device=dev, dtype=dtype)  # noqa: E731
        self.shape, self.ctx = s, ctx
        self.layers = [
            (one(), r(q + 2 * kv, s.hidden), r(s.hidden, q), one(), r(2 * s.intermediate, s.hidden),
             r(s.hidden, s.intermediate))
            for _ in range(s.layers)
        ]  # fmt: skip
        self.lm = r(s.vocab, s.hidden)
        self.cache = r(s.layers, 2, max_seqs, s.kv_heads, ctx + 8, s.head_dim)  # [L, K/V, seqs, kv heads, T, d]
        wrap = (lambda f: torch.compile(f, dynamic=True)) if compile else (lambda f: f)  # noqa: E731
        self.attn_in, self.attn_out_mlp = wrap(attn_in), wrap(attn_out_mlp)

    def forward(self, x: torch.Tensor, n_logits: int) -> torch.Tensor:
        """x [b, q, hidden]: q new tokens of each of b sequences; logits [n_logits, vocab]."""
        s, c = self.shape, self.ctx
        b, q_len, _ = x.shape
        for i, (n1, w_qkv, w_o, n2, w_gu, w_down) in enumerate(self.layers):
            q, k, v = self.attn_in(x, n1, w_qkv, s.heads, s.kv_heads, s.head_dim)
            kc, vc = self.cache[i, 0, :b], self.cache[i, 1, :b]  # [b, kv heads, T, d]
            kc[:, :, c : c + q_len] = k  # the cache write (vLLM: one kernel for K and V)
            vc[:, :, c : c + q_len] = v
            a = F.scaled_dot_product_attention(q, kc[:, :, : c + q_len], vc[:, :, : c + q_len])  # [b, kvh, g q, d]
            x = self.attn_out_mlp(x, a, w_o, n2, w_gu, w_down)
        return x.reshape(b * q_len, -1)[:n_logits] @ self.lm.T  # [n_logits, vocab]


def time_pass(dec: Decoder, b: int, q_len: int, n_logits: int, dev: torch.device, repeats: int, graph: bool):
    """Seconds of one pass: the median of ``repeats`` CUDA-graph replays (or eager calls), after warm-up."""
    x = torch.randn(b, q_len, dec.shape.hidden, device=dev, dtype=dec.lm.dtype)
    run = lambda: dec.forward(x, n_logits)  # noqa: E731
    if dev.type != "cuda":
        return min(timed(dev, run)[1] for _ in range(repeats))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            run()
    torch.cuda.current_stream().wait_stream(side)
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run()
        run = g.replay
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def kernel_profile(dec: Decoder, role: str, dev: torch.device) -> list[dict]:
    """The GPU kernels of one batch-1 pass (one new token, launched eagerly after warm-up): name, launches and
    device time, summed over the pass (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(1, 1, dec.shape.hidden, device=dev, dtype=dec.lm.dtype)
    for _ in range(3):
        dec.forward(x, 1)
    sync(dev)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=activities) as prof:
        dec.forward(x, 1)
        sync(dev)
    rows = []
    for e in prof.key_averages():
        if dev.type == "cuda":
            us = getattr(e, "self_device_time_total", 0) if str(e.device_type).endswith("CUDA") else 0
        else:  # the smoke run on a CPU: operators' own CPU time
            us = e.self_cpu_time_total
        if us > 0:
            rows.append(dict(role=role, model=dec.shape.name, kernel=e.key[:90], launches=e.count, us=us))
    return sorted(rows, key=lambda r: -r["us"])


def decode_side(args, target: M.ModelConfig, drafter: M.ModelConfig, dev: torch.device) -> list[dict]:
    """Every (b, k): the target verifying k drafts per sequence (b (k+1) tokens, logits for each), and the
    drafter's pass over the same tokens with one logit per sequence (its first pass; k = 0: a later one)."""
    rows = []
    for role, shape in (("target", target), ("drafter", drafter)):
        dec = Decoder(shape, max(args.batches), args.ctx, dev, compile=args.compile)
        for b in args.batches:
            for k in args.ks:
                n_logits = b * (k + 1) if role == "target" else b
                t = time_pass(dec, b, k + 1, n_logits, dev, args.repeats, graph=not args.eager)
                rows.append(dict(role=role, model=shape.name, b=b, k=k, tokens=b * (k + 1), ctx=args.ctx,
                                 logits=n_logits, seconds=t, graph=dev.type == "cuda" and not args.eager,
                                 compiled=args.compile))  # fmt: skip
            print(
                f"  {role} b={b}: "
                + ", ".join(f"k={r['k']} {r['seconds'] * 1e3:.3f} ms" for r in rows[-len(args.ks) :])
            )
        if args.profile:
            args.kernels += kernel_profile(dec, role, dev)
        for b in (1, max(args.batches)):  # what the graphs save: the same pass launched eagerly
            t = time_pass(dec, b, 1, b, dev, args.repeats, graph=False)
            rows.append(dict(role=role, model=shape.name, b=b, k=0, tokens=b, ctx=args.ctx, logits=b, seconds=t,
                             graph=False, eager=True, compiled=args.compile))  # fmt: skip
        del dec
        peak_reset(dev, free=True)
    return rows


def machine(dev: torch.device) -> dict:
    from rl_specdec.sysinfo import machine_label

    info = dict(label=machine_label(), torch=torch.__version__, device=dev.type, load_average=os.getloadavg()[0])
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        info.update(name=p.name, memory_gb=p.total_memory / 1e9, sms=p.multi_processor_count)
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_common.add_out(p, "gpu-torch", "gpu_torch.json, gpu_torch.md")
    p.add_argument("--report", default=None, help="a gpu_torch.json to print the tables of (no measuring)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, few cells: check the code path on a CPU")
    p.add_argument("--parts", default="train,decode")
    p.add_argument(
        "--policy-shape",
        choices=["qwen3-1.7b", "smollm2-135m"],
        default="qwen3-1.7b",
        help="the train side's model: qwen3_1p7b_one_gpu.yaml's, or the real model of configs/smollm2_*.yaml",
    )
    p.add_argument("--precisions", nargs="+", default=["bf16-mixed", "bf16"])
    p.add_argument("--micro-batch-sizes", nargs="+", type=int, default=[1, 2])
    p.add_argument("--seqs", type=int, default=32, help="rollouts in the train batch")
    p.add_argument("--max-len", type=int, default=2048, help="the longest rollout (max_model_len of the config)")
    p.add_argument("--prompt-len", type=int, default=120)
    p.add_argument("--steps", type=int, default=2, help="timed train steps per precision")
    p.add_argument("--ctx", type=int, default=1024, help="KV cache tokens per sequence in the decode passes")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--eager", action="store_true", help="decode passes without CUDA graphs")
    p.add_argument("--compile", action="store_true", help="decode layers through torch.compile (inductor)")
    p.add_argument("--profile", action="store_true", help="and the kernels of each model's batch-1 pass")
    args = p.parse_args(argv)
    args.batches, args.ks, args.kernels = BATCHES, KS, []
    if args.smoke:
        args.seqs, args.max_len, args.prompt_len, args.ctx, args.repeats = 4, 64, 8, 32, 2
        args.batches, args.ks = (1, 4), (0, 2)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.report:
        report(json.load(open(args.report)), args.out)
        return
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.compile:  # every (b, k) shape may compile once: keep them all compiled, never fall back to eager
        torch._dynamo.config.cache_size_limit = torch._dynamo.config.recompile_limit = 512
    if dev.type == "cpu" and not args.smoke:
        sys.exit("gpu_torch.py: no GPU here; measure on a GPU machine, or add --smoke to check the code path")
    policy, target, drafter = (
        (SMOKE_TARGET, SMOKE_TARGET, SMOKE_DRAFTER) if args.smoke else (M.QWEN3_17B, M.QWEN3_8B, M.QWEN3_06B)
    )
    if args.policy_shape == "smollm2-135m" and not args.smoke:
        policy = M.SMOLLM2_135M
    out = dict(machine=machine(dev), args={k: v for k, v in vars(args).items() if k != "kernels"}, train=[], decode=[])
    out["shapes"] = {s.name: asdict(s) for s in (policy, target, drafter)}
    print(f"gpu_torch: {out['machine']}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "gpu_torch.json")
    for part in args.parts.split(","):  # in the order given
        if part in ("train", "decode"):
            out[part] = train_side(args, policy, dev) if part == "train" else decode_side(args, target, drafter, dev)
            out["kernels"] = args.kernels
            with open(path, "w") as f:  # after each part: a run cut short keeps what it measured
                json.dump(out, f, indent=1)
            print(f"wrote {path}")
    if not args.smoke:  # tiny shapes: a check of the code path, nothing to set against the model
        report(out, args.out)


def report(data: dict, out: str) -> None:
    """The tables of a measurement against the model, printed and in ``<out>/gpu_torch.md``."""
    from benchmarks.whatif.gpu_report import print_report

    title = "The torch side on one GPU, measured, against the cost model"
    m = data["machine"]  # the machine that measured, not this one (--report reads any measurement)
    with bench_common.markdown_report(out, "gpu_torch.md", title, m.get("label") or m.get("name", m["device"])):
        print_report(data)


if __name__ == "__main__":
    main()
