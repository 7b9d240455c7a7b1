"""The policy group: N Ray actors that train one model, seen by the loop as one policy.

``PolicyGroup(config)`` starts ``policy.num_workers`` :class:`PolicyWorker`
actors. When a worker reserves resources (``policy.gpus_per_worker`` on GPU,
``policy.cpus_per_worker``), they go in one Ray placement group with one
bundle per worker (``policy.placement_strategy``), so the group spans the
nodes of a Ray cluster as the engines do. Rank 0 reports its node's IP and a
free port; every worker then joins a torch.distributed process group there
(gloo on CPU, NCCL on GPU) and wraps the model in DDP or FSDP2.

Each call splits the batch over the workers
(:func:`~rl_specdec.policy.distributed.shard_batch`), runs them together and
returns rank 0's result; metrics are already reduced over all workers. One
worker (the default) is the single-process trainer: no process group, no
wrapper, the whole batch.

A worker that dies stops the group: the error names its rank and node, and
the other workers (which may wait in a collective for it) are killed.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Iterator

import torch

from rl_specdec.errors import PolicyWorkerDied
from rl_specdec.policy.distributed import shard_batch
from rl_specdec.policy.interface import LossFn
from rl_specdec.policy.worker import PolicyWorker

if TYPE_CHECKING:
    from rl_specdec.config import PolicyConfig

logger = logging.getLogger(__name__)

GRACE_S = 30.0  # after one worker fails, how long to wait for the others to report before naming the dead
REFIT_PREFETCH = 2  # buckets rank 0 may produce ahead of the consumer (Ray streaming-generator backpressure)


def worker_bundle(config: PolicyConfig) -> dict[str, float]:
    """What one worker reserves; empty when it reserves nothing (then no placement group is made)."""
    bundle = {"GPU": config.gpus_per_worker if config.device == "cuda" else 0, "CPU": config.cpus_per_worker}
    return {k: float(v) for k, v in bundle.items() if v > 0}


def threads_and_local_ranks(nodes: list[dict[str, Any]], num_threads: int | None) -> list[tuple[int, int]]:
    """Per rank: torch threads (``num_threads``, else the host's cores shared by its workers) and the rank on its host.

    Hosts are told apart by IP and hostname, so the nodes of a simulated Ray cluster on one machine share its cores.
    """
    per_host: dict[tuple, int] = defaultdict(int)
    local = []
    for n in nodes:
        key = (n["ip"], n["host"])
        local.append(per_host[key])
        per_host[key] += 1
    return [
        (num_threads or max(1, n["host_cpus"] // per_host[(n["ip"], n["host"])]), lr) for n, lr in zip(nodes, local)
    ]


def death_cause(error: BaseException) -> str:
    """The likely cause of a worker's death, from Ray's report, in words a user can act on."""
    from ray.exceptions import OutOfMemoryError

    text = str(error)
    if isinstance(error, OutOfMemoryError) or "memory monitor" in text:
        return "Ray's memory monitor killed it, the node being out of memory (a smaller policy.micro_batch_size helps)"
    return (
        "its process ended without an error of its own, most often the kernel's OOM killer (`dmesg | grep -i "
        "'killed process'` shows its record; a smaller policy.micro_batch_size helps), else a signal or a crash"
    )


class PolicyGroup:
    """``policy.num_workers`` data-parallel workers behind :class:`~rl_specdec.policy.interface.PolicyInterface`."""

    def __init__(self, config: PolicyConfig, *, keep_reference: bool = False, seed: int = 0):
        import ray

        self.config = config
        self.workers: list[Any] = []
        self.nodes: list[dict[str, Any]] = []
        self.pg = None
        # results of other ranks for a call whose rank-0 result went out as a ref
        self._background: list[tuple[int, Any]] = []
        try:
            self._start_actors(ray.remote(PolicyWorker), keep_reference, seed)
            self.nodes = self._get([w.node_info.remote() for w in self.workers])
            addr, port = self.nodes[0]["ip"], self.nodes[0]["free_port"]
            plan = threads_and_local_ranks(self.nodes, config.num_threads)
            self._get(
                [
                    w.start.remote(rank, len(self.workers), addr, port, num_threads=threads, local_rank=local_rank)
                    for rank, (w, (threads, local_rank)) in enumerate(zip(self.workers, plan))
                ]
            )
        except BaseException:  # a failed start leaves no actor and no reservation behind
            self.shutdown()
            raise
        if len(self.workers) > 1:
            logger.info(
                "policy group: %d %s workers on %s",
                len(self.workers),
                config.strategy,
                [self._where(r) for r in range(len(self.workers))],
            )

    def _start_actors(self, actor_cls, keep_reference: bool, seed: int) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        n, bundle = self.config.num_workers, worker_bundle(self.config)
        if bundle:
            self.pg = placement_group([dict(bundle) for _ in range(n)], strategy=self.config.placement_strategy)
            try:
                ray.get(self.pg.ready(), timeout=120)
            except ray.exceptions.GetTimeoutError as e:
                raise RuntimeError(
                    f"Ray could not reserve {n} x {bundle} for policy.num_workers={n} "
                    f"({self.config.placement_strategy}); the cluster has "
                    f"{ray.available_resources()} free. Lower policy.num_workers, gpus_per_worker or cpus_per_worker, "
                    "or add nodes."
                ) from e
        for i in range(n):
            where = (
                {
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(
                        placement_group=self.pg, placement_group_bundle_index=i
                    )
                }
                if self.pg
                else {}
            )
            opts = {"num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0), **where}
            self.workers.append(actor_cls.options(**opts).remote(self.config, keep_reference=keep_reference, seed=seed))

    # ---- calls and failures ----------------------------------------------------------
    def _where(self, rank: int) -> str:
        n = self.nodes[rank] if rank < len(self.nodes) else {}
        return f"rank {rank} (node {n.get('ip', '?')}, id {str(n.get('node_id', '?'))[:12]}, pid {n.get('pid', '?')})"

    def _get(self, refs: list, ranks: list[int] | None = None, keep_group: bool = False) -> list:
        """Every rank's result; if one fails, the dead workers (or else the first error) name themselves.

        ``keep_group``: no rank waits for another after the call's collectives (a checkpoint write), so a rank's
        error (not its death) leaves the group usable: it is raised as it is (an instance of its own class), and
        the group is not stopped.
        """
        import ray
        from ray.exceptions import RayActorError

        ranks = list(range(len(refs))) if ranks is None else ranks
        pending = dict(zip(refs, ranks))
        results: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=GRACE_S if errors else None)
            if not ready:  # the rest wait in a collective for a failed rank
                break
            rank = pending.pop(ready[0])
            try:
                results[rank] = ray.get(ready[0])
            except ray.exceptions.RayError as e:  # a rank failed or died: named below, once the others are in
                errors[rank] = e
        if not errors:
            return [results[r] for r in ranks]
        dead = sorted(r for r, e in errors.items() if isinstance(e, RayActorError))
        if keep_group and not dead:
            raise errors[min(errors)]
        self.shutdown()  # survivors may be stuck in a collective with the dead
        if dead:
            logger.debug("Ray's report of the dead policy worker: %s", errors[dead[0]])
            raise PolicyWorkerDied(
                f"the trainer's policy worker {', '.join(self._where(r) for r in dead)} died: "
                f"{death_cause(errors[dead[0]])}. "
                f"The policy group ({len(ranks)} workers) is stopped."
            ) from errors[dead[0]]
        first = min(errors)
        raise RuntimeError(f"policy worker {self._where(first)} failed: {errors[first]}") from errors[first]

    def _run(self, method: str, per_rank_args: list[tuple] | None = None, ranks: list[int] | None = None) -> list:
        """Call ``method`` on ``ranks`` (default: all) and wait for all of them."""
        self._settle()
        ranks = list(range(len(self.workers))) if ranks is None else ranks
        args = per_rank_args or [()] * len(ranks)
        return self._get([getattr(self.workers[r], method).remote(*a) for r, a in zip(ranks, args)], ranks)

    def _settle(self) -> None:
        """Collect the other ranks' part of the last refit gather (their errors surface here)."""
        if self._background:
            ranks, refs = zip(*self._background)
            self._background = []
            self._get(list(refs), list(ranks))

    @property
    def _gathers_on_all_ranks(self) -> bool:
        """FSDP2 shards must be all-gathered by every rank; a DDP replica on rank 0 holds everything."""
        return self.config.strategy == "fsdp2"

    # ---- PolicyInterface ---------------------------------------------------------------
    def train_step(self, batch: dict[str, torch.Tensor], loss_fn: LossFn) -> dict[str, float]:
        shards = shard_batch(batch, len(self.workers))
        return self._run("train_step", [(shard, loss_fn) for _, shard in shards])[0]

    def forward_backward_time(self, batch: dict[str, torch.Tensor], loss_fn: LossFn) -> float:
        """The slowest worker's seconds for this batch's forwards and backwards without the head (nothing steps)."""
        shards = shard_batch(batch, len(self.workers))
        return max(self._run("forward_backward_time", [(shard, loss_fn) for _, shard in shards]))

    def get_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        shards = shard_batch(batch, len(self.workers))
        outs = self._run("get_logprobs", [(shard,) for _, shard in shards])
        n, t = batch["input_ids"].shape
        out = torch.zeros(n, t - 1)  # [N, T-1]
        for (idx, _), lp in zip(shards, outs):
            real = idx >= 0
            out[idx[real]] = lp[real]
        return out

    def state_dict_for_refit(self):
        """An ObjectRef of the whole state dict: engines fetch it straight from Ray's object store."""
        self._settle()
        ranks = range(len(self.workers)) if self._gathers_on_all_ranks else [0]
        refs = [self.workers[r].state_dict_for_refit.remote() for r in ranks]
        self._background = list(zip(ranks, refs))[1:]
        return refs[0]

    def state_dict_buckets(self) -> Iterator[Any]:
        """ObjectRefs of dicts of at most ``policy.refit_bucket_bytes``, in order; together the whole state dict.

        Rank 0 streams them (a Ray streaming generator) and runs at most
        ``REFIT_PREFETCH`` buckets ahead of the consumer, so the object store
        holds a few buckets at a time, not the model. Consume them in order and
        drop each ref once the engines have loaded it. Starts at once.
        """
        self._settle()
        ranks = list(range(len(self.workers))) if self._gathers_on_all_ranks else [0]
        gens = [
            self.workers[r]
            .state_dict_buckets.options(num_returns="streaming", _generator_backpressure_num_objects=REFIT_PREFETCH)
            .remote(self.config.refit_bucket_bytes)
            for r in ranks
        ]
        return self._stream(gens, ranks)

    def _stream(self, gens: list, ranks: list[int]) -> Iterator[Any]:
        # a plain loop, not `yield from`: closing this generator early (a refit that failed) must not close Ray's
        # streaming generator, whose close() raises
        for ref in gens[0]:
            yield ref
        for rank, gen in zip(ranks[1:], gens[1:]):  # the other ranks yield nothing, unless they failed
            for ref in gen:
                self._get([ref], [rank])

    def head_result(self) -> dict[str, float]:
        """The EAGLE-3 head's last step (rank 0's shard; {} without a head or before its first step)."""
        return self._get([self.workers[0].head_result.remote()], [0])[0]

    def head_state_dict_for_refit(self):
        """The head's tensors (rank 0: the head is replicated, never sharded); None without a head."""
        return self._get([self.workers[0].head_state_dict_for_refit.remote()], [0])[0]

    def save_checkpoint(self, path: str) -> None:
        """Rank 0 writes after the gathers: a failed write (a full disk) raises its error and the group goes on."""
        self._settle()
        self._get([w.save_checkpoint.remote(path) for w in self.workers], keep_group=True)

    def load_checkpoint(self, path: str) -> None:
        self._run("load_checkpoint", [(path,)] * len(self.workers))

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for w in self.workers:
            ray.kill(w, no_restart=True)  # a dead actor is killed again without complaint
        self.workers = []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None
