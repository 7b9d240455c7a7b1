"""The GRPO update checked against closed-form maths on tiny policies (pure torch, no engines).

The policy here is a *unigram* model: the same logits ``theta`` [V] at every
position, whatever the context, so a response's log-prob is a sum of
``log softmax(theta)`` entries and the gradient of the package's loss is known
in closed form. Batches go through the package's own path:
``group_advantages`` -> ``select_for_training`` -> ``build_train_batch`` ->
``PolicyWorker.train_step`` (micro-batching, gradient accumulation) ->
``ClippedPGLoss``.

On-policy (ratio 1), with N response tokens in the batch, the loss is
``-(1/N) sum_i A_i sum_t log pi(y_it)`` and its gradient is::

    dL/dtheta = -(1/N) sum_i A_i sum_t (onehot(y_it) - pi)                    (1)

For one-token responses and mean-centred advantages ``A_i = r_i - mean_j r_j``
over a group of G independent samples, ``E[A_i (e_{y_i} - pi)] = (G-1)/G *
E[r(y) (e_y - pi)]`` (the other samples' rewards are independent of y_i and
``E[e_y - pi] = 0``), and ``E[r(y) (e_y - pi)] = r*pi - (r.pi) pi = grad J``
with ``J = sum_k pi_k r_k`` the expected reward. So the expectation of (1) is
``-(G-1)/G * grad J``: the update ascends the expected reward.
"""

import itertools
from types import SimpleNamespace

import pytest
import torch

from rl_specdec.config import PolicyConfig
from rl_specdec.grpo import ClippedPGLoss, group_advantages
from rl_specdec.grpo.batch import Trajectory, build_train_batch, select_for_training
from rl_specdec.policy import PolicyWorker

PROMPT = [3]  # any token: the unigram policy ignores its context
NO_CLIP = 1e9  # max_grad_norm that never clips


def _config(micro_batch_size: int = 64, max_grad_norm: float = NO_CLIP) -> PolicyConfig:
    return PolicyConfig(device="cpu", precision="fp32", micro_batch_size=micro_batch_size, max_grad_norm=max_grad_norm)


class Unigram(torch.nn.Module):
    """logits [N, T, V] = theta at every position."""

    def __init__(self, theta: torch.Tensor):
        super().__init__()
        self.theta = torch.nn.Parameter(theta.clone().float())

    def forward(self, input_ids, attention_mask=None):
        n, t = input_ids.shape
        return SimpleNamespace(logits=self.theta.expand(n, t, -1))


def _worker(theta, lr=1.0, micro_batch_size=64, optimizer=torch.optim.SGD) -> PolicyWorker:
    model = Unigram(theta)
    return PolicyWorker.from_module(_config(micro_batch_size), model, optimizer(model.parameters(), lr=lr))


def _batch(theta, responses, advantages, gen_shift=None):
    """On-policy batch: generation log-probs are the policy's own (``gen_shift`` [N] moves them off-policy)."""
    logp = torch.log_softmax(theta.float(), -1)  # [V]
    trajs = []
    for i, r in enumerate(responses):
        lps = [float(logp[y]) + (0.0 if gen_shift is None else float(gen_shift[i])) for y in r]
        trajs.append(Trajectory.single_turn(PROMPT, list(r), lps))
    return build_train_batch(trajs, advantages, pad_id=0)


def _grad(theta, responses, advantages, micro_batch_size=64, gen_shift=None) -> torch.Tensor:
    w = _worker(theta, lr=0.0, micro_batch_size=micro_batch_size)
    w.train_step(_batch(theta, responses, advantages, gen_shift), ClippedPGLoss(0.2))
    return w.model.theta.grad.detach().clone()  # [V]


def _closed_form_grad(theta, responses, advantages) -> torch.Tensor:
    """Equation (1)."""
    pi = torch.softmax(theta.float(), -1)  # [V]
    n = sum(len(r) for r in responses)
    g = torch.zeros_like(pi)
    for a, r in zip(advantages.tolist(), responses):
        for y in r:
            g -= a * (torch.nn.functional.one_hot(torch.tensor(y), len(pi)).float() - pi) / n
    return g


