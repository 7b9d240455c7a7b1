"""A generate call in flight: the engines' shards, started, whose results the caller collects later.

:meth:`VllmGeneration.submit <rl_specdec.rollout.group.VllmGeneration.submit>` returns one;
``generate`` is ``submit(...).result()``, so a blocking call and one that overlaps other work are the same
remote calls, gathered the same way.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import ray

from rl_specdec.errors import EnginesLost
from rl_specdec.rollout.interfaces import GenerationOutput


class PendingGeneration:
    """The shards of one generate call, one ObjectRef per engine that got work, in input order."""

    def __init__(self, refs: list[ray.ObjectRef], with_top: bool, get: Callable[[list[ray.ObjectRef]], list[Any]]):
        self.refs, self.with_top, self._get = refs, with_top, get
        self.launched_at = time.perf_counter()  # the driver's clock, as the loop's timers

    def done(self) -> bool:
        """Whether every engine has finished its shard (does not wait)."""
        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        return len(ready) == len(self.refs)

    def result(self) -> GenerationOutput:
        """Wait for every shard and join them in input order (engines that died raise
        :class:`~rl_specdec.errors.EnginesLost`, whose ``redo`` returns the joined output)."""
        try:
            parts = self._get(self.refs)
        except EnginesLost as lost:
            raise lost.then(self._join) from lost.__cause__
        return self._join(parts)

    def _join(self, parts: list[Any]) -> GenerationOutput:
        return GenerationOutput.concat(parts, with_top=self.with_top)
