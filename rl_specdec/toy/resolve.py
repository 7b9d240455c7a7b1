"""The step between loading a config and starting a run: model names become folders.

``toy:*`` names become the embedded models' folders (built and cached the first time: the default pair in about
90 s on 2 cores, the wide pair in minutes), ``pkg:*`` names a real model converted once from its package (about a
minute; ``pkg:<name>-eagle3`` also trains its head, about 5 minutes), a local-looking path must be a folder, and
a hub id stays a name (vLLM and transformers fetch it). Then the drafter's vocabulary is compared with the
policy's where both are local folders, and a head trained online is one the trainer can train.

:func:`prepare_models` is what ``rl_specdec.grpo.run.setup`` (and ``--print-config --resolved``) calls; loading
a config (:func:`rl_specdec.config.load_config`) builds nothing. A model already built is found in the cache in
milliseconds, so preparing twice costs nothing.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable

from rl_specdec.config.models import DRAFTER_KEY, PKG_PREFIX, toy_model
from rl_specdec.config.schema import RunConfig
from rl_specdec.errors import ConfigError


def _toy_pairs(log: Callable[[str], None]) -> Callable[[str], Any]:
    """A toy pair's folders by its name, built at most once per call of :func:`prepare_models`."""
    cache: dict[str, Any] = {}

    def toy_paths(pair: str):
        if pair not in cache:
            from rl_specdec.toy.build import build_toy_models
            from rl_specdec.toy.longtail import build_longtail_models
            from rl_specdec.toy.tools import build_tool_toy
            from rl_specdec.toy.wide import build_wide_models

            builders = {"digits": build_toy_models, "longtail": build_longtail_models, "wide": build_wide_models}
            builders["tools"] = build_tool_toy
            cache[pair] = builders[pair](log=log)
        return cache[pair]

    return toy_paths


def _folder(name: str, key: str, toy_paths, log: Callable[[str], None]) -> str:
    from rl_specdec.toy.packaged import packaged_model_path

    if name.startswith(PKG_PREFIX):  # a model shipped in a PyPI package, converted once into a cached folder
        return packaged_model_path(name, key, log=log)
    toy = toy_model(name, key)
    if toy is not None:
        pair, attr = toy
        if attr.startswith("eagle3"):  # a head for the pair's policy, trained on it the first time (or untrained)
            from rl_specdec.heads.build import HeadBuildConfig, build_head

            cfg = HeadBuildConfig(steps=0) if attr == "eagle3-untrained" else None
            return str(build_head(toy_paths(pair), cfg, log=log))
        return str(getattr(toy_paths(pair), attr))
    looks_local = name.startswith(("/", "./", "../", "~")) or os.path.exists(name)
    if looks_local and not Path(os.path.expanduser(name)).is_dir():
        raise ConfigError(f"{key}={name!r} is not a directory; give a local Hugging Face model folder or a hub id")
    return os.path.expanduser(name) if looks_local else name


def model_folder(name: str, log: Callable[[str], None] | None = None) -> str:
    """The folder of one model name (``toy:*``, ``pkg:*``, a local folder or a hub id), built the first time."""
    log = log or (lambda m: print(m, flush=True))
    return _folder(name, "model", _toy_pairs(log), log)


def prepare_models(cfg: RunConfig, log: Callable[[str], None] | None = None) -> RunConfig:
    """Replace ``cfg``'s model names with their folders, building what is not cached yet (its progress on
    ``log``, print by default), then check the drafter's vocabulary and a trained head. Returns ``cfg``."""
    from rl_specdec.config.vllm_kwargs import check_drafter_vocabulary

    log = log or (lambda m: print(m, flush=True))
    t0, toy_paths = time.time(), _toy_pairs(log)
    gen = cfg.policy.generation
    cfg.policy.model_name = _folder(cfg.policy.model_name, "policy.model_name", toy_paths, log)
    if gen.speculation is not None and gen.speculation.model:
        gen.set_drafter_model(_folder(gen.speculation.model, DRAFTER_KEY, toy_paths, log))
    spec = gen.speculation
    check_drafter_vocabulary(spec.to_vllm() if spec else None, cfg.policy.model_name)
    if spec is not None and spec.is_head and gen.drafter_training.enabled:
        _check_trainable_head(spec.model, cfg.policy.model_name)
    if time.time() - t0 > 5:
        log(f"models ready in {time.time() - t0:.0f}s (cached for the next run)")
    return cfg


def _check_trainable_head(folder: str, target: str) -> None:
    import torch

    from rl_specdec.heads.eagle3 import Eagle3Head, HeadShape
    from rl_specdec.heads.forms import tensor_names, tensor_problems, untrainable

    path = Path(folder) / "config.json"
    if not os.path.isdir(folder):  # a hub id: read when the policy workers load it
        return
    target_config = Path(target) / "config.json"
    layers = json.loads(target_config.read_text()).get("num_hidden_layers") if target_config.is_file() else None
    why = untrainable(json.loads(path.read_text()) if path.is_file() else {}, layers)
    if not why:
        shape = HeadShape.read(folder, layers)
        with torch.device("meta"):
            expected = set(Eagle3Head(shape).vllm_state_dict())
        why = tensor_problems(tensor_names(folder), expected, shape.draft_vocab_size > 0)
    if why:
        raise ConfigError(
            f"{DRAFTER_KEY}={folder!r} with policy.generation.drafter_training.enabled=true: the trainer cannot "
            f"train this head ({why}). Use a one-layer Llama EAGLE-3 head, or one built here (toy:eagle3, "
            "toy:wide-eagle3, pkg:smollm2-135m-instruct-eagle3), or set drafter_training.enabled=false to serve "
            "this head frozen."
        )
