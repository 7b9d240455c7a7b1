"""The long-tail workload: its task, its budget law, its tokenizer, and (integration) its toy pair on a real engine."""

from __future__ import annotations

import random
import statistics

import pytest

from rl_specdec.tasks import make_task
from rl_specdec.tasks.longtail import (
    BUDGET_MAX,
    BUDGET_MIN,
    LongTailSortTask,
    countdown,
    draw_budget,
    reference_response,
)


def test_score_wants_a_whole_countdown_then_the_answer():
    task = LongTailSortTask()
    assert task.score(reference_response("1134", 6), "1134", finished=True).reward == 1.0
    assert task.score(reference_response("1134", 0), "1134", finished=True).correct
    assert task.score(reference_response("1134", 6), "1134", finished=False).reward == 0.0  # truncated
    assert task.score(reference_response("1143", 6), "1134", finished=True).reward == 0.0  # wrong answer
    assert task.score("<6><5><3><2><1><0>|1134", "1134", finished=True).reward == 0.0  # a skipped number
    assert task.score("<6><5><4><3><2><1>|1134", "1134", finished=True).reward == 0.0  # stops before <0>
    assert task.score("|1134", "1134", finished=True).reward == 0.0  # no countdown
    assert task.score("1134", "1134", finished=True).reward == 0.0


def test_budget_law_is_heavy_tailed():
    rng = random.Random(0)
    draws = [draw_budget(rng) for _ in range(20_000)]
    assert min(draws) == BUDGET_MIN and max(draws) == BUDGET_MAX
    assert 14 <= statistics.median(draws) <= 18  # 2 x BUDGET_MIN for a Pareto law of index 1
    assert 0.01 < sum(d == BUDGET_MAX for d in draws) / len(draws) < 0.03
    # a GRPO step's 128 rollouts: the longest budget is many times the median one
    steps = [draws[i : i + 128] for i in range(0, 12_800, 128)]
    assert all(max(s) >= 4 * statistics.median(s) for s in steps)


def test_the_task_keeps_sorting_splits_and_registers():
    task = make_task("longtail_sorting", min_len=4, max_len=8, dataset_size=0)
    assert isinstance(task, LongTailSortTask)
    assert not any(task.is_held_out(s) for s in task.make_batch(seed=3, n=256))
    assert all(task.is_held_out(s) for s in task.validation_batch(seed=3, n=64))


def test_tokenizer_has_one_token_per_countdown_number():
    from rl_specdec.toy.longtail import build_longtail_tokenizer, model_vocab_size

    tok = build_longtail_tokenizer()
    text = "3141=" + reference_response("1134", 12)
    ids = tok.encode(text)
    assert len(ids) == len("3141=") + 13 + 1 + 4 and tok.pad_token_id not in ids
    assert tok.decode(ids) == text
    assert len(tok.encode(countdown(BUDGET_MAX))) == BUDGET_MAX + 1
    assert len(tok.get_vocab()) <= model_vocab_size()


@pytest.mark.integration
def test_longtail_pair_samples_heavy_tailed_lengths(local_ray, longtail_pair):
    """The built pair on a real engine: sampled lengths have a long tail, rollouts score, the drafter is accepted."""
    from conftest import draft_spec, start_engine
    from rl_specdec.metrics import compute_spec_decode_metrics
    from rl_specdec.rollout import SamplingSettings
    from rl_specdec.toy.longtail import build_longtail_tokenizer

    toy, tok, task = longtail_pair, build_longtail_tokenizer(), LongTailSortTask()
    samples = task.make_batch(seed=1, n=16)
    g = start_engine(toy.policy, draft_spec(toy.drafter, k=4), max_model_len=512, kv_cache_memory_bytes=1 << 30)
    try:
        out = g.generate(
            [tok.encode(s.prompt) for s in samples for _ in range(8)],
            SamplingSettings(max_tokens=448, temperature=1.0, seed=0),
        )
    finally:
        g.shutdown()
    lengths = [len(t) for t in out.token_ids]  # [128]
    assert max(lengths) >= 4 * statistics.median(lengths), sorted(lengths)
    rewards = [
        task.score(tok.decode(t, skip_special_tokens=True), s.answer, r == "stop").reward
        for t, s, r in zip(out.token_ids, [s for s in samples for _ in range(8)], out.finish_reasons)
    ]
    assert 0.05 < statistics.fmean(rewards) < 0.95, "the SFT should leave room for RL (some right, some wrong)"
    assert compute_spec_decode_metrics(None, out.spec_counters)["spec_decode/acceptance_rate"] > 0.6
