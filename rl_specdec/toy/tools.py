"""A toy tokenizer, chat template, policy and drafter that write hermes-style tool calls.

For the lookup task (:mod:`rl_specdec.tasks.lookup`). One episode, as
the model sees it after splicing (one line in reality; ``|`` marks the
model's two turns, which SFT trains on)::

    <tools>lookup</tools>a= | <tool_call>{"name":"lookup","arguments":{"key":"a"}}</tool_call><eos> |
    <tool_response>482</tool_response> | 482<eos>

vLLM's hermes parser (``--tool-call-parser hermes``) reads the text between
``<tool_call>`` and ``</tool_call>`` as JSON with ``name`` and ``arguments``.

**The tokenizer** is character level: ``<pad> <eos>``, six tag tokens added as
single *non-special* tokens (like Qwen2.5's ``<tool_call>``, so they survive
detokenization), digits, ``=``, ``a``-``z`` and the JSON characters. It is a
byte-level BPE with no merges, because transformers 5 loads every
``model_type: qwen2`` folder as ``Qwen2Tokenizer`` whatever the saved class
says: a byte-level tokenizer, which maps ``" "`` to ``Ġ`` and ``"\\n"`` to ``Ċ``
and silently drops characters missing from the vocabulary. The build checks
that what transformers (and so vLLM) loads from the saved folder tokenizes
exactly like this tokenizer (:func:`check_saved_tokenizer`).

**The chat template** (saved with the tokenizer, so the server needs no
``chat_template``) renders tool calls as Qwen2.5's does: newlines inside the
tags and ``tojson`` spacing. The model writes compact JSON instead, so the
re-rendered history differs from the model's tokens: the retokenization case
that on-policy splicing exists for.

Built and cached like the digit toy (:mod:`rl_specdec.toy.build`), under its
own key, on first use only.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from rl_specdec.toy.build import (
    EOS,
    PAD,
    ModelShape,
    PairBuildConfig,
    ToyModels,
    build_pair,
    cached_pair,
    qwen2_config,
)
from rl_specdec.toy.sft import pad_batch

TOOL_BUILD_VERSION = 2
TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<tools>", "</tools>"]
CHARS = list("0123456789=abcdefghijklmnopqrstuvwxyz") + list('{}[]":, \n')
VOCAB = [PAD, EOS] + TAGS + CHARS
MODEL_VOCAB_SIZE = 64
MAX_LEN = 128

# Tools listed by name; a user turn is its content + "="; an assistant turn is its
# content, then each tool call as Qwen2.5 renders it, then EOS (the turn boundary the
# splice counts); a tool result is wrapped in <tool_response>. No generation prompt:
# the model answers after "=" or after </tool_response>.
TOOL_CHAT_TEMPLATE = (
    "{%- if tools -%}<tools>{%- for t in tools -%}{{ t['function']['name'] }}"
    "{%- if not loop.last -%},{%- endif -%}{%- endfor -%}</tools>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}{{ m['content'] }}="
    "{%- elif m['role'] == 'assistant' -%}"
    "{%- if m['content'] -%}{{ m['content'] }}{%- endif -%}"
    "{%- for tc in (m['tool_calls'] or []) -%}"
    '<tool_call>\n{"name": "{{ tc[\'function\'][\'name\'] }}", "arguments": '
    "{{ tc['function']['arguments'] if tc['function']['arguments'] is string "
    "else (tc['function']['arguments'] | tojson) }}"
    "}\n</tool_call>"
    "{%- endfor -%}{{ eos_token }}"
    "{%- elif m['role'] == 'tool' -%}<tool_response>{{ m['content'] }}</tool_response>"
    "{%- else -%}{{ raise_exception('the toy tool template has no ' + m['role'] + ' role') }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


@dataclass(frozen=True)
class ToolToyConfig(PairBuildConfig):
    version: ClassVar[int] = TOOL_BUILD_VERSION
    key_len: int = 1
    value_len: int = 3
    num_keys: int = 8  # one-letter keys a..h: the toy learns to copy each of them
    direct_rate: float = 0.5  # SFT examples that answer a guessed value without calling the tool ...
    direct_from: int = 250  # ... from this SFT step on (copying is learned first, from tool episodes only)
    policy_steps: int = 400
    batch_size: int = 32

    def task(self):
        from rl_specdec.tasks.lookup import LookupTask

        return LookupTask(self.key_len, self.value_len, self.num_keys)


def _symbol(c: str) -> str:
    """A character's vocabulary symbol, byte-level as GPT-2/Qwen write them (" " -> "Ġ", "\\n" -> "Ċ")."""
    return {" ": "\u0120", "\n": "\u010a"}.get(c, c)


