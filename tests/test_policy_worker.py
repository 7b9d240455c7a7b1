"""The torch policy worker in-process on the toy policy: micro-batching must not change results."""

import math

import torch

from rl_specdec.config import PolicyConfig
from rl_specdec.grpo import ClippedPGLoss
from rl_specdec.grpo.batch import Trajectory, build_train_batch
from rl_specdec.policy import PolicyWorker, token_logprobs_and_entropy
from rl_specdec.toy.build import build_tokenizer, build_toy_models


def _batch():
    tok = build_tokenizer()
    g = torch.Generator().manual_seed(0)
    prompts, responses = [], []
    for n in (3, 9, 5, 14, 7, 4):
        digits = torch.randint(0, 10, (n,), generator=g).tolist()
        prompts.append(tok.encode("".join(map(str, digits)) + "="))
        responses.append(tok.encode("".join(map(str, sorted(digits)))[: n // 2 + 1]) + [tok.eos_token_id])
    trajs = [Trajectory.single_turn(p, r, [-1.0] * len(r)) for p, r in zip(prompts, responses)]
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    return build_train_batch(trajs, adv, tok.pad_token_id)


def started(path, **kw) -> PolicyWorker:
    """One worker in this process, as the single-worker group runs it (CPU, float32)."""
    w = PolicyWorker(PolicyConfig(model_name=str(path), device="cpu", precision="fp32", **kw), seed=0)
    w.start()
    return w


def test_micro_batching_matches_one_full_batch():
    path = str(build_toy_models().policy)
    batch = _batch()
    whole = started(path, micro_batch_size=100)
    micro = started(path, micro_batch_size=2)

    # log-probs: same values, same (input) order, zeros outside each row's length
    lp_whole, lp_micro = whole.get_logprobs(batch), micro.get_logprobs(batch)
    assert lp_whole.shape == batch["loss_mask"].shape
    assert torch.allclose(lp_whole, lp_micro, atol=1e-5)
    ref, _ = token_logprobs_and_entropy(whole.model.eval(), batch["input_ids"], batch["attention_mask"])
    m = batch["loss_mask"] > 0
    assert torch.allclose(lp_whole[m], ref.detach()[m], atol=1e-5)

    # one optimizer step with accumulation over 3 micro-batches == one step on the whole batch
    loss_fn = ClippedPGLoss(0.2)
    a, b = whole.train_step(batch, loss_fn), micro.train_step(batch, loss_fn)
    for k in ("loss", "pg_loss", "entropy", "grad_norm", "logprob_mismatch", "ratio_error"):
        assert abs(a[k] - b[k]) < 1e-4 * max(1.0, abs(a[k])), k
    # The gradients agree up to fp32 rounding: the micro-batches sum the same terms in another order.
    ga, gb = dict(whole.model.named_parameters()), dict(micro.model.named_parameters())
    for name in ga:
        assert (ga[name].grad - gb[name].grad).abs().max() <= grad_tolerance(ga[name].grad, len(batch["input_ids"])), (
            name
        )
    # So do the parameters, within what one Adam step makes of that rounding (adam_step_tolerance).
    sa, sb, s0 = whole.state_dict_for_refit(), micro.state_dict_for_refit(), started(path).state_dict_for_refit()
    lr, eps = whole.config.learning_rate, whole.opt.defaults["eps"]
    for name, p in ga.items():
        bound = adam_step_tolerance(
            ga[name].grad, gb[name].grad, grad_tolerance(ga[name].grad, len(batch["input_ids"])), lr, eps
        )
        rounding = 4 * FP32_EPS * (s0[name].abs() + lr)  # the step's own fp32 arithmetic, in either run
        assert ((sa[name] - sb[name]).abs() <= bound + rounding).all(), name
    assert any((sa[k] - s0[k]).abs().max() > 0 for k in sa)  # it trained


FP32_EPS = torch.finfo(torch.float32).eps


def grad_tolerance(g: torch.Tensor, rows: int) -> float:
    """How far two fp32 sums of the same per-token terms in different orders may drift: a few ulps of the
    largest gradient entry per row of the batch (each micro-batch adds one partial sum per row)."""
    return 4 * rows * FP32_EPS * g.abs().max().item()


def adam_step_tolerance(g_a: torch.Tensor, g_b: torch.Tensor, grad_tol: float, lr: float, eps: float) -> torch.Tensor:
    """Per element, how far the first Adam steps of two gradients ``grad_tol`` apart may land.

    With bias correction, step one moves a parameter by ``-lr * g / (|g| + eps)``; its slope in ``g`` is
    ``eps / (|g| + eps)**2``, so near ``g = 0`` a rounding difference is magnified up to ``lr / eps``, and two
    steps can never be more than ``2 lr`` apart.
    """
    g = torch.minimum(g_a.abs(), g_b.abs())
    return lr * torch.clamp(grad_tol * eps / (g + eps) ** 2, max=2.0)


def test_shard_batch_balances_pads_and_covers_every_row():
    from rl_specdec.policy.distributed import shard_batch

    batch = _batch()  # 6 rows of lengths 6..23
    assert shard_batch(batch, 1)[0][1] is batch  # one worker: the batch as it is
    shards = shard_batch(batch, 4)  # 6 rows -> 8: two padding rows
    assert [s["input_ids"].shape[0] for _, s in shards] == [2, 2, 2, 2]
    idx = torch.cat([i for i, _ in shards])
    assert sorted(idx[idx >= 0].tolist()) == list(range(6)) and (idx < 0).sum() == 2
    for i, s in shards:
        real = i >= 0
        assert torch.equal(s["input_ids"][real], batch["input_ids"][i[real]])
        assert torch.equal(s["loss_mask"][real], batch["loss_mask"][i[real]])
        assert s["loss_mask"][~real].sum() == 0  # padding rows carry no loss
        assert torch.equal(s["batch_num_tokens"], batch["batch_num_tokens"][: len(i)])  # the GLOBAL token count
    tokens = [int(s["attention_mask"].sum()) for _, s in shards]
    assert max(tokens) - min(tokens) <= max(batch["attention_mask"].sum(1)).item()  # dealt by length: balanced


def test_padding_rows_add_nothing_to_the_loss():
    from rl_specdec.policy.distributed import shard_batch

    batch, loss_fn = _batch(), ClippedPGLoss(0.2)
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(batch["loss_mask"].shape, generator=g)  # [N, T-1]: any log-probs
    full = loss_fn(lp, batch, None)[0]
    shards = shard_batch(batch, 4)  # two padding rows, copies of a real row
    parts = sum(loss_fn(lp[i.clamp(min=0)], s, None)[0] for i, s in shards)
    assert torch.allclose(full, parts, atol=1e-6)


def test_buckets_are_bounded_and_in_order():
    from rl_specdec.policy.state import bucketed

    tied = torch.zeros(10)
    items = [
        (["a", "a2"], tied),
        (["b"], torch.zeros(30)),
        (["c"], torch.zeros(5)),
        (["d"], torch.zeros(100)),
        (["e"], None),
        (["f"], torch.zeros(1)),
    ]
    out = list(bucketed(items, max_bytes=160))  # float32: 40 (once), 120, 20, 400, -, 4 bytes
    # d alone: larger than a bucket; e: another rank's
    assert [list(b) for b in out] == [
        ["a", "a2", "b"],
        ["c"],
        ["d"],
        ["f"],
    ]
    assert out[0]["a"] is out[0]["a2"] is tied  # a tied tensor: both names, one tensor (serialised once)


def test_refit_names_every_tensor_and_ties_stay_tied():
    """The engines get every name of the model's state dict: vLLM's reload does not re-tie an LM head it is not sent."""
    w = started(build_toy_models().policy)
    sd = w.state_dict_for_refit()
    assert set(sd) == set(w.model.state_dict()) and "lm_head.weight" in sd  # the toy ties its head to the embedding
    assert sd["lm_head.weight"] is sd["model.embed_tokens.weight"]


def test_threads_share_a_host_and_local_ranks_count_per_host():
    from rl_specdec.policy.group import threads_and_local_ranks, worker_bundle

    nodes = [{"ip": "10.0.0.1", "host": "a", "host_cpus": 8}] * 3 + [{"ip": "10.0.0.2", "host": "b", "host_cpus": 4}]
    assert threads_and_local_ranks(nodes, None) == [(2, 0), (2, 1), (2, 2), (4, 0)]
    assert threads_and_local_ranks(nodes, 3) == [(3, 0), (3, 1), (3, 2), (3, 0)]
    assert threads_and_local_ranks(nodes[:1], None) == [(8, 0)]  # one worker: every core, as before
    cpu = PolicyConfig(device="cpu")
    assert worker_bundle(cpu) == {}  # the default reserves nothing: no placement group
    assert worker_bundle(PolicyConfig(device="cuda", cpus_per_worker=2)) == {"GPU": 1.0, "CPU": 2.0}
    assert worker_bundle(PolicyConfig(device="cuda", gpus_per_worker=0)) == {}


def test_worker_refuses_an_unresolved_config():
    import pytest

    with pytest.raises(ValueError, match="resolved once"):
        PolicyWorker(PolicyConfig(model_name="x"))


def padded_tokens(lengths: list[int], bounds: list[int]) -> int:
    return sum((b - a) * lengths[a] for a, b in zip(bounds[:-1], bounds[1:]))


def test_balanced_split_finds_the_least_padding_within_the_budget():
    """Against every way to cut a few sorted rows: the fewest padded tokens, the count asked for, no
    micro-batch over the budget; and on a long-tailed batch, far less padding than even slices."""
    import itertools
    import random

    from rl_specdec.policy.worker import balanced_split

    rng = random.Random(0)
    for _ in range(30):
        n, parts = rng.randint(2, 9), rng.randint(1, 4)
        lengths = sorted((rng.randint(1, 50) for _ in range(n)), reverse=True)
        size = math.ceil(n / parts)
        budget = size * lengths[0]
        bounds = balanced_split(lengths, parts, budget)
        assert bounds[0] == 0 and bounds[-1] == n and len(bounds) == min(parts, n) + 1
        assert all(b > a and (b - a) * lengths[a] <= budget for a, b in zip(bounds[:-1], bounds[1:]))
        cuts = (
            [0, *c, n]
            for c in itertools.combinations(range(1, n), min(parts, n) - 1)
            if all((b - a) * lengths[a] <= budget for a, b in zip([0, *c], [*c, n]))
        )
        assert padded_tokens(lengths, bounds) == min(padded_tokens(lengths, c) for c in cuts)
    tail = [400] + [20] * 31  # one long rollout among short ones, 4 micro-batches of 8
    even = [0, 8, 16, 24, 32]
    assert padded_tokens(tail, balanced_split(tail, 4, 8 * 400)) == 400 + 31 * 20 < padded_tokens(tail, even) / 3
