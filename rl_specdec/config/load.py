"""Loading a run config: OmegaConf YAML, overrides, the typed schema, checks, model and dtype resolution.

``load_config(path, overrides)`` does, in order:

1. reads the YAML (and, recursively, the files named in its ``defaults:`` list,
   relative to it; later files override earlier ones, the file itself last);
2. applies command-line ``key=value`` overrides (any key, ``null`` allowed);
   ``speculative_config`` is replaced rather than merged (:mod:`rl_specdec.config.layers`);
3. merges onto the typed schema below, so an unknown key or a wrong type fails
   with the key's full name and the closest valid names;
4. checks values (ranges, combinations);
5. resolves ``device: auto``, ``precision: auto`` and the engines' dtype once,
   for the trainer and the engines together, and checks that they go together
   (:func:`resolve_device_and_dtype`; on a cluster whose head has no GPU but
   whose workers do, set ``policy.device=cuda``);
6. validates the engine arguments (:func:`check_engine_args`): vLLM's gate
   (the hooks fit the installed vLLM), the model names (``toy:*``, ``pkg:*``:
   :mod:`rl_specdec.config.models`), and every key of ``vllm_kwargs`` and its
   ``speculative_config`` against vLLM's own declarations
   (:mod:`rl_specdec.config.vllm_kwargs`), filling in the RL defaults.

Loading reads no model file, builds nothing and fetches nothing, so it runs the same on any machine.
Turning ``toy:*`` and ``pkg:*`` names into folders (built or converted the first time) is a step of its own,
:func:`rl_specdec.toy.resolve.prepare_models`, which a run's setup calls.
Everything happens before any Ray actor starts, so a bad config costs seconds.
Whether this machine's vLLM backend can run the speculation method (eagle3 on
the CPU build, suffix without arctic-inference) is not a property of the config:
:func:`check_runs_here` asks it where a run starts (``grpo.run.setup``), so a
config prints and validates anywhere.
:func:`load_config_as_written` runs steps 1-6 but changes nothing: the config as the user wrote it
(``--print-config``).
``${...}`` interpolation works as in any OmegaConf file.
"""

import dataclasses
import difflib
import functools
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from rl_specdec.config import checks, precision
from rl_specdec.config.checks import validate
from rl_specdec.config.layers import apply_overrides, read_yaml
from rl_specdec.config.models import DRAFTER_KEY, check_name
from rl_specdec.config.schema import PolicyConfig, RunConfig
from rl_specdec.config.speculation import resolved_speculation
from rl_specdec.errors import ConfigError


def _all_keys(node: Any, prefix: str = "") -> list[str]:
    """Every dotted key of a plain (container) config."""
    out = []
    if isinstance(node, dict):
        for k, v in node.items():
            out += [f"{prefix}{k}"] + _all_keys(v, f"{prefix}{k}.")
    return out


RENAMED = {"env": "task"}  # an old key -> its new name


def _refuse_replaced_keys(raw: DictConfig) -> None:
    """``policy.dtype`` became ``policy.precision`` (and the engines' ``vllm_kwargs.dtype``): say so,
    with the new value."""
    policy = raw.get("policy")
    if isinstance(policy, DictConfig) and "dtype" in policy:
        old = policy.get("dtype")
        bf16 = "bf16-mixed (or bf16: weights and AdamW state in bf16 too)"
        new = {"auto": "auto", "bfloat16": bf16}.get(str(old), "fp32")
        raise ConfigError(
            f"policy.dtype={old} was replaced by policy.precision (fp32 | bf16-mixed | bf16 | auto; "
            f'docs/grpo.md, "Precision"): set policy.precision={new} and remove policy.dtype. '
            "The engines' dtype follows the precision; policy.generation.vllm_kwargs.dtype sets it apart."
        )


