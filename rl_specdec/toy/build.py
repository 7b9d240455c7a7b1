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

import contextlib
import contextvars
import fcntl
import functools
import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar

from rl_specdec.toy.sft import pad_batch, train_lm

BUILD_VERSION = 4  # bump when the build procedure changes (4: the SFT draws from the training split only)

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
class PairBuildConfig:
    """What a toy policy/drafter pair's build depends on; :meth:`key` (its hash) names the cache folder."""

    version: ClassVar[int] = 0  # bump in a subclass when its build changes without a field changing
    seed: int = 0
    policy: ModelShape = ModelShape(256, 4, 8, 768)
    drafter: ModelShape = ModelShape(128, 2, 4, 384)
    policy_steps: int = 120
    drafter_steps: int = 100
    batch_size: int = 64
    lr: float = 2e-3

    def key(self) -> str:
        return config_key({"v": self.version, **asdict(self)})


def config_key(settings: dict) -> str:
    """A build's cache key: a short hash of everything it depends on."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class ToyBuildConfig(PairBuildConfig):
    version: ClassVar[int] = BUILD_VERSION
    min_len: int = 4
    max_len: int = 24


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


def cached_pair(folder: str, cfg, root: Path | None, make, log) -> ToyModels:
    """A pair's folders: ``root``, or ``<cache>/<folder>/<cfg.key()>``; ``make(path, cfg, log)`` builds them
    the first time (it ends with the ``DONE`` file)."""
    out = ToyModels(Path(root) if root else cache_root() / folder / cfg.key())
    build_once(out.root, lambda path: make(path, cfg, log), f"{folder} pair", log)
    return out


class BuildBusy(Exception):
    """Another process holds the build lock of a folder, and the caller asked not to wait (:func:`not_waiting`)."""


_WAIT = contextvars.ContextVar("rl_specdec_build_wait", default=True)


@contextlib.contextmanager
def not_waiting():
    """Within this block, :func:`build_once` raises :class:`BuildBusy` for a folder that another process is
    building, instead of waiting for it (a caller with other builds to do takes those first)."""
    token = _WAIT.set(False)
    try:
        yield
    finally:
        _WAIT.reset(token)


def build_once(root: Path, make: Callable[[Path], None], what: str, log: Callable[[str], None] = print) -> Path:
    """``root``, built by ``make(root)`` the first time (``make`` ends with the ``DONE`` file).

    One process builds a folder at a time: a second one that needs it waits on the folder's lock file (in the
    cache's ``.locks``), then finds it built. So two runs started together, or two test workers, never build the
    same model twice; a build that fails leaves the lock free and no folder, and the next caller builds it again.
    ``what`` names the build in the
    two progress lines ``log`` gets: its start, and the seconds it took.
    """
    root = Path(root)
    if (root / "DONE").exists():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    # the lock files sit apart, in the cache's own folder: a folder of models holds only whole models
    locks = cache_root() / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    name = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:16]
    with open(locks / f"{root.name}-{name}.lock", "w") as lock:
        try:  # released when the file closes, or when the process dies
            fcntl.flock(lock, fcntl.LOCK_EX | (0 if _WAIT.get() else fcntl.LOCK_NB))
        except BlockingIOError:
            raise BuildBusy(what) from None
        if (root / "DONE").exists():  # built by the process we waited for
            return root
        t0 = time.time()
        log(f"[build] {what}: building into {root} (first use only)")
        make(root)
        seconds = time.time() - t0
        log(f"[build] {what}: built in {seconds:.0f}s")
        _record_build(root, what, seconds)
    return root


BUILT = "built.json"  # what a first-use build cost, kept in its folder (read by built_seconds)


def _record_build(root: Path, what: str, seconds: float) -> None:
    from rl_specdec.sysinfo import machine_label

    record = {"what": what, "seconds": round(seconds, 1), "machine": machine_label()}
    (root / BUILT).write_text(json.dumps(record) + "\n")


def built_where(folder: Path) -> Path:
    """The build that made ``folder``: itself, or the pair's folder that holds it (one build, several models)."""
    return next((r for r in (folder, folder.parent) if (r / BUILT).is_file() or (r / "DONE").is_file()), folder)


def built_seconds(folder: Path) -> float | None:
    """The seconds the first-use build of ``folder`` (or of the pair that holds it) took, None where it was
    not recorded: a folder built before build times were kept gives the training's seconds in its ``DONE``."""
    root = built_where(folder)
    if (root / BUILT).is_file():
        return float(json.loads((root / BUILT).read_text())["seconds"])
    text = (root / "DONE").read_text().strip() if (root / "DONE").is_file() else ""
    try:
        return float(text[:-1]) if text.endswith("s") else None
    except ValueError:
        return None


def build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, model_max_length=128)


