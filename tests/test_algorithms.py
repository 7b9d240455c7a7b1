"""Pure-logic tests of the GRPO parts: advantages, loss, batch layout, checkpoints, plot."""

import json
import math
import random
from pathlib import Path

import pytest
import torch

from rl_specdec.errors import CheckpointDamaged
from rl_specdec.grpo import ClippedPGLoss, group_advantages
from rl_specdec.grpo.batch import Trajectory, build_train_batch
from rl_specdec.grpo.checkpoint import CheckpointManager
from rl_specdec.grpo.sources import decode_response
from rl_specdec.rollout import GenerationOutput
from rl_specdec.tasks import SortingTask


def test_group_advantages_normalise_within_groups():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5])
    a = group_advantages(r, group_size=4)
    # group 1: mean 0.25, std sqrt(3)/4 -> (0.75, -0.25 x3) / 0.433
    std = math.sqrt(3) / 4
    assert torch.allclose(a[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]) / std, atol=1e-4)
    assert torch.equal(a[4:], torch.zeros(4))  # identical rewards: no signal
    centred = group_advantages(r, group_size=4, normalize_std=False)
    assert torch.allclose(centred[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]))
    with pytest.raises(ValueError):
        group_advantages(torch.ones(6), group_size=4)


def _mb(logp_gen, adv, mask):
    return {
        "gen_logprobs": logp_gen,
        "advantages": adv,
        "loss_mask": mask,
        "batch_num_tokens": torch.full((adv.shape[0],), float(mask.sum())),
    }


def test_clipped_pg_loss_on_policy_gradient_is_minus_advantage():
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.9]])).requires_grad_(True)
    mb = _mb(logp.detach().clone(), torch.tensor([2.0]), torch.tensor([[1.0, 1.0, 0.0]]))
    loss, m = ClippedPGLoss(0.2)(logp, mb, None)
    loss.backward()
    # ratio = 1: d loss / d logp_t = -A / num_tokens on masked tokens, 0 elsewhere
    assert torch.allclose(logp.grad, torch.tensor([[-1.0, -1.0, 0.0]]))
    assert m["logprob_mismatch"].item() == 0.0 and m["ratio_error"].item() == 0.0
    assert "kl" not in m


def test_clipped_pg_loss_clips_and_measures_mismatch():
    gen = torch.log(torch.tensor([[0.5, 0.5]]))
    logp = torch.log(torch.tensor([[0.75, 0.5]])).requires_grad_(True)  # ratio 1.5 on token 0
    mb = _mb(gen, torch.tensor([1.0]), torch.ones(1, 2))
    loss, m = ClippedPGLoss(0.2)(logp, mb, None)
    loss.backward()
    assert logp.grad[0, 0].item() == 0.0  # clipped: ratio above 1 + eps with A > 0 has no gradient
    assert logp.grad[0, 1].item() == pytest.approx(-0.5)
    assert m["clip_fraction"].item() == pytest.approx(0.5)
    assert m["logprob_mismatch"].item() == pytest.approx(math.log(1.5) / 2, rel=1e-5)
    assert m["ratio_error"].item() == pytest.approx(0.25, rel=1e-5)
    ref = torch.log(torch.tensor([[0.5, 0.5]]))
    loss_kl, m_kl = ClippedPGLoss(0.2, kl_coef=0.1)(logp.detach(), mb, ref)
    d = math.log(0.5 / 0.75)
    assert m_kl["kl"].item() == pytest.approx((math.exp(d) - d - 1) / 2, rel=1e-5)
    assert loss_kl.item() > loss.item()


def test_build_train_batch_aligns_response_tokens_and_logprobs():
    trajs = [
        Trajectory.single_turn([5, 6, 12], [2, 1], [-0.1, -0.2]),
        Trajectory.single_turn([7, 12], [3, 4, 1], [-0.3, -0.4, -0.5]),
    ]
    b = build_train_batch(trajs, torch.tensor([1.0, -1.0]), pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 12, 2, 1], [7, 12, 3, 4, 1]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    # position t predicts token t+1
    assert b["loss_mask"].tolist() == [[0, 0, 1, 1], [0, 1, 1, 1]]
    assert torch.allclose(b["gen_logprobs"], torch.tensor([[0, 0, -0.1, -0.2], [0, -0.3, -0.4, -0.5]]))
    assert b["batch_num_tokens"].tolist() == [5.0, 5.0]


