"""The wandb settings a user sets to find runs, and the dashboard's panels (offline: nothing is saved)."""

import re
from pathlib import Path

import pytest

from rl_specdec import dashboard
from rl_specdec.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "configs" / "grpo_spec.yaml"


def test_wandb_entity_group_tags_notes_are_config_keys():
    cfg = load_config(
        SPEC,
        [
            "logger.wandb.entity=team",
            "logger.wandb.group=sweep1",
            "logger.wandb.tags=[spec,k3]",
            "logger.wandb.notes=hi",
        ],
    )
    w = cfg.logger.wandb
    assert (w.entity, w.group, w.tags, w.notes) == ("team", "sweep1", ["spec", "k3"], "hi")


@pytest.mark.parametrize(
    "override, needle",
    [
        ("logger.wandb.tags=[a,'']", "logger.wandb.tags[1]"),
        (f"logger.wandb.tags=[{'x' * 65}]", "logger.wandb.tags[0]"),
        (f"logger.wandb.group={'g' * 129}", "logger.wandb.group"),
        ("logger.wandb.entity=''", "logger.wandb.entity"),
    ],
)
def test_bad_wandb_names_are_refused_with_the_key(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(SPEC, [override])
    assert needle in str(e.value)


def test_every_dashboard_key_is_a_documented_metric():
    documented = (ROOT / "docs" / "metrics.md").read_text().replace("`…_", "`generation/time_to_")  # its shorthand
    for panels in dashboard.SECTIONS.values():
        for p in panels:
            for key in p.keys + p.optional + p.families:
                stem = re.sub(r"_$", "", key)
                assert f"`{stem}" in documented, key


def test_layout_expands_families_and_drops_empty_panels():
    keys = {"val/accuracy", "spec_decode/acceptance_rate_pos_10", "spec_decode/acceptance_rate_pos_2", "timing/step"}
    out = dashboard.layout(keys)
    assert out["learning"] == [("validation accuracy", ["val/accuracy"])]
    assert out["speculation"] == [
        ("acceptance per draft position", ["spec_decode/acceptance_rate_pos_2", "spec_decode/acceptance_rate_pos_10"])
    ]
    assert out["phase times"] == [("phase times (s)", ["timing/step"])]
    assert "the tail" not in out and "on-policy check" not in out


# ---- the workspace, built for a run's real metrics.jsonl --------------------------------------------------------


class _Engines:
    """Rollouts without an engine: every other sample the right answer, the rest the digits as given; each request
    with a spec-decode histogram as vLLM reports it (3 drafted tokens a step, 7 steps)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def generate(self, prompt_ids, sampling):
        from rl_specdec.metrics import aggregate_spec_decode_counters, counters_from_histogram
        from rl_specdec.rollout import GenerationOutput

        digits = [self.tok.decode(ids).rstrip("=") for ids in prompt_ids]
        texts = ["".join(sorted(d)) if i % 2 == 0 else d for i, d in enumerate(digits)]
        ids = [self.tok.encode(t) + [self.tok.eos_token_id] for t in texts]
        return GenerationOutput(
            token_ids=ids,
            logprobs=[[-0.5] * len(x) for x in ids],
            finish_reasons=["stop"] * len(ids),
            finish_time_s=[0.1 * (i + 1) for i in range(len(ids))],
            spec_counters=aggregate_spec_decode_counters(counters_from_histogram([1, 2, 3, 1], 21) for _ in ids),
        )

    def update_weights_buckets(self, buckets):
        list(buckets)


class _Policy:
    """The update's metrics from the real loss, on log-probs a little off the generation's."""

    def train_step(self, batch, loss_fn):
        _, metrics = loss_fn(batch["gen_logprobs"] + 0.01, batch, None)
        return {k: float(v) for k, v in metrics.items()}

    def state_dict_buckets(self):
        return iter(())


def _log_two_steps(log_dir: Path) -> None:
    """metrics.jsonl as the loop writes it (step 0, then two GRPO steps), the engines and the policy stubbed."""
    from rl_specdec.drafter.upkeep import DrafterUpkeep
    from rl_specdec.grpo.loop import baseline, step_and_log
    from rl_specdec.grpo.loss import ClippedPGLoss
    from rl_specdec.grpo.run import GRPORun
    from rl_specdec.metrics.logger import MetricsLogger, Timer
    from rl_specdec.tasks import make_task
    from rl_specdec.toy.build import build_tokenizer

    small = ["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=4", "grpo.val_num_prompts=4"]
    cfg = load_config(SPEC, [*small, "grpo.max_steps=2", "grpo.val_every=1", "grpo.self_check_prompts=0"])
    tok, g = build_tokenizer(), cfg.grpo
    task = make_task(cfg.task.name, **cfg.task.kwargs)
    metrics = MetricsLogger(str(log_dir), {})
    loss = ClippedPGLoss(g.clip_eps, g.kl_coef, g.behaviour_is_cap)
    run = GRPORun(cfg, tok, task, _Policy(), _Engines(tok), metrics, None, loss, Timer(), DrafterUpkeep(cfg))
    baseline(run)
    for step in range(g.max_steps):
        step_and_log(run, step)


def test_the_workspace_builds_for_a_real_runs_metrics(tmp_path, monkeypatch):
    """Built with wandb-workspaces' own classes and serialised as ``save()`` would send it, offline: a class, field
    or panel type renamed there fails here, and so does a metric renamed in the run but not in the dashboard."""
    import socket

    def no_network(*_a, **_k):
        raise AssertionError("building the workspace must not reach the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    _log_two_steps(tmp_path)
    keys = dashboard.run_keys(tmp_path)
    want = dashboard.layout(keys)
    every_run = {k for panels in dashboard.SECTIONS.values() for p in panels for k in p.keys}
    assert every_run <= keys, every_run - keys  # the keys the dashboard expects of every run are the logged ones
    assert list(want) == list(dashboard.SECTIONS)
    workspace = dashboard.build_workspace("team", "project", keys)
    view = workspace._to_model()  # what Workspace.save() uploads
    assert (view.entity, view.project, view.display_name) == ("team", "project", "rl_specdec")
    built = {
        s.name: [(p.config.chart_title, list(p.config.metrics)) for p in s.panels]
        for s in view.spec.section.panel_bank_config.sections
    }
    assert built == {section: [(title, keys) for title, keys in rows] for section, rows in want.items()}
    assert {p.config.x_axis for s in view.spec.section.panel_bank_config.sections for p in s.panels} == {"step"}
