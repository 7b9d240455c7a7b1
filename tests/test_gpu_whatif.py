"""benchmarks/gpu/gpu_whatif.py: the cost model against hand-computed cases, the simulator's token
accounting, the package's controller reaching the top bound where drafting is free, the calibration fit.
Pure numpy: no engines, no Ray. Each test has a case that makes it fail if the code it covers is broken."""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace

import numpy as np
import pytest

from benchmarks.whatif import calibrate as CAL
from benchmarks.whatif import costmodel as C
from benchmarks.whatif import hardware as H
from benchmarks.whatif import models as M
from benchmarks.whatif import policies as P
from benchmarks.whatif import workload as W
from benchmarks.whatif.grpo import predict_grpo
from benchmarks.whatif.simulate import simulate_feedback, simulate_static

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "cost_table_synthetic.json")


# ---- the cost model, by hand ---------------------------------------------------------------


def test_qwen3_shapes_give_the_published_parameter_counts():
    # per layer: q 4096*4096 + k,v 2*4096*1024 + o 4096*4096 + MLP 3*4096*12288 = 192,937,984
    assert M.QWEN3_8B.layer_params == 192_937_984
    assert M.QWEN3_8B.total_params == 36 * 192_937_984 + 2 * 4096 * 151_936  # 8.19e9: "Qwen3-8B, 8.2B"
    assert M.QWEN3_32B.total_params == 64 * 487_587_840 + 2 * 5120 * 151_936  # 32.8e9
    assert M.QWEN3_06B.total_params == 28 * 15_728_640 + 1024 * 151_936  # tied: 0.60e9, 0.44e9 without embedding
    assert M.QWEN3_8B.kv_bytes_per_token(2) == 2 * 36 * 8 * 128 * 2 == 147_456  # GQA: 8 KV heads, not 32
    assert M.TOY_POLICY.total_params == 4 * (4 * 256 * 256 + 3 * 256 * 768) + 256 * 32


def test_decode_step_at_batch_one_is_the_weight_read():
    """H100, Qwen3-8B, b=1, context 1000, no drafter: memory-bound everywhere."""
    d, m = H.H100, M.QWEN3_8B
    bw, fl = 3.35e12 * 0.8, 989e12 * 0.6
    dense = max(m.dense_params * 2 / bw, 2 * m.dense_params / fl)
    attn = max(147_456 * (1000 + 1) / bw, 4 * 36 * 32 * 128 * 1000 / fl)
    hand = d.t_step + d.t_req + dense + attn + 36 * d.t_layer
    assert dense == m.dense_params * 2 / bw  # the weight read, 5.6 ms
    assert C.steady_time(d, W.PAIRS["8B+0.6B"], 1, 0, 1000, "none") == pytest.approx(hand, rel=1e-12)
    assert 6.0e-3 < hand < 6.8e-3


def test_verifying_4_tokens_at_batch_32_is_compute_bound_on_h20_only():
    """H20's ridge is ~28 FLOP/byte, H100's ~221: 32 requests x 4 tokens are compute-bound on the one only."""
    m, n = M.QWEN3_8B, 32 * 4
    for dev, bound in ((H.H20, "compute"), (H.H100, "memory")):
        c = C.fwd_const(dev, m)
        compute, memory = c.f * n + c.h * n, c.w
        assert (compute > memory) == (bound == "compute"), dev.name
    assert H.H20.ridge == pytest.approx(148e12 * 0.6 / (4e12 * 0.8))
    t = C.forward_time(H.H20, m, n, 0.0, 0.0)
    assert float(t) == pytest.approx(2 * m.dense_params * n / (148e12 * 0.6) + 147_456 * n / (4e12 * 0.8) + 36 * 6e-6)


def test_speculation_pays_by_el_at_small_batch_and_loses_on_h20_at_large_batch():
    pair = W.PAIRS["8B+EAGLE3"]
    s1 = C.steady_speedup(H.H100, pair, 1, 3, 1000)
    assert 0.7 * pair.expected_length(3) < s1 < pair.expected_length(3)  # E[L] minus the drafter and overheads
    assert C.steady_speedup(H.H20, pair, 256, 3, 1000) < 1.0
    assert C.steady_speedup(H.H100, pair, 256, 3, 1000) > 1.0


