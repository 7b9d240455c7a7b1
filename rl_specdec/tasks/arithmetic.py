"""A chat task for instruct models: multi-step arithmetic word problems.

The task of the GPU configs (``configs/qwen3_*.yaml``). Each problem is a short
story about one person's collection of items: a starting count, then
``min_steps`` to ``max_steps`` operations on it (gains, losses, packs bought,
a multiple, an equal split), then the question of the final count::

    Hana has 14 shells. Hana buys 3 packs with 6 shells in each. Hana gives
    9 shells to a friend. How many shells does Hana have now?
    Reason step by step, then give the final answer as \\boxed{N}.   -> 23

Problems are generated in code from a seed (nothing is downloaded); every
intermediate count is a non-negative integer. The prompt reaches the model
through the tokenizer's chat template (``apply_chat_template(...,
add_generation_prompt=True)``, with ``chat_template_kwargs`` such as Qwen3's
``enable_thinking``): :meth:`ArithmeticChatTask.encode_prompt`. A tokenizer
without a chat template is refused before any actor starts.

Reward: 1.0 when the response finished (EOS, not cut off at
``max_new_tokens``) and its final answer equals the answer exactly, else 0.0.
The final answer is the content of the last ``\\boxed{...}`` when there is
one, else the last integer of the response; a reasoning block
(``<think>...</think>``) is skipped, and a response still inside one has no
answer. Thousands separators (``1,234``) are accepted.

Held-out split: a problem belongs to the validation split when the CRC32 of
its prompt text is divisible by ``holdout_every``. Training problems are drawn
only outside that split and validation problems only inside it, so no
validation problem is ever trained on, whatever the seeds.
"""

from __future__ import annotations

import random
import re
import zlib
from dataclasses import dataclass, field
from typing import Any

from rl_specdec.errors import ConfigError
from rl_specdec.tasks.base import Sample, TaskReward

NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goro", "Hana", "Ivan", "Jamal", "Kira", "Luis")
ITEMS = ("apples", "stamps", "marbles", "books", "coins", "stickers", "pencils", "shells")
MULTIPLES = {2: "twice", 3: "three times", 4: "four times"}
INSTRUCTION = "Reason step by step, then give the final answer as \\boxed{N}."
OPERATIONS = ("gain", "pack", "lose", "multiple", "split")
MAX_COUNT = 100_000  # no multiple is taken of a count above this: answers stay short

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_INTEGER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?![\d])")
_PLAIN_INTEGER = re.compile(r"[-+]?\d+")


def parse_integer(text: str) -> str | None:
    """``text`` as a canonical integer string (``"1,234"`` -> ``"1234"``, ``" +7 "`` -> ``"7"``), else None."""
    s = text.strip().strip("$").strip().rstrip(".").replace(",", "")
    return str(int(s)) if _PLAIN_INTEGER.fullmatch(s) else None


def final_answer(response: str) -> str | None:
    """The response's final answer: its last ``\\boxed{}``, else its last integer, after any reasoning block."""
    if "</think>" in response:
        response = response.rsplit("</think>", 1)[1]
    elif "<think>" in response:
        return None  # cut off while reasoning
    boxed = _BOXED.findall(response)
    if boxed:
        return parse_integer(boxed[-1])
    integers = _INTEGER.findall(response)
    return parse_integer(integers[-1]) if integers else None


def _count(k: int, item: str) -> str:
    """``"1 apple"``, ``"3 apples"`` (every item's plural is its singular + s)."""
    return f"{k} {item if k != 1 else item[:-1]}"


def _operation(
    rng: random.Random, who: str, item: str, x: int, allowed: tuple[str, ...] = OPERATIONS, max_operand: int = 30
) -> tuple[str, int]:
    """One random operation on ``x``, of the ``allowed`` kinds that apply: its sentence and the new count."""
    kinds = ["gain", "pack"] + (["lose"] if x >= 2 else [])
    kinds += ["multiple"] if 0 < x <= MAX_COUNT else []
    divisors = [d for d in range(2, 7) if x >= d and x % d == 0]
    kinds += ["split"] if divisors else []
    kinds = [k for k in kinds if k in allowed] or ["gain"]  # a gain always applies
    kind = rng.choice(kinds)
    if kind == "gain":
        k = rng.randint(2, max(2, max_operand))
        return f"{who} gets {k} more {item}.", x + k  # k >= 2
    if kind == "pack":
        a, b = rng.randint(2, 9), rng.randint(2, 12)
        return f"{who} buys {a} packs with {b} {item} in each.", x + a * b
    if kind == "lose":
        k = rng.randint(1, x - 1)
        return f"{who} gives {_count(k, item)} to a friend.", x - k
    if kind == "multiple":
        m = rng.choice(sorted(MULTIPLES))
        return f"{who} then has {MULTIPLES[m]} as many {item} as before.", x * m
    d = rng.choice(divisors)
    return f"{who} splits the {item} into {d} equal piles and keeps one pile.", x // d


