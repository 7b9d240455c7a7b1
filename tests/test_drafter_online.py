"""The two online drafters behind one interface (rl_specdec/drafter/online.py): pure logic, the policy and the
drafter's actor stood in by what they return. Both kinds run for real in tests/test_eagle3_grpo.py and
tests/test_grpo.py."""

from __future__ import annotations

from types import SimpleNamespace

from rl_specdec.drafter.online import DraftModelDrafter, PolicyHeadDrafter


class _Policy:
    def __init__(self):
        self.version = 0.0

    def head_result(self):
        return {"version": self.version, "loss": 1.0} if self.version else {}

    def head_state_dict_for_refit(self):
        return {"w": self.version}


class _Actor:
    def __init__(self):
        self.trained, self.saved, self.loaded = [], [], []

    def train(self, batch):
        self.trained.append(batch)

    def result(self):
        return {"loss": 0.5, "time_s": 0.1}

    def state_dict_for_refit(self):
        return {"d": 1}

    def save_checkpoint(self, path):
        self.saved.append(path)

    def load_checkpoint(self, path):
        self.loaded.append(path)

    def shutdown(self):
        self.trained = None


def test_a_head_reports_each_update_once_and_a_resumed_run_keeps_its_last_version(tmp_path):
    policy = _Policy()
    head = PolicyHeadDrafter(policy)
    assert head.top_k == 0 and head.finish() == {}  # nothing began: no step
    policy.version = 1.0
    head.begin(0, [[1]], None, 0)
    assert head.finish()["version"] == 1.0 and head.weights() == {"w": 1.0}
    head.begin(1, [[1]], None, 0)
    assert head.finish() == {}  # the update did not step the head (version unchanged): nothing new to refit
    head.save(tmp_path)
    again = PolicyHeadDrafter(policy)
    assert again.load(tmp_path) and again.version == 1.0
    again.begin(2, [[1]], None, 0)
    assert again.finish() == {}  # the restored version is not reported as new
    assert PolicyHeadDrafter(policy).load(tmp_path / "none") is True  # an older checkpoint: the head is the policy's


def test_a_draft_model_trains_on_the_rollouts_while_the_policy_updates_or_after(tmp_path):
    from rl_specdec.rollout import GenerationOutput

    out = GenerationOutput([[3, 4]], [[-0.1, -0.2]], ["stop"], top_logprobs=[[{3: -0.1}, {4: -0.2}]])
    for overlap in (True, False):
        actor = _Actor()
        training = SimpleNamespace(top_k=1, max_sequences=0, overlap=overlap)
        d = DraftModelDrafter(actor, training)
        assert d.top_k == 1 and d.finish() == {}
        d.begin(0, [[1, 2]], out, 0)
        assert len(actor.trained) == (1 if overlap else 0)
        assert d.finish() == {"loss": 0.5, "time_s": 0.1} and len(actor.trained) == 1
        assert d.finish() == {}  # one step, one result
    assert not d.load(tmp_path)  # no drafter in this checkpoint: the caller warns
    (tmp_path / "drafter").mkdir()
    d.save(tmp_path)
    assert d.load(tmp_path) and actor.saved == actor.loaded == [str(tmp_path / "drafter")]