def test_scalar_and_vector_pricing_agree():
    rng = np.random.default_rng(0)
    pr = C.Pricer(H.H100, W.PAIRS["32B+1.7B"], tp=2)
    for _ in range(20):
        b = int(rng.integers(1, 200))
        k = int(rng.integers(0, 6))
        dtok = [b * (k + 1)] + [b] * max(k - 1, 0) if k else []
        args = dict(
            b=b,
            ctx=b * 900.0,
            vt=b * (k + 1),
            qc=b * (k + 1) * 900.0,
            spec=int(k > 0),
            dtok=dtok,
            dseq=[b] * len(dtok),
            cu=float(rng.integers(0, 3) * 500),
        )
        row = C.one_row(**args)
        assert pr.step(
            args["b"], args["ctx"], args["vt"], args["vt"], args["qc"], args["spec"], dtok, args["dseq"], args["cu"]
        ) == pytest.approx(float(pr.rows(row)[0]), rel=1e-12)


def test_acceptance_pmf_and_expected_length():
    pair = W.PAIRS["8B+MTP"]
    for k in range(7):
        pmf = pair.pmf(k)
        assert pmf.sum() == pytest.approx(1.0) and (pmf >= 0).all()
        assert 1 + pmf @ np.arange(k + 1) == pytest.approx(pair.expected_length(k))
    assert W.alpha_for_length(pair.expected_length(3), 3, pair.decay) == pytest.approx(pair.alpha1, abs=1e-9)


# ---- the simulator ---------------------------------------------------------------------------


def small_workload(seed=0, n=24, max_seqs=None):
    return W.Workload(W.LengthDist(60, 1.0, 400).sample(n, np.random.default_rng(seed)), 32, max_seqs)


@pytest.mark.parametrize("max_seqs", [None, 8])
def test_every_policy_generates_exactly_the_sampled_lengths(max_seqs):
    wl = small_workload(max_seqs=max_seqs)
    pair = W.PAIRS["8B+0.6B"]
    pricer = C.Pricer(H.H100, pair)
    for pol in P.gpu_policies():
        ph = simulate_static(pair, wl, pol, np.random.default_rng(1))
        assert ph.tokens == wl.tokens, pol.name
        assert ph.rows.m.sum() == ph.steps and (ph.rows.b <= (max_seqs or 99)).all()
    for pol in (P.AdaptiveVerification(3), P.ControllerPolicy(4), P.Fixed(3)):
        ph = simulate_feedback(pair, wl, pol, pricer, np.random.default_rng(1))
        assert ph.tokens == wl.tokens, pol.name


def test_macro_steps_match_step_by_step_statistics():
    """The static path's multi-step rows draw the same acceptance as single steps: same mean step count."""
    pair, wl = W.PAIRS["8B+MTP"], small_workload(n=16)
    pricer = C.Pricer(H.H100, pair)
    macro = np.mean([simulate_static(pair, wl, P.Fixed(3), np.random.default_rng(s)).steps for s in range(30)])
    single = np.mean(
        [simulate_feedback(pair, wl, P.Fixed(3), pricer, np.random.default_rng(s)).steps for s in range(30)]
    )
    assert macro == pytest.approx(single, rel=0.03)
    none = simulate_static(pair, wl, P.NoSpec(), np.random.default_rng(0)).steps
    assert none == wl.lengths.max()  # without drafts a step is one token: the longest sequence sets the count
    assert macro < 0.6 * none  # negative control: drafting at E[L(3)] = 2.95 does cut the steps


# ---- the package's controller in the loop -----------------------------------------------------

FREE = replace(H.H100, name="free drafting", flops=1e30, t_spec=0.0, t_pass=0.0, t_req=0.0, t_layer=0.0)
NULL_DRAFTER = M.ModelConfig("free drafter", 0, 1, 1, 1, 1, 1, 1, True, "test")


