"""What does training an EAGLE-3 head online cost per step on this device, against the cost model's price?

The head's update as the policy worker runs it (rl_specdec/heads/training.py ``HeadTrainer.learn`` and ``end``):
the policy's aux hidden states and next-token log-probs of one micro-batch, detached and cast to fp32, then
``head_loss`` over ``--chain-steps`` training-time-test steps through the policy's own embedding and LM head,
backward into the head only, and the head's AdamW step. Random weights and inputs at a target's shape (Qwen3-8B
by default, the head sized as ``HeadShape.for_target`` sizes it). Variants: ``fp32`` (the worker under
``policy.precision=fp32``) and ``bf16`` (under bf16-mixed or bf16: the head's matmuls in bf16 autocast).

Printed beside each: tokens/s, the achieved TFLOP/s at 6 FLOPs per weight of the head's pass (its layer, its fc,
the LM head it projects through) per token and chain step, the peak memory, and the cost model's price for the
same tokens (benchmarks/whatif/costmodel.py ``head_train_time``: 40% of the device's dense bf16 FLOP/s)::

    python -m benchmarks gpu-head --seqs 2 --max-len 2048              # on a GPU: the 8B head
    python -m benchmarks gpu-head --tiny                                # anywhere: a toy shape, to check it runs
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from rl_specdec.heads.eagle3 import Eagle3Head, HeadShape, default_aux_layers, micro_batch_loss

QWEN3_8B = {"hidden": 4096, "heads": 32, "head_dim": 128, "intermediate": 12288, "vocab": 151936, "layers": 36}
TINY = {"hidden": 64, "heads": 4, "head_dim": 16, "intermediate": 128, "vocab": 97, "layers": 6}


def pass_weights(shape: HeadShape) -> int:
    """Matmul weights one chain step reads per token: fc, the layer, the LM head (the embedding is gathered)."""
    h, q, i = shape.hidden_size, shape.num_attention_heads * shape.head_dim, shape.intermediate_size
    fc = len(shape.aux_layer_ids) * h * h
    return fc + 3 * 2 * h * q + q * h + 3 * h * i + h * shape.vocab_size


def inputs(s: dict, n: int, t: int, prompt: int, dev, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, s["vocab"], (n, t), generator=g).to(dev)  # [n, T]
    aux = [torch.randn(n, t, s["hidden"], generator=g).to(dev, torch.bfloat16) for _ in range(3)]  # 3 x [n, T, H]
    logits = torch.randn(n, t, s["vocab"], generator=g).to(dev, torch.bfloat16)
    mask = torch.zeros(n, t, device=dev)
    mask[:, prompt:] = 1.0  # [n, T]: response positions
    embed = (torch.randn(s["vocab"], s["hidden"], generator=g) * 0.02).to(dev)
    lm_head = (torch.randn(s["vocab"], s["hidden"], generator=g) * 0.02).to(dev)
    return ids, aux, logits, mask, embed, lm_head


def update(head, opt, batch, steps: int, bf16: bool) -> float:
    """One micro-batch's ``HeadTrainer.learn`` (its own loss function) and the head's step (``end``)."""
    ids, aux, logits, mask, embed, lm_head = batch
    states = dict(zip(head.shape.aux_layer_ids, aux))  # the policy's hidden states the head reads
    mb = {"input_ids": ids, "loss_mask": mask[:, 1:]}  # [n, T-1]: token t+1 is a response token
    logp = F.log_softmax(logits[:, :-1][mb["loss_mask"] > 0].float(), -1)  # [M, V]: the policy's, at those
    loss, _, _ = micro_batch_loss(head, states, logp, mb, embed, lm_head, steps, bf16)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def measure(s: dict, args, variant: str, dev) -> dict:
    shape = HeadShape(
        s["hidden"],
        s["heads"],
        s["head_dim"],
        s["intermediate"],
        s["vocab"],
        default_aux_layers(s["layers"]),
        max_position_embeddings=max(2048, args.max_len),
    )
    head = Eagle3Head(shape).to(dev)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-4)
    batch = inputs(s, args.seqs, args.max_len, args.prompt_len, dev)
    tokens = float(batch[3].sum())
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    times = []
    for r in range(args.warmup + args.repeats):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        update(head, opt, batch, args.chain_steps, variant == "bf16")
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if r >= args.warmup:
            times.append(time.perf_counter() - t0)
    sec = sorted(times)[len(times) // 2]
    flops = 6.0 * pass_weights(shape) * tokens * args.chain_steps
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
    return {
        "variant": variant,
        "seconds": sec,
        "tokens": tokens,
        "tokens_per_s": tokens / sec,
        "tflops": flops / sec / 1e12,
        "flops": flops,
        "peak_gb": peak,
        "pass_weights": pass_weights(shape),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, default=2, help="sequences in the micro-batch")
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--chain-steps", type=int, default=3)
    p.add_argument("--variants", default="fp32,bf16")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="a toy shape (runs on a CPU in seconds)")
    p.add_argument("--device-flops", type=float, default=989e12, help="dense bf16 FLOP/s, for the model's price")
    p.add_argument("--out", default="results/gpu_head")
    args = p.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    s = TINY if args.tiny else QWEN3_8B
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    rows = [measure(s, args, v, dev) for v in args.variants.split(",")]
    model_s = rows[0]["flops"] / (args.device_flops * 0.40)  # costmodel.head_train_time's price for these tokens
    print(
        f"head update on {name}: {args.seqs} x {args.max_len} tokens ({rows[0]['tokens']:.0f} response), "
        f"{args.chain_steps} chain steps, {rows[0]['pass_weights'] / 1e9:.3f}B weights per pass"
    )
    print("\n| variant | seconds | tokens/s | TFLOP/s (6 N per token and step) | peak GB | / the model's price |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        peak = f"{r['peak_gb']:.1f}" if r["peak_gb"] is not None else "-"
        print(
            f"| {r['variant']} | {r['seconds']:.3f} | {r['tokens_per_s']:,.0f} | {r['tflops']:.1f} | {peak} "
            f"| {r['seconds'] / model_s:.1f}x |"
        )
    print(f"\nthe model's price (40% of {args.device_flops / 1e12:.0f} TFLOP/s): {model_s:.3f} s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = {"device": name, "shape": s, "args": vars(args), "rows": rows, "model_s": model_s}
    (out / "gpu_head.json").write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
