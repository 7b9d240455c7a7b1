"""Build the embedded toy policy, drafter and tokenizer, with no download.

The default run must work on a machine that reaches no model hub, so the
package makes its own models:

* a character-level tokenizer (digits, ``=``, ``<pad>``, ``<eos>``), saved as a
  Hugging Face ``PreTrainedTokenizerFast`` so vLLM and transformers load it;
* a policy: a Qwen2 decoder, supervised-trained briefly on the digit-sorting
  task until it is right part of the time (GRPO has room to improve it);
* a drafter: a much smaller Qwen2 with the same vocabulary, distilled from the
  policy's next-token distributions on the same data, so it agrees with the
  policy when both sample at temperature 1.

Both use ``head_dim=32``, which vLLM's CPU attention kernels support (16 is
rejected). The build is deterministic from its seed and cached under
``$RL_SPECDEC_CACHE`` (default ``~/.cache/rl_specdec``) in a folder named by a
hash of its settings; the folder is written under a temporary name and renamed
into place, so an interrupted build never leaves a half-written model behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

BUILD_VERSION = 3  # bump when the build procedure changes

PAD, EOS = "<pad>", "<eos>"
CHARS = list("0123456789=")
VOCAB = [PAD, EOS] + CHARS
MODEL_VOCAB_SIZE = 32  # >= len(VOCAB); padded so the embedding is a round size


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int


@dataclass(frozen=True)
class ToyBuildConfig:
    seed: int = 0
    min_len: int = 4
    max_len: int = 24
    policy: ModelShape = ModelShape(256, 4, 8, 768)
    drafter: ModelShape = ModelShape(128, 2, 4, 384)
    policy_steps: int = 120
    drafter_steps: int = 100
    batch_size: int = 64
    lr: float = 2e-3

    def key(self) -> str:
        blob = json.dumps({"v": BUILD_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


@dataclass
class ToyModels:
    root: Path
    policy: Path = field(init=False)
    drafter: Path = field(init=False)

    def __post_init__(self):
        self.policy = self.root / "policy"
        self.drafter = self.root / "drafter"

    @property
    def drafter_untrained(self) -> Path:
        """The toy drafter's architecture with random weights (``toy:drafter-untrained``): a cold start."""
        return build_untrained_drafter(self)


def cache_root() -> Path:
    return Path(os.environ.get("RL_SPECDEC_CACHE", Path.home() / ".cache" / "rl_specdec"))


def build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, model_max_length=128
    )


def _qwen2_config(shape: ModelShape):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=MODEL_VOCAB_SIZE,
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_attention_heads,
        head_dim=shape.hidden_size // shape.num_attention_heads,
        intermediate_size=shape.intermediate_size,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=VOCAB.index(EOS),
        pad_token_id=VOCAB.index(PAD),
        torch_dtype="float32",
    )


def _sft_batch(rng: random.Random, cfg: ToyBuildConfig, tokenizer):
    """Token ids [B, T], a loss mask on response tokens [B, T], padded right."""
    import torch

    from rl_specdec.environments.sorting import SortingTask

    task = SortingTask(cfg.min_len, cfg.max_len)
    seqs, masks = [], []
    for _ in range(cfg.batch_size):
        s = task.sample_problem(rng)
        p = tokenizer.encode(s.prompt)
        r = tokenizer.encode(s.answer) + [tokenizer.eos_token_id]
        seqs.append(p + r)
        masks.append([0] * len(p) + [1] * len(r))
    t = max(map(len, seqs))
    ids = torch.full((len(seqs), t), tokenizer.pad_token_id)
    mask = torch.zeros((len(seqs), t))
    for i, (s, m) in enumerate(zip(seqs, masks)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float)
    return ids, mask


