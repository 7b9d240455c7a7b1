"""The toys' training loop: supervised fine-tuning, or distillation from a teacher, on padded batches.

A batch may be computed in groups of rows of like length (``length_groups``): the rows sorted by length, each
group cut to its own longest row. Padding is on the right and never attended to, so the gradient is the whole
batch's (each group's loss is divided by the whole batch's count of loss positions) on fewer padded positions.
The long-tail toy's whole batches pad most rows to a rare long one: two thirds of the positions its build computed
in one group were padding, and in four groups it computes 46% of them.
"""

from __future__ import annotations

import random


def pad_batch(seqs: list[list[int]], masks: list[list[int]], pad_id: int):
    """Token ids [B, T] and loss masks [B, T], right-padded with ``pad_id`` / 0."""
    import torch

    t = max(map(len, seqs))
    ids = torch.full((len(seqs), t), pad_id)
    mask = torch.zeros((len(seqs), t))
    for i, (s, m) in enumerate(zip(seqs, masks)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float)
    return ids, mask


def length_groups(ids, mask, pad_id: int, groups: int) -> list[tuple]:
    """``groups`` (ids [b, t], mask [b, t]) slices of a right-padded batch, its rows sorted by length and each
    slice cut to its longest row; the batch itself where ``groups`` is 1."""
    import torch

    if groups <= 1:
        return [(ids, mask)]
    lengths = ((ids != pad_id) | (mask > 0)).sum(1)  # [B]
    out = []
    for rows in torch.argsort(lengths).tensor_split(groups):
        if len(rows):
            t = int(lengths[rows].max())
            out.append((ids[rows, :t], mask[rows, :t]))
    return out


def _masked_sum(model, ids, mask, pad_id: int, teacher):
    """The sum over loss positions of the next-token NLL (SFT), or of KL(teacher || model) (distillation)."""
    import torch
    import torch.nn.functional as F

    attn = ((ids != pad_id) | (mask > 0)).long()
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]  # [b, t-1, V]
    m = mask[:, 1:]  # predict token t+1 from the prefix up to t
    if teacher is None:
        nll = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")  # [b, t-1]
        return (nll * m).sum()
    with torch.no_grad():
        t_logp = F.log_softmax(teacher(input_ids=ids, attention_mask=attn).logits[:, :-1], -1)
    s_logp = F.log_softmax(logits, -1)
    kl = (t_logp.exp() * (t_logp - s_logp)).sum(-1)  # [b, t-1]  KL(teacher || student)
    return (kl * m).sum()


def train_lm(model, batches, pad_id: int, lr: float, steps: int, seed: int, teacher=None, log=print, groups=1):
    """SFT (teacher=None) or distillation from ``teacher``; ``batches(rng)`` gives (ids [B, T], loss mask [B, T]),
    each computed in ``groups`` groups of like length (:func:`length_groups`)."""
    import torch

    if steps == 0:  # an untrained model (random weights)
        return model.eval()
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    model.train()
    for step in range(steps):
        ids, mask = batches(rng)  # [B, T], [B, T]
        positions = mask[:, 1:].sum()
        opt.zero_grad(set_to_none=True)
        loss = 0.0
        for ids_g, mask_g in length_groups(ids, mask, pad_id, groups):
            part = _masked_sum(model, ids_g, mask_g, pad_id, teacher) / positions
            part.backward()
            loss += part.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 20 == 0 or step == steps - 1:
            log(f"  step {step + 1}/{steps} loss {loss:.4f}")
    model.eval()
    return model