def build_tool_tokenizer():
    """The character-level byte-level BPE tokenizer (no merges), with the tool chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {(_symbol(t) if len(t) == 1 else t): i for i, t in enumerate(VOCAB)}
    tok = Tokenizer(models.BPE(vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(PAD, special=True), AddedToken(EOS, special=True)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, model_max_length=MAX_LEN)
    out.chat_template = TOOL_CHAT_TEMPLATE
    return out


def check_saved_tokenizer(folder: str | Path) -> None:
    """What transformers (and vLLM) load from ``folder`` must tokenize and decode exactly like the toy tokenizer."""
    from transformers import AutoTokenizer

    ours, loaded = build_tool_tokenizer(), AutoTokenizer.from_pretrained(str(folder))
    sample = "".join(TAGS) + "".join(CHARS) + EOS + '<tool_call>\n{"name": "lookup"}\n</tool_call>'
    a, b = ours.encode(sample, add_special_tokens=False), loaded.encode(sample, add_special_tokens=False)
    if a != b or loaded.decode(b) != sample or ours.decode(a) != sample:
        raise RuntimeError(
            f"{type(loaded).__name__} loaded from {folder} tokenizes differently from the tool toy tokenizer; "
            "a vocabulary symbol is probably not byte-level (see rl_specdec/toy/tools.py)"
        )


def sft_example(tok, episode, guess: str | None = None) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of a whole episode as the spliced conversation looks; loss on the model's turns.

    With ``guess``, the model answers it at once without calling the tool (the
    behaviour RL has to train away: a guessed value is almost never right).
    """
    from rl_specdec.tasks.lookup import model_tool_call

    prompt = ("<tools>lookup</tools>" + episode.key + "=", 0)
    if guess is not None:
        segments = [prompt, (guess + EOS, 1)]
    else:
        segments = [
            prompt,
            (model_tool_call(episode.key) + EOS, 1),
            ("<tool_response>" + episode.value + "</tool_response>", 0),
            (episode.value + EOS, 1),
        ]
    ids, mask = [], []
    for text, m in segments:
        t = tok.encode(text, add_special_tokens=False)
        ids += t
        mask += [m] * len(t)
    return ids, mask


class _SftBatches:
    """``(ids [B, T], loss mask [B, T])`` per call; guessed answers appear from step ``cfg.direct_from`` on."""

    def __init__(self, cfg: ToolToyConfig, tok):
        self.cfg, self.tok, self.task, self.step = cfg, tok, cfg.task(), 0

    def __call__(self, rng: random.Random):
        cfg, examples = self.cfg, []
        rate = cfg.direct_rate if self.step >= cfg.direct_from else 0.0
        self.step += 1
        for _ in range(cfg.batch_size):
            ep = self.task.sample_episode(rng)
            guess = "".join(rng.choice("0123456789") for _ in range(cfg.value_len)) if rng.random() < rate else None
            examples.append(sft_example(self.tok, ep, guess))
        return pad_batch([i for i, _ in examples], [m for _, m in examples], self.tok.pad_token_id)


def _model_config(shape: ModelShape):
    return qwen2_config(shape, MODEL_VOCAB_SIZE, VOCAB.index(EOS), VOCAB.index(PAD))


def build_tool_toy(cfg: ToolToyConfig | None = None, root: Path | None = None, log=print) -> ToyModels:
    """The tool toy's policy/drafter folders, built the first time (cached under ``tool_toy/<key>``).

    ``policy_steps=0`` gives random weights (seconds; the tests force outputs with a regex).
    """
    return cached_pair("tool_toy", cfg or ToolToyConfig(), root, _build, log)


def _build(root: Path, cfg: ToolToyConfig, log) -> None:
    tok = build_tool_tokenizer()
    build_pair(root, cfg, tok, _SftBatches(cfg, tok), log, model_config=_model_config, check=check_saved_tokenizer)
