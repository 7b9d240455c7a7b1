"""Shared fixtures and helpers for the tests.

Engine tests (``@pytest.mark.integration``) start real Ray actors and vLLM
engines on the toy models. An engine costs 15-35 s to start on a 2-core CPU
machine, so engines are module-scoped fixtures built by :func:`start_engine`
and shared by every test of a module; each module tears its engines and its
Ray instance down at the end, so modules with their own Ray instance (the
simulated multi-node cluster) can follow. The README's command runs the suite in
two pytest-xdist workers, each with its own Ray instances; a file's tests stay in
one worker (pyproject.toml's addopts).

Engine settings used everywhere on CPU are the toy presets
(``rl_specdec.toy.presets.TOY_ENGINE_KWARGS``; why each one, see there and
docs/speculative_decoding.md).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rl_specdec.toy.build import build_tokenizer
from rl_specdec.toy.presets import TOY_ENGINE_KWARGS, usable_cores

CPU_VLLM_KWARGS: dict[str, Any] = TOY_ENGINE_KWARGS
# The suite runs in two pytest-xdist workers (the README's command), so two tests' engines and trainers share the
# cores. OpenMP's threads spin between parallel regions by default, burning the cycles the other test needs: set
# before any Ray instance or run starts, this reaches every engine, trainer and driver the tests start. Numerics
# are unchanged. Measured: three engine-heavy modules took 414 s in two workers spinning, 325 s passive, 400 s in one.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
TESTS_DIR = Path(__file__).resolve().parent
HOST_CORES = usable_cores()


# The slowest test files, slowest first (seconds in two workers on 2 cores). Workers take files one at a time in
# collection order: run first, these cannot be what one worker still runs while the other has nothing left.
SLOWEST_FIRST = (
    "test_stops.py",  # 318
    "test_engine_restart.py",  # 230
    "test_off_policy_runs.py",  # 161
    "test_real_model_engine.py",  # 156
    "test_spec_control.py",  # 153
    "test_generation.py",  # 149
    "test_grpo.py",  # 127
    "test_wide.py",  # 125
    "test_policy_group.py",  # 94
    "test_compile_cache.py",  # 92
    "test_real_model_grpo.py",  # 81
)


def pytest_collection_modifyitems(session, config, items) -> None:
    """The files of SLOWEST_FIRST first, in its order; the rest after them as collected (a stable sort)."""
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_collection_finish(session) -> None:
    """Every test module is imported: leave the import-time heap (torch, transformers, vLLM, Ray) out of later
    garbage collections, as the engine workers do before vLLM's loader collects (VllmWorker.freeze_heap)."""
    import gc

    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session, exitstatus) -> None:
    """Frozen objects are not freed at exit; unfrozen, the bindings that count theirs (triton's) find none left."""
    import gc

    gc.unfreeze()


# The models the tests build (tests/builds.py) and the suite's time against CI's budget (tests/suite_budget.py).
# One Ray instance per worker, and engines shared across files (tests/shared_ray.py).
pytest_plugins = ("builds", "shared_ray", "suite_budget")

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def draft_spec(drafter_path, k: int = 3) -> dict[str, Any]:
    return {"method": "draft_model", "model": str(drafter_path), "num_speculative_tokens": k}


# ---- models and prompts -----------------------------------------------------------


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def task_prompts(tokenizer) -> list[list[int]]:
    """16 sorting-task prompts as token ids ("31415=" ...)."""
    from rl_specdec.tasks.sorting import SortingTask

    return [tokenizer.encode(s.prompt) for s in SortingTask(max_len=24).make_batch(seed=123, n=16)]


@pytest.fixture(scope="session")
def hf_policy(toy):
    """The policy in transformers, float32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(toy.policy, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def smol_tokenizer(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2)


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (EOS included when emitted)."""
    import torch

    eos = model.config.eos_token_id
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            seq = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                eos_token_id=eos,
                pad_token_id=model.config.pad_token_id,
            )[0, len(p) :].tolist()
            if eos in seq:  # generate pads nothing for a single sequence, but be safe
                seq = seq[: seq.index(eos) + 1]
            out.append(seq)
    return out