def controller_run(pair, dev, phases=4, k_max=4):
    pol = P.ControllerPolicy(k_max, 256, seed=0)
    pricer = C.Pricer(dev, pair)
    dist = W.LengthDist(300, 0.8, 1500)
    for i in range(phases):
        ph = simulate_feedback(
            pair, W.Workload(dist.sample(64, np.random.default_rng(i)), 64), pol, pricer, np.random.default_rng(10 + i)
        )
    wl = W.Workload(dist.sample(64, np.random.default_rng(phases)), 64)
    base = float(pricer.rows(simulate_static(pair, wl, P.NoSpec(), np.random.default_rng(0)).rows).sum())
    ph = simulate_feedback(pair, wl, pol, pricer, np.random.default_rng(99))
    return pol, base / ph.time


def test_controller_reaches_the_top_bound_where_drafting_is_free():
    """Drafting and verifying cost nothing: t(b, k) = t(b, 0), so k_max pays E[L(k_max)] and the controller's
    own prediction for it (its rate at k_max over its rate at k=0) must reach that bound."""
    pair = replace(W.PAIRS["8B+0.6B"], drafter=NULL_DRAFTER, alpha1=0.8, decay=1.0)
    top = pair.expected_length(4)
    pol, speedup = controller_run(pair, FREE)
    ks = [k for _, _, k in pol.ctl.report()["buckets"]]
    # the batch is 64 at most; b=1 is the phase's last rollout alone, a few dozen steps in which one exploring
    # burst (whose end the rollout's own end may cut) is all a k gets measured by: too few to settle on
    seen = [j for j, (lo, _) in enumerate(pol.ctl.ranges) if 2 <= lo < 64]
    assert all(ks[j] == 4 for j in seen), ks
    for j in seen:
        rates = pol.ctl.ratings_for(j)
        assert rates[4] / rates[0] == pytest.approx(top, rel=0.1), (j, rates)
    assert speedup > 0.85 * top, speedup  # the phase, warm-up and exploration included


def test_controller_stays_at_zero_with_a_useless_drafter():
    """Negative control: the same free drafting with acceptance 0 gives nothing to win."""
    pair = replace(W.PAIRS["8B+0.6B"], drafter=NULL_DRAFTER, alpha1=0.0, decay=1.0)
    pol, speedup = controller_run(pair, FREE, phases=3)
    assert [k for _, _, k in pol.ctl.report()["buckets"]] == [0] * len(pol.ctl.ranges)
    assert speedup < 1.02


def test_adaptive_verification_admits_all_where_verifying_is_free_and_fewer_where_it_is_dear():
    pair, wl = W.PAIRS["8B+EAGLE3"], small_workload(n=32)
    free, dear = P.AdaptiveVerification(3), P.AdaptiveVerification(3)
    simulate_feedback(pair, wl, free, C.Pricer(FREE, pair), np.random.default_rng(0))
    dear_dev = replace(H.H20, flops=1e12)  # verification compute-bound from the first extra token
    simulate_feedback(pair, wl, dear, C.Pricer(dear_dev, pair), np.random.default_rng(0))
    assert free.summary()["admitted_fraction"] > 0.99
    assert dear.summary()["admitted_fraction"] < 0.5


# ---- calibration -----------------------------------------------------------------------------


def model_table(theta, pair_key="toy", cells=None, noise=0.0, seed=0) -> dict:
    """A t(b, k) table the model itself writes with known constants (optionally noisy)."""
    rng = np.random.default_rng(seed)
    tbl = {"pair": pair_key, "dtype": "float32", "acceptance_length": {"3": 2.9}, "cells": []}
    pair = CAL.table_pair(tbl, log=lambda s: None)
    for b in (1, 2, 4, 8, 16, 32, 64, 128):
        for k in (0, 1, 2, 3, 4):
            t = float(C.Pricer(CAL.device_of(theta), pair).rows(C.steady_row(b, k, 30.0, "auto", pair))[0])
            tbl["cells"].append(
                {"b": b, "k": k, "context_mean": 30.0, "step_s": t * math.exp(noise * rng.standard_normal())}
            )
    return tbl


KNOWN = np.log([15e9, 40e9, 3e-3, 1.5e-3, 0.8e-3, 150e-6, 30e-6])


