"""The chat task of the GPU configs: problems, chat-template encoding, reward, and its config plumbing."""

import re
from pathlib import Path

import pytest

from rl_specdec.config import ConfigError, load_config
from rl_specdec.tasks import ArithmeticChatTask, Sample, SortingTask, encode_prompts
from rl_specdec.tasks.arithmetic import MULTIPLES, final_answer
from rl_specdec.toy.resolve import prepare_models
from rl_specdec.toy.tools import build_tool_tokenizer

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "configs" / "grpo_spec.yaml"
GPU_CONFIGS = ["qwen3_1p7b_one_gpu.yaml", "qwen3_draft_model.yaml", "qwen3_eagle3.yaml", "qwen3_ngram.yaml"]

# Qwen3's generation prompt, as its chat template writes it (thinking off: an empty think block).
QWEN3_STYLE_TEMPLATE = (
    "{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}{%- endif -%}"
)


def byte_tokenizer(template: str | None = QWEN3_STYLE_TEMPLATE):
    """A byte-level tokenizer with no merges (every byte one token; Qwen's turn markers special tokens)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", model_max_length=1 << 20)
    out.chat_template = template
    return out


# ---- problems -------------------------------------------------------------------------------


def solve(prompt: str) -> int:
    """The answer of a problem, recomputed from its sentences (independently of the generator)."""
    story = prompt.split("\n")[0]
    sentences = re.split(r"(?<=[.?])\s+", story)
    x = int(re.match(r"\w+ has (\d+) ", sentences[0]).group(1))
    words = {w: m for m, w in MULTIPLES.items()}
    for s in sentences[1:-1]:
        n = [int(v) for v in re.findall(r"\d+", s)]
        if " gets " in s:
            x += n[0]
        elif " buys " in s:
            x += n[0] * n[1]
        elif " gives " in s:
            x -= n[0]
        elif " as many " in s:
            x *= words[re.search(r"has (.+) as many", s).group(1)]
        elif " splits " in s:
            assert x % n[0] == 0, s
            x //= n[0]
        else:
            raise AssertionError(f"unknown sentence {s!r}")
        assert x >= 0, prompt
    assert sentences[-1].startswith("How many ")
    return x


def test_problems_are_deterministic_correct_and_split():
    task = ArithmeticChatTask(min_steps=2, max_steps=5)
    train, again = task.make_batch(seed=3, n=200), task.make_batch(seed=3, n=200)
    assert train == again
    assert train != task.make_batch(seed=4, n=200)
    val = task.validation_batch(seed=3, n=200)
    assert all(str(solve(s.prompt)) == s.answer for s in train + val)
    assert not any(task.is_held_out(s) for s in train) and all(task.is_held_out(s) for s in val)
    assert not {s.prompt for s in train} & {s.prompt for s in val}
    steps = sorted(len(re.split(r"(?<=[.?])\s+", s.prompt.split("\n")[0])) - 2 for s in train)
    assert steps == sorted(2 + (i * 4) // 200 for i in range(200))  # spread evenly over 2..5
    assert all(s.prompt.endswith("\\boxed{N}.") for s in train)


def test_operations_and_max_operand_bound_the_problems():
    """The real model's task: one gain or loss of at most 10 on a count up to 10, every answer still right."""
    task = ArithmeticChatTask(min_steps=1, max_steps=1, max_start=10, operations=["gain", "lose"], max_operand=10)
    problems = task.make_batch(seed=5, n=300) + task.validation_batch(seed=5, n=100)
    assert all(str(solve(s.prompt)) == s.answer for s in problems)
    kinds = {("gets" in s.prompt, "gives" in s.prompt) for s in problems}
    assert kinds == {(True, False), (False, True)}  # both kinds, nothing else
    gains = [int(re.search(r"gets (\d+) more", s.prompt).group(1)) for s in problems if "gets" in s.prompt]
    assert max(gains) == 10 and min(gains) == 2
    assert max(int(re.search(r"has (\d+) ", s.prompt).group(1)) for s in problems) <= 10