def test_build_train_batch_covers_every_model_turn_and_nothing_between():
    # prompt [5, 12] | turn 1 [2, 1] | user turn [7, 12] | turn 2 [3, 1]
    t = Trajectory([5, 12, 2, 1, 7, 12, 3, 1], [(2, [2, 1], [-0.1, -0.2]), (6, [3, 1], [-0.3, -0.4])])
    b = build_train_batch([t], torch.tensor([1.0]), pad_id=0)
    assert b["loss_mask"].tolist() == [[0, 1, 1, 0, 0, 1, 1]]
    assert torch.allclose(b["gen_logprobs"], torch.tensor([[0, -0.1, -0.2, 0, 0, -0.3, -0.4]]))
    assert b["batch_num_tokens"].tolist() == [4.0]


def test_a_turn_that_is_not_in_the_sequence_is_refused():
    bad = Trajectory([5, 12, 2, 1], [(2, [2, 9], [-0.1, -0.2])])  # the model generated 9, the sequence holds 1
    with pytest.raises(ValueError, match="did not keep the model's own tokens"):
        build_train_batch([bad], torch.tensor([1.0]), pad_id=0)


def test_sorting_task_scores():
    t = SortingTask()
    assert t.score("1134", "1134", finished=True).correct
    assert t.score("1134", "1134", finished=True).reward == 1.0
    assert t.score("1199", "1134", finished=True).reward == 0.0
    assert t.score("11349", "1134", finished=True).reward == 0.0  # rambling past the answer
    truncated = t.score("1134", "1134", finished=False)  # no EOS: cut off at the token limit
    assert not truncated.correct and truncated.reward == 0.0
    a, b = t.make_batch(3, 5), t.make_batch(3, 5)
    assert a == b and all(s.answer == "".join(sorted(s.prompt[:-1])) for s in a)


def test_decode_response_strips_eos_only_when_stopped():
    from rl_specdec.toy.build import build_tokenizer

    tok = build_tokenizer()
    ids = tok.encode("123") + [tok.eos_token_id]
    assert decode_response(tok, ids, "stop") == "123"
    assert decode_response(tok, tok.encode("12"), "length") == "12"


def test_checkpoint_crash_mid_save_keeps_last_good(tmp_path):
    cm = CheckpointManager(str(tmp_path), keep=2)

    def good(path):
        (tmp_path / "x").mkdir(exist_ok=True)
        import os

        os.makedirs(path)
        (open(os.path.join(path, "weights"), "w")).write("ok")

    cm.save(2, good, {"step": 2})

    def crash(path):
        import os

        os.makedirs(path)
        raise RuntimeError("killed while saving")

    with pytest.raises(RuntimeError):
        cm.save(4, crash, {"step": 4})
    path, state = cm.latest()
    assert state["step"] == 2 and path.name == "step_000002"
    cm.save(6, good, {"step": 6})
    cm.save(8, good, {"step": 8})
    assert [p.name for p in cm._complete()] == ["step_000006", "step_000008"]  # keep=2
    assert not list(tmp_path.glob(".tmp-*"))  # the crashed save's leftovers are gone