def test_fit_recovers_the_constants_that_wrote_a_table():
    theta, _, meas, pred = CAL.fit([model_table(KNOWN)], log=lambda s: None)
    assert np.max(np.abs(pred / meas - 1)) < 0.01
    for i in range(1, 6):  # the bandwidth is not determined by a toy whose weights are a few MB
        assert math.exp(theta[i] - KNOWN[i]) == pytest.approx(1.0, rel=0.1), CAL.NAMES[i]


def test_a_table_the_model_cannot_describe_shows_misses():
    """Negative control for the 15% criterion: steps that grow with b squared are not a roofline."""
    tbl = model_table(KNOWN)
    for c in tbl["cells"]:
        c["step_s"] = 1e-3 * (1 + c["k"]) + 2e-6 * c["b"] ** 2
    theta, prepared, meas, pred = CAL.fit([tbl], log=lambda s: None)
    assert np.sum(np.abs(pred / meas - 1) > CAL.TOLERANCE) >= 3
    assert "MISS" in CAL.report(theta, prepared, meas, pred)


def test_synthetic_fixture_loads_and_fits():
    tables = CAL.load_tables([FIXTURE])
    assert tables[0]["synthetic"] is True
    theta, prepared, meas, pred = CAL.fit(tables, log=lambda s: None)
    assert np.mean(np.abs(pred / meas - 1) <= CAL.TOLERANCE) >= 0.9
    assert "cells within 15%" in CAL.report(theta, prepared, meas, pred)


def test_grpo_prediction_recovers_a_phase_the_model_wrote_and_misses_with_wrong_constants():
    pair = W.TOY_PAIRS["toy"]
    wl = W.Workload(np.full(300, 12), 10, 256)
    dev = CAL.device_of(KNOWN)
    t = float(C.Pricer(dev, pair).rows(simulate_static(pair, wl, P.NoSpec(), np.random.default_rng(0)).rows).sum())
    t += CAL.CALL_OVERHEAD_S + CAL.CALL_OVERHEAD_PER_REQUEST_S * 300
    row = {
        "step": 1,
        "generation/num_tokens": 3600,
        "generation/response_length_mean": 12.0,
        "generation/response_length_median": 12.0,
        "generation/response_length_max": 12,
        "timing/generation": t,
    }
    assert "1 of 1 steps within 15%" in predict_grpo([row], KNOWN, pair, "none", 3)
    wrong = KNOWN + np.log([1, 1, 3, 1, 1, 3, 1])
    assert "0 of 1 steps within 15%" in predict_grpo([row], wrong, pair, "none", 3)


def test_the_measured_wide_table_fits_within_the_documented_residuals():
    """docs/performance.md quotes this fit: 55 of 56 cells within 15%, the one miss (t(128, 4)) within 35%,
    the drafter pass (not fitted) within 20% (measured 0.71 ms, model 0.59 ms)."""
    from benchmarks.whatif import measured

    tables = CAL.load_tables([str(measured.ROOT / p) for p in measured.TABLES])
    theta, prepared, meas, pred = CAL.fit(tables, log=lambda s: None)
    res = np.abs(pred / meas - 1)
    assert np.sum(res <= CAL.TOLERANCE) >= 55 and res.max() < 0.35
    dev, pair = CAL.device_of(theta), prepared[0][1]
    drafter_pass = dev.t_pass + dev.t_req_draft + C._fwd(C.Pricer(dev, pair).D, 1.0, 23.0, 23.0, 1.0, max)
    assert drafter_pass == pytest.approx(tables[0]["drafter_pass_s"], rel=0.2)


def test_lengths_rebuilt_from_a_metrics_row_keep_its_count_total_and_max():
    row = {
        "generation/num_tokens": 52_000,
        "generation/response_length_mean": 406.25,
        "generation/response_length_median": 250.0,
        "generation/response_length_max": 4000,
    }
    x = W.lengths_from_row(row)
    assert len(x) == 128 and x.sum() == 52_000 and x.max() == 4000
    assert abs(np.median(x) - 250) < 60


