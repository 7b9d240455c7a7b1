"""Refit gather: the whole state dict in one object against bounded buckets.

    python -m benchmarks refit                      # toy and a random Qwen3-0.6B-shape model, ~5 min on 2 cores
    python -m benchmarks refit --models toy --repeats 5
    python -m benchmarks refit --zero-copy          # the same with Ray's zero-copy torch tensors

For each model and policy layout (1 worker; 2 FSDP2 workers), the policy group
hands out its weights as the engines would take them, and this process plays
the engine: it fetches every object from Ray's object store and drops it.

* ``whole``: ``state_dict_for_refit()``, one ObjectRef of the whole dict (today's path);
* ``bucketed``: ``state_dict_buckets()``, a stream of dicts of at most ``--bucket-mib``.

Measured: wall time from the call until the engine has read the last tensor
(median of ``--repeats``), and the peak memory the refit *adds* (max over the
repeats): in rank 0's process and in the engine's, their private resident
memory (``RssAnon``, sampled every 5 ms: the gathered tensors, the serialised
copy, the deserialised tensors; pages of the shared-memory object store they
map are not counted there), and the bytes held in Ray's object store (sampled
through the raylet, about every 0.1 s). Each layout and mode gets fresh worker
and engine processes. Every process must run on this host (``/proc``). The
Qwen3-0.6B-shape model is ``transformers.Qwen3Config`` with that architecture,
randomly initialised in float32 (no download), saved once under
``$RL_SPECDEC_CACHE`` (default ``~/.cache/rl_specdec``).
Prints a markdown table and writes it (``refit.md``) and the figures (``refit.json``) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path

from benchmarks import bench_common

MIB = 2**20
QWEN3_0P6B = dict(  # Qwen/Qwen3-0.6B's config.json, shape only
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
)


def model_path(name: str) -> str:
    if name == "toy":
        from rl_specdec.toy.build import build_toy_models

        return str(build_toy_models().policy)
    root = (
        Path(os.environ.get("RL_SPECDEC_CACHE", Path.home() / ".cache" / "rl_specdec"))
        / "bench"
        / "qwen3-0.6b-shape-random"
    )
    if not (root / "config.json").is_file():
        import torch
        from transformers import AutoModelForCausalLM, Qwen3Config

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(Qwen3Config(**QWEN3_0P6B), dtype=torch.float32)
        tmp = root.with_name(root.name + ".tmp")
        model.save_pretrained(tmp)
        tmp.rename(root)
    return str(root)


def _rss_anon(pid: int) -> int:
    """Private (anonymous) resident bytes of a process: its heap, not the shared object-store pages it maps."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise KeyError("RssAnon")


def _store_used() -> int:
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    return get_memory_info_reply(get_state_from_address(ray_gcs_address())).store_stats.object_store_bytes_used


def ray_gcs_address() -> str:
    import ray

    return ray.get_runtime_context().gcs_address


class Peaks:
    """Samples, in background threads, the private memory of some processes (every 5 ms) and the bytes
    held in Ray's object store (every RPC, ~0.1 s); reports each one's peak above its value at the start."""

    def __init__(self, pids: list[int]):
        self.pids = pids

    def __enter__(self):
        self.base = [_rss_anon(p) for p in self.pids] + [_store_used()]
        self.peak = list(self.base)
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._procs, daemon=True),
            threading.Thread(target=self._store, daemon=True),
        ]
        for t in self.threads:
            t.start()
        return self

    def _procs(self):
        while not self.stop.wait(0.005):
            for i, p in enumerate(self.pids):
                self.peak[i] = max(self.peak[i], _rss_anon(p))

    def _store(self):
        while not self.stop.is_set():
            self.peak[-1] = max(self.peak[-1], _store_used())

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join()
        for i, p in enumerate(self.pids):  # the last value too
            self.peak[i] = max(self.peak[i], _rss_anon(p))
        self.added = [peak - base for peak, base in zip(self.peak, self.base)]


class Engine:
    """Plays a generation engine: loads what refit hands it, reading every page, and keeps nothing."""

    def pid(self) -> int:
        import torch

        torch.zeros(1).sum()  # torch loaded before the first measurement, not during it
        return os.getpid()

    def load(self, state: dict) -> int:
        unique = {id(t): t for t in state.values()}.values()  # a tied tensor comes under two names, once
        for t in unique:
            t.reshape(-1)[::1024].sum()  # touch every page, as copying it into an engine's weights does
        return sum(t.numel() * t.element_size() for t in unique)


