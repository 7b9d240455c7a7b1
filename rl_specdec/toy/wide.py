"""The wide toy pair: a target far dearer than its drafter, so that speculation can pay on this CPU.

The long-tail toy target (:mod:`rl_specdec.toy.longtail`) is so small that its
decode step is bound by per-step latency, and one drafter pass costs a third of
it. Real targets are the other shape: at small batch an 8B target's step is
bound by reading its weights, and a drafter pass costs a tenth of it or less.

This pair builds that shape by **function-preserving widening** of the trained
long-tail target, with no training at all:

* every MLP is widened from 768 to :attr:`WideToyConfig.intermediate_size` units.
  The new rows of ``gate_proj`` and ``up_proj`` are random, the new columns of
  ``down_proj`` are zero, so the new units add exactly 0 to the residual stream;
* :attr:`WideToyConfig.extra_layers` decoder layers are appended, each with
  random attention and MLP inputs and zero ``o_proj`` and ``down_proj``: each
  new layer is the identity.

So at build the wide target computes what the long-tail target computes (its
greedy output and log-probs equal the long-tail target's; the tests check
both), and GRPO trains every new weight from there (the zero projections get
gradients at the first step).

The drafter is a one-layer Qwen2 (hidden 128), distilled from the long-tail
target (which is what the wide one computes) for :attr:`WideToyConfig.drafter_steps`
steps, as the other toy drafters are. So few steps leave it as far from its
target as real drafters are from theirs: acceptance length ~2.9 at k=4 (the
long-tail drafter reaches 3.9, closer than any published pair). At batch 1
the wide target's step reads ~400 MB of fp32 weights and costs ~14 ms on 2
cores, about 20 drafter passes (docs/lab/wide_pair.md, "Its cost table", has the measured table;
docs/performance.md, "Where it pays: the wide pair", its best k per batch size).

Cached like the other toys, under its own key (first use builds the long-tail
pair if needed, then widens in seconds): ``toy:wide-policy``, ``toy:wide-drafter``.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rl_specdec.toy import build
from rl_specdec.toy.build import ModelShape, ToyModels
from rl_specdec.toy.longtail import LongTailToyConfig, build_longtail_models, build_longtail_tokenizer
from rl_specdec.toy.sft import train_lm

WIDE_BUILD_VERSION = 1


@dataclass(frozen=True)
class WideToyConfig:
    source: LongTailToyConfig = LongTailToyConfig()
    intermediate_size: int = 16384  # the long-tail target's is 768
    extra_layers: int = 4  # identity layers appended to its 4
    drafter: ModelShape = ModelShape(128, 1, 4, 384)
    drafter_steps: int = 80  # distillation steps: acceptance length ~2.9 at k=4 (see the module doc)
    seed: int = 0  # for the new (random) input weights
    init_std: float = 0.02

    def key(self) -> str:
        return build.config_key({"v": WIDE_BUILD_VERSION, **asdict(self)})


def widen(model, cfg: WideToyConfig):
    """A new Qwen2 model, wider and deeper than ``model``, that computes exactly what ``model`` computes."""
    import copy

    import torch
    from transformers import Qwen2ForCausalLM

    old = model.config
    if cfg.intermediate_size < old.intermediate_size:
        raise ValueError(f"intermediate_size={cfg.intermediate_size} is narrower than the source's")
    new_cfg = copy.deepcopy(old)
    new_cfg.intermediate_size = cfg.intermediate_size
    new_cfg.num_hidden_layers = old.num_hidden_layers + cfg.extra_layers
    new_cfg.layer_types = ["full_attention"] * new_cfg.num_hidden_layers
    torch.manual_seed(cfg.seed)
    wide = Qwen2ForCausalLM(new_cfg)
    src, dst = model.state_dict(), wide.state_dict()
    i0 = old.intermediate_size
    with torch.no_grad():
        for name, w in dst.items():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                w.zero_()  # new layers and new MLP units add nothing to the residual stream
            elif name.endswith(("_proj.weight", "_proj.bias")):
                w.normal_(0.0, cfg.init_std)
            s = src.get(name)
            if s is None:
                continue  # an appended layer: norms at 1, inputs random, outputs zero
            if s.shape == w.shape:
                w.copy_(s)
            elif name.endswith("down_proj.weight"):  # [hidden, intermediate]
                w[:, :i0] = s
            else:  # gate_proj / up_proj [intermediate, hidden]
                w[:i0] = s
    wide.load_state_dict(dst)
    return wide.eval()


def build_wide_models(cfg: WideToyConfig | None = None, root: Path | None = None, log=print) -> ToyModels:
    """The wide pair's folders, built the first time (cached under its own key)."""
    return build.cached_pair("toy-wide", cfg or WideToyConfig(), root, _build, log)


def distill_drafter(teacher, cfg: WideToyConfig, log):
    """A small drafter distilled from ``teacher`` on the long-tail SFT data (the other toys' recipe)."""
    import os

    import torch
    from transformers import Qwen2ForCausalLM

    from rl_specdec.toy.longtail import MAX_POSITIONS, model_vocab_size, sft_batch

    tok, src = build_longtail_tokenizer(), cfg.source
    counter = [0]  # batches drawn so far: every FULL_EVERY-th keeps its examples whole
    torch.manual_seed(cfg.seed + 1)
    shape_cfg = build.qwen2_config(cfg.drafter, model_vocab_size(), tok.eos_token_id, tok.pad_token_id, MAX_POSITIONS)
    drafter = Qwen2ForCausalLM(shape_cfg)
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        train_lm(
            drafter,
            lambda rng: sft_batch(rng, src, tok, counter),
            tok.pad_token_id,
            src.lr,
            cfg.drafter_steps,
            cfg.seed + 1,
            teacher=teacher,
            log=log,
            groups=src.length_groups,
        )
    finally:
        torch.set_num_threads(threads)
    return drafter


def _build(root: Path, cfg: WideToyConfig, log) -> None:
    import torch
    from transformers import Qwen2ForCausalLM

    source = build_longtail_models(cfg.source, log=log)
    t0 = time.time()
    narrow = Qwen2ForCausalLM.from_pretrained(source.policy, dtype=torch.float32).eval()
    wide = widen(narrow, cfg)
    log(f"[toy] wide policy: {sum(p.numel() for p in wide.parameters()) / 1e6:.1f}M parameters (widened)")
    drafter = distill_drafter(narrow, cfg, log)
    log(f"[toy] wide drafter: {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M parameters, distilled")
    tok = build_longtail_tokenizer()

    def write(tmp: Path) -> None:
        for name, model in (("policy", wide), ("drafter", drafter)):
            model.save_pretrained(tmp / name, safe_serialization=True)
            tok.save_pretrained(tmp / name)
        (tmp / "build.json").write_text(json.dumps(asdict(cfg), indent=2))
        (tmp / "DONE").write_text(f"{time.time() - t0:.1f}s\n")

    build.write_atomically(root, write)
