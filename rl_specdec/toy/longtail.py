"""The long-tail toy pair: a policy and drafter for :mod:`rl_specdec.tasks.longtail`.

Same architecture as the digit toy, with two differences the task needs:

* **the vocabulary** adds ``|`` and one token per countdown number,
  ``<0>`` ... ``<400>``, so a countdown step is one token (the next number
  token after ``<n>`` is ``<n-1>``);
* **512 positions** (``max_position_embeddings``), for responses of up to
  about 410 tokens; vLLM refuses ``max_model_len`` above it.

**SFT data.** Each example is a training-split sorting problem with a budget
drawn from the task's Pareto law. So that a step does not pad every example to
the longest one, three batches in four cut their examples after
:data:`SHORT_TOKENS` tokens (the loss sees the budget token and the start of
the countdown, which is all the budget law needs); the fourth keeps them whole,
which teaches the long countdowns and the answer after them at far positions. Each batch is computed in
:attr:`LongTailToyConfig.length_groups` groups of rows of like length, so that the whole batches do not pad every
row to their rare long one (the same gradient on 46% of the positions: :mod:`rl_specdec.toy.sft`).

Built and cached like the digit toy (:mod:`rl_specdec.toy.build`), under its
own key, on first use only: ``toy:longtail-policy`` and ``toy:longtail-drafter``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from rl_specdec.toy import build
from rl_specdec.toy.build import EOS, PAD, ModelShape, PairBuildConfig, ToyModels
from rl_specdec.toy.sft import pad_batch

LONGTAIL_BUILD_VERSION = 1
MAX_POSITIONS = 512
SHORT_TOKENS = 48  # a cut example's length (prompt included)
FULL_EVERY = 4  # one batch in FULL_EVERY keeps its examples whole


def _vocab() -> list[str]:
    from rl_specdec.tasks.longtail import BUDGET_MAX, number_token

    return [PAD, EOS] + list("0123456789=|") + [number_token(i) for i in range(BUDGET_MAX + 1)]


def model_vocab_size() -> int:
    return -(-len(_vocab()) // 64) * 64  # padded to a multiple of 64


@dataclass(frozen=True)
class LongTailToyConfig(PairBuildConfig):
    version: ClassVar[int] = LONGTAIL_BUILD_VERSION
    policy: ModelShape = ModelShape(256, 4, 8, 768)
    drafter: ModelShape = ModelShape(128, 2, 4, 384)
    policy_steps: int = 240
    drafter_steps: int = 120
    batch_size: int = 32
    min_len: int = 4
    max_len: int = 8
    # rows of like length per group: a whole batch pads its rows to a rare ~410-token one (rl_specdec/toy/sft.py)
    length_groups: int = 4

    def task(self):
        from rl_specdec.tasks.longtail import LongTailSortTask

        return LongTailSortTask(self.min_len, self.max_len)


def build_longtail_tokenizer():
    """Word-level: one token per character, and one per ``<n>`` number token."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(_vocab())}, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"<\d+>|."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, model_max_length=MAX_POSITIONS)


def sft_batch(rng: random.Random, cfg: LongTailToyConfig, tokenizer, counter: list[int]):
    """Token ids [B, T] and a loss mask on response tokens [B, T]; see the module doc for the cut batches."""
    from rl_specdec.tasks.longtail import draw_budget, reference_response

    task = cfg.task()
    full = counter[0] % FULL_EVERY == FULL_EVERY - 1
    counter[0] += 1
    seqs, masks = [], []
    for _ in range(cfg.batch_size):
        s = task.draw(rng)  # the training split only
        p = tokenizer.encode(s.prompt)
        r = tokenizer.encode(reference_response(s.answer, draw_budget(rng))) + [tokenizer.eos_token_id]
        ids, mask = p + r, [0] * len(p) + [1] * len(r)
        if not full:
            ids, mask = ids[:SHORT_TOKENS], mask[:SHORT_TOKENS]
        seqs.append(ids)
        masks.append(mask)
    return pad_batch(seqs, masks, tokenizer.pad_token_id)


def build_longtail_models(cfg: LongTailToyConfig | None = None, root: Path | None = None, log=print) -> ToyModels:
    """The long-tail pair's folders, built the first time (cached under its own key)."""
    return build.cached_pair("toy-longtail", cfg or LongTailToyConfig(), root, _build, log)


def _build(root: Path, cfg: LongTailToyConfig, log) -> None:
    tokenizer = build_longtail_tokenizer()
    counter = [0]  # batches drawn so far: every FULL_EVERY-th keeps its examples whole
    vocab, eos, pad = model_vocab_size(), tokenizer.eos_token_id, tokenizer.pad_token_id
    build.build_pair(
        root,
        cfg,
        tokenizer,
        lambda rng: sft_batch(rng, cfg, tokenizer, counter),
        log,
        lambda shape: build.qwen2_config(shape, vocab, eos, pad, max_positions=MAX_POSITIONS),
        groups=cfg.length_groups,
    )
