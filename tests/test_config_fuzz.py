"""Every leaf key of every shipped config, given values of the wrong kind and out of range at load: each is refused
with a ``config error`` naming the key, never a traceback, and none is accepted (pure: no engine, no model file).

A key's kind is what its owner declares: rl_specdec's dataclasses for its own keys, vLLM's ``EngineArgs`` and
``SpeculativeConfig`` for ``vllm_kwargs`` (the declarations the config is checked against), the task's dataclass for
``task.kwargs``. Each distinct key is tried in the first shipped config (by name) that holds it. A negative number is
nonsense except where a key means something by it (``NEGATIVE_MEANS``). The negative control runs the same cases
with the kind checks switched off and shows the fuzzer catching what they catch."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import pytest

from rl_specdec.config import ConfigError, RunConfig, load_config_as_written, to_dict
from rl_specdec.vllm_ext import declarations
from rl_specdec.vllm_ext.declarations import kind_of

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
VK = "policy.generation.vllm_kwargs"
SPEC = f"{VK}.speculative_config"
# keys where a negative number is a setting: vLLM's and the trainer's "off" or "all"
NEGATIVE_MEANS = {"seed": "any integer seeds the run"}
BAD = {
    "int": ["abc", "1.5", "nan", "-7"],
    "float": ["abc", "nan", "inf", "-7.0"],
    "bool": ["maybe"],  # OmegaConf reads an integer given for a bool as its truth value, as YAML 1.1 does
    "str": ["{a: 1}"],
}


def leaves(d: dict, prefix: str = ""):
    for k, v in d.items():
        if isinstance(v, dict) and v:
            yield from leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def own_kind(key: str) -> Any:
    """The kind rl_specdec's own dataclasses declare for ``key`` (None: a dict's entry, or not a scalar)."""
    cls: Any = RunConfig
    for part in key.split("."):
        if not dataclasses.is_dataclass(cls):
            return None
        tp = typing.get_type_hints(cls).get(part)
        if tp is None:
            return None
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        cls = inner[0] if typing.get_origin(tp) is typing.Union and len(inner) == 1 else tp
    return None if dataclasses.is_dataclass(cls) else kind_of(cls)


def declared_kind(key: str, cfg: dict) -> Any:
    if key.startswith(f"{SPEC}."):
        return declarations.speculative_config_kinds().get(key.rsplit(".", 1)[1])
    if key.startswith(f"{VK}."):
        return declarations.engine_arg_kinds().get(key[len(VK) + 1 :])
    if key.startswith("task.kwargs."):
        from rl_specdec.tasks import TASKS

        cls = TASKS[cfg["task"]["name"]]
        hints = typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
        return kind_of(hints[key.rsplit(".", 1)[1]]) if key.rsplit(".", 1)[1] in hints else None
    return own_kind(key)


def cases() -> list[tuple[str, str, str, Any]]:
    """(config file, key, bad value, kind), each distinct key in the first config that holds it."""
    seen: dict[str, tuple[str, dict]] = {}
    for path in CONFIGS:
        cfg = to_dict(load_config_as_written(path))
        for key, _ in leaves(cfg):
            seen.setdefault(key, (path.name, cfg))
    out = []
    for key, (name, cfg) in sorted(seen.items()):
        kind = declared_kind(key, cfg)
        if isinstance(kind, list):
            bad = ["not_one_of_them", "123"]
        else:
            bad = BAD.get(kind, [])
            if kind == "str" and key.startswith(f"{VK}."):
                bad = bad + ["123"]  # vLLM reads a string there; rl_specdec's own strings take "123" as text
        out += [(name, key, b, kind) for b in bad if not (b.startswith("-") and key in NEGATIVE_MEANS)]
    return out


CASES = cases()


def outcome(name: str, key: str, bad: str) -> str:
    """``refused`` (a config error naming the key), or what went wrong: accepted, a traceback, an unnamed key."""
    try:
        load_config_as_written(ROOT / "configs" / name, [f"{key}={bad}"])
    except ConfigError as e:
        return "refused" if key.rsplit(".", 1)[-1] in str(e) else f"refused without naming {key}: {e}"
    except Exception as e:  # noqa: BLE001 (a traceback, where a user should read a config error)
        return f"traceback {type(e).__name__}: {e}"
    return "accepted"


def test_the_cases_cover_every_shipped_config_and_each_kind():
    keys = {k for _, k, _, _ in CASES}
    assert {name for name, _, _, _ in CASES} <= {p.name for p in CONFIGS}
    wanted = {"policy.learning_rate", f"{SPEC}.num_speculative_tokens", f"{VK}.max_model_len", "task.kwargs.min_len"}
    assert wanted <= keys
    assert {kind for *_, kind in CASES if not isinstance(kind, list)} == {"int", "float", "bool", "str"}
    assert len(keys) > 60


@pytest.mark.parametrize("chunk", range(4))
def test_every_wrong_or_out_of_range_value_of_every_key_is_a_config_error(chunk):
    wrong = [
        f"{key}={bad} ({name}): {got}"
        for name, key, bad, _ in CASES[chunk::4]
        if (got := outcome(name, key, bad)) != "refused"
    ]
    assert not wrong, "\n".join(wrong)


def test_negative_control_with_the_checks_off_the_fuzzer_reports_what_they_catch(monkeypatch):
    """The cases the kind and number checks refuse come back as accepted nonsense once those checks are off
    (``num_speculative_tokens=abc`` stays refused: the typed speculation refuses it too)."""
    from rl_specdec.config import checks, vllm_kwargs

    monkeypatch.setattr(vllm_kwargs, "check_kinds", lambda *a, **k: None)
    monkeypatch.setattr(checks, "check_numbers", lambda *a, **k: None)
    for key, bad in (
        (f"{SPEC}.draft_sample_method", "123"),
        (f"{VK}.max_model_len", "-7"),
        ("policy.weight_decay", "nan"),
    ):
        case = next(c for c in CASES if c[1] == key and c[2] == bad)
        assert outcome(*case[:3]) == "accepted", case