@dataclass
class ArithmeticChatTask:
    """Arithmetic word problems for a chat model, encoded with its chat template.

    ``min_steps``/``max_steps`` bound the operations per problem; ``max_start``
    the starting count; ``operations`` the kinds drawn from (a subset of
    :data:`OPERATIONS`); ``max_operand`` the count a gain adds. ``chat_template_kwargs`` go to ``apply_chat_template``
    (e.g. ``{enable_thinking: false}`` for Qwen3); ``system_prompt``, when set,
    is sent as a system message before the problem.
    """

    min_steps: int = 2
    max_steps: int = 5
    max_start: int = 50
    operations: tuple[str, ...] = OPERATIONS
    max_operand: int = 30
    instruction: str = INSTRUCTION
    system_prompt: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    holdout_every: int = 8  # 1 problem in holdout_every is reserved for validation (see module doc)
    # A right answer earns its reward only after this many words of working: without it GRPO can learn to guess
    # a bare \boxed{N} (shorter, so never cut) where the instruction asks for sentences. Accuracy ignores it.
    min_working_words: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.min_steps <= self.max_steps:
            raise ConfigError(
                f"task.kwargs.min_steps={self.min_steps}, max_steps={self.max_steps}: need 1 <= min_steps <= max_steps"
            )
        if self.max_start < 1:
            raise ConfigError(f"task.kwargs.max_start={self.max_start} must be >= 1")
        self.operations = tuple(self.operations)
        unknown = sorted(set(self.operations) - set(OPERATIONS))
        if unknown or not self.operations:
            raise ConfigError(
                f"task.kwargs.operations={list(self.operations)}: give a non-empty subset of {list(OPERATIONS)}"
            )
        if self.max_operand < 2:
            raise ConfigError(f"task.kwargs.max_operand={self.max_operand} must be >= 2 (a gain adds 2..max_operand)")
        if self.min_working_words < 0:
            raise ConfigError(f"task.kwargs.min_working_words={self.min_working_words} must be >= 0 (0: none needed)")
        if self.holdout_every < 2:
            raise ConfigError(
                f"task.kwargs.holdout_every={self.holdout_every} must be >= 2 (1 in holdout_every problems is held out)"
            )

    def sample_problem(self, rng: random.Random, num_steps: int) -> Sample:
        who, item = rng.choice(NAMES), rng.choice(ITEMS)
        x = rng.randint(1, self.max_start)
        sentences = [f"{who} has {_count(x, item)}."]
        for _ in range(num_steps):
            sentence, x = _operation(rng, who, item, x, self.operations, self.max_operand)
            sentences.append(sentence)
        sentences.append(f"How many {item} does {who} have now?")
        prompt = " ".join(sentences) + ("\n" + self.instruction if self.instruction else "")
        return Sample(prompt=prompt, answer=str(x))

    def is_held_out(self, sample: Sample) -> bool:
        """Whether ``sample`` is in the validation split (never trained on)."""
        return zlib.crc32(sample.prompt.encode()) % self.holdout_every == 0

    def make_batch(self, seed: int, n: int) -> list[Sample]:
        """n training problems for this seed, deterministically, with step counts spread evenly over the range."""
        return self._problems(seed, n, held_out=False)

    def validation_batch(self, seed: int, n: int) -> list[Sample]:
        """n problems from the validation split."""
        return self._problems(seed, n, held_out=True)

    def _problems(self, seed: int, n: int, held_out: bool) -> list[Sample]:
        rng = random.Random(seed)
        span = self.max_steps - self.min_steps + 1
        steps = [self.min_steps + (i * span) // n for i in range(n)]
        rng.shuffle(steps)
        out = []
        for k in steps:
            s = self.sample_problem(rng, k)
            while self.is_held_out(s) != held_out:  # 1 in holdout_every is held out: a few draws at most
                s = self.sample_problem(rng, k)
            out.append(s)
        return out

    def encode_prompt(self, tokenizer: Any, prompt: str) -> list[int]:
        """The prompt as one user turn, rendered by the tokenizer's chat template with the generation prompt."""
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                f"task.name=chat_arithmetic renders prompts with the policy's chat template, but the tokenizer of "
                f"policy.model_name ({getattr(tokenizer, 'name_or_path', '?')}) has none. Use a chat/instruct model "
                "(e.g. Qwen/Qwen3-8B), or a task for raw prompts (task.name=sorting)."
            )
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append({"role": "user", "content": prompt})
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **self.chat_template_kwargs
        )
        return tokenizer.encode(text, add_special_tokens=False)  # the template writes any BOS itself

    def score(self, response: str, answer: str, finished: bool) -> TaskReward:
        """1.0 when the response finished and its final answer is exactly ``answer`` (after ``min_working_words``
        words before its last ``\\boxed``, where set); ``correct`` is the answer's alone."""
        correct = finished and final_answer(response) == answer
        working = len(response.rsplit("\\boxed", 1)[0].split())
        return TaskReward(reward=float(correct and working >= self.min_working_words), correct=correct)