def _train(model, cfg: ToyBuildConfig, tokenizer, steps: int, seed: int, teacher=None, log=print):
    """SFT (teacher=None) or distillation from ``teacher`` on sorting data."""
    import torch
    import torch.nn.functional as F

    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=steps, pct_start=0.1)
    model.train()
    for step in range(steps):
        ids, mask = _sft_batch(rng, cfg, tokenizer)  # [B, T], [B, T]
        attn = (ids != tokenizer.pad_token_id) | (mask > 0)
        logits = model(input_ids=ids, attention_mask=attn.long()).logits[:, :-1]  # [B, T-1, V]
        m = mask[:, 1:]  # predict token t+1 from the prefix up to t
        if teacher is None:
            nll = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")  # [B, T-1]
            loss = (nll * m).sum() / m.sum()
        else:
            with torch.no_grad():
                t_logp = F.log_softmax(teacher(input_ids=ids, attention_mask=attn.long()).logits[:, :-1], -1)
            s_logp = F.log_softmax(logits, -1)
            kl = (t_logp.exp() * (t_logp - s_logp)).sum(-1)  # [B, T-1]  KL(teacher || student)
            loss = (kl * m).sum() / m.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 20 == 0 or step == steps - 1:
            log(f"  step {step + 1}/{steps} loss {loss.item():.4f}")
    model.eval()
    return model


def build_toy_models(cfg: ToyBuildConfig | None = None, root: Path | None = None, log=print) -> ToyModels:
    """Return the toy models' folders, building them the first time (cached)."""
    cfg = cfg or ToyBuildConfig()
    root = Path(root) if root else cache_root() / "toy" / cfg.key()
    out = ToyModels(root)
    if (root / "DONE").exists():
        return out

    import torch
    from transformers import Qwen2ForCausalLM

    t0 = time.time()
    log(f"[toy] building the toy policy and drafter into {root} (first run only, ~2 min)")
    torch.manual_seed(cfg.seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        tokenizer = build_tokenizer()
        policy = Qwen2ForCausalLM(_qwen2_config(cfg.policy))
        log(f"[toy] policy: {sum(p.numel() for p in policy.parameters()) / 1e6:.1f}M parameters, SFT")
        _train(policy, cfg, tokenizer, cfg.policy_steps, cfg.seed, log=log)
        torch.manual_seed(cfg.seed + 1)
        drafter = Qwen2ForCausalLM(_qwen2_config(cfg.drafter))
        log(f"[toy] drafter: {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M parameters, distilled")
        _train(drafter, cfg, tokenizer, cfg.drafter_steps, cfg.seed + 1, teacher=policy, log=log)
    finally:
        torch.set_num_threads(threads)

    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root.parent, prefix=f".{root.name}-"))
    try:
        for name, model in (("policy", policy), ("drafter", drafter)):
            model.save_pretrained(tmp / name, safe_serialization=True)
            tokenizer.save_pretrained(tmp / name)
        (tmp / "build.json").write_text(json.dumps(asdict(cfg), indent=2))
        (tmp / "DONE").write_text(f"{time.time() - t0:.1f}s\n")
        try:
            os.rename(tmp, root)
        except OSError:  # another process finished first: keep theirs
            if not (root / "DONE").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"[toy] built in {time.time() - t0:.0f}s")
    return out


def build_untrained_drafter(models: ToyModels, seed: int = 12345) -> Path:
    """A randomly initialised copy of the toy drafter's architecture, cached beside it."""
    import torch
    from transformers import AutoConfig, Qwen2ForCausalLM

    out = models.root / "drafter-untrained"
    if (out / "DONE").exists():
        return out
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(AutoConfig.from_pretrained(models.drafter))
    tmp = Path(tempfile.mkdtemp(dir=models.root, prefix=".drafter-untrained-"))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        build_tokenizer().save_pretrained(tmp)
        (tmp / "DONE").write_text("random init\n")
        try:
            os.rename(tmp, out)
        except OSError:  # another process made it first
            if not (out / "DONE").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


if __name__ == "__main__":
    m = build_toy_models()
    print(m.policy, m.drafter)
