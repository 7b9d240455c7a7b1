"""``policy.generation.speculation_control`` at load: ``auto``, the concurrency threshold, and the errors."""

from pathlib import Path

import pytest

from rl_specdec.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "configs" / "grpo_spec.yaml"


def test_speculation_control_off_survives_yaml():
    """`mode: off` is a YAML 1.1 boolean; it must still mean off (from a file and from the command line)."""
    base = ROOT / "configs/grpo_base_longtail.yaml"
    assert load_config(base).policy.generation.speculation_control.mode == "off"
    cfg = load_config(SPEC, ["policy.generation.speculation_control.mode=off"])
    assert cfg.policy.generation.speculation_control.mode == "off"


@pytest.mark.parametrize(
    "edit",
    [
        "policy.generation.vllm_kwargs.speculative_config=null",
        "policy.generation.vllm_kwargs.speculative_config.method=ngram",
        "policy.generation.vllm_kwargs.async_scheduling=true",
    ],
)
def test_auto_is_run_time_k_where_it_can_run_and_off_elsewhere(edit):
    """The default's ``mode: auto`` runs its concurrency threshold (``draft_below``) through run-time k on its
    draft_model engine, the controller without a threshold, and gives way to vLLM's own k where run-time k cannot
    run, so switching speculation stays one key; ``adaptive`` asked for there is an error."""
    mode, below = "policy.generation.speculation_control.mode", "policy.generation.speculation_control.draft_below"
    assert load_config(SPEC).policy.generation.speculation_control.mode == "fixed"
    assert load_config(SPEC, [f"{below}=null"]).policy.generation.speculation_control.mode == ("adaptive")
    assert load_config(SPEC, [edit]).policy.generation.speculation_control.mode == "off"
    with pytest.raises(ConfigError, match="speculation_control.mode=adaptive"):
        load_config(SPEC, [edit, f"{mode}=adaptive"])


def test_draft_below_becomes_the_engines_schedule():
    """``draft_below: 32`` starts the engine with k below 32 running requests and k=0 from 32 up (the fast path);
    without it the run-time-k engine starts at k everywhere."""
    from rl_specdec.config.engine_args import SCHEDULE_END, engine_args

    def schedule(*overrides):
        gen = load_config(SPEC, list(overrides)).policy.generation
        return engine_args(gen, "policy", 0, "ext")["speculative_config"]["num_speculative_tokens_per_batch_size"]

    below = "policy.generation.speculation_control.draft_below"
    assert schedule() == [[1, 31, 3], [32, SCHEDULE_END, 0]]
    assert schedule(f"{below}=8") == [[1, 7, 3], [8, SCHEDULE_END, 0]]
    assert schedule(f"{below}=null") == [[1, SCHEDULE_END, 3]]


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["policy.generation.speculation_control.draft_below=1"], "draft_below=1 must be a whole number >= 2"),
        (
            [
                "policy.generation.vllm_kwargs.speculative_config.num_speculative_tokens_per_batch_size=[[1,8,3],[9,1024,0]]"
            ],
            "both say where to draft",
        ),
    ],
)
def test_bad_draft_below_names_the_key_and_the_fix(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(SPEC, overrides)
    # the control: the same keys load where nothing of run-time k runs (vLLM's own k, as written)
    load_config(SPEC, [*overrides, "policy.generation.speculation_control.mode=off"])
    with pytest.raises(ConfigError, match="speculation_control.draft_below.*wrong type"):
        load_config(SPEC, ["policy.generation.speculation_control.draft_below=0.5"])


def test_the_controller_starts_from_a_schedule_when_one_is_set():
    """``start: null`` resolves to ``schedule`` when speculative_config has a schedule (the controller starts
    from it) and to ``zero`` otherwise; a bad value, or ``start`` without the controller, names the key."""
    wide, ctl = ROOT / "configs/grpo_spec_wide.yaml", "policy.generation.speculation_control"
    sched = (
        "policy.generation.vllm_kwargs.speculative_config.num_speculative_tokens_per_batch_size=[[1,4,5],[5,1024,0]]"
    )

    def start(*overrides):
        return load_config(wide, list(overrides)).policy.generation.speculation_control.start

    assert start() == "zero" and start(sched) == "schedule"
    assert start(sched, f"{ctl}.start=zero") == "zero" and start(f"{ctl}.start=schedule") == "schedule"
    with pytest.raises(ConfigError, match=r"speculation_control\.start='first'.*must be zero"):
        start(f"{ctl}.start=first")
    with pytest.raises(ConfigError, match=r"speculation_control\.start=schedule applies to the controller only"):
        load_config(SPEC, [f"{ctl}.start=schedule"])  # the default's threshold: fixed


def test_eagle3_runs_its_k0_steps_through_the_fast_path_unless_told_not_to():
    """A head's k=0 steps take the fast path by default (its catch-up reads the hidden states the plain steps
    kept); ``k0_fast_path=false`` keeps vLLM's own path."""
    s, c = "policy.generation.vllm_kwargs.speculative_config", "policy.generation.speculation_control"
    head = [f"{s}.method=eagle3", f"{s}.model=toy:eagle3"]
    ctl = load_config(SPEC, head).policy.generation.speculation_control
    assert (ctl.mode, ctl.k0_fast_path) == ("fixed", True)
    ctl = load_config(SPEC, [*head, f"{c}.k0_fast_path=false"]).policy.generation.speculation_control
    assert (ctl.mode, ctl.k0_fast_path) == ("fixed", False)


def test_ngram_runs_a_schedule_through_run_time_k_with_its_k0_steps_plain_and_not_the_controller():
    """ngram keeps no drafter state, so its k=0 steps take the fast path; ``auto`` leaves it to vLLM, and the
    controller (built for drafters) is refused with the mode that runs it."""
    s, c = "policy.generation.vllm_kwargs.speculative_config", "policy.generation.speculation_control"
    ngram = [f"{s}.method=ngram", f"{s}.model=null"]
    ctl = load_config(SPEC, [*ngram, f"{c}.mode=fixed"]).policy.generation.speculation_control
    assert (ctl.mode, ctl.k0_fast_path) == ("fixed", True)
    assert load_config(SPEC, ngram).policy.generation.speculation_control.mode == "off"
    with pytest.raises(ConfigError, match=rf"{c}.mode=adaptive with .*method='ngram'.*{c}.mode=fixed"):
        load_config(SPEC, [*ngram, f"{c}.mode=adaptive"])
    real = load_config(ROOT / "configs/smollm2_spec.yaml").policy.generation
    assert (real.speculation_control.mode, real.speculation_control.k0_fast_path) == ("fixed", True)
    assert real.speculation.schedule[0][2] == 0  # no drafting at one request: it measured slower there
