"""Tasks (prompts + verifiers) for the GRPO loop."""

from rl_specdec.tasks.arithmetic import ArithmeticChatTask
from rl_specdec.tasks.base import Sample, Task, TaskReward, encode_prompts
from rl_specdec.tasks.longtail import LongTailSortTask
from rl_specdec.tasks.sorting import SortingTask

TASKS = {"sorting": SortingTask, "longtail_sorting": LongTailSortTask, "chat_arithmetic": ArithmeticChatTask}


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
]
