"""EAGLE-3 heads built here with no download: the embedded targets' (``toy:eagle3``, ``toy:wide-eagle3``) and a
packaged chat model's (``pkg:*-eagle3``, from the model's own answers to its task's prompts).

``toy:eagle3-untrained`` is the digit toy's head with random weights (no training steps): a cold start.

A head is trained briefly at build time on its target's own outputs: the
target's aux hidden states and next-token distributions on the pair's SFT
data, computed once into a pool of batches (the wide target's forward is the
dear part), then :func:`rl_specdec.heads.eagle3.head_loss` over three chain
steps. The head is cached beside its pair (``<pair>/eagle3``), written
atomically as the pairs are; its folder holds ``config.json`` and
``model.safetensors`` in the format vLLM's Llama EAGLE-3 head reads.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rl_specdec.toy import build
from rl_specdec.toy.build import ToyModels

HEAD_BUILD_VERSION = 1


@dataclass(frozen=True)
class HeadBuildConfig:
    pool: int = 16  # batches of target features computed once
    steps: int = 160  # head training steps over the pool
    chain_steps: int = 3  # training-time-test depth: the k the head is trained for
    lr: float = 3e-3
    seed: int = 0
    intermediate_size: int = 768  # the head's MLP (one of the narrow targets' layers)
    pool_dtype: str = "float32"  # the pooled target log-probs ("bfloat16" halves a wide vocabulary's)
    # 0: draft over the target's vocabulary through its LM head; n: the head's own LM head over the n tokens
    # the target answers with most often in the pool (rl_specdec.heads.eagle3.HeadShape.draft_vocab_size)
    draft_vocab: int = 0


NEW_FIELDS = {"pool_dtype": "float32", "draft_vocab": 0}  # left out of the cache key at these values (older heads)


# the digit toy's head learns its short answers in fewer steps (top-1 agreement ~0.9 after 100)
DEFAULT_BUILDS = {"toy": HeadBuildConfig(steps=100)}


def target_features(target, ids, aux_ids):
    """The target's aux states [B, T, n*H] and next-token log-probs [B, T, V] (detached) on ids [B, T], right-padded
    (causal attention: no real position sees a pad)."""
    import torch

    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i] for i in sorted(aux_ids)], -1)
        return aux, torch.log_softmax(out.logits.float(), -1)


def train_head(target, batches, cfg: HeadBuildConfig, log=print):
    """A head for ``target`` (a transformers causal LM) trained on ``batches(rng)`` -> (ids [B, T], mask [B, T])."""
    import torch

    from rl_specdec.heads.eagle3 import Eagle3Head, HeadShape, head_loss

    shape = HeadShape.for_target(target.config, cfg.intermediate_size)
    torch.manual_seed(cfg.seed)
    head = Eagle3Head(shape)
    if cfg.steps == 0:  # an untrained head (random weights): a cold start
        return head.eval()
    rng = random.Random(cfg.seed)
    pool, counts = [], torch.zeros(shape.vocab_size, dtype=torch.long)
    t0, every = time.time(), max(cfg.pool // 4, 1)
    for i in range(cfg.pool):
        ids, mask = batches(rng)  # mask [B, T]: 1 on response tokens
        learn = torch.nn.functional.pad(mask[:, 1:], (0, 1))  # [B, T]: row t predicts a response token t+1
        aux, logp = target_features(target, ids, shape.aux_layer_ids)
        # logp [B, T, V]: large on a wide vocabulary, so the pool may keep it in bf16
        pool.append((ids, learn, aux, logp.to(getattr(torch, cfg.pool_dtype))))
        counts += torch.bincount(ids[mask > 0], minlength=shape.vocab_size)
        if (i + 1) % every == 0:  # the pool is a build's slow start where the target generates: show it moving
            log(f"  head pool {i + 1}/{cfg.pool} batches of the target's features ({time.time() - t0:.0f}s)")
    embed = target.get_input_embeddings().weight.detach()
    lm_head = target.get_output_embeddings().weight.detach()
    if cfg.draft_vocab:
        head = with_draft_vocabulary(head, counts, cfg.draft_vocab, lm_head)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=cfg.steps, pct_start=0.1)
    for step in range(cfg.steps):
        ids, mask, aux, logp = pool[step % len(pool)]
        loss, agree = head_loss(head, aux, ids, logp, mask, embed, lm_head, cfg.chain_steps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 60 == 0 or step == cfg.steps - 1:
            log(f"  head step {step + 1}/{cfg.steps} loss {loss.item():.4f} top-1 agreement per chain step {agree}")
    return head.eval()


def with_draft_vocabulary(head, counts, n: int, lm_head):
    """``head`` with its own LM head over the ``n`` most frequent answer tokens (counts [V]), its other weights
    kept; the LM head starts as the target's rows for those tokens."""
    import dataclasses

    import torch

    from rl_specdec.heads.eagle3 import Eagle3Head

    ids = torch.sort(torch.topk(counts, min(n, len(counts))).indices).values  # [n], ascending target ids
    out = Eagle3Head(dataclasses.replace(head.shape, draft_vocab_size=len(ids)))
    out.load_state_dict(head.state_dict(), strict=False)  # all but the new LM head and d2t
    out.set_draft_vocabulary(ids, lm_head)
    return out


