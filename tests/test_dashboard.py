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
        resolve_models=False,
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
        load_config(SPEC, [override], resolve_models=False)
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
