"""Unit tests of multi-turn token splicing (no engine): replace_prefix_tokens.

The splice inside the server is tested through a running server (test_openai_wire.py, test_agent.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rl_specdec.errors import PrefixSpliceError
from rl_specdec.rollout import replace_prefix_tokens

TOK2 = SimpleNamespace(eos_token_id=2)  # the seed document's example uses eos = 2


# ---- replace_prefix_tokens ----------------------------------------------------------------------


def test_seed_document_example():
    # turn 1: prefill [11,12,13,40,41], model output [220,17,2]; turn 2 re-tokenises " 4" as 1001
    model_prefix = [11, 12, 13, 40, 41, 220, 17, 2]
    template_prefix = [11, 12, 13, 40, 41, 1001, 2]
    template = [11, 12, 13, 40, 41, 1001, 2, 21, 22, 40, 41]
    assert replace_prefix_tokens(TOK2, model_prefix, template_prefix, template) == [
        11,
        12,
        13,
        40,
        41,
        220,
        17,
        2,
        21,
        22,
        40,
        41,
    ]


def test_first_turn_returns_the_template():
    assert replace_prefix_tokens(TOK2, [], [], [11, 40, 41]) == [11, 40, 41]


def test_last_turn_hit_max_tokens_without_eos():
    # the model stopped at max_tokens after [220, 17]: its tokens are kept whole and the template's EOS follows
    out = replace_prefix_tokens(TOK2, [11, 40, 220, 17], [11, 40, 1001, 2], [11, 40, 1001, 2, 21, 40])
    assert out == [11, 40, 220, 17, 2, 21, 40]
    assert out[:4] == [11, 40, 220, 17]


def test_template_that_strips_earlier_reasoning():
    """Every turn ends with EOS (Qwen style); re-rendered history drops the reasoning block [50, 60, 51].

    The template is then shorter than its own prefix rendering, so the turn's EOS moves;
    a search by position (up to len(template_prefix)) would stop at the new user turn's EOS.
    """
    model_prefix = [11, 12, 2, 40, 50, 60, 51, 17, 2]  # prompt [11,12,2,40] + output [50,60,51,17,2]
    template_prefix = [11, 12, 2, 40, 50, 60, 51, 1017, 2]  # reasoning kept: it is the last turn here
    template = [11, 12, 2, 40, 1017, 2, 21, 22, 2, 40]  # reasoning stripped, then user [21,22] + EOS, gen prompt 40
    out = replace_prefix_tokens(TOK2, model_prefix, template_prefix, template)
    assert out == [11, 12, 2, 40, 50, 60, 51, 17, 2, 21, 22, 2, 40]
    assert out[: len(model_prefix)] == model_prefix


def test_several_earlier_turns():
    # two assistant turns in the history; the model prefix already holds turn 1's exact tokens
    model_prefix = [11, 220, 17, 2, 21, 230, 2]
    template_prefix = [11, 1001, 2, 21, 1002, 2]
    template = [11, 1001, 2, 21, 1002, 2, 31, 40]
    assert replace_prefix_tokens(TOK2, model_prefix, template_prefix, template) == [11, 220, 17, 2, 21, 230, 2, 31, 40]


def test_tokenizer_without_eos_is_an_error():
    with pytest.raises(PrefixSpliceError, match="EOS"):
        replace_prefix_tokens(SimpleNamespace(eos_token_id=None), [1, 2], [1, 2], [1, 2, 3])
    with pytest.raises(PrefixSpliceError, match="EOS"):
        replace_prefix_tokens(SimpleNamespace(), [1, 2], [1, 2], [1, 2, 3])


def test_template_without_turn_boundary_is_an_error():
    with pytest.raises(PrefixSpliceError, match="no turn boundary"):
        replace_prefix_tokens(TOK2, [11, 220, 17, 2], [11, 1001], [11, 1001, 21, 40])


def test_template_that_loses_a_boundary_is_an_error():
    with pytest.raises(PrefixSpliceError, match="inconsistently"):
        replace_prefix_tokens(TOK2, [11, 220, 2, 21, 230, 2], [11, 1001, 2, 21, 1002, 2], [11, 1001, 2, 21, 1002, 31])


def test_error_type_is_a_value_error():
    assert issubclass(PrefixSpliceError, ValueError)
