"""Episodes for the loop, as pure logic: the lookup environment's reset and step, the splice check at every turn,
the bounds on turns and tokens, the step's episode metrics and counter deltas, and the config checks of a
multi-turn task. The episodes through the real server and the real client are in tests/test_agent_grpo.py."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from rl_specdec.errors import ConfigError, PrefixSpliceError
from rl_specdec.grpo.batch import Trajectory
from rl_specdec.grpo.episodes import PendingEpisodes, episode_metrics
from rl_specdec.metrics.counters import ACCEPTED, DRAFT_TOKENS, DRAFTS, PER_POS, counters_delta
from rl_specdec.rollout.serving.episodes import EpisodeOutput, EpisodeResult, Turn, check_splice, run_episode
from rl_specdec.tasks.lookup import Episode, LookupTask

TABLE = (("a", "482"), ("b", "555"))
AGENT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "agent_spec.yaml"


def call(key: str) -> dict:
    return {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"key": "%s"}' % key}}


def test_the_lookup_environment_answers_a_call_then_scores_the_answer():
    env = LookupTask().environment(Episode("a", TABLE))
    messages, tools = env.reset()
    assert messages == [{"role": "user", "content": "a"}] and tools[0]["function"]["name"] == "lookup"
    first = env.step({"role": "assistant", "content": None, "tool_calls": [call("a")]}, "tool_calls")
    assert not first.done and first.observations == [{"role": "tool", "tool_call_id": "c1", "content": "482"}]
    last = env.step({"role": "assistant", "content": "482"}, "stop")
    assert last.done and last.reward == 1.0 and last.correct and last.info == {"called": 1.0, "right_key": 1.0}


def test_a_wrong_key_an_unfinished_answer_and_no_call_score_zero():
    task = LookupTask()
    env = task.environment(Episode("a", TABLE))
    assert env.step({"content": None, "tool_calls": [call("b")]}, "tool_calls").observations[0]["content"] == "555"
    wrong = env.step({"content": "555"}, "stop")
    assert wrong.done and wrong.reward == 0.0 and wrong.info["right_key"] == 0.0
    env = task.environment(Episode("a", TABLE))
    env.step({"content": None, "tool_calls": [call("a")]}, "tool_calls")
    assert env.step({"content": "482"}, "length").reward == 0.0  # cut at max_tokens: not finished
    guess = task.environment(Episode("a", TABLE)).step({"content": "482"}, "stop")
    assert guess.done and guess.reward == 0.0 and guess.info["called"] == 0.0  # an answer with no call ends it


def turn(start: int, ids: list[int]) -> Turn:
    return Turn(start, ids, [-0.5] * len(ids), "stop", 0)


def test_the_splice_check_takes_an_extension_and_refuses_a_retokenised_history():
    prompts, turns = [[1, 2, 3]], [turn(3, [7, 8, 0])]
    check_splice(prompts, turns, [1, 2, 3, 7, 8, 0, 9, 9])  # the model's own ids, then the tool result
    with pytest.raises(PrefixSpliceError, match="first difference at position 4 of 6"):
        check_splice(prompts, turns, [1, 2, 3, 7, 5, 8, 0, 9])  # its turn re-rendered as other tokens
    check_splice([], [], [4, 5])  # the first prompt has nothing to extend


class ScriptedClient:
    """Pure logic: answers each request with the next scripted turn, as the server's chat completion would."""

    def __init__(self, script: list[tuple[list[int], list[int], dict]]):
        self.script, self.requests = list(script), []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    async def create(self, **request):
        self.requests.append(request)
        prompt, ids, extra = self.script.pop(0)
        msg = {"role": "assistant", "content": extra.get("content"), "tool_calls": extra.get("tool_calls")}
        msg.update(prompt_token_ids=prompt, generation_token_ids=ids, generation_log_probs=[-0.1] * len(ids))
        message = SimpleNamespace(to_dict=lambda: dict(msg))
        logprobs = None
        if request.get("top_logprobs"):  # the server's shape with return_tokens_as_token_ids: "token_id:N"
            top = lambda i: [SimpleNamespace(token=f"token_id:{i + d}", logprob=-0.1 * (d + 1)) for d in (0, 1)]  # noqa: E731
            content = [SimpleNamespace(token=f"token_id:{i}", top_logprobs=top(i)) for i in ids]
            logprobs = SimpleNamespace(content=content)
        choice = SimpleNamespace(message=message, finish_reason=extra.get("finish", "stop"), logprobs=logprobs)
        return SimpleNamespace(choices=[choice], model_extra={"metrics": extra.get("metrics")})


