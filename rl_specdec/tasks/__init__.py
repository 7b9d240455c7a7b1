"""Tasks for the GRPO loop: prompts and a verifier (single-turn), or episodes played in an environment
(multi-turn: the task has ``environment(episode)``)."""

from rl_specdec.tasks.arithmetic import ArithmeticChatTask
from rl_specdec.tasks.base import Environment, EnvStep, EpisodeTask, Sample, Task, TaskReward, encode_prompts
from rl_specdec.tasks.longtail import LongTailSortTask
from rl_specdec.tasks.lookup import LookupTask
from rl_specdec.tasks.retry import RetryArithmeticTask
from rl_specdec.tasks.sorting import SortingTask

TASKS = {
    "sorting": SortingTask,
    "longtail_sorting": LongTailSortTask,
    "chat_arithmetic": ArithmeticChatTask,
    "lookup": LookupTask,
    "chat_arithmetic_retry": RetryArithmeticTask,
}


def is_episodic(task) -> bool:
    """Whether a task (or its class) is multi-turn: its episodes are played in an environment, through the
    engines' OpenAI servers."""
    return callable(getattr(task, "environment", None))


def make_task(name: str, **kwargs) -> Task:
    if name not in TASKS:
        raise ValueError(
            f"task.name={name!r} is not a known task; choose one of {sorted(TASKS)} "
            "or register yours in rl_specdec.tasks.TASKS"
        )
    return TASKS[name](**kwargs)


__all__ = [
    "Sample",
    "Task",
    "TaskReward",
    "SortingTask",
    "LongTailSortTask",
    "ArithmeticChatTask",
    "TASKS",
    "make_task",
    "encode_prompts",
    "is_episodic",
    "Environment",
    "EnvStep",
    "EpisodeTask",
    "LookupTask",
    "RetryArithmeticTask",
]