def _wrap_omegaconf_error(e: OmegaConfBaseException, schema: DictConfig) -> ConfigError:
    key = e.full_key or ""
    old = key.split(".")[0]
    if old in RENAMED:
        new = RENAMED[old] + key[len(old) :]
        return ConfigError(f"config key '{key}' is now '{new}'; rename it (see docs/grpo.md for every key).")
    if isinstance(e, ConfigKeyError) or "not in" in str(e):
        valid = _all_keys(OmegaConf.to_container(schema))
        close = difflib.get_close_matches(key, valid, n=3, cutoff=0.5)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        return ConfigError(
            f"unknown config key '{key}'.{hint} Remove it or fix its name (see docs/grpo.md for every key)."
        )
    if isinstance(e, ValidationError):
        return ConfigError(f"config key '{key}' has a value of the wrong type: {str(e).splitlines()[0]}")
    return ConfigError(f"config key '{key}': {e}")


@functools.lru_cache(maxsize=1)
def _schema() -> DictConfig:
    """The typed schema, built once per process (two fifths of a load's time): ``OmegaConf.merge`` copies its
    first argument, so no load changes it."""
    return OmegaConf.structured(RunConfig)


def _load_unresolved(path: str | os.PathLike | None, overrides: list[str] | None) -> RunConfig:
    schema = _schema()
    raw = read_yaml(Path(path)) if path else OmegaConf.create()
    raw = apply_overrides(raw, list(overrides or []))
    _refuse_replaced_keys(raw)
    try:
        merged = OmegaConf.merge(schema, raw)
        OmegaConf.resolve(merged)
        cfg: RunConfig = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise _wrap_omegaconf_error(e, schema) from e
    validate(cfg)
    return cfg


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load, merge, type-check and validate a run config; builds nothing (see module doc)."""
    return resolve(_load_unresolved(path, overrides))


def load_config_as_written(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> RunConfig:
    """The config as written (``auto`` and nulls unresolved), after every check of :func:`load_config`."""
    cfg = _load_unresolved(path, overrides)
    resolve(cfg)  # for its checks: the config as written is left as it is
    return cfg


def resolve(cfg: RunConfig) -> RunConfig:
    """``cfg`` resolved as a new config (``cfg`` is left as it is): speculation's ``auto`` and nulls, the device,
    the precision and the engines' dtype, and ``vllm_kwargs`` with vLLM's RL defaults filled in."""
    gen = resolved_speculation(cfg.policy.generation)
    policy = resolve_device_and_dtype(dataclasses.replace(cfg.policy, generation=gen))
    return check_engine_args(dataclasses.replace(cfg, policy=policy))


# ---- validation ------------------------------------------------------------------------------------------------


def check_engine_args(cfg: RunConfig) -> RunConfig:
    """vLLM's gate, the ``toy:*`` and ``pkg:*`` names, and ``vllm_kwargs`` against vLLM's declarations; returns a
    new config whose ``vllm_kwargs`` has the RL defaults filled in. No model file is read and nothing is fetched: a
    hub id is a name here."""
    from rl_specdec.config.speculation import check_trainable_method
    from rl_specdec.config.vllm_kwargs import validate_vllm_kwargs
    from rl_specdec.vllm_ext import check_vllm

    gen = cfg.policy.generation
    check_vllm(gen.allow_untested_vllm, gen.vllm_hook_features(server=gen.server is not None))  # before vLLM is read
    check_name(cfg.policy.model_name, "policy.model_name")
    gen = dataclasses.replace(gen, vllm_kwargs=validate_vllm_kwargs(gen.vllm_kwargs, None, training=True))
    check_trainable_method(gen)  # after vLLM's check: an unknown method is named as vLLM's, not as untrainable
    spec = gen.vllm_kwargs.get("speculative_config")
    if spec and spec.get("model"):
        check_name(spec["model"], DRAFTER_KEY)
    return dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, generation=gen))


def check_runs_here(cfg: RunConfig) -> None:
    """Refuse a speculation method this machine's vLLM backend cannot run (on vLLM's CPU build: the ``cpu``
    methods of :mod:`rl_specdec.vllm_ext.methods` only; suffix needs arctic-inference). The run's start asks it,
    not loading: a config for GPUs still prints and validates on a CPU machine."""
    from rl_specdec.config.vllm_kwargs import check_backend_runs
    from rl_specdec.vllm_ext.methods import method as method_row
    from rl_specdec.vllm_ext.platform import is_cpu

    spec = cfg.policy.generation.vllm_kwargs.get("speculative_config")
    method = (spec or {}).get("method")
    # vLLM's platform is asked only where it decides (importing vLLM to ask takes seconds)
    on_cpu = cfg.policy.device == "cpu" and method is not None and not method_row(method).cpu and is_cpu()
    check_backend_runs(spec, on_cpu=on_cpu)


def resolve_device_and_dtype(
    p: PolicyConfig, cuda_available: bool | None = None, cpu_bf16: bool | None = None
) -> PolicyConfig:
    """``p`` with 'auto' resolved, as new settings (``p`` is left as it is): device cuda where the loading process
    sees CUDA, else cpu;
    precision bf16-mixed on cuda and on a CPU with native bf16 (``cpu_bf16``: probed when None), else
    fp32; the engines' dtype (``vllm_kwargs.dtype``) the
    precision's compute dtype unless set, checked against the precision. Workers and engines use what
    this leaves.

    On a Ray cluster whose head has no GPU but whose workers do, set ``policy.device=cuda``.
    """
    device = p.device
    if device == "auto":
        device = "cuda" if (checks.cuda_available() if cuda_available is None else cuda_available) else "cpu"
    out = dataclasses.replace(p, device=device, precision=precision.resolve(p.precision, device, cpu_bf16))
    dtype = precision.engine_dtype(out)  # the engine samples in the trainer's compute dtype
    precision.check_pairing(out.precision, dtype)
    gen = dataclasses.replace(p.generation, vllm_kwargs={**p.generation.vllm_kwargs, "dtype": dtype})
    return dataclasses.replace(out, generation=gen)


def check_cluster_resources(cfg: RunConfig, resources: dict[str, float]) -> None:
    """Fail before any actor starts if the run asks for more GPUs or CPUs than the Ray cluster has.

    ``resources`` is ``ray.cluster_resources()``. Engines count as the engine
    group reserves them (rollout/placement.py ``reserve_engine_bundles``):
    ``tensor_parallel_size`` GPUs + 1 CPU each on a GPU cluster, ``cpus_per_engine``
    CPUs each otherwise. Policy workers reserve ``gpus_per_worker`` (with
    device=cuda) and ``cpus_per_worker`` each.
    """
    p, gen = cfg.policy, cfg.policy.generation
    have_gpu, have_cpu = float(resources.get("GPU", 0)), float(resources.get("CPU", 0))
    if p.device == "cuda" and have_gpu == 0:
        raise ConfigError(
            f"policy.device=cuda but the Ray cluster has no GPU (resources: CPU {have_cpu:g}); set policy.device=cpu "
            "or join a GPU cluster"
        )
    tp = int(gen.vllm_kwargs.get("tensor_parallel_size") or 1)
    engine_gpu = gen.num_engines * tp if have_gpu > 0 else 0
    engine_cpu = gen.num_engines * (1 if have_gpu > 0 else gen.cpus_per_engine)
    policy_gpu = p.num_workers * p.gpus_per_worker if p.device == "cuda" else 0.0
    policy_cpu = p.num_workers * p.cpus_per_worker
    per_engine_cpu = "1 per GPU engine" if have_gpu > 0 else "cpus_per_engine"
    for what, have, pol, eng, pol_how, eng_how, fix in (
        (
            "GPUs",
            have_gpu,
            policy_gpu,
            engine_gpu,
            f"{p.num_workers} x {p.gpus_per_worker:g} (policy.num_workers x policy.gpus_per_worker)",
            f"{gen.num_engines} x {tp} (policy.generation.num_engines x tensor_parallel_size)",
            "policy.gpus_per_worker=0 shares the engines' GPUs",
        ),
        (
            "CPUs",
            have_cpu,
            policy_cpu,
            engine_cpu,
            f"{p.num_workers} x {p.cpus_per_worker:g} (policy.num_workers x policy.cpus_per_worker)",
            f"{gen.num_engines} x {engine_cpu // max(gen.num_engines, 1)} (policy.generation.num_engines x "
            f"{per_engine_cpu})",
            "policy.cpus_per_worker=0 reserves none",
        ),
    ):
        if pol + eng > have:
            raise ConfigError(
                f"the run asks for {pol + eng:g} {what} but the Ray cluster has {have:g}: policy {pol_how} = {pol:g}, "
                f"engines {eng_how} = {eng:g}. Lower these ({fix}), or add nodes to the cluster."
            )


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