def play(script, **kw):
    client = ScriptedClient(script)
    env = LookupTask().environment(Episode("a", TABLE))
    args = {"seed": 10, "temperature": 1.0, "max_turns": 2, "max_tokens": [48, 8], **kw}
    return client, asyncio.run(run_episode(client, "m", env, **args))


def test_an_episode_is_the_last_prompt_with_each_model_turn_as_a_span():
    client, x = play(
        [
            ([1, 2], [5, 6, 0], {"tool_calls": [call("a")], "finish": "tool_calls"}),
            ([1, 2, 5, 6, 0, 9], [4, 8, 2, 0], {"content": "482"}),
        ]
    )
    assert x.token_ids == [1, 2, 5, 6, 0, 9, 4, 8, 2, 0] and x.reward == 1.0 and x.model_tokens == 7
    assert [(t.start, t.ids) for t in x.turns] == [(2, [5, 6, 0]), (6, [4, 8, 2, 0])]
    Trajectory(x.token_ids, [(t.start, t.ids, t.logprobs) for t in x.turns]).check()
    assert [r["seed"] for r in client.requests] == [10, 11] and [r["max_tokens"] for r in client.requests] == [48, 8]
    assert client.requests[1]["messages"][-1] == {"role": "tool", "tool_call_id": "c1", "content": "482"}


TWO_TURNS = [
    ([1, 2], [5, 6, 0], {"tool_calls": [call("a")], "finish": "tool_calls"}),
    ([1, 2, 5, 6, 0, 9], [4, 8, 2, 0], {"content": "482"}),
]


def test_a_drafter_distils_on_each_model_turn_and_never_on_a_tool_result():
    """With top_logprobs each turn keeps the policy's top-k keyed by token id, and the drafter's batch targets
    exactly the positions that predict a model token: the tool result (id 9 at 5) and the prompt are context."""
    from rl_specdec.drafter.trainer import distill_batch

    client, x = play(list(TWO_TURNS), top_logprobs=2)
    assert all(r["logprobs"] is True and r["top_logprobs"] == 2 for r in client.requests)
    assert all(r["extra_body"] == {"return_tokens_as_token_ids": True} for r in client.requests)
    assert x.turns[1].top_logprobs[0] == {4: pytest.approx(-0.1), 5: pytest.approx(-0.2)}
    out = EpisodeOutput.of([x], 1.0, {})
    assert out.top_logprobs == [[d for t in x.turns for d in t.top_logprobs]]
    batch = distill_batch(out.distill_spans([]), top_k=2, pad_id=0)
    predicts = [i + 1 for i in batch["mask"][0].nonzero().flatten().tolist()]
    assert predicts == [2, 3, 4, 6, 7, 8, 9]  # ids 5 6 0 and 4 8 2 0; never 9, the tool's
    assert batch["top_ids"][0, 5].tolist() == [4, 5] and batch["input_ids"][0].tolist() == x.token_ids
    plain_client, plain = play(list(TWO_TURNS))  # no drafter learning: the requests ask for no top-k
    assert plain.turns[0].top_logprobs is None and all("top_logprobs" not in r for r in plain_client.requests)
    assert all(r["extra_body"] is None for r in plain_client.requests)
    assert EpisodeOutput.of([plain], 1.0, {}).top_logprobs is None


def test_a_prompt_that_drops_the_models_tokens_stops_the_episode():
    with pytest.raises(PrefixSpliceError, match="turn 2's prompt"):
        play(
            [
                ([1, 2], [5, 6, 0], {"tool_calls": [call("a")], "finish": "tool_calls"}),
                ([1, 2, 5, 0, 9], [4, 0], {"content": "482"}),
            ]
        )


def test_the_bounds_end_an_episode_with_its_last_reward():
    script = [([1, 2], [5, 6, 0], {"tool_calls": [call("a")], "finish": "tool_calls"})]
    _, by_turns = play(list(script), max_turns=1)
    _, by_tokens = play(list(script), max_episode_tokens=5)
    for x in (by_turns, by_tokens):
        assert len(x.turns) == 1 and x.reward == 0.0 and x.info["called"] == 1.0


