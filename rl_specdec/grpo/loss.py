"""The clipped policy-gradient loss of GRPO, with an optional KL penalty.

Per response token t of sample i, with the importance ratio taken against the
log-probs the generation engine reported when it sampled the token::

    ratio_t   = exp(logp_t - logp_gen_t)
    pg_t      = -min(ratio_t * A_i, clip(ratio_t, 1 - eps, 1 + eps) * A_i)
    kl_t      = exp(ref_t - logp_t) - (ref_t - logp_t) - 1        (k3 estimator, >= 0)
    loss      = sum_t mask_t * (pg_t + beta * kl_t) / sum_t mask_t  (token mean over the batch)

Because each GRPO step takes one optimizer step on fresh rollouts, ratio_t is 1
up to the numerical gap between the engine and the trainer; the mean of
|logp_t - logp_gen_t| measures that gap (``logprob_mismatch``). Speculative
decoding is lossless only if it leaves that gap as small as it is without it.
Rollouts one step old (``grpo.max_staleness=1``) make ratio_t the importance
weight of the policy against the behaviour policy that sampled them.

With ``behaviour_is_cap`` c, that weight is truncated at c (truncated importance
sampling)::

    w_t  = min(ratio_t, c) / ratio_t        (detached: it scales, never steers)
    pg_t = -w_t * min(ratio_t * A_i, clip(ratio_t, 1 - eps, 1 + eps) * A_i)

so a token the clip keeps gets the gradient -A_i * min(ratio_t, c) * grad logp_t
instead of -A_i * ratio_t * grad logp_t; the clip still decides which tokens
get one (docs/grpo.md, "The importance weight's cap").

The function is handed to the policy worker; micro-batch values are divided by
the *whole* batch's token count (``batch_num_tokens``) so that their sum over
micro-batches is the full-batch loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ClippedPGLoss:
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    behaviour_is_cap: float | None = None  # truncate the importance weight against the generation log-probs

    def __call__(self, logp: torch.Tensor, mb: dict[str, torch.Tensor], ref_logp: torch.Tensor | None):
        mask = mb["loss_mask"]  # [n, T-1]
        denom = mb["batch_num_tokens"][0]  # scalar: response tokens in the whole batch
        adv = mb["advantages"].unsqueeze(1)  # [n, 1]
        delta = (logp - mb["gen_logprobs"]) * mask  # [n, T-1]
        ratio = torch.exp(delta)  # [n, T-1]
        pg = -torch.min(ratio * adv, torch.clamp(ratio, 1 - self.clip_eps, 1 + self.clip_eps) * adv)  # [n, T-1]
        metrics: dict[str, torch.Tensor] = {}
        if self.behaviour_is_cap is not None:
            r = ratio.detach()
            pg = pg * (torch.clamp(r, max=self.behaviour_is_cap) / r)  # [n, T-1]  truncated IS weight
            metrics["is_capped_fraction"] = ((r > self.behaviour_is_cap).float() * mask).sum() / denom
        per_token = pg
        if ref_logp is not None:  # KL to the reference is logged whenever a reference is kept
            d = (ref_logp - logp) * mask
            kl = torch.exp(d) - d - 1  # [n, T-1]
            if self.kl_coef > 0:
                per_token = per_token + self.kl_coef * kl
            metrics["kl"] = (kl * mask).sum().detach() / denom
        loss = (per_token * mask).sum() / denom
        with torch.no_grad():
            d = delta.detach()
            metrics["loss"] = loss.detach()
            metrics["pg_loss"] = (pg * mask).sum().detach() / denom
            metrics["logprob_mismatch"] = (d.abs() * mask).sum() / denom  # mean |logp_train - logp_gen|
            metrics["logprob_mismatch_max"] = (d.abs() * mask).max()
            metrics["ratio_error"] = ((torch.exp(d) - 1).abs() * mask).sum() / denom  # mean |p_train/p_gen - 1|
            clipped = ((ratio - 1).abs() > self.clip_eps).float()
            metrics["clip_fraction"] = (clipped * mask).sum() / denom
        return loss, metrics