def test_a_checkpoint_that_cannot_be_written_is_removed_and_named(tmp_path):
    """A full disk mid-save: the half-written folder goes, the older checkpoints stay, and the error names the
    folder and its free space; a dead worker or an interrupt propagate as they are, leaving nothing behind."""
    import errno

    from rl_specdec.errors import CheckpointWriteFailed, PolicyWorkerDied
    from rl_specdec.grpo.checkpoint import verify

    cm = CheckpointManager(str(tmp_path), keep=2)
    cm.save(2, _save_fake_policy, {"step": 2})

    def fills_the_disk(error):
        def save(path):
            _save_fake_policy(path)  # half of it is on disk when the write fails
            raise error

        return save

    for error, name in [
        (OSError(errno.ENOSPC, "No space left on device"), "OSError: [Errno 28] No space left on device"),
        (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos"), "RuntimeError: [enforce"),
    ]:
        with pytest.raises(CheckpointWriteFailed) as e:
            cm.save(4, fills_the_disk(error), {"step": 4})
        assert f"could not write checkpoint step_000004 into {tmp_path}: {name}" in str(e.value)
        assert "MiB free of" in str(e.value) and "intact: step_000002" in str(e.value)
        assert (
            sorted(p.name for p in tmp_path.iterdir()) == ["step_000002"] and verify(tmp_path / "step_000002") is None
        )
    for error in (PolicyWorkerDied("rank 0 died"), KeyboardInterrupt()):
        with pytest.raises(type(error)):
            cm.save(4, fills_the_disk(error), {"step": 4})
        assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002"]
    assert cm.latest()[0].name == "step_000002" and cm.has(2) and not cm.has(4)


def _save_fake_policy(path):
    """A checkpoint's layout: policy/model/*.safetensors and policy/optimizer.pt."""
    from safetensors.torch import save_file

    model = Path(path) / "policy" / "model"
    model.mkdir(parents=True)
    save_file({"w": torch.arange(1000.0)}, str(model / "model.safetensors"))
    torch.save({"format": 2}, Path(path) / "policy" / "optimizer.pt")


def test_damaged_checkpoint_is_named_and_the_previous_one_used(tmp_path, caplog):
    cm = CheckpointManager(str(tmp_path), keep=2)
    cm.save(2, _save_fake_policy, {"step": 2})
    cm.save(4, _save_fake_policy, {"step": 4})
    assert (
        json.loads((tmp_path / "step_000004/manifest.json").read_text())["files"]["policy/model/model.safetensors"][
            "bytes"
        ]
        > 4000
    )
    newest = tmp_path / "step_000004/policy/model/model.safetensors"
    newest.write_bytes(newest.read_bytes()[:100])  # truncated, as by a full disk or a killed copy

    fresh = CheckpointManager(str(tmp_path), keep=2)  # a resumed run: nothing verified yet
    with caplog.at_level("WARNING"):
        path, state = fresh.latest()
    assert (path.name, state["step"]) == ("step_000002", 2)
    assert "step_000004" in caplog.text and "policy/model/model.safetensors has 100 bytes" in caplog.text

    # same size, other bytes: the checksum catches it
    older = tmp_path / "step_000002/policy/optimizer.pt"
    data = bytearray(older.read_bytes())
    data[-1] ^= 0xFF
    older.write_bytes(bytes(data))
    with pytest.raises(
        CheckpointDamaged,
        match=r"no intact checkpoint .*step_000004: policy/model/model.safetensors has 100 bytes"
        r".*step_000002: policy/optimizer.pt does not match its sha256",
    ):
        CheckpointManager(str(tmp_path)).latest()


def test_plot_renders_png(tmp_path):
    from rl_specdec.plot import main

    rows = [
        {
            "step": s,
            "train/reward_mean": 0.1 * s,
            "train/accuracy": 0.05 * s,
            "spec_decode/acceptance_rate": 0.7,
            "spec_decode/acceptance_length": 3.0,
            "spec_decode/acceptance_rate_pos_1": 0.8,
            "timing/generation": 1.0,
            "timing/train": 0.5,
            "train/logprob_mismatch": 1e-7,
            "generation/tokens_per_s": 500.0,
        }
        for s in range(1, 5)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main([str(tmp_path)]) == 0
    png = tmp_path / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main([str(tmp_path / "missing")]) == 2


def test_select_for_training_drops_zero_advantage_groups():
    from rl_specdec.grpo.batch import select_for_training

    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0]), group_size=2)  # groups: mixed, same, same
    assert select_for_training(adv, skip_zero=True) == [0, 1]
    assert select_for_training(adv, skip_zero=False) == list(range(6))
    assert select_for_training(torch.zeros(4), skip_zero=True) == [0, 1, 2, 3]  # no signal at all: keep the batch
    out = GenerationOutput(
        token_ids=[[1], [2], [3]], logprobs=[[-1.0], [-2.0], [-3.0]], finish_reasons=["stop", "length", "stop"]
    )
    sub = out.select([2, 0])
    assert sub.token_ids == [[3], [1]] and sub.logprobs == [[-3.0], [-1.0]] and sub.finish_reasons == ["stop", "stop"]


def test_sorting_pool_is_a_fixed_dataset_and_validation_is_held_out():
    t = SortingTask(dataset_size=32)
    pool = {s.prompt for s in t.pool()}
    assert len(t.pool()) == 32
    a = t.make_batch(7, 8)
    assert a == t.make_batch(7, 8) and {s.prompt for s in a} <= pool and len({s.prompt for s in a}) == 8
    val = t.validation_batch(10**9 + 7, 64)
    assert all(t.is_held_out(s) for s in val) and not any(t.is_held_out(s) for s in t.pool())
    assert SortingTask().make_batch(7, 8) != a  # dataset_size=0: fresh problems