def result(turns: list[Turn], length: int, reward: float, **info) -> EpisodeResult:
    return EpisodeResult(list(range(length)), turns, [], reward, reward > 0, info, 1.0)


def test_a_turn_keeps_its_own_spec_decode_counters_from_the_servers_response():
    """vLLM's chat response (a real ``openai`` ChatCompletion, parsed as the client parses the server's JSON)
    carries the request's acceptance histogram under ``metrics.speculative_decoding``; each turn keeps it, and the
    step reports each turn's acceptance from them. A response without it (no speculation) gives no keys."""
    from openai.types.chat import ChatCompletion

    from rl_specdec.rollout.serving.episodes import turn_counters

    body = {"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": []}
    spec = {
        "mean_acceptance_length": 2.5,
        "draft_acceptance_rate": 0.5,
        "acceptance_histogram": [1, 0, 1, 2],
        "num_spec_steps": 4,
        "num_accepted_draft_tokens": 8,
        "num_draft_tokens": 12,
        "num_spec_tokens": 3,
    }
    got = turn_counters(ChatCompletion.model_validate({**body, "metrics": {"speculative_decoding": spec}}))
    assert got == {DRAFTS: 4.0, DRAFT_TOKENS: 12.0, ACCEPTED: 8.0, PER_POS: [3.0, 3.0, 2.0]}
    assert turn_counters(ChatCompletion.model_validate(body)) is None

    first = {"tool_calls": [call("a")], "finish": "tool_calls", "metrics": {"speculative_decoding": spec}}
    spec2 = {**spec, "acceptance_histogram": [2, 0, 0, 0], "num_spec_steps": 2, "num_draft_tokens": 6}
    _, x = play(
        [
            ([1, 2], [5, 6, 0], first),
            ([1, 2, 5, 6, 0, 9], [4, 0], {"content": "482", "metrics": {"speculative_decoding": spec2}}),
        ]
    )
    assert x.turns[0].spec_counters == got and x.turns[1].spec_counters[ACCEPTED] == 0.0
    m = episode_metrics([x, x])
    assert m["spec_decode/turn_1_num_drafts"] == 8.0 and m["spec_decode/turn_1_acceptance_length"] == 3.0
    assert m["spec_decode/turn_1_acceptance_rate"] == pytest.approx(8 / 12)
    assert m["spec_decode/turn_2_acceptance_length"] == 1.0 and m["spec_decode/turn_2_num_drafts"] == 4.0
    _, plain = play([([1, 2], [5, 6, 0], {"tool_calls": [call("a")], "finish": "tool_calls"})], max_turns=1)
    assert plain.turns[0].spec_counters is None
    assert not any(k.startswith("spec_decode/") for k in episode_metrics([plain]))


def test_the_step_metrics_of_its_episodes():
    xs = [
        result([Turn(2, [1, 2, 3, 4], [0.0] * 4, "tool_calls", 1), turn(7, [1, 2])], 9, 1.0, called=1.0),
        result([turn(2, [1, 2])], 4, 0.0, called=0.0),
    ]
    m = episode_metrics(xs)
    assert m["episodes/turns_mean"] == 1.5 and m["episodes/tool_call_rate"] == 0.5 and m["episodes/called"] == 0.5
    assert m["episodes/model_token_share"] == pytest.approx(8 / 13)
    assert m["episodes/turn_1_response_length_mean"] == 3.0 and m["episodes/turn_2_response_length_mean"] == 2.0
    out = EpisodeOutput.of(xs, 2.0, {})
    assert [len(t) for t in out.token_ids] == [6, 2] and out.finish_reasons == ["stop", "stop"]


