"""One optimizer step, compared: the first AdamW step of two runs, checked on their gradients and each run's
weights checked to be exactly AdamW's step of its own gradient (test_precision.py, test_policy_group.py)."""

from __future__ import annotations

# The first AdamW step (weight decay 0) moves each weight by lr * m_hat / (sqrt(v_hat) + eps), with
# m_hat = g and v_hat = g^2 of the (reduced, clipped) gradient g: about lr * sign(g). Where |g| is
# below its own numerical error (or near eps) two equivalent computations may step a weight in
# opposite directions, so runs are compared on their gradients (exp_avg / (1 - beta1)), and each
# run's weights are checked to be exactly AdamW's step of its own gradient.
BF16_UNIT = 2.0**-8  # bf16's unit roundoff: 8 significant bits


def adam_step(named_params, optimizer) -> dict[str, dict]:
    """{"params", "exp_avg", "exp_avg_sq"}: {name: tensor} of an in-process worker's model and AdamW."""
    out: dict[str, dict] = {"params": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for name, p in named_params:
        out["params"][name] = p.detach().clone()
        for k in ("exp_avg", "exp_avg_sq"):
            out[k][name] = optimizer.state[p][k].clone()
    return out


def adam_step_from_checkpoint(path) -> dict[str, dict]:
    """The same from a checkpoint folder (``PolicyWorker.save_checkpoint``: any worker count)."""
    from pathlib import Path

    import torch
    from safetensors.torch import load_file

    params: dict = {}
    for f in sorted((Path(path) / "model").glob("*.safetensors")):
        params.update(load_file(str(f)))
    # None: saved before a step
    state = (torch.load(Path(path) / "optimizer.pt", weights_only=False)["optimizer"] or {"state": {}})["state"]
    return {"params": params, **{k: {n: s[k] for n, s in state.items()} for k in ("exp_avg", "exp_avg_sq")}}


def gradient(step: dict[str, dict], beta1: float = 0.9):
    """The gradient the first step took, flat over the parameters in name order (float64)."""
    import torch

    m = step["exp_avg"]
    return torch.cat([m[n].double().flatten() for n in sorted(m)]) / (1 - beta1)


def assert_adam_first_step(
    before: dict, step: dict[str, dict], lr: float, betas=(0.9, 0.999), eps: float = 1e-8
) -> None:
    """Every weight is float32 and is ``before`` moved by AdamW's first step of the stored moments,
    to float32 rounding of the weight (a bf16 master weight would be off by ~2^-9 of itself)."""
    import torch

    for name, m in step["exp_avg"].items():
        w, v = step["params"][name], step["exp_avg_sq"][name]
        assert w.dtype == m.dtype == v.dtype == torch.float32, (name, w.dtype, m.dtype, v.dtype)
        update = lr / (1 - betas[0]) * m.double() / (v.double().sqrt() / (1 - betas[1]) ** 0.5 + eps)
        expected = before[name].double() - update
        err = (w.double() - expected).abs()
        assert (err <= 2 * torch.finfo(torch.float32).eps * expected.abs() + 1e-10).all(), (name, err.max().item())
