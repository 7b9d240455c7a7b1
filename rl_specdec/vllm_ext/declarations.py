"""vLLM's own declarations that rl_specdec validates configs against (names, literals, parsers, registries).

Reading them here, instead of copying lists into rl_specdec, means a new vLLM
method or engine argument passes validation without a change; reading them in
one module means an upgrade that moves them fails in one place
(:mod:`rl_specdec.vllm_ext` probes every name below at start-up).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from typing import Any, Callable

from rl_specdec.vllm_ext import facts


def _flatten_literal(tp) -> list[str]:
    out: list[str] = []
    for a in typing.get_args(tp):
        out += _flatten_literal(a) if typing.get_args(a) else [a]
    return out


def _field_names(cls) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(cls.model_fields)


def _declared(kind: Callable[[Any], Any]):
    """The declaration as ``kind`` (list or set), read from the installation's facts file where the store is on."""

    def wrap(read):
        @functools.wraps(read)
        def declared():
            return kind(facts.fact(f"declarations/{read.__name__}", lambda: sorted(read())))

        return declared

    return wrap


@_declared(list)
def speculative_methods() -> list[str]:
    """Every ``speculative_config.method`` vLLM declares (the ``SpeculativeMethod`` literal)."""
    from vllm.config.speculative import SpeculativeMethod

    return sorted(set(_flatten_literal(SpeculativeMethod)))


@_declared(set)
def mtp_methods() -> set[str]:
    """The multi-token-prediction model types vLLM declares (``MTPModelTypes``)."""
    from vllm.config.speculative import MTPModelTypes

    return set(_flatten_literal(MTPModelTypes))


@_declared(set)
def speculative_config_fields() -> set[str]:
    from vllm.config.speculative import SpeculativeConfig

    return _field_names(SpeculativeConfig)


@_declared(set)
def engine_arg_names() -> set[str]:
    """The fields of ``vllm.engine.arg_utils.EngineArgs``: every key ``vllm.LLM(...)`` takes."""
    from vllm.engine.arg_utils import EngineArgs

    return _field_names(EngineArgs)


@_declared(set)
def async_engine_arg_names() -> set[str]:
    from vllm.engine.arg_utils import AsyncEngineArgs

    return _field_names(AsyncEngineArgs)


def kind_of(tp) -> Any:
    """A declared type as a check that needs no import: "bool", "int", "float", "str", a list of the allowed
    values (a ``Literal``), or None (any other type, left to its owner to check). Optional adds nothing: a null
    value means the default and is not checked."""
    if tp in (bool, int, float, str):
        return tp.__name__
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return _flatten_literal(tp)
    if origin not in (typing.Union, types.UnionType):
        return None
    kinds = [kind_of(a) for a in typing.get_args(tp) if a is not type(None)]
    if len(kinds) == 1:
        return kinds[0]
    return "str" if "str" in kinds and all(k == "str" or isinstance(k, list) for k in kinds) else None


def _kinds(cls) -> dict[str, Any]:
    return {f.name: k for f in dataclasses.fields(cls) if (k := kind_of(f.type)) is not None}


def _declared_kinds(read):
    """A declaration of field types (a dict), read from the installation's facts file where the store is on."""

    @functools.wraps(read)
    def declared() -> dict[str, Any]:
        return facts.fact(f"declarations/{read.__name__}", read)

    return declared


@_declared_kinds
def engine_arg_kinds() -> dict[str, Any]:
    """Each ``EngineArgs`` field's :func:`kind_of`, where it has one."""
    from vllm.engine.arg_utils import EngineArgs

    return _kinds(EngineArgs)


@_declared_kinds
def speculative_config_kinds() -> dict[str, Any]:
    """Each ``SpeculativeConfig`` field's :func:`kind_of`, where it has one."""
    from vllm.config.speculative import SpeculativeConfig

    return _kinds(SpeculativeConfig)


def parse_speculation_schedule(schedule: list[Any]) -> list[list[int]]:
    """vLLM's own parser of ``num_speculative_tokens_per_batch_size`` (raises ValueError/TypeError on a bad one)."""

    def parse() -> list[list[int]]:
        from vllm.v1.spec_decode.dynamic.utils import validate_and_normalize_dynamic_sd_schedule

        return [list(e) for e in validate_and_normalize_dynamic_sd_schedule(schedule)]

    try:
        key = json.dumps(schedule)
    except TypeError:  # not JSON: vLLM's parser says what is wrong with it
        return parse()
    return [list(e) for e in facts.fact(f"schedule/{key}", parse)]


@_declared(list)
def tool_call_parsers() -> list[str]:
    from vllm.tool_parsers import ToolParserManager

    return sorted(ToolParserManager.list_registered())


@_declared(list)
def reasoning_parsers() -> list[str]:
    from vllm.reasoning import ReasoningParserManager

    return sorted(ReasoningParserManager.list_registered())


def has_arctic_inference() -> bool:
    """Whether vLLM's ``suffix`` method can run here (it needs the arctic-inference package, which the key does
    not cover: asked live)."""
    from vllm.utils.import_utils import has_arctic_inference as has

    return bool(has())


PROBES = {
    "SpeculativeMethod": speculative_methods,
    "MTPModelTypes": mtp_methods,
    "SpeculativeConfig fields": speculative_config_fields,
    "EngineArgs fields": engine_arg_names,
    "AsyncEngineArgs fields": async_engine_arg_names,
    "EngineArgs field types": engine_arg_kinds,
    "SpeculativeConfig field types": speculative_config_kinds,
    "validate_and_normalize_dynamic_sd_schedule": lambda: parse_speculation_schedule([[1, 4, 2]]),
    "ToolParserManager": tool_call_parsers,
    "ReasoningParserManager": reasoning_parsers,
}