def test_a_checkpoint_carries_a_steps_episodes_exactly(tmp_path):
    """One step off-policy: the next step's episodes, every turn and fact, come back from rollouts.json as they
    were; the step they were played for trains on them, and a step of another size does not."""
    from rl_specdec.grpo.rollouts import Rollouts, load_rollouts, save_rollouts, unusable

    tops = lambda n: [{7: -0.5, 1000 + i: -1.5} for i in range(n)]  # noqa: E731  the drafter's targets, by id
    first = Turn(2, [1, 2, 3], [-0.5, -0.25, 0.0], "tool_calls", 1, tops(3))
    xs = [
        result([first, Turn(7, [4], [0.0], "stop", 0, tops(1))], 8, 1.0, called=1.0),
        result([Turn(2, [5, 6], [0.0, 0.0], "stop", 0, tops(2))], 4, 0.0, called=0.0),
    ]
    ro = Rollouts(3, [], EpisodeOutput.of(xs, 2.5, {DRAFTS: 4.0, PER_POS: [3.0, 1.0]}), [2, 2])
    save_rollouts(tmp_path, ro)
    back = load_rollouts(tmp_path)
    assert back == ro and isinstance(back.out, EpisodeOutput) and isinstance(back.out.episodes[0].turns[0], Turn)
    assert back.out.episodes[0].turns[0].top_logprobs[2] == {7: -0.5, 1002: -1.5}  # int ids, as played
    assert unusable(back, 3, 1, [], True, n=2) is None
    assert "prompts are not this step's" in unusable(back, 3, 1, [], False, n=4)


def test_pending_episodes_give_their_output_or_raise_their_error_where_it_is_asked_for():
    import threading

    gate = threading.Event()
    pending = PendingEpisodes(lambda: gate.wait() and "out")
    assert not pending.done()
    gate.set()
    assert pending.result() == "out" and pending.done()

    def fail():
        raise ConnectionError("engine 0 is gone")

    with pytest.raises(ConnectionError, match="engine 0 is gone"):
        PendingEpisodes(fail).result()


def test_counter_deltas_never_go_backwards():
    start = {DRAFTS: 10.0, ACCEPTED: 20.0, PER_POS: [8.0, 5.0]}
    end = {DRAFTS: 14.0, ACCEPTED: 26.0, PER_POS: [11.0, 7.0, 1.0]}
    assert counters_delta(start, end) == {DRAFTS: 4.0, ACCEPTED: 6.0, PER_POS: [3.0, 2.0, 1.0]}
    assert counters_delta(end, {DRAFTS: 2.0}) == {DRAFTS: 0.0}  # a replaced engine counts from zero again
    assert counters_delta(start, {}) == {}


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("policy.generation.server=null", "set policy.generation.server"),
        ("task.max_turns=-1", "task.max_turns"),
        ("task.max_episode_tokens=0", "task.max_episode_tokens"),
    ],
)
def test_a_multi_turn_config_is_checked_at_load(override, words):
    from rl_specdec.config import load_config

    with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
        load_config(AGENT_CONFIG, override.split())


def test_a_draft_model_learns_on_episodes_and_a_head_is_refused_naming_the_fix():
    from rl_specdec.config import load_config

    online, spec = "policy.generation.drafter_training.enabled=true", "policy.generation.vllm_kwargs.speculative_config"
    assert load_config(AGENT_CONFIG, [online]).policy.generation.drafter_training.enabled
    with pytest.raises(ConfigError, match="EAGLE-3 head does not train on episodes.*method: draft_model"):
        load_config(AGENT_CONFIG, [online, f"{spec}.method=eagle3", f"{spec}.model=toy:eagle3"])


class TwoEngines:
    """Pure logic of the engine group an EpisodeSource sees: two engines' counters, and engine 1 dead until
    replaced (a replacement starts its counters at zero)."""

    def __init__(self):
        self.num_engines, self.replaced = 2, False
        self.counters = [{DRAFTS: 10.0, ACCEPTED: 20.0}, {DRAFTS: 100.0, ACCEPTED: 200.0}]

    def engine_counters(self):
        return [dict(c) for c in self.counters]

    def dead_engines(self):
        return [] if self.replaced else [1]

    def base_urls(self):
        return ["http://a/v1", "http://b/v1"]


def _source_with_a_death(monkeypatch):
    """An EpisodeSource over :class:`TwoEngines` whose first round loses engine 1's episodes after its first
    (episode 1 finishes, 3 and 5 meet a dropped connection); each played episode adds one draft and two
    accepted tokens to its engine's counters."""
    import httpx
    import openai

    from rl_specdec.grpo.episodes import EpisodeSource

    group, rounds = TwoEngines(), []

    async def plays(self, todo, sampling, t0):
        rounds.append(sorted(todo))
        out = []
        for i in todo:
            if i % 2 == 1 and i > 1 and len(rounds) == 1:
                out.append(openai.APIConnectionError(request=httpx.Request("POST", "http://b/v1")))
                continue
            group.counters[i % 2][DRAFTS] += 1
            group.counters[i % 2][ACCEPTED] += 2
            out.append(EpisodeResult([i], [turn(0, [i])], [[i]], float(i), True, {}, 0.1))
        return out

    monkeypatch.setattr(EpisodeSource, "_episodes", plays)
    task = SimpleNamespace(environment=lambda episode: episode)
    return EpisodeSource(SimpleNamespace(generation=group, task=task)), group, rounds