def test_bad_task_values_stop_the_load_with_the_key():
    with pytest.raises(ConfigError, match=r"task.kwargs.operations=\['gain', 'divide'\]: give a non-empty subset"):
        ArithmeticChatTask(operations=["gain", "divide"])
    with pytest.raises(ConfigError, match=r"task.kwargs.max_operand=1 must be >= 2"):
        ArithmeticChatTask(max_operand=1)
    with pytest.raises(ConfigError, match=r"task.kwargs.min_steps=4, max_steps=2: need 1 <= min_steps <= max_steps"):
        load_config(
            SPEC,
            ["task.name=chat_arithmetic", "task.kwargs.min_steps=4", "task.kwargs.max_steps=2"],
        )
    with pytest.raises(
        ConfigError, match=r"task.kwargs.max_step is not an argument .*Did you mean task.kwargs.max_steps"
    ):
        load_config(SPEC, ["task.name=chat_arithmetic", "task.kwargs.max_step=3"])


# ---- reward ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "response, finished, right",
    [
        ("14 + 9 = 23, so Hana has 23 shells.\n\\boxed{23}", True, True),
        ("Hana has 23 shells.", True, True),  # no box: the last integer
        ("<think>\n14 + 10 = 24? No: 23.\n</think>\n\n\\boxed{23}", True, True),
        ("\\boxed{ 23 }", True, True),
        ("\\boxed{22}", True, False),
        ("First \\boxed{23}, but on second thought \\boxed{24}", True, False),  # the last box counts
        ("\\boxed{23}", False, False),  # cut off at max_new_tokens
        ("It is 23 or maybe 24", True, False),
        ("", True, False),
        ("\\boxed{twenty-three}", True, False),
        ("\\boxed{23.5}", True, False),
        ("\\boxed{}", True, False),
        ("<think>\nHana has 23", True, False),  # still reasoning: no answer
    ],
)
def test_reward_reads_the_final_integer_exactly(response, finished, right):
    r = ArithmeticChatTask().score(response, "23", finished)
    assert (r.reward, r.correct) == (float(right), right)


def test_a_bare_guess_is_right_but_unrewarded_where_working_is_asked_for():
    task = ArithmeticChatTask(min_working_words=4)
    worked = task.score("Hana had 14 and found 9, so 23.\n\\boxed{23}", "23", True)
    assert (worked.reward, worked.correct) == (1.0, True)
    bare = task.score("So \\boxed{23}", "23", True)  # one word: the answer counts, the reward does not
    assert (bare.reward, bare.correct) == (0.0, True)
    assert task.score("Hana had 14 and found 9, so 22.\n\\boxed{22}", "23", True).reward == 0.0
    assert ArithmeticChatTask().score("So \\boxed{23}", "23", True).reward == 1.0  # 0, the default: none needed
    with pytest.raises(ConfigError, match=r"task.kwargs.min_working_words=-1 must be >= 0"):
        ArithmeticChatTask(min_working_words=-1)


def test_final_answer_canonical_forms():
    assert final_answer("\\boxed{1,234}") == "1234"
    assert final_answer("so 1,234 shells") == "1234"
    assert final_answer("\\boxed{$-7$}") == "-7"
    assert final_answer("no number here") is None


# ---- encoding through a chat template -------------------------------------------------------


def test_prompts_go_through_the_tool_toys_chat_template():
    tok = build_tool_tokenizer()  # the toy's template: the user turn, then "="
    task = ArithmeticChatTask()
    ids = encode_prompts(task, tok, [Sample("abc 12", "0")])
    assert ids == [tok.encode("abc 12=", add_special_tokens=False)]
    assert ids != [tok.encode("abc 12")]
    sorting = SortingTask()  # no encode_prompt: plain tokenizer.encode
    assert encode_prompts(sorting, tok, [Sample("31=", "13")]) == [tok.encode("31=")]


@pytest.mark.parametrize("thinking", [False, True])
def test_qwen3_style_template_with_template_kwargs(thinking):
    tok = byte_tokenizer()
    task = ArithmeticChatTask(system_prompt="Be brief.", chat_template_kwargs={"enable_thinking": thinking})
    prompt = task.make_batch(seed=0, n=1)[0].prompt
    ids = task.encode_prompt(tok, prompt)
    think = "" if thinking else "<think>\n\n</think>\n\n"
    expected = (
        f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n{think}"
    )
    assert tok.decode(ids) == expected
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3  # the markers are single tokens