def hf_token_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    """log p(completion_t | prompt, completion_<t) from one teacher-forced forward pass."""
    import torch

    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()  # [T, V]
    logp = torch.log_softmax(logits, dim=-1)
    n = len(prompt)
    pos = torch.arange(n - 1, n - 1 + len(completion))
    return logp[pos, torch.tensor(completion)].tolist()


# ---- Ray and engines -----------------------------------------------------------------


def start_engine(
    policy_path,
    spec: dict[str, Any] | None,
    *,
    num_engines: int = 1,
    cpus_per_engine: int | None = None,
    env_vars=None,
    cluster=None,
    control=None,
    group_cls=None,
    server=None,
    **extra_kwargs,
):
    """A VllmGeneration (or ``group_cls``) on the toy policy, with ``spec`` as its speculative_config
    and ``control`` (a dict) as its speculation_control; ``server`` goes to an AsyncVllmGeneration."""
    from rl_specdec.config import GenerationConfig, SpeculationControlConfig, validate_vllm_kwargs
    from rl_specdec.rollout.group import VllmGeneration

    kw = validate_vllm_kwargs({**CPU_VLLM_KWARGS, **extra_kwargs, "speculative_config": spec}, str(policy_path))
    cfg = GenerationConfig(
        num_engines=num_engines,
        cpus_per_engine=cpus_per_engine or max(1, min(HOST_CORES, 4) // num_engines),
        vllm_kwargs=kw,
        env_vars=dict(env_vars or {}),
        self_check=False,
        speculation_control=SpeculationControlConfig(**(control or {})),
    )
    more = {"server": server} if server is not None else {}
    return (group_cls or VllmGeneration)(str(policy_path), cfg, cluster=cluster, **more)


@pytest.fixture(scope="module")
def eng_plain(local_ray, toy):
    """The toy policy without speculation, one per worker for every file that only reads from it (no refit, no
    change of settings: tests/shared_ray.py)."""
    from shared_ray import shared_engine

    return shared_engine(toy.policy, None)


@pytest.fixture(scope="module")
def plain_samples(eng_plain, tokenizer):
    """The temperature-1 reference of the distribution tests: ``dist_samples`` of ``eng_plain``, seed 1000,
    sampled once per engine."""
    from shared_ray import computed_once

    return computed_once(eng_plain, "dist_samples 1000", lambda: dist_samples(eng_plain, tokenizer, seed=1000))


def module_engine(request, toy, spec, **kw):
    """start_engine on the toy policy, shut down when the requesting (module-scoped) fixture ends."""
    g = start_engine(toy.policy, spec, **kw)
    request.addfinalizer(g.shutdown)
    return g


def wait_until(cond, timeout: float = 15.0, every: float = 0.2) -> bool:
    """Poll ``cond()`` until it is true or ``timeout`` seconds pass; returns its last value."""
    import time

    end = time.monotonic() + timeout
    while not (ok := bool(cond())) and time.monotonic() < end:
        time.sleep(every)
    return ok


def actor_states(class_name: str | None = "VllmWorker") -> dict[str, str]:
    """{actor id (hex): state} for every actor of ``class_name`` (None: of any class) the connected GCS knows.

    Reads the GCS directly (``ray.util.state`` needs the dashboard, which the
    tests do not start).
    """
    from ray._private import state

    return {
        aid: info["State"]
        for aid, info in state.actors().items()
        if class_name is None or info.get("ActorClassName") == class_name
    }


def assert_failed_start_leaves_nothing(start, class_name: str) -> None:
    """``start()`` must raise, and leave no live actor of ``class_name`` and no reserved placement group."""
    import ray

    actors0, pgs0 = set(actor_states(class_name)), set(ray.util.placement_group_table())
    with pytest.raises(Exception, match="max_model_len"):
        start()
    new_pgs = [pg for pid, pg in ray.util.placement_group_table().items() if pid not in pgs0]
    assert len(new_pgs) == 1 and new_pgs[0]["state"] == "REMOVED", new_pgs

    def new_actors():
        return {a: s for a, s in actor_states(class_name).items() if a not in actors0}

    assert wait_until(lambda: new_actors() and all(s == "DEAD" for s in new_actors().values())), new_actors()


# ---- the temperature-1 distribution test -------------------------------------------------------
# A fixed short prompt on which the toy policy is uncertain (about 0.7-1.2 nats of
# entropy per token; sorting prompts are nearly deterministic), many samples, 12 positions.
DIST_PROMPT = "31"
DIST_SAMPLES = 400
DIST_TOKENS = 12


def dist_samples(g, tokenizer, seed: int, n: int = DIST_SAMPLES) -> list[list[int]]:
    """``n`` temperature-1 samples of ``DIST_TOKENS`` tokens after ``DIST_PROMPT``."""
    from rl_specdec.rollout import SamplingSettings

    out = g.generate(
        [tokenizer.encode(DIST_PROMPT)] * n, SamplingSettings(max_tokens=DIST_TOKENS, temperature=1.0, seed=seed)
    )
    return out.token_ids


def position_test(a: list[list[int]], b: list[list[int]], n_pos: int = DIST_TOKENS) -> tuple[float, list[float]]:
    """Two-sample chi-square per position (token, or END once a sequence stopped).

    Returns the Bonferroni-adjusted smallest p-value over positions and the
    raw per-position p-values. Categories seen fewer than 10 times in both
    samples together are merged into one "rare" column.
    """
    from scipy.stats import chi2_contingency

    END, RARE = -1, -2
    pvals = []
    for pos in range(n_pos):
        ta = [s[pos] if pos < len(s) else END for s in a]
        tb = [s[pos] if pos < len(s) else END for s in b]
        cats = sorted(set(ta) | set(tb))
        total = {c: ta.count(c) + tb.count(c) for c in cats}
        keep = [c for c in cats if total[c] >= 10]
        cols = keep + ([RARE] if len(keep) < len(cats) else [])
        if len(cols) < 2:
            continue

        def row(ts):
            return [sum(1 for t in ts if t == c) if c != RARE else sum(1 for t in ts if t not in keep) for c in cols]

        table = np.array([row(ta), row(tb)])
        table = table[:, table.sum(0) > 0]
        if table.shape[1] < 2:
            continue
        pvals.append(float(chi2_contingency(table)[1]))
    assert pvals, "no position had two categories: the test prompt has no randomness"
    return min(1.0, min(pvals) * len(pvals)), pvals


def hf_samples(model, prompt: list[int], n: int, length: int, seed: int, temperature: float = 1.0) -> list[list[int]]:
    """``n`` samples of ``length`` tokens from transformers, plain ancestral sampling (no top-k or top-p), each
    cut after an end-of-turn token as the engine stops there. The prompt is computed once; its cache is copied to
    the ``n`` rows."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    eos = model.generation_config.eos_token_id
    stop = {model.config.eos_token_id, *(eos if isinstance(eos, list) else [eos])}
    rows = []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1].expand(n, -1)  # [n, V]
        past.batch_repeat_interleave(n)
        for t in range(length):
            probs = torch.softmax(logits.float() / temperature, dim=-1)  # [n, V]
            rows.append(torch.multinomial(probs, 1, generator=gen))  # [n, 1]
            if t + 1 < length:
                out = model(input_ids=rows[-1], past_key_values=past, use_cache=True)
                past, logits = out.past_key_values, out.logits[:, -1]
    samples = torch.cat(rows, dim=1).tolist()  # [n, length]
    return [s[: next((i + 1 for i, t in enumerate(s) if t in stop), len(s))] for s in samples]


def perturbed_state_dict(hf_policy, scale=0.3, seed=0):
    """``hf_policy``'s weights plus Gaussian noise of ``scale`` times each tensor's std (tied embeddings kept
    tied): new weights for a refit."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for k, v in hf_policy.state_dict().items():
        noise = torch.randn(v.shape, generator=gen, dtype=v.dtype) * (v.std() if v.numel() > 1 else 0.0) * scale
        sd[k] = (v + noise).contiguous()
    if hf_policy.config.tie_word_embeddings and "lm_head.weight" in sd:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    return sd