RESPONSES = [[0], [2, 1], [4, 4, 1], [2], [1, 3], [0, 0, 0, 1]]  # one group of 6, lengths 1-4
REWARDS = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 0.0])
THETA = torch.tensor([0.3, -0.2, 0.5, 0.0, -0.4])


def test_update_matches_the_closed_form_gradient_and_step():
    adv = group_advantages(REWARDS, group_size=6)  # std-normalised, as in the loop
    expected = _closed_form_grad(THETA, RESPONSES, adv)
    assert expected.abs().max() > 1e-2  # a gradient worth comparing
    assert torch.allclose(_grad(THETA, RESPONSES, adv), expected, atol=1e-6)
    # one SGD step lands exactly where the maths puts it
    w = _worker(THETA, lr=0.5)
    w.train_step(_batch(THETA, RESPONSES, adv), ClippedPGLoss(0.2))
    assert torch.allclose(w.model.theta.detach(), THETA - 0.5 * expected, atol=1e-6)


def test_probability_of_the_rewarded_completion_rises_at_the_predicted_rate():
    """Bandit, one-token responses: d pi_r / d lr at lr=0 is -grad(pi_r) . g, with g from (1)."""
    responses = [[0], [1], [2], [3], [0], [1]]  # token 2 is the rewarded arm
    adv = group_advantages(torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0, 0.0]), group_size=6)
    g = _closed_form_grad(THETA, responses, adv)
    pi = torch.softmax(THETA, -1)
    rate = -(pi[2] * (torch.nn.functional.one_hot(torch.tensor(2), 5) - pi) * g).sum()  # d pi_2 / d lr
    lr = 1e-3
    w = _worker(THETA, lr=lr)
    w.train_step(_batch(THETA, responses, adv), ClippedPGLoss(0.2))
    moved = torch.softmax(w.model.theta.detach(), -1)[2] - pi[2]
    assert moved.item() > 0  # the package's step raises the rewarded arm
    assert moved.item() == pytest.approx(lr * rate.item(), rel=1e-2)  # at the rate the maths predicts


def test_expected_update_is_the_policy_gradient_of_the_expected_reward():
    """Enumerate every group of G=3 one-token samples from V=3 arms: E[grad] = -(G-1)/G * grad J."""
    theta, r, G = torch.tensor([0.2, -0.5, 0.1]), torch.tensor([0.0, 1.0, 0.5]), 3
    pi = torch.softmax(theta, -1)
    expected_grad = torch.zeros(3)
    for ys in itertools.product(range(3), repeat=G):
        prob = torch.prod(pi[list(ys)])
        adv = group_advantages(r[list(ys)], G, normalize_std=False)  # mean-centred
        expected_grad += prob * _grad(theta, [[y] for y in ys], adv)
    grad_j = (r * pi) - (r * pi).sum() * pi  # d/dtheta sum_k pi_k r_k
    assert grad_j.abs().max() > 1e-2  # not a flat spot: the identity has something to match
    assert torch.allclose(expected_grad, -(G - 1) / G * grad_j, atol=1e-6)


def _bandit(rewarded_arm: int, shuffle_rewards: bool, steps: int = 60, seed: int = 0) -> torch.Tensor:
    """The loop's chain on a 4-armed bandit (P=4 prompts x G=8 samples a step); returns the final policy [4].

    ``shuffle_rewards`` permutes the rewards across the step's samples before the
    advantages: the same reward statistics, but no longer tied to the arm drawn.
    """
    gen = torch.Generator().manual_seed(seed)
    w = _worker(torch.zeros(4), lr=0.05, optimizer=torch.optim.Adam)
    for _ in range(steps):
        theta = w.model.theta.detach().clone()
        ys = torch.multinomial(
            torch.softmax(theta, -1).expand(4, -1), 8, replacement=True, generator=gen
        ).flatten()  # [P*G]
        rewards = (ys == rewarded_arm).float()  # [P*G]
        if shuffle_rewards:
            rewards = rewards[torch.randperm(rewards.numel(), generator=gen)]
        adv = group_advantages(rewards, 8)
        keep = select_for_training(adv, skip_zero=True)
        w.train_step(_batch(theta, [[int(ys[i])] for i in keep], adv[keep]), ClippedPGLoss(0.2))
    return torch.softmax(w.model.theta.detach(), -1)


