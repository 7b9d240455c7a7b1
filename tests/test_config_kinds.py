"""A declared type as a load-time check (rl_specdec/config/kinds.py): pure logic, no vLLM."""

from pathlib import Path

import pytest

from rl_specdec.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
SPEC_KEY = "policy.generation.vllm_kwargs.speculative_config"
VK = "policy.generation.vllm_kwargs"


def test_a_declared_type_becomes_a_check_and_right_values_pass():
    """kind_of reads what a field declares; check_kinds refuses the wrong kind and passes the right one (the
    negative control: the same fields with good values)."""
    from typing import Literal, Optional

    from rl_specdec.config.kinds import check_kinds
    from rl_specdec.errors import ConfigError
    from rl_specdec.vllm_ext.declarations import kind_of

    assert [kind_of(t) for t in (int, Optional[float], bool | None, str)] == ["int", "float", "bool", "str"]
    assert kind_of(Optional[Literal["a", "b"]]) == ["a", "b"] and kind_of(Literal["a"] | str) == "str"
    assert kind_of(dict[str, int]) is None and kind_of(int | str) is None  # left to their owner
    kinds = {"n": "int", "x": "float", "on": "bool", "how": ["a", "b"]}
    check_kinds({"n": 3, "x": 2, "on": False, "how": "b", "other": object(), "size": None}, kinds, "k", {"n": ()})
    bad_values = [
        ({"n": True}, "k.n=True must be an integer"),
        ({"x": float("inf")}, "finite"),
        ({"on": 1}, "true or false"),
        ({"how": "c"}, "one of a, b"),
        ({"n": 0}, "k.n=0 must be >= 1"),
    ]
    for bad, says in bad_values:
        with pytest.raises(ConfigError, match=says):
            check_kinds(bad, kinds, "k", {"n": ()})


# values of the wrong kind for the field vLLM, the trainer or the task declares, and sizes below 1
@pytest.mark.parametrize(
    "overrides, needle",
    [
        ([f"{SPEC_KEY}.draft_sample_method=123"], "draft_sample_method=123 must be one of greedy, probabilistic"),
        (["policy.learning_rate=nan"], "policy.learning_rate=nan must be a finite number"),
        (["policy.max_grad_norm=nan"], "policy.max_grad_norm=nan must be a finite number"),
        (["grpo.kl_coef=nan"], "grpo.kl_coef=nan must be a finite number"),
        ([f"{VK}.max_model_len=abc"], "vllm_kwargs.max_model_len='abc' must be an integer"),
        ([f"{VK}.max_model_len=1.5"], "vllm_kwargs.max_model_len=1.5 must be an integer"),
        ([f"{VK}.max_model_len=-7"], "vllm_kwargs.max_model_len=-7 must be >= 1 or -1"),
        ([f"{VK}.kv_cache_memory_bytes=-7"], "vllm_kwargs.kv_cache_memory_bytes=-7 must be >= 1"),
        ([f"{VK}.enable_prefix_caching=maybe"], "vllm_kwargs.enable_prefix_caching='maybe' must be true or false"),
        ([f"{VK}.kv_cache_dtype=fp4"], "vllm_kwargs.kv_cache_dtype='fp4' must be one of auto"),
        (["task.kwargs.min_len=abc"], "task.kwargs.min_len='abc' must be an integer"),
    ],
)
def test_a_value_of_the_wrong_kind_names_the_key(overrides, needle):
    with pytest.raises(ConfigError, match=None) as e:
        load_config(ROOT / "configs/grpo_spec.yaml", overrides)
    assert needle in str(e.value)
