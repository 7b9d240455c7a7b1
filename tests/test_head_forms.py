"""Published EAGLE-3 heads: the form whose parity with vLLM's drafter is tested is taken, every other is refused
at load, naming the option and the fix (no engine, no download)."""

from __future__ import annotations

import json

import pytest

from rl_specdec.heads.eagle3 import HeadShape
from rl_specdec.heads.forms import SUPPORTED, untrainable

# the published head configs/qwen3_eagle3.yaml names (Tengyunw/qwen3_8b_eagle3), as its config.json reads:
# one Llama decoder layer sized like a Qwen3-8B layer, grouped-query 32:8, a 32,000-token draft vocabulary
QWEN3_8B_HEAD = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "model_type": "llama",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 12288,
    "num_hidden_layers": 1,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "vocab_size": 151936,
    "draft_vocab_size": 32000,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
}


def test_the_published_head_the_gpu_config_names_is_the_trained_form():
    assert untrainable(QWEN3_8B_HEAD, 36) == ""
    shape = HeadShape.from_config(type("C", (), QWEN3_8B_HEAD)(), 36)
    assert shape.aux_layer_ids == (2, 18, 33) and shape.kv_heads == 8 and shape.draft_vocab_size == 32000


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("norm_before_residual", True),
        ("norm_output", True),
        ("attention_bias", True),
        ("mlp_bias", True),
        ("hidden_act", "gelu"),
        ("num_hidden_layers", 2),
        ("fc_norm", True),
        ("norm_before_fc", True),
        ("logit_scale", 2.0),
        ("target_hidden_size", 2048),
    ],
)
def test_an_option_that_changes_vllms_computation_is_refused_by_name(option, value):
    why = untrainable({**QWEN3_8B_HEAD, option: value}, 36)
    assert option in why and "LlamaForCausalLMEagle3" in why  # the option, and the supported form


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"eagle_config": {"norm_before_fc": True}}, "norm_before_fc"),
        ({"eagle_config": {"use_aux_hidden_state": False}}, "use_aux_hidden_state"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"architectures": ["Eagle3Qwen3ForCausalLM"]}, "qwen3_eagle3.Eagle3Qwen3ForCausalLM"),
        ({"architectures": ["Eagle3DeepseekV3ForCausalLM"]}, "deepseek_eagle3"),
        ({"eagle_aux_hidden_state_layer_ids": [2, 18, 36]}, "0..35"),
        ({"eagle_aux_hidden_state_layer_ids": [2, 2, 33]}, "repeat"),
        ({"eagle_aux_hidden_state_layer_ids": [2, 18, 33], "num_aux_hidden_states": 4}, "num_aux_hidden_states"),
    ],
)
def test_a_form_the_trainer_does_not_mirror_is_refused_with_the_reason(extra, words):
    assert words in untrainable({**QWEN3_8B_HEAD, **extra}, 36)


def test_every_supported_architecture_is_the_drafter_the_parity_tests_load():
    from rl_specdec.vllm_ext.head_parity import drafter_class

    assert {drafter_class(a) for a in SUPPORTED} == {"llama_eagle3.Eagle3LlamaForCausalLM"}


def test_the_trainer_reads_aux_ids_as_vllm_does_top_level_first_and_in_layer_order():
    shape = HeadShape.from_config(type("C", (), {**QWEN3_8B_HEAD, "eagle_aux_hidden_state_layer_ids": [30, 3, 17]})())
    assert shape.aux_layer_ids == (3, 17, 30)
    with pytest.raises(ValueError, match="repeat"):
        HeadShape(
            hidden_size=8, num_attention_heads=1, head_dim=8, intermediate_size=8, vocab_size=8, aux_layer_ids=(1, 1, 2)
        )


def test_the_run_stops_at_prepare_on_a_head_it_cannot_train(tmp_path):
    from rl_specdec.errors import ConfigError
    from rl_specdec.toy.resolve import _check_trainable_head

    (tmp_path / "head").mkdir()
    (tmp_path / "head" / "config.json").write_text(json.dumps({**QWEN3_8B_HEAD, "norm_output": True}))
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps({"num_hidden_layers": 36}))
    with pytest.raises(ConfigError, match=r"speculative_config.model.*norm_output=True.*enabled=false"):
        _check_trainable_head(str(tmp_path / "head"), str(tmp_path / "target"))