def qwen2_config(
    shape: ModelShape,
    vocab_size: int = MODEL_VOCAB_SIZE,
    eos_id: int = VOCAB.index(EOS),
    pad_id: int = VOCAB.index(PAD),
    max_positions: int = 128,
):
    """A small Qwen2 config (head_dim 32: vLLM's CPU attention rejects 16; 128 positions unless told)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_attention_heads,
        head_dim=shape.hidden_size // shape.num_attention_heads,
        intermediate_size=shape.intermediate_size,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype="float32",
    )


def sft_batch(rng: random.Random, cfg: ToyBuildConfig, tokenizer):
    """Token ids [B, T], a loss mask on response tokens [B, T], padded right."""
    from rl_specdec.tasks.sorting import SortingTask

    task = SortingTask(cfg.min_len, cfg.max_len)
    seqs, masks = [], []
    for _ in range(cfg.batch_size):
        s = task.draw(rng)  # the training split: the SFT never sees a validation problem
        p = tokenizer.encode(s.prompt)
        r = tokenizer.encode(s.answer) + [tokenizer.eos_token_id]
        seqs.append(p + r)
        masks.append([0] * len(p) + [1] * len(r))
    return pad_batch(seqs, masks, tokenizer.pad_token_id)


def build_toy_models(cfg: ToyBuildConfig | None = None, root: Path | None = None, log=print) -> ToyModels:
    """Return the toy models' folders, building them the first time (cached)."""
    return cached_pair("toy", cfg or ToyBuildConfig(), root, _build_digits, log)


def _build_digits(root: Path, cfg: ToyBuildConfig, log) -> None:
    tokenizer = build_tokenizer()
    build_pair(root, cfg, tokenizer, lambda rng: sft_batch(rng, cfg, tokenizer), log)


def build_pair(
    root: Path, cfg: PairBuildConfig, tokenizer, batches, log=print, model_config=None, check=None, groups: int = 1
) -> None:
    """Train a policy (SFT) and a drafter (distilled from it) on ``batches(rng)`` and save both into ``root``.

    ``cfg`` gives the shapes, steps, learning rate and seed; it is saved as ``build.json``.
    ``model_config(shape)`` gives each model's Qwen2 config (default: the digit toy's
    vocabulary). The folder is written under a temporary name and renamed into place;
    ``check(folder)`` runs on each saved model folder before that. Both models train on each batch in ``groups``
    groups of rows of like length (:func:`rl_specdec.toy.sft.length_groups`).
    """
    import torch
    from transformers import Qwen2ForCausalLM

    model_config = model_config or qwen2_config
    t0 = time.time()
    torch.manual_seed(cfg.seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        # the policy trains, then the drafter distils from it, on the same batches with the same settings
        train = functools.partial(train_lm, batches=batches, pad_id=tokenizer.pad_token_id, lr=cfg.lr, log=log)
        policy = Qwen2ForCausalLM(model_config(cfg.policy))
        log(f"[toy] policy: {sum(p.numel() for p in policy.parameters()) / 1e6:.1f}M parameters, SFT")
        train(policy, steps=cfg.policy_steps, seed=cfg.seed, groups=groups)
        torch.manual_seed(cfg.seed + 1)
        drafter = Qwen2ForCausalLM(model_config(cfg.drafter))
        log(f"[toy] drafter: {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M parameters, distilled")
        train(drafter, steps=cfg.drafter_steps, seed=cfg.seed + 1, teacher=policy, groups=groups)
    finally:
        torch.set_num_threads(threads)

    def write(tmp: Path) -> None:
        for name, model in (("policy", policy), ("drafter", drafter)):
            model.save_pretrained(tmp / name, safe_serialization=True)
            tokenizer.save_pretrained(tmp / name)
            if check is not None:
                check(tmp / name)
        (tmp / "build.json").write_text(json.dumps(asdict(cfg), indent=2))
        (tmp / "DONE").write_text(f"{time.time() - t0:.1f}s\n")

    write_atomically(root, write)


def write_atomically(root: Path, write) -> None:
    """``write(tmp)`` fills a temporary folder beside ``root`` (ending with its ``DONE`` file), which is then
    renamed to ``root``: an interrupted build never leaves a half-written folder. If another process finished
    first, its folder is kept."""
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root.parent, prefix=f".{root.name}-"))
    try:
        write(tmp)
        try:
            os.rename(tmp, root)
        except OSError:  # another process finished first: keep theirs
            if not (root / "DONE").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build_untrained_drafter(models: ToyModels, seed: int = 12345) -> Path:
    """A randomly initialised copy of the toy drafter's architecture, cached beside it."""
    import torch
    from transformers import AutoConfig, Qwen2ForCausalLM

    out = models.root / "drafter-untrained"
    if (out / "DONE").exists():
        return out

    def make(root: Path) -> None:
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(AutoConfig.from_pretrained(models.drafter))

        def write(tmp: Path) -> None:
            model.save_pretrained(tmp, safe_serialization=True)
            build_tokenizer().save_pretrained(tmp)
            (tmp / "DONE").write_text("random init\n")

        write_atomically(root, write)

    return build_once(out, make, "the untrained toy drafter", log=lambda *_: None)


if __name__ == "__main__":
    m = build_toy_models()
    print(m.policy, m.drafter)