def _pair_batches(models: ToyModels):
    """The SFT batches the pair was built on (its folder's family names it)."""
    family = models.root.parent.name
    if family == "toy":
        from rl_specdec.toy.build import ToyBuildConfig, build_tokenizer, sft_batch

        tok, cfg = build_tokenizer(), ToyBuildConfig(**_build_fields(models, ToyBuildConfig))
        return lambda rng: sft_batch(rng, cfg, tok)
    if family == "toy-wide":
        from rl_specdec.toy.longtail import build_longtail_tokenizer, sft_batch
        from rl_specdec.toy.wide import WideToyConfig

        tok, counter = build_longtail_tokenizer(), [0]
        return lambda rng: sft_batch(rng, WideToyConfig().source, tok, counter)
    raise ValueError(f"no EAGLE-3 head recipe for the toy pair family {family!r} ({models.root})")


def _build_fields(models: ToyModels, cls) -> dict:
    from rl_specdec.toy.build import ModelShape

    raw = json.loads((models.root / "build.json").read_text())
    return {k: ModelShape(**v) if isinstance(v, dict) else v for k, v in raw.items() if k in cls.__dataclass_fields__}


def build_head(models: ToyModels, cfg: HeadBuildConfig | None = None, log=print) -> Path:
    """The pair's EAGLE-3 head folder, trained on its policy the first time (cached as ``<pair>/eagle3-<key>``)."""
    cfg = cfg or DEFAULT_BUILDS.get(models.root.parent.name, HeadBuildConfig())
    return cached_head(models.policy, models.root, lambda target: _pair_batches(models), cfg, log)


def cached_head(policy: Path, root: Path, make_batches, cfg: HeadBuildConfig, log=print) -> Path:
    """``<root>/eagle3-<key>``: a head for the model in ``policy``, trained the first time on
    ``make_batches(target)(rng)`` and written atomically."""
    import os

    import torch
    from transformers import AutoModelForCausalLM

    from rl_specdec.heads.eagle3 import save_head

    settings = {k: v for k, v in asdict(cfg).items() if k not in NEW_FIELDS or NEW_FIELDS[k] != v}
    out = Path(root) / f"eagle3-{build.config_key({'v': HEAD_BUILD_VERSION, **settings})}"

    def make(root: Path) -> None:
        t0 = time.time()
        threads = torch.get_num_threads()
        torch.set_num_threads(os.cpu_count() or 1)
        try:
            target = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()
            head = train_head(target, make_batches(target), cfg, log)
        finally:
            torch.set_num_threads(threads)

        def write(tmp: Path) -> None:
            save_head(head, tmp)
            (tmp / "DONE").write_text(f"{time.time() - t0:.1f}s\n")

        build.write_atomically(root, write)

    return build.build_once(out, make, f"the EAGLE-3 head of {Path(policy).name} ({cfg.steps} steps)", log)


# the real model's head: its own layer's width, its own sampled answers to the chat task (one-sentence replies),
# its own LM head over the 4,096 tokens it answers with most: a pass costs 1/20 of a model step at batch 1, where
# drafting through the model's 49,152-token LM head costs 1/5
# (docs/lab/smollm2.md, "Its EAGLE-3 head: cost and speed-up per batch size")
CHAT_HEAD = HeadBuildConfig(pool=24, steps=200, intermediate_size=1536, pool_dtype="bfloat16", draft_vocab=4096)
CHAT_INSTRUCTION = "Answer in one short sentence, then give the final answer as \\boxed{N}."


def build_chat_head(policy: Path, cfg: HeadBuildConfig = CHAT_HEAD, log=print) -> Path:
    """A head for a chat model's folder (``pkg:*-eagle3``), trained the first time on the model's own
    temperature-1 answers to the chat arithmetic task, and cached inside that folder."""
    return cached_head(policy, policy, lambda target: chat_batches(policy, target), cfg, log)


def chat_batches(policy: Path, target, batch: int = 8, new_tokens: int = 64):
    """``batches(rng)`` -> (ids [B, T] right-padded, mask [B, T]: 1 on the model's sampled answer)."""
    import torch
    from transformers import AutoTokenizer

    from rl_specdec.tasks import ArithmeticChatTask

    tok = AutoTokenizer.from_pretrained(policy)
    task = ArithmeticChatTask(min_steps=1, max_steps=3, max_start=20, instruction=CHAT_INSTRUCTION)
    eos, pad = target.config.eos_token_id, tok.pad_token_id if tok.pad_token_id is not None else 0

    def batches(rng: random.Random):
        prompts = [task.encode_prompt(tok, s.prompt) for s in task.make_batch(seed=rng.randrange(2**31), n=batch)]
        enc = tok.pad({"input_ids": prompts}, padding_side="left", return_tensors="pt")
        torch.manual_seed(rng.randrange(2**31))
        with torch.no_grad():
            out = target.generate(
                **enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens, pad_token_id=pad
            )
        rows = []
        for p, r in zip(prompts, out[:, enc["input_ids"].shape[1] :].tolist()):
            r = r[: r.index(eos) + 1] if eos in r else r  # the answer up to its end-of-turn token
            rows.append((p + r, [0] * len(p) + [1] * len(r)))
        width = max(len(ids) for ids, _ in rows)
        ids = torch.tensor([i + [pad] * (width - len(i)) for i, _ in rows])  # [B, T]
        mask = torch.tensor([m + [0] * (width - len(m)) for _, m in rows], dtype=torch.float32)  # [B, T]
        return ids, mask

    return batches