def test_an_online_head_costs_its_update_and_a_draft_model_nothing_here():
    """The head's update: 6 FLOPs per weight of its pass, per response token and training-time-test step, at the
    train phase's MFU; a small part of the 8B's train phase (8 N per token), and linear in the chain's steps."""
    dev, wl = H.H100, W.Workload(np.full(64, 300), 200)
    head, draft = W.PAIRS["8B+EAGLE3"], W.PAIRS["8B+0.6B"]
    t = C.head_train_time(dev, head, wl)
    assert C.head_train_time(dev, draft, wl) == 0.0
    assert t == pytest.approx(6 * head.drafter.dense_params * 64 * 300 * 3 / (dev.flops * dev.mfu))
    assert C.head_train_time(dev, head, wl, chain_steps=1) == pytest.approx(t / 3)
    assert 0.02 < t / C.train_time(dev, head, wl) < 0.25


def test_the_script_runs_end_to_end_small(tmp_path, capsys):
    from benchmarks.gpu import gpu_whatif

    gpu_whatif.main(
        [
            "--devices",
            "H100,H20",
            "--pairs",
            "8B+EAGLE3",
            "--batch",
            "16",
            "--length-median",
            "80",
            "--max-new-tokens",
            "400",
            "--warmup-phases",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    assert "Where speculation loses" in out and "H20" in out and (tmp_path / "speedup_vs_batch.png").exists()
    assert "the head trained online" in out  # an EAGLE-3 pair's table prices the head's own update
    gpu_whatif.main(["--calibrate", FIXTURE, "--out", str(tmp_path)])
    assert json.load(open(tmp_path / "cpu_constants.json"))["t_step"] > 0


# ---- a GPU measurement (benchmarks/gpu/gpu_torch.py) against the model -----------------------------------


def test_the_gpu_fit_recovers_the_constants_that_made_the_passes():
    """Passes priced by the model with known constants are fitted back to them; the assumed H200 misses the same
    passes (the negative control: a fit that returned the datasheet device would fail here)."""
    from dataclasses import asdict

    from benchmarks.whatif import gpu_report as G

    truth = replace(H.H200, eta_bw=0.9, eta_flops=0.55, t_layer=50e-6, **G.HOST_FREE)
    rows = []
    for role, shape in (("target", M.QWEN3_8B), ("drafter", M.QWEN3_06B)):
        for b in (1, 8, 64, 256):
            for k in (0, 3, 5):
                n = b * (k + 1)
                r = dict(role=role, model=shape.name, b=b, k=k, tokens=n, ctx=1024, logits=n if role == "target" else b)
                rows.append(dict(r, seconds=G.predicted(truth, shape, r)))
    data = dict(
        machine=dict(name="NVIDIA H200", device="cuda"),
        shapes={s.name: asdict(s) for s in (M.QWEN3_8B, M.QWEN3_06B)},
        decode=rows,
        args=dict(ctx=1024),
    )
    dev = G.measured_device(data)
    assert (dev.eta_bw, dev.t_layer, dev.eta_flops) == pytest.approx((0.9, 50e-6, 0.55), rel=1e-6)
    assert dev.name == "H200 (kernels measured)" and dev.t_step == H.H200.t_step  # host constants stay assumed
    fitted, assumed = replace(dev, **G.HOST_FREE), replace(H.H200, **G.HOST_FREE)
    for r in rows:
        shape = G.shape_of(data, r["model"])
        assert G.predicted(fitted, shape, r) == pytest.approx(r["seconds"], rel=1e-6)
    misses = [r["seconds"] / G.predicted(assumed, G.shape_of(data, r["model"]), r) for r in rows]
    assert max(misses) > 1.5  # the drafter's batch-1 pass, where the per-layer floor dominates


def test_the_head_update_benchmark_runs_the_workers_loss_at_a_toy_shape(tmp_path, capsys):
    from benchmarks.gpu import gpu_head

    gpu_head.main(["--tiny", "--max-len", "32", "--prompt-len", "8", "--repeats", "1", "--out", str(tmp_path)])
    rows = json.load(open(tmp_path / "gpu_head.json"))["rows"]
    assert [r["variant"] for r in rows] == ["fp32", "bf16"] and all(r["tokens"] == 2 * 24 for r in rows)
    assert "| fp32 |" in capsys.readouterr().out
