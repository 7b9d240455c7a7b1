"""The console: a quiet one by default (errors, the progress bar, one line per validation), the same
level for vLLM, Ray and transformers in the driver and in every Ray worker."""

from __future__ import annotations

import logging
import os

THIRD_PARTY_LOGGERS = ("vllm", "ray", "transformers", "urllib3", "httpx", "uvicorn", "wandb")
LEVEL_ENV = "RL_SPECDEC_LOG_LEVEL"


def configure_console(level: str = "error") -> None:
    """A quiet console: vLLM, Ray and transformers log at ``level``; rl_specdec's own lines always show.

    Call it before vLLM is first imported: vLLM reads ``VLLM_LOGGING_LEVEL``
    when it is imported. Ray workers get the same level through
    :func:`worker_env` (``init_ray`` passes it as the job's runtime env).
    """
    name = level.upper()
    os.environ[LEVEL_ENV] = name
    os.environ["VLLM_LOGGING_LEVEL"] = name
    os.environ["TRANSFORMERS_VERBOSITY"] = level.lower()
    logging.basicConfig(level=getattr(logging, name), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(getattr(logging, name))
    for lib in THIRD_PARTY_LOGGERS:
        logging.getLogger(lib).setLevel(getattr(logging, name))
    logging.getLogger("rl_specdec").setLevel(logging.INFO)
    logging.getLogger("ray._private.worker").addFilter(_leftover_ray_errors)


def _leftover_ray_errors(record: logging.LogRecord) -> bool:
    """Ray logs, as each is garbage collected, the error held by every result no one read: after a fault the run
    has named (a dead process, say) that is every piece of work abandoned with it, Ray's raw report each time.
    Those stay off a quiet console; the fault's own line says what happened."""
    return not (record.getMessage().startswith("Unhandled error") and console_level() > logging.INFO)


def console_level() -> int:
    """The level :func:`configure_console` set (WARNING if it was not called)."""
    return getattr(logging, os.environ.get(LEVEL_ENV, "WARNING"))


def worker_env() -> dict[str, str]:
    """Environment for Ray workers (engines, policy) that matches the console level; {} if none was set.

    Above INFO the workers' progress bars (weight loading, checkpoint writing),
    Python warnings and torch's C++ warnings are off as well; the driver's own
    progress bar is unaffected.
    """
    if LEVEL_ENV not in os.environ:
        return {}
    name = os.environ[LEVEL_ENV]
    env = {LEVEL_ENV: name, "VLLM_LOGGING_LEVEL": name, "TRANSFORMERS_VERBOSITY": name.lower()}
    if getattr(logging, name) > logging.INFO:
        env.update({"TQDM_DISABLE": "1", "PYTHONWARNINGS": "ignore", "TORCH_CPP_LOG_LEVEL": "ERROR"})
    return env