def test_held_out_split_is_disjoint_and_keeps_the_length_mix():
    t = SortingTask(min_len=4, max_len=12)
    train = [s for seed in range(50) for s in t.make_batch(seed, 64)]  # 3200 problems
    val = t.validation_batch(10**9 + 7, 256)
    assert not any(t.is_held_out(s) for s in train) and all(t.is_held_out(s) for s in val)
    assert not {s.answer for s in train} & {s.answer for s in val}  # not even a shared answer
    # stratified as before
    assert sorted(len(s.prompt) - 1 for s in val) == sorted(4 + (i * 9) // 256 for i in range(256))
    # ~1/8 held out
    assert 0.08 < sum(t.is_held_out(t.sample_problem(random.Random(i))) for i in range(4000)) / 4000 < 0.17
    with pytest.raises(ValueError, match="no validation problem of length 1"):
        SortingTask(min_len=1, max_len=1, holdout_every=1000).validation_batch(0, 4)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("config", ["grpo_spec.yaml", "grpo_base.yaml"])
def test_default_run_never_trains_on_a_validation_problem(config, seed):
    """Every training prompt of the default run (all steps) against the validation and self-check prompts."""
    from pathlib import Path
    from types import SimpleNamespace

    from rl_specdec.config import load_config
    from rl_specdec.grpo.sources import VAL_SEED, step_prompts
    from rl_specdec.tasks import make_task

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / config, [f"seed={seed}"])
    assert not cfg.task.kwargs.get("dataset_size"), "the default run trains on fresh problems, not a fixed pool"
    run = SimpleNamespace(cfg=cfg, task=make_task(cfg.task.name, **cfg.task.kwargs))
    held_out = run.task.validation_batch(VAL_SEED, cfg.grpo.val_num_prompts) + run.task.validation_batch(
        VAL_SEED + 1, cfg.grpo.self_check_prompts
    )
    train = [s for step in range(cfg.grpo.max_steps) for s in step_prompts(run, step)]
    assert len(train) == cfg.grpo.max_steps * cfg.grpo.num_prompts_per_step
    assert cfg.grpo.val_num_prompts >= 256
    assert not {s.prompt for s in train} & {s.prompt for s in held_out}
    assert not {s.answer for s in train} & {s.answer for s in held_out}


def test_time_until_done_and_tail_metrics():
    from rl_specdec.grpo.step import tail_metrics

    out = GenerationOutput(
        token_ids=[[1]] * 10,
        logprobs=[[0.0]] * 10,
        finish_reasons=["stop"] * 10,
        finish_time_s=[0.9, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 5.0],
    )
    assert out.time_until_done(0.5) == 0.5  # the 5th of 10 sorted times
    assert out.time_until_done(0.9) == 0.9
    assert out.time_until_done(1.0) == 5.0  # the straggler the step waits for
    assert out.time_until_done(0.01) == 0.1
    assert tail_metrics(out) == {
        "generation/time_to_50pct_done": 0.5,
        "generation/time_to_90pct_done": 0.9,
        "generation/time_to_100pct_done": 5.0,
    }
    sub = out.select([9, 0])
    assert sub.finish_time_s == [5.0, 0.9]
    with pytest.raises(ValueError, match="fraction"):
        out.time_until_done(0.0)
    none = GenerationOutput(token_ids=[[1]], logprobs=[[0.0]], finish_reasons=["stop"])
    assert none.time_until_done(0.5) is None and tail_metrics(none) == {} and none.select([0]).finish_time_s == []


def test_drafter_subset_is_bounded_seeded_and_complete_when_unbounded():
    from rl_specdec.drafter.online import drafter_subset

    assert drafter_subset(128, 0, step=3) == list(range(128))
    assert drafter_subset(16, 32, step=3) == list(range(16))
    a, b, c = drafter_subset(128, 32, step=3), drafter_subset(128, 32, step=3), drafter_subset(128, 32, step=4)
    assert len(a) == 32 == len(set(a)) and a == sorted(a) and all(0 <= i < 128 for i in a)
    assert a == b and a != c  # seeded by the step: reproducible, and a different subset each step


def test_plot_draws_k_per_bucket_in_bucket_order():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rl_specdec.plot import _k_per_bucket

    rows = [
        {"step": s, "spec_decode/k_bucket_16_31": 0.0, "spec_decode/k_bucket_1_1": 5.0, "spec_decode/k_bucket_2_3": s}
        for s in range(1, 4)
    ]
    fig, ax = plt.subplots()
    _k_per_bucket(ax, "run", rows)
    assert [line.get_label() for line in ax.lines] == ["run 1-1 running", "run 2-3 running", "run 16-31 running"]
    assert list(ax.lines[1].get_ydata()) == [1, 2, 3]
    plt.close(fig)
