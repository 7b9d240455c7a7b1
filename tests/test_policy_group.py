"""The data-parallel policy group: real Ray actors, real torch.distributed (gloo on CPU).

N workers must compute the same update as one: same parameters after an
optimizer step, same metrics, with DDP and FSDP2, on one node and across the
two nodes of a simulated Ray cluster. Checkpoints move between worker counts;
a dead worker is named.

Runs its own Ray instance (``ray.cluster_utils.Cluster``, two nodes): any Ray
instance left by an earlier module is shut down first, and the cluster is
shut down at the end of the module.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch

from adam_steps import BF16_UNIT, adam_step_from_checkpoint, assert_adam_first_step, gradient
from conftest import actor_states, wait_until
from rl_specdec.config import PolicyConfig, load_config
from rl_specdec.grpo import ClippedPGLoss
from rl_specdec.grpo.batch import Trajectory, build_train_batch
from rl_specdec.policy import PolicyGroup, PolicyWorker, PolicyWorkerDied

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
LOSS = ClippedPGLoss(0.2, kl_coef=0.05)  # the KL term runs the frozen reference on every worker too
TOL = 1e-5  # on parameters after Adam steps of lr = 1e-4 (float summation order differs between 1 and 2 workers)


def policy_config(path, **kw) -> PolicyConfig:
    return PolicyConfig(**{"model_name": str(path), "device": "cpu", "precision": "fp32", "micro_batch_size": 2, **kw})


def make_batch(tokenizer, seed: int, n: int = 7) -> dict[str, torch.Tensor]:
    """``n`` sorting prompts with partial answers; 7 rows: 2 workers get 4 each, one a padding row."""
    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for _ in range(n):
        digits = torch.randint(0, 10, (int(torch.randint(3, 15, (1,), generator=g)),), generator=g).tolist()
        prompts.append(tokenizer.encode("".join(map(str, digits)) + "="))
        responses.append(
            tokenizer.encode("".join(map(str, sorted(digits)))[: len(digits) // 2 + 1]) + [tokenizer.eos_token_id]
        )
    lp = [(-0.5 - torch.rand(len(r), generator=g)).tolist() for r in responses]
    trajectories = [Trajectory.single_turn(p, r, lps) for p, r, lps in zip(prompts, responses, lp)]
    return build_train_batch(trajectories, torch.randn(n, generator=g), tokenizer.pad_token_id)


def started(path, **kw) -> PolicyWorker:
    w = PolicyWorker(policy_config(path, **kw), keep_reference=True, seed=0)
    w.start()
    return w


def snapshot(w: PolicyWorker) -> dict[str, torch.Tensor]:
    """A copy: in this process the refit dict holds the live CPU parameters themselves."""
    return {k: v.clone() for k, v in w.state_dict_for_refit().items()}


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 4})
    c.add_node(num_cpus=4)
    c.wait_for_nodes()
    ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test module
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def reference(toy, tokenizer, tmp_path_factory):
    """One worker in this process (today's single trainer): its initial state saved, log-probs, one step."""
    batch = make_batch(tokenizer, seed=1)
    w = started(toy.policy)
    initial = tmp_path_factory.mktemp("initial") / "policy"
    w.save_checkpoint(str(initial))
    before = snapshot(w)
    logprobs = w.get_logprobs(batch)
    metrics = w.train_step(batch, LOSS)
    return {
        "initial": str(initial),
        "batch": batch,
        "before": before,
        "logprobs": logprobs,
        "metrics": metrics,
        "after": snapshot(w),
    }


BUCKET = 300_000  # refit bucket bytes: the toy's 3M parameters come in many buckets
GROUPS = {
    # FSDP2, both workers wherever Ray puts them (they reserve nothing)
    "fsdp2": dict(num_workers=2, strategy="fsdp2", refit_bucket_bytes=BUCKET),
    # DDP, one worker on each node of the two-node cluster
    "ddp across nodes": dict(
        num_workers=2, strategy="ddp", cpus_per_worker=1, placement_strategy="STRICT_SPREAD", refit_bucket_bytes=BUCKET
    ),
}


@pytest.fixture(scope="module")
def group(cluster, toy):
    """``group(name)``: a started 2-worker group of ``GROUPS``, shared by the module's tests (a new one if it
    was stopped)."""
    live: dict[str, PolicyGroup] = {}

    def get(name: str) -> PolicyGroup:
        if name not in live or not live[name].workers:
            live[name] = PolicyGroup(
                policy_config(toy.policy, **{**GROUPS, **MIXED}[name]), keep_reference=True, seed=0
            )
        return live[name]

    yield get
    for g in live.values():
        g.shutdown()


def assert_same_step(group: PolicyGroup, reference) -> dict:
    """From the same start, the group's log-probs, metrics and parameters after one step equal one worker's."""
    import ray

    group.load_checkpoint(reference["initial"])
    assert torch.allclose(group.get_logprobs(reference["batch"]), reference["logprobs"], atol=1e-5)
    metrics = group.train_step(reference["batch"], LOSS)
    for k in (
        "loss",
        "pg_loss",
        "kl",
        "entropy",
        "grad_norm",
        "logprob_mismatch",
        "logprob_mismatch_max",
        "ratio_error",
        "clip_fraction",
    ):
        assert metrics[k] == pytest.approx(reference["metrics"][k], rel=1e-4, abs=1e-6), k
    after = ray.get(group.state_dict_for_refit())
    assert max_diff(after, reference["after"]) < TOL
    assert max_diff(after, reference["before"]) > 5 * TOL  # it trained (Adam moves a weight by up to lr = 1e-4)
    return after


@pytest.mark.parametrize("name", list(GROUPS))
def test_two_workers_equal_one_and_refit_in_buckets(group, reference, name):
    import ray

    g = group(name)
    if name == "ddp across nodes":
        assert len({n["node_id"] for n in g.nodes}) == 2, g.nodes
    after = assert_same_step(g, reference)
    buckets = [ray.get(ref) for ref in g.state_dict_buckets()]
    assert len(buckets) > 5
    for b in buckets:
        unique = {id(t): t for t in b.values()}.values()  # a tied tensor counts once
        assert len(unique) == 1 or sum(t.numel() * t.element_size() for t in unique) <= BUCKET
    merged = {k: v for b in buckets for k, v in b.items()}
    assert sum(map(len, buckets)) == len(merged)  # no name twice
    assert set(merged) == set(after) and "lm_head.weight" in merged  # every name, the tied head too
    assert all(torch.equal(merged[k], after[k]) for k in after)
    g.train_step(reference["batch"], LOSS)  # the group goes on after a refit gather (FSDP2: every rank took part)


def test_checkpoints_move_between_worker_counts(group, toy, tokenizer, tmp_path):
    """1 worker saves, 2 FSDP2 workers resume; they save, 1 worker resumes: the same steps as one worker throughout."""
    import ray

    b1, b2, b3 = (make_batch(tokenizer, seed=s) for s in (11, 12, 13))
    one = started(toy.policy)
    one.train_step(b1, LOSS)
    one.save_checkpoint(str(tmp_path / "by_one"))
    m2, after2 = one.train_step(b2, LOSS), snapshot(one)
    m3, after3 = one.train_step(b3, LOSS), snapshot(one)

    two = group("fsdp2")
    two.load_checkpoint(str(tmp_path / "by_one"))
    assert two.train_step(b2, LOSS)["loss"] == pytest.approx(m2["loss"], rel=1e-4)
    # Adam's moments came along: a fresh Adam steps differently
    assert max_diff(ray.get(two.state_dict_for_refit()), after2) < TOL
    two.save_checkpoint(str(tmp_path / "by_two"))
    again = started(toy.policy)
    again.load_checkpoint(str(tmp_path / "by_two"))
    assert again.train_step(b3, LOSS)["loss"] == pytest.approx(m3["loss"], rel=1e-4)
    assert max_diff(snapshot(again), after3) < TOL


def test_a_failed_checkpoint_write_leaves_the_group_working(group, reference, tmp_path):
    """Rank 0 writes after the gathers, so a write that fails (a full disk; here a folder under a file) raises
    the writer's own error and no rank waits: the group goes on training and saving."""
    g = group("fsdp2")
    (tmp_path / "a_file").write_text("")
    with pytest.raises(OSError):
        g.save_checkpoint(str(tmp_path / "a_file" / "ckpt"))
    assert len(g.workers) == 2 and g.pg is None
    g.train_step(reference["batch"], LOSS)
    g.save_checkpoint(str(tmp_path / "ckpt"))
    assert (tmp_path / "ckpt" / "optimizer.pt").is_file()


class DieOnRank1:
    """A loss that kills worker rank 1's process in the middle of a step."""

    def __call__(self, logp, mb, ref_logp):
        import torch.distributed as dist

        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return LOSS(logp, mb, ref_logp)


def test_dead_worker_is_named_and_the_checkpoint_survives(group, toy, reference, tmp_path):
    g = group("ddp across nodes")
    g.save_checkpoint(str(tmp_path / "ckpt"))
    rank1, ids = g.nodes[1], [w._actor_id.hex() for w in g.workers]
    with pytest.raises(PolicyWorkerDied, match=rf"rank 1 \(node {rank1['ip']}, id \w+, pid {rank1['pid']}\) died") as e:
        g.train_step(reference["batch"], DieOnRank1())
    assert "OOM killer" in str(e.value) and "dmesg" in str(e.value) and "SYSTEM_ERROR" not in str(e.value)
    # the survivor, maybe waiting in a collective for its dead peer, was stopped too
    assert g.workers == [] and g.pg is None
    assert wait_until(lambda: all(actor_states("PolicyWorker").get(i) == "DEAD" for i in ids)), actor_states(
        "PolicyWorker"
    )
    # the checkpoint written before the failure is whole: one worker resumes from it
    w = started(toy.policy)
    w.load_checkpoint(str(tmp_path / "ckpt"))
    assert set(snapshot(w)) == set(reference["before"])


# ---- bf16-mixed: two workers take one worker's step, to bf16 rounding ----------------------------------
MIXED = {
    # autocast, fp32 gradients all-reduced
    "ddp bf16-mixed": dict(num_workers=2, strategy="ddp", precision="bf16-mixed"),
    # MixedPrecisionPolicy: bf16 compute, fp32 reduce-scatter
    "fsdp2 bf16-mixed": dict(num_workers=2, strategy="fsdp2", precision="bf16-mixed"),
}


@pytest.fixture(scope="module")
def one_worker_steps(toy, reference, tmp_path_factory) -> dict[str, dict]:
    """From the reference's initial checkpoint, one worker's step on its batch in fp32 and in bf16-mixed
    (this process)."""
    out = {}
    for precision in ("fp32", "bf16-mixed"):
        w = started(toy.policy, precision=precision)
        w.load_checkpoint(reference["initial"])
        metrics = w.train_step(reference["batch"], LOSS)
        path = tmp_path_factory.mktemp(precision) / "ckpt"
        w.save_checkpoint(str(path))
        out[precision] = {"metrics": metrics, **adam_step_from_checkpoint(path)}
    return out


@pytest.mark.parametrize("name", list(MIXED))
def test_bf16_mixed_two_workers_take_one_workers_step(group, reference, one_worker_steps, tmp_path, name):
    """The tolerance is the error one worker's bf16 step itself makes against the fp32 step, eps1 for the
    gradient (measured 1.5 x 2^-8) and d1 for the master weights. Two workers must compute in bf16 too
    and be as accurate within a factor 2 (FSDP2's bf16 compute is not autocast's: measured 1.35 eps1;
    DDP's is: 1.0 eps1), so by the triangle inequality they take one worker's step within 3 eps1 and
    3 d1 (measured 1.7 eps1 and 1.2 d1 for FSDP2, 0.3 eps1 and 0.3 d1 for DDP). The grad norm tells a
    sum from an average; each run's fp32 master weights are AdamW's step of its own gradient."""
    import ray

    g = group(name)
    g.load_checkpoint(reference["initial"])
    metrics = g.train_step(reference["batch"], LOSS)
    g.save_checkpoint(str(tmp_path / "two"))
    refit = ray.get(g.state_dict_for_refit())
    two = adam_step_from_checkpoint(tmp_path / "two")
    fp32, one = one_worker_steps["fp32"], one_worker_steps["bf16-mixed"]
    g32, g1, g2 = gradient(fp32), gradient(one), gradient(two)
    eps1, eps2 = float((g1 - g32).norm() / g32.norm()), float((g2 - g32).norm() / g32.norm())
    # one worker computed in bf16 (in fp32, with the bf16 reference, it is 4e-4)
    assert BF16_UNIT / 4 < eps1 < 8 * BF16_UNIT, eps1
    assert BF16_UNIT / 4 < eps2 <= 2 * eps1, (eps1, eps2)  # two workers too, as accurately
    assert (g2 - g1).norm() <= 3 * eps1 * g32.norm(), (eps1, float((g2 - g1).norm() / g32.norm()))
    assert metrics["grad_norm"] == pytest.approx(one["metrics"]["grad_norm"], rel=2 * eps1)  # summed, not averaged
    before = adam_step_from_checkpoint(reference["initial"])["params"]
    assert_adam_first_step(before, two, lr=1e-4)  # fp32 master weights and moments, stepped in fp32

    def dist(a, b) -> float:
        return (
            sum(float((a["params"][n].double() - b["params"][n].double()).norm() ** 2) for n in fp32["exp_avg"]) ** 0.5
        )

    d1 = dist(one, fp32)
    assert dist(two, fp32) <= 2 * d1 and dist(two, one) <= 3 * d1, (d1, dist(two, fp32), dist(two, one))
    assert {t.dtype for t in refit.values()} == {torch.bfloat16}  # the engines' dtype
    assert all(torch.equal(refit[n], two["params"][n].to(torch.bfloat16)) for n in fp32["exp_avg"])


# ---- a whole GRPO run -------------------------------------------------------------------------
SMALL = [
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations_per_prompt=4",
    "grpo.max_steps=2",
    "grpo.val_every=0",
    "grpo.self_check_prompts=0",
    "policy.generation.max_new_tokens=28",
    "policy.generation.vllm_kwargs.speculative_config=null",  # plain sampling with per-request seeds: bit-reproducible
    "policy.generation.vllm_kwargs.enforce_eager=true",
    "policy.precision=fp32",  # 1 and 2 workers agree to fp32 rounding (bf16-mixed: test_bf16_mixed_* above)
    "logger.progress_bar=false",
    "logger.wandb.enabled=false",
    "checkpoint.enabled=false",
]


def test_grpo_with_two_workers_matches_one(cluster, tmp_path):
    from rl_specdec.grpo.loop import train

    rows = {}
    for n in (1, 2):
        cfg = load_config(
            ROOT / "configs/grpo_spec.yaml", SMALL + [f"logger.log_dir={tmp_path / str(n)}", f"policy.num_workers={n}"]
        )
        train(cfg, progress=False)
        rows[n] = [json.loads(line) for line in (tmp_path / str(n) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows[2]] == [r["step"] for r in rows[1]] == [1, 2]
    for a, b in zip(rows[1], rows[2]):
        # on-policy (fp32, ~1e-7): the refit reached the engine
        assert max(a["train/logprob_mismatch"], b["train/logprob_mismatch"]) < 1e-4
        assert b["generation/num_tokens"] == a["generation/num_tokens"]  # same rollouts: the refit weights agree
        assert b["train/reward_mean"] == a["train/reward_mean"]
        for k in ("train/loss", "train/kl", "train/entropy", "train/grad_norm", "train/logprob_mismatch"):
            assert b[k] == pytest.approx(a[k], rel=1e-3, abs=1e-6), (a["step"], k)