def refit(group, engine, mode: str) -> tuple[int, int]:
    """Hand the weights to the engine as the loop would, dropping each object once loaded; (objects, bytes)."""
    import ray

    refs = [group.state_dict_for_refit()] if mode == "whole" else group.state_dict_buckets()
    n = nbytes = 0
    for ref in refs:
        nbytes += ray.get(engine.load.remote(ref))  # Ray resolves the ref: the engine reads it from the object store
        n += 1
        del ref
    return n, nbytes


def measure(cfg, mode: str, repeats: int) -> dict:
    """Fresh workers and a fresh engine process, so each peak starts from a clean resident set."""
    import ray

    from rl_specdec.policy import PolicyGroup

    group = PolicyGroup(cfg)
    engine = ray.remote(Engine).options(num_cpus=0).remote()
    try:
        rank0, eng = group.nodes[0]["pid"], ray.get(engine.pid.remote())
        times, peaks = [], []
        for _ in range(repeats):
            with Peaks([rank0, eng]) as p:
                t0 = time.perf_counter()
                n, nbytes = refit(group, engine, mode)
                times.append(time.perf_counter() - t0)
            peaks.append(p.added)
    finally:
        group.shutdown()
        ray.kill(engine)
    worker, engine_, store = (max(p[i] for p in peaks) for i in range(3))
    return {
        "objects": n,
        "bytes": nbytes,
        "time_s": statistics.median(times),
        "worker_peak": worker,
        "engine_peak": engine_,
        "store_peak": store,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_common.add_out(p, "refit", "refit.md, refit.json")
    p.add_argument("--models", default="toy,qwen3-0.6b", help="comma-separated: toy, qwen3-0.6b")
    p.add_argument(
        "--layouts", default="1xddp,2xfsdp2", help="comma-separated WORKERSxSTRATEGY, e.g. 1xddp,2xddp,2xfsdp2"
    )
    p.add_argument(
        "--bucket-mib",
        default="toy=1,qwen3-0.6b=256",
        help="bucket size per model in MiB (256 is policy.refit_bucket_bytes' default)",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ray-cpus", type=int, default=8, help="logical CPUs of the local Ray instance")
    p.add_argument(
        "--zero-copy",
        action="store_true",
        help="set RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1 for every process: Ray maps tensors instead of pickling them",
    )
    args = p.parse_args(argv)
    if args.zero_copy:
        os.environ["RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"] = (
            "1"  # before ray.init: the local Ray instance's processes inherit it
        )

    import ray

    buckets = {k: float(v) for k, v in (kv.split("=") for kv in args.bucket_mib.split(","))}
    ray.init(address="local", num_cpus=args.ray_cpus, include_dashboard=False, log_to_driver=False)
    head = f"{bench_common.header(versions=False)}; zero-copy tensors: {'on' if args.zero_copy else 'off'}"
    with bench_common.markdown_report(args.out, "refit.md", "Refit gather: whole against bucketed", head):
        results = measure_all(args, buckets)
    (Path(args.out) / "refit.json").write_text(json.dumps({"machine": head, "rows": results}, indent=1))
    return 0


def measure_all(args, buckets: dict[str, float]) -> list[dict]:
    """Every model, layout and mode: the table printed row by row, and each row's figures."""
    from rl_specdec.config import PolicyConfig

    results = []
    rows = [
        "| model | layout | refit | objects | MiB moved | time (s) | rank-0 heap, peak added (MiB) | engine heap, "
        "peak added (MiB) | object store, peak added (MiB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in args.models.split(","):
        path = model_path(name)
        for layout in args.layouts.split(","):
            workers, strategy = layout.split("x")
            cfg = PolicyConfig(
                model_name=path,
                device="cpu",
                precision="fp32",
                num_workers=int(workers),
                strategy=strategy,
                refit_bucket_bytes=int(buckets[name] * MIB),
            )
            for mode in ("whole", "bucketed"):
                r = measure(cfg, mode, args.repeats)
                results.append(dict(model=name, layout=layout, mode=mode, bucket_mib=buckets[name], **r))
                label = mode if mode == "whole" else f"bucketed ({buckets[name]:g} MiB)"
                rows.append(
                    f"| {name} | {workers} x {strategy} | {label} | {r['objects']} | {r['bytes'] / MIB:.0f} | "
                    f"{r['time_s']:.2f} | {r['worker_peak'] / MIB:.0f} | {r['engine_peak'] / MIB:.0f} | "
                    f"{r['store_peak'] / MIB:.0f} |"
                )
                print(rows[-1], flush=True)
    print("\n" + "\n".join(rows))
    return results


if __name__ == "__main__":
    raise SystemExit(main())
