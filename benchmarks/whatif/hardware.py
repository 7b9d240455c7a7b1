"""Devices: datasheet bandwidth and dense bf16 FLOP/s, the achievable fractions, and per-step overheads.

Datasheet figures are NVIDIA's (dense, i.e. without 2:4 sparsity). The achievable
fractions and the overheads are assumptions, stated as such: no GPU could be
measured for this project. The CPU's constants are not assumed but fitted to
this machine's measured step times (:mod:`.calibrate`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

GB = 1e9
TB = 1e12


@dataclass(frozen=True)
class Device:
    name: str
    bandwidth: float  # memory bandwidth, bytes/s (datasheet)
    flops: float  # dense bf16 tensor FLOP/s (datasheet)
    memory: float  # bytes per device
    link: float  # tensor-parallel all-reduce bandwidth per device, bytes/s (NVLink or PCIe)
    eta_bw: float = 0.80  # achieved fraction of the bandwidth in decode kernels
    eta_flops: float = 0.60  # achieved fraction of the dense FLOP/s in GEMMs and attention
    t_step: float = 0.5e-3  # per engine step: scheduler, input preparation, sampler (s)
    t_spec: float = 0.3e-3  # per speculative step: rejection sampler, draft hand-off, metadata (s)
    t_pass: float = 0.05e-3  # per drafter pass: its own launch and sampling (s)
    t_req: float = 1e-6  # per request in a target step: host-side input and output work, sampling (s)
    t_req_draft: float = 1e-6  # per request in a drafter pass: the same for the drafter (s)
    t_layer: float = 6e-6  # per decoder layer and forward pass: the kernel chain's latency floor (s)
    t_allreduce: float = 8e-6  # per all-reduce latency at tensor parallel > 1 (s)
    mfu: float = 0.40  # training: achieved fraction of dense FLOP/s
    bytes_per_param: float = 2.0  # bf16 weights and KV cache
    anchor_only: bool = False  # shown only beside the published figure that used it
    sources: dict = field(default_factory=dict, compare=False)

    @property
    def ridge(self) -> float:
        """FLOPs per byte where the achieved roofline turns from memory- to compute-bound."""
        return self.flops * self.eta_flops / (self.bandwidth * self.eta_bw)


ASSUMED = {
    "eta_bw": "assumption: decode GEMV/attention kernels reach about 80% of datasheet HBM bandwidth",
    "eta_flops": "assumption: bf16 GEMMs of a few hundred to a few thousand rows reach about 60% of dense peak",
    "t_step": "assumption: vLLM V1's per-step host work with CUDA graphs, about 0.5 ms",
    "t_spec": "assumption: rejection sampler and draft bookkeeping, about 0.3 ms per speculative step",
    "t_pass": "assumption: a drafter pass's own launch and sampling under CUDA graphs, about 50 us",
    "t_req": "assumption: 1 us per request and step left on the critical path (vLLM V1 overlaps most host work)",
    "t_req_draft": "assumption: as t_req, per request and drafter pass",
    "t_layer": "assumption: about 6 us per decoder layer per pass (a chain of ~5 kernels), a latency floor",
    "t_allreduce": "assumption: 8 us per all-reduce over NVLink (20 us over PCIe)",
    "mfu": "assumption: 40% MFU for the train phase (FSDP/Megatron bf16 at 8B-32B)",
}


def _gpu(name, bw, fl, mem, link, sheet, **kw) -> Device:
    src = {"bandwidth, flops, memory, link": sheet, **ASSUMED}
    return Device(name, bw, fl, mem, link, sources=src, **kw)


H100 = _gpu(
    "H100 SXM",
    3.35 * TB,
    989e12,
    80 * GB,
    900 * GB,
    "NVIDIA H100 datasheet: 3.35 TB/s HBM3, 989 TFLOPS bf16 dense, NVLink 900 GB/s",
)
H200 = _gpu(
    "H200", 4.8 * TB, 989e12, 141 * GB, 900 * GB, "NVIDIA H200 datasheet: 4.8 TB/s HBM3e, 989 TFLOPS bf16 dense, 141 GB"
)
A100 = _gpu(
    "A100 80GB",
    2.039 * TB,
    312e12,
    80 * GB,
    600 * GB,
    "NVIDIA A100 datasheet (SXM 80GB): 2,039 GB/s, 312 TFLOPS bf16 dense, NVLink 600 GB/s",
)
L40S = _gpu(
    "L40S",
    0.864 * TB,
    362e12,
    48 * GB,
    64 * GB,
    "NVIDIA L40S datasheet: 864 GB/s GDDR6, 362 TFLOPS bf16 dense (733 sparse), PCIe Gen4 x16 64 GB/s",
    t_allreduce=20e-6,
)
H20 = _gpu(
    "H20",
    4.0 * TB,
    148e12,
    96 * GB,
    900 * GB,
    "NVIDIA H20 product brief: 4.0 TB/s HBM3, 148 TFLOPS bf16 dense, 96 GB, NVLink 900 GB/s",
)
GB200 = _gpu(
    "GB200 (per GPU)",
    8.0 * TB,
    2.5e15,
    186 * GB,
    1800 * GB,
    "NVIDIA GB200 NVL72 datasheet / 72: 8 TB/s HBM3e, 5 PFLOPS bf16 sparse = 2.5 dense, NVLink 1.8 TB/s",
    anchor_only=True,
)

GPUS = (H100, H200, A100, L40S, H20)
ALL = GPUS + (GB200,)


def by_name(name: str) -> Device:
    """A device by its name or the name's first word (H100, H200, A100, L40S, H20, GB200)."""
    for d in ALL:
        if name.lower() in (d.name.lower(), d.name.split()[0].lower()):
            return d
    raise KeyError(f"no device {name!r}: {[d.name for d in ALL]}")


def cpu_device(
    bandwidth: float,
    flops: float,
    t_step: float,
    t_spec: float,
    t_pass: float,
    t_req: float,
    t_req_draft: float,
    bytes_per_param: float = 4.0,
    source: str = "fitted",
) -> Device:
    """This machine's CPU with fitted constants: the achieved bandwidth and FLOP/s are the fit's (eta = 1), no
    per-layer floor (folded into the per-step and per-pass overheads), one socket (no tensor parallel)."""
    return Device(
        "CPU (this machine)",
        bandwidth,
        flops,
        64 * GB,
        1.0,
        eta_bw=1.0,
        eta_flops=1.0,
        t_step=t_step,
        t_spec=t_spec,
        t_pass=t_pass,
        t_req=t_req,
        t_req_draft=t_req_draft,
        t_layer=0.0,
        t_allreduce=0.0,
        mfu=1.0,
        bytes_per_param=bytes_per_param,
        sources={"all": source},
    )


def with_overrides(dev: Device, **kw) -> Device:
    return replace(dev, **kw)
