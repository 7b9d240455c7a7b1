"""The lookup task and the tool toy's SFT data (pure logic, no engine)."""

from __future__ import annotations

import random

from rl_specdec.tasks.lookup import KEYS, LookupTask, model_tool_call
from rl_specdec.toy.tools import ToolToyConfig, _SftBatches, build_tool_tokenizer, sft_example


def test_one_letter_keys_come_from_the_first_num_keys_letters():
    task = LookupTask(num_keys=8)
    eps = task.make_batch(seed=0, n=400)
    assert {e.key for e in eps} == set(KEYS[:8])
    assert all(len(e.value) == 3 and e.value.isdigit() for e in eps)
    assert all(e.lookup(e.key) == e.value and e.lookup("zz") == "none" for e in eps[:10])


def test_validation_episodes_are_not_training_episodes():
    task = LookupTask()
    train = {(e.key, e.table) for s in range(50) for e in task.make_batch(seed=s, n=16)}
    val = [(e.key, e.table) for e in task.validation_batch(seed=0, n=128)]
    assert not train & set(val)


def test_a_tool_episode_trains_both_model_turns_and_not_the_tool_result():
    tok = build_tool_tokenizer()
    ep = LookupTask(num_keys=8).make_batch(seed=3, n=1)[0]
    ids, mask = sft_example(tok, ep)
    trained = tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert trained == model_tool_call(ep.key) + "<eos>" + ep.value + "<eos>"
    assert tok.decode(ids, skip_special_tokens=False).count("<tool_response>" + ep.value) == 1


def test_a_guessed_answer_has_no_tool_call():
    tok = build_tool_tokenizer()
    ep = LookupTask(num_keys=8).make_batch(seed=4, n=1)[0]
    ids, mask = sft_example(tok, ep, guess="123")
    assert tok.decode(ids, skip_special_tokens=False) == f"<tools>lookup</tools>{ep.key}=123<eos>"
    assert tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False) == "123<eos>"


def test_guesses_enter_the_sft_data_only_from_direct_from():
    cfg = ToolToyConfig(batch_size=64, direct_rate=0.5, direct_from=3)
    tok = build_tool_tokenizer()
    batches, rng = _SftBatches(cfg, tok), random.Random(0)
    call_id = tok.convert_tokens_to_ids("<tool_call>")
    rates = []
    for _ in range(6):
        ids, _ = batches(rng)  # [B, T]
        rates.append((ids == call_id).any(dim=1).float().mean().item())
    assert rates[:3] == [1.0, 1.0, 1.0]
    assert all(0.3 < r < 0.7 for r in rates[3:]), rates