def test_grpo_finds_the_rewarded_arm_and_not_without_credit():
    """Sampled: the rewarded arm takes over; with rewards detached from the actions (control) it does not."""
    assert _bandit(2, shuffle_rewards=False)[2] > 0.95
    assert _bandit(1, shuffle_rewards=False)[1] > 0.95  # not an artefact of one arm or one sample path
    control = _bandit(2, shuffle_rewards=True)
    assert control.max() < 0.8  # same steps, same reward rate: no credit, no arm takes over (seeds 0-29: at most 0.62)


def test_advantage_signs_reach_the_loss():
    """Flipped rewards flip the advantages and the update; zero advantages give zero gradient, on and off policy."""
    adv = group_advantages(REWARDS, 6)
    assert torch.allclose(group_advantages(1 - REWARDS, 6), -adv)
    shift = torch.tensor([0.05, -0.08, 0.02, 0.0, -0.03, 0.09])  # ratios inside the clip range
    for gen_shift in (None, shift):
        g = _grad(THETA, RESPONSES, adv, gen_shift=gen_shift)
        assert g.abs().max() > 1e-3
        assert torch.allclose(_grad(THETA, RESPONSES, -adv, gen_shift=gen_shift), -g, atol=1e-7)
        assert torch.equal(_grad(THETA, RESPONSES, torch.zeros(6), gen_shift=gen_shift), torch.zeros(5))
    # off-policy the ratio weights each sample's gradient: it is not the on-policy one
    assert not torch.allclose(_grad(THETA, RESPONSES, adv, gen_shift=shift), _grad(THETA, RESPONSES, adv), atol=1e-4)


def test_advantage_signs_reach_a_real_transformer():
    """The same on a tiny random Qwen2: the full model's gradient flips with the advantages, and is 0 at A=0."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=16,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        pad_token_id=0,
    )
    model = Qwen2ForCausalLM(cfg).float()
    w = PolicyWorker.from_module(_config(micro_batch_size=3), model, torch.optim.SGD(model.parameters(), lr=0.0))
    prompts, responses = [[5, 6, 7], [8, 9], [5, 6, 7], [8, 9]], [[1, 2], [3, 4, 1], [2, 2, 2], [1]]
    trajs = [Trajectory.single_turn(p, r, [-1.0] * len(r)) for p, r in zip(prompts, responses)]

    def grads(adv):
        batch = build_train_batch(trajs, adv, pad_id=0)
        batch["gen_logprobs"] = w.get_logprobs(batch)  # on-policy generation log-probs, from the model itself
        m = w.train_step(batch, ClippedPGLoss(0.2))
        assert m["logprob_mismatch"] < 1e-5  # on policy: ratio 1, inside the clip range
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    g = grads(adv)
    assert g.abs().max() > 1e-4
    assert torch.allclose(grads(-adv), -g, atol=1e-6)
    assert torch.count_nonzero(grads(torch.zeros(4))) == 0


@pytest.mark.parametrize("micro_batch_size", [1, 2, 4])
def test_micro_batching_does_not_change_the_gradient(micro_batch_size):
    """Responses of different lengths: a per-micro-batch token mean would weight them differently."""
    adv = group_advantages(REWARDS, 6)
    whole = _grad(THETA, RESPONSES, adv, micro_batch_size=64)
    assert torch.allclose(whole, _closed_form_grad(THETA, RESPONSES, adv), atol=1e-6)
    assert torch.allclose(_grad(THETA, RESPONSES, adv, micro_batch_size=micro_batch_size), whole, atol=1e-6)
