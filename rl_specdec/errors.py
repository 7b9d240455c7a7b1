"""Every error rl_specdec raises on purpose, in one neutral module.

Each message names what went wrong (the config key, the engine, the tensor)
and the fix. Importing this module imports nothing else, so any layer
(config, generation, policy, algorithms) can raise or catch these.
"""

from __future__ import annotations

from typing import Any, Callable


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the key and the fix."""


class VllmIncompatible(ConfigError):
    """The installed vLLM is not the one rl_specdec's engine hooks were written for, or a hook moved."""


class GenerationEngineDied(RuntimeError):
    """A vLLM engine actor died, and was not (or could not be) replaced; ``engines``: their indices, if known."""

    def __init__(self, message: str, engines: list[int] | tuple[int, ...] = ()):
        super().__init__(message)
        self.engines = list(engines)


class EnginesLost(GenerationEngineDied):
    """Engines died during a call whose other shards are kept: ``engines`` (their indices, which are also their
    shards') and ``redo``, which generates those shards again and returns the call's whole result once the
    engines are replaced. The engine group raises it; what to do about it is the caller's to decide."""

    def __init__(self, message: str, engines: list[int], redo: Callable[[], Any]):
        super().__init__(message, engines)
        self.redo = redo

    def then(self, finish: Callable[[Any], Any]) -> EnginesLost:
        """The same loss for a caller that makes its own result from the call's: its ``redo`` returns
        ``finish(result)``, and a loss while it redoes carries ``finish`` too."""

        def redo() -> Any:
            try:
                return finish(self.redo())
            except EnginesLost as again:
                raise again.then(finish) from again.__cause__  # the dead engine's own error

        lost = EnginesLost(str(self), self.engines, redo)
        lost.__cause__ = self.__cause__
        return lost


class SpeculationTurnedOff(RuntimeError):
    """The acceptance canary tripped with ``acceptance_canary.action=disable``: the engines must run without
    speculation from now on. ``metrics`` are the step's canary metrics, which the step still logs."""

    def __init__(self, message: str, metrics: dict[str, float]):
        super().__init__(message)
        self.metrics = metrics


class PolicyWorkerDied(RuntimeError):
    """A policy worker process died; the group cannot continue (the message names its rank and node)."""


class ProcessDied(RuntimeError):
    """A process of the run that is not an engine died (the trainer while it streamed the refit, the drafter's
    trainer), and the engines met its death through the work they waited on; the message names it from Ray's
    own report (``process``: its actor class)."""

    def __init__(self, message: str, process: str = ""):
        super().__init__(message)
        self.process = process


class CheckpointDamaged(RuntimeError):
    """No complete checkpoint in the folder is intact (the message names each damaged file)."""


class CheckpointWriteFailed(RuntimeError):
    """Writing a checkpoint failed (a full disk, a quota, a read-only folder); the half-written folder was
    removed and the checkpoints before it are intact. The message names the folder and its free space."""


class RunStopped(SystemExit):
    """The run stopped on SIGTERM or SIGINT after saving what it had; ``code`` is 128 + the signal's number
    (143, 130), so an uncaught one exits with the status a shell reports for that signal.

    ``message`` is one line: the signal, the last finished step, its checkpoint and the command to resume.
    """

    def __init__(self, message: str, signum: int):
        super().__init__(128 + signum)
        self.message = message
        self.signum = signum

    def __str__(self) -> str:
        return self.message


class SamplingSelfCheckFailed(RuntimeError):
    """The engines do not sample from the policy's distribution (speculation is not lossless here)."""


class SleepNotSupported(RuntimeError):
    """vLLM sleep mode is not available on this platform (CPU)."""


class WeightIntegrityError(RuntimeError):
    """An engine does not hold what was sent to it (a tensor with a wrong name or shape, missing, or corrupted)."""


class SpecDecodeCanaryTripped(RuntimeError):
    """Acceptance collapsed right after a refit and ``acceptance_canary.action`` is ``fail``."""


class PrefixSpliceError(ValueError):
    """The model's tokens cannot be spliced into the re-rendered conversation."""


__all__ = [
    "CheckpointDamaged",
    "CheckpointWriteFailed",
    "ConfigError",
    "EnginesLost",
    "GenerationEngineDied",
    "PolicyWorkerDied",
    "PrefixSpliceError",
    "ProcessDied",
    "RunStopped",
    "SamplingSelfCheckFailed",
    "SleepNotSupported",
    "SpecDecodeCanaryTripped",
    "SpeculationTurnedOff",
    "WeightIntegrityError",
]
