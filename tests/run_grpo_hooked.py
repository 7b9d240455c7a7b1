"""examples/run_grpo.py with test-only hooks, chosen by environment variables (tests/test_stops.py).

    python tests/run_grpo_hooked.py --config configs/grpo_spec.yaml key=value ...

``RL_SPECDEC_TEST_PAUSE=<phase>:<step>:<seconds>`` holds the run inside one phase of one step (1-based) so a
test can signal it there: it writes ``<logger.log_dir>/paused`` and waits. ``train``: the driver sleeps before
the policy's train step (a phase the loop finishes). ``generation``: the driver waits in ``ray.get`` on a remote
task before the rollouts (a phase a stop drops), as it does on the engines. ``episodes``: a multi-turn task's
round of episodes (validation's too) waits in its event loop before it plays, as a turn waits for its server.

``RL_SPECDEC_TEST_DISK_FULL=<step>``: writing the checkpoint of that step fails with ENOSPC after the policy
and the drafter have written their files, as a disk that fills up mid-save does.

``RL_SPECDEC_TEST_VLLM_VERSION=<version>``: the version vLLM reports to rl_specdec's gate.

``RL_SPECDEC_TEST_KILL_TRAINER_IN_REFIT=<n>``: the run's n-th streamed refit SIGKILLs the policy worker of rank 0
once the engines have loaded its first bucket, as the OOM killer would.
"""

from __future__ import annotations

import errno
import os
import runpy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _log_dir() -> Path:
    given = [a.split("=", 1)[1] for a in sys.argv if a.startswith("logger.log_dir=")]
    return Path(given[-1])


def _pause(phase: str, step: int, seconds: float) -> None:
    import asyncio

    import ray

    from rl_specdec.grpo.episodes import EpisodeSource
    from rl_specdec.policy.group import PolicyGroup
    from rl_specdec.rollout.group import VllmGeneration

    calls = {"train": 0, "generation": 0, "episodes": 0}

    @ray.remote(num_cpus=0)
    def wait(s: float) -> None:
        time.sleep(s)

    def hold(kind: str) -> None:
        calls[kind] += 1
        if kind == phase and calls[kind] == step:
            (_log_dir() / "paused").write_text(kind)
            if kind == "train":
                time.sleep(seconds)
            else:
                ray.get(wait.remote(seconds))

    real_train, real_generate = PolicyGroup.train_step, VllmGeneration.generate

    def train_step(self, batch, loss_fn):
        hold("train")
        return real_train(self, batch, loss_fn)

    def generate(self, prompt_token_ids, sampling):
        if sampling.temperature > 0:  # the rollouts, not validation
            hold("generation")
        return real_generate(self, prompt_token_ids, sampling)

    real_episodes = EpisodeSource._episodes

    async def episodes(self, plays, sampling, t0):
        calls["episodes"] += 1
        if phase == "episodes" and calls["episodes"] == step:
            (_log_dir() / "paused").write_text("episodes")
            await asyncio.sleep(seconds)  # inside the episodes' event loop, as a turn awaits its server
        return await real_episodes(self, plays, sampling, t0)

    PolicyGroup.train_step, VllmGeneration.generate = train_step, generate
    EpisodeSource._episodes = episodes


def _disk_full(step: int) -> None:
    from rl_specdec.grpo import checkpoint

    real = checkpoint.write_manifest

    def write_manifest(root: Path) -> None:
        if root.name == f".tmp-step_{step:06d}":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(root / checkpoint.MANIFEST))
        real(root)

    checkpoint.write_manifest = write_manifest


def _kill_trainer_in_refit(call: int) -> None:
    import signal

    from rl_specdec.policy.group import PolicyGroup

    real, calls = PolicyGroup.state_dict_buckets, [0]

    def state_dict_buckets(self):
        calls[0] += 1
        stream = real(self)
        if calls[0] != call:
            return stream

        def killed():
            yield next(stream)  # the engines load it; the trainer dies before it sends the next
            os.kill(self.nodes[0]["pid"], signal.SIGKILL)
            yield from stream

        return killed()

    PolicyGroup.state_dict_buckets = state_dict_buckets


def main() -> None:
    from rl_specdec.metrics.console import configure_console

    configure_console("error")  # as run_grpo.py does, before the hooks import vLLM
    if pause := os.environ.get("RL_SPECDEC_TEST_PAUSE"):
        phase, step, seconds = pause.split(":")
        _pause(phase, int(step), float(seconds))
    if step := os.environ.get("RL_SPECDEC_TEST_DISK_FULL"):
        _disk_full(int(step))
    if call := os.environ.get("RL_SPECDEC_TEST_KILL_TRAINER_IN_REFIT"):
        _kill_trainer_in_refit(int(call))
    if version := os.environ.get("RL_SPECDEC_TEST_VLLM_VERSION"):
        from rl_specdec import vllm_ext

        vllm_ext.installed_version = lambda: version
    sys.argv = [str(ROOT / "examples/run_grpo.py"), *sys.argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