def test_a_tokenizer_without_chat_template_is_refused():
    tok = build_tool_tokenizer()
    tok.chat_template = None
    with pytest.raises(ConfigError, match=r"task.name=chat_arithmetic .* has none\. .*task.name=sorting"):
        ArithmeticChatTask().encode_prompt(tok, "abc")


def test_setup_refuses_a_template_less_policy_before_any_actor(tmp_path, monkeypatch):
    from rl_specdec.grpo import run

    def no_actor(cfg):
        raise AssertionError("workers started before the task was checked")

    monkeypatch.setattr(run, "_start_workers", no_actor)
    base = ["logger.wandb.enabled=false", f"logger.log_dir={tmp_path}", "checkpoint.enabled=false"]
    cfg = load_config(SPEC, base + ["task.name=chat_arithmetic"])  # the toy policy's tokenizer has no template
    with pytest.raises(ConfigError, match="task.name=chat_arithmetic renders prompts with the policy's chat template"):
        run.setup(cfg)
    tokenizer, task = run.prepare_task(prepare_models(load_config(SPEC, base)))  # control: the sorting task passes
    assert isinstance(task, SortingTask) and encode_prompts(task, tokenizer, [Sample("31=", "13")])


# ---- task.kwargs follow task.name -------------------------------------------------------------


def test_another_task_drops_the_inherited_kwargs(tmp_path):
    cfg = load_config(SPEC, ["task.name=chat_arithmetic", "task.kwargs.max_steps=3"])
    assert cfg.task.kwargs == {"max_steps": 3}  # not grpo_spec's min_len/max_len/dataset_size
    same = load_config(SPEC, ["task.name=sorting", "task.kwargs.max_len=6"])
    assert same.task.kwargs == {"min_len": 4, "max_len": 6, "dataset_size": 0}  # same task: merged
    child = tmp_path / "child.yaml"
    child.write_text(f"defaults: [{SPEC}]\ntask: {{name: chat_arithmetic}}\n")
    assert load_config(child).task.kwargs == {}
    child.write_text(f"defaults: [{SPEC}]\ntask: {{kwargs: {{max_len: 6}}}}\n")
    assert load_config(child).task.kwargs["min_len"] == 4


# ---- the GPU configs ------------------------------------------------------------------------


@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_gpu_configs_train_the_chat_task_within_their_lengths(name):
    cfg = load_config(ROOT / "configs" / name, ["policy.device=cuda", "cluster.address=auto"])
    assert cfg.task.name == "chat_arithmetic"
    assert cfg.task.kwargs["chat_template_kwargs"] == {"enable_thinking": False}
    gen = cfg.policy.generation
    assert (gen.vllm_kwargs["max_model_len"], cfg.policy.micro_batch_size) == (2048, 1)  # the headers' arithmetic
    assert gen.speculation_control.mode == "off" and cfg.policy.precision == "bf16-mixed"
    # A byte-level BPE token is at least one byte (special tokens: one token), so bytes bound the
    # prompt's length in Qwen3's tokenizer from above.
    task = ArithmeticChatTask(**cfg.task.kwargs)
    tok = byte_tokenizer()
    samples = task.make_batch(seed=0, n=500) + task.validation_batch(seed=0, n=500)
    longest = max(len(ids) for ids in encode_prompts(task, tok, samples))
    assert longest + gen.max_new_tokens <= gen.vllm_kwargs["max_model_len"]
    rollouts = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    assert rollouts % gen.num_engines == 0 and rollouts % cfg.policy.num_workers == 0


def test_the_step0_probe_counts_the_groups_a_first_step_learns_from():
    """examples/heldout_accuracy.py --samples: a problem with answers both right and wrong is one GRPO learns from;
    all right or all wrong has no advantage."""
    import importlib.util

    import torch

    path = ROOT / "examples/heldout_accuracy.py"
    spec = importlib.util.spec_from_file_location("heldout_accuracy", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    correct = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0, 1.0]])  # [P=4, G=3]
    line = module._sampled(correct, [10] * 10 + [100, 384])
    assert "sampled accuracy 0.500 (3 answers to each of 4 problems)" in line
    assert "2/4 problems with a right and a wrong answer" in line
    assert "median 10, p90 91, max 384" in line
