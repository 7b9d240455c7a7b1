"""The layers a run config is made of, before the schema sees it: YAML files and command-line overrides.

A YAML file's ``defaults: [other.yaml]`` inherit (later entries win, the file
itself last); overrides (``key=value``) come after every file. Layers merge key
by key, with one exception: ``policy.generation.vllm_kwargs.speculative_config``
describes one speculation method, and the keys of one method mean nothing to
another, so it is **replaced, not merged**:

* a YAML file (or an override ``speculative_config='{...}'``) that sets it to a
  mapping, or to null, replaces the inherited one whole;
* overrides of single keys (``speculative_config.num_speculative_tokens=5``)
  edit it in place, unless one of them names another method
  (``speculative_config.method=ngram``): then they start from that method's
  defaults (``defaults`` in :mod:`rl_specdec.vllm_ext.methods`).

Likewise ``task.kwargs`` are one task's arguments: a layer that names another
task (``task.name``) starts from that task's defaults, dropping the inherited
``task.kwargs``; a layer that keeps the task merges into them.

Elsewhere a mapping with ``_replace_: true`` replaces the inherited mapping
instead of merging into it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rl_specdec.errors import ConfigError
from rl_specdec.vllm_ext.methods import method as method_row

SPEC_KEY = "policy.generation.vllm_kwargs.speculative_config"
TASK_NAME, TASK_KWARGS = "task.name", "task.kwargs"
_UNSET = object()


def read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> DictConfig:
    """A YAML file merged over the files its ``defaults:`` list names (relative to it)."""
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"{path}: 'defaults' forms a cycle through {[str(p) for p in seen]}")
    if not path.is_file():
        raise ConfigError(
            f"config file {path} does not exist; pass an existing YAML, e.g. --config configs/grpo_spec.yaml"
        )
    try:
        cfg = OmegaConf.load(path)
    except (yaml.YAMLError, OmegaConfBaseException, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from e
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    defaults = cfg.pop("defaults", None) or []
    if isinstance(defaults, str):
        defaults = [defaults]
    merged = OmegaConf.create()
    for base in defaults:
        merged = OmegaConf.merge(merged, read_yaml(path.parent / str(base), seen + (path,)))
    _apply_replace_markers(merged, cfg)
    _reset_task_kwargs(merged, cfg)
    if OmegaConf.select(cfg, SPEC_KEY, default=_UNSET) is not _UNSET:
        OmegaConf.update(merged, SPEC_KEY, None, merge=False)  # the file's own speculative_config replaces it
    return OmegaConf.merge(merged, cfg)


def _reset_task_kwargs(base: DictConfig, layer: DictConfig) -> None:
    """A layer that names another task drops the inherited ``task.kwargs`` (the old task's arguments)."""
    name = OmegaConf.select(layer, TASK_NAME, default=None)
    if name is not None and name != OmegaConf.select(base, TASK_NAME, default=None):
        OmegaConf.update(base, TASK_KWARGS, {}, merge=False)


def _apply_replace_markers(base: DictConfig, child: DictConfig) -> None:
    """A mapping with ``_replace_: true`` replaces the inherited one instead of merging into it."""
    for k in list(child.keys()):
        node = child._get_node(k)
        if isinstance(node, DictConfig):
            if node.get("_replace_", False):
                del node["_replace_"]
                if k in base:
                    base[k] = None
            elif isinstance(base.get(k), DictConfig):
                _apply_replace_markers(base[k], node)


def parse_overrides(overrides: list[str]) -> DictConfig:
    for o in overrides:
        if "=" not in o or o.startswith("="):
            raise ConfigError(f"override {o!r} is not of the form key=value (e.g. grpo.max_steps=5)")
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as e:
        raise ConfigError(f"could not parse overrides {overrides}: {e}") from e


def apply_overrides(raw: DictConfig, overrides: list[str]) -> DictConfig:
    """``raw`` with the command-line overrides applied (speculative_config and task.kwargs: see module doc)."""
    whole, single, rest = [], [], []
    for o in overrides:
        key = o.split("=", 1)[0].strip()
        (whole if key == SPEC_KEY else single if key.startswith(SPEC_KEY + ".") else rest).append(o)
    layer = parse_overrides(rest)
    _reset_task_kwargs(raw, layer)
    raw = OmegaConf.merge(raw, layer)
    for o in whole:
        OmegaConf.update(raw, SPEC_KEY, OmegaConf.select(parse_overrides([o]), SPEC_KEY), merge=False)
    if single:
        edits = OmegaConf.to_container(OmegaConf.select(parse_overrides(single), SPEC_KEY))
        OmegaConf.update(raw, SPEC_KEY, edit_speculative_config(_current_spec(raw), edits), merge=False)
    return raw


def _current_spec(raw: DictConfig) -> dict[str, Any] | None:
    spec = OmegaConf.select(raw, SPEC_KEY, default=None)
    if spec is None:
        return None
    if not isinstance(spec, DictConfig):
        raise ConfigError(f"{SPEC_KEY} must be a mapping (or null), not {spec!r}")
    return OmegaConf.to_container(spec)


def edit_speculative_config(spec: dict[str, Any] | None, edits: dict[str, Any]) -> dict[str, Any]:
    """``spec`` with single-key ``edits``; an edit that names another method starts from that method's defaults."""
    method = edits.get("method")
    if method is not None and not isinstance(method, str):
        raise ConfigError(f"{SPEC_KEY}.method={method!r} must be a string (a vLLM speculative method, e.g. ngram)")
    if method is not None and (spec is None or spec.get("method") != method):
        spec = {"method": method, **dict(method_row(method).defaults)}
    return {**(spec or {}), **edits}