def test_a_dead_engines_episodes_are_all_played_again_and_the_survivors_kept(monkeypatch):
    from rl_specdec.errors import EnginesLost
    from rl_specdec.rollout import SamplingSettings

    source, group, rounds = _source_with_a_death(monkeypatch)
    with pytest.raises(EnginesLost) as lost:
        source._play(list(range(6)), SamplingSettings(max_tokens=4))
    assert lost.value.engines == [1] and "[1] died with 2 episode(s) in flight" in str(lost.value)
    group.replaced, group.counters[1] = True, {DRAFTS: 0.0, ACCEPTED: 0.0}  # the recovery's replacement
    out = lost.value.redo()
    assert rounds == [[0, 1, 2, 3, 4, 5], [1, 3, 5]], "engine 1's episodes, the finished one too, and no other"
    assert [x.token_ids for x in out.episodes] == [[i] for i in range(6)]
    # engine 0's three episodes of the first round and the replacement's three: the dead engine's work is not counted
    assert out.spec_counters[DRAFTS] == 6.0 and out.spec_counters[ACCEPTED] == 12.0


def test_an_episode_that_fails_on_a_live_engine_raises_its_own_error(monkeypatch):
    """Negative control: the same dropped connection with no engine gone is the episode's error, not a loss."""
    import openai

    from rl_specdec.rollout import SamplingSettings

    source, group, _ = _source_with_a_death(monkeypatch)
    group.replaced = True  # dead_engines() finds none
    with pytest.raises(openai.APIConnectionError):
        source._play(list(range(4)), SamplingSettings(max_tokens=4))


def test_the_second_try_task_gives_feedback_after_a_wrong_answer_and_half_the_reward_for_a_right_second():
    from rl_specdec.tasks import TASKS, is_episodic
    from rl_specdec.tasks.retry import FEEDBACK

    task = TASKS["chat_arithmetic_retry"](min_steps=1, max_steps=1, max_start=10, operations=("lose",))
    assert is_episodic(task)
    sample = task.make_batch(seed=0, n=1)[0]
    env = task.environment(sample)
    messages, tools = env.reset()
    assert messages == [{"role": "user", "content": sample.prompt}] and tools == []
    wrong = env.step({"role": "assistant", "content": "\\boxed{999}"}, "stop")
    assert not wrong.done and wrong.reward == 0.0 and wrong.observations == [{"role": "user", "content": FEEDBACK}]
    right = env.step({"role": "assistant", "content": f"\\boxed{{{sample.answer}}}"}, "stop")
    assert right.done and right.correct and right.reward == 0.5
    assert right.info == {"first_try_correct": 0.0, "tries": 2.0}
    first = task.environment(sample).step({"content": f"\\boxed{{{sample.answer}}}"}, "stop")
    assert first.done and first.reward == 1.0 and first.info["first_try_correct"] == 1.0
    cut = task.environment(sample).step({"content": f"\\boxed{{{sample.answer}}}"}, "length")
    assert not cut.done and cut.reward == 0.0  # cut at max_tokens: not finished, so another try
    env = task.environment(sample)
    env.step({"content": "no"}, "stop")
    last = env.step({"content": "still no"}, "stop")
    assert last.done and not last.correct and last.reward == 0.0


@pytest.mark.parametrize(
    "kwargs, key",
    [({"tries": 0}, "tries"), ({"retry_reward": 2.0}, "retry_reward"), ({"chat_template_kwargs": {"a": 1}}, "chat_")],
)
def test_the_second_try_task_refuses_bad_kwargs_naming_them(kwargs, key):
    from rl_specdec.tasks.retry import RetryArithmeticTask

    with pytest.raises(ConfigError, match=f"task.kwargs.{key}"):
        RetryArithmeticTask(**kwargs)
