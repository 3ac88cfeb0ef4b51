"""GPU and network figures the forecast uses: one frozen dataclass per GPU type.

Every figure is a field, documented with its unit and source, and every field can be
overridden: ``--hardware-file FILE`` loads a JSON object of field names (a full
:class:`Hardware`, as ``--calibrate`` writes, or a few fields over ``--gpu``'s defaults).

Network figures are *bus bandwidth* in the nccl-tests sense: for a ring all-gather or
reduce-scatter of ``n`` ranks moving ``B`` bytes in total, time = ``(n - 1) * latency +
(n - 1) / n * B / bandwidth``. Published nccl-tests bus bandwidths reach about 80 % of the
link's one-way rate; the defaults below apply that to the links' datasheet rates.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

__all__ = ["GPUS", "Hardware", "load_hardware"]

GiB = 1024**3


@dataclass(frozen=True)
class Hardware:
    """One GPU type and its interconnect.

    Fields:
        name: label in reports.
        memory_bytes: device memory (bytes) as the driver reports it.
        reserved_bytes: memory training cannot use (bytes): CUDA context, NCCL buffers,
            allocator fragmentation. A rule-of-thumb figure, not a measurement.
        peak_flops_bf16, peak_flops_fp32: dense matmul peak (FLOP/s); fp32 is plain FP32,
            not TF32 (PyTorch leaves TF32 matmuls off by default).
        memory_bandwidth: device memory bandwidth (bytes/s), for copies and the optimizer.
        copy_efficiency: fraction of ``memory_bandwidth`` a device copy kernel reaches.
        gpus_per_node: GPUs joined by the intra-node link.
        intra_node_latency_s, intra_node_bandwidth: per ring step (s) and bus bandwidth
            (bytes/s per GPU) inside a node.
        inter_node_latency_s, inter_node_bandwidth: the same across nodes (per GPU: one NIC
            per GPU).
        overlaps_communication: whether collectives run beside compute (GPUs: a separate
            stream); when False, every collective adds to the step.
        fsdp2_all_gather_factor, fsdp2_reduce_scatter_factor: FSDP2's collective time over
            veScale-FSDP's for the same bytes. 1 on NCCL, where both call the same tensor
            collectives. On gloo they differ: FSDP2 calls gloo's, which stage through a full
            copy (and reduce-scatter by all-reduce), veScale-FSDP sends point-to-point in
            place (``vescale_plugins/dbuffer/collectives.py``); ``--calibrate`` measures both.
    """

    name: str
    memory_bytes: int
    reserved_bytes: int
    peak_flops_bf16: float
    peak_flops_fp32: float
    memory_bandwidth: float
    copy_efficiency: float
    gpus_per_node: int
    intra_node_latency_s: float
    intra_node_bandwidth: float
    inter_node_latency_s: float
    inter_node_bandwidth: float
    overlaps_communication: bool = True
    fsdp2_all_gather_factor: float = 1.0
    fsdp2_reduce_scatter_factor: float = 1.0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# Latencies: NCCL's per-step ring latency is a few microseconds inside a node (NVLink) and
# roughly 5-10 us across InfiniBand/RoCE; we use 3 us and 6 us for every GPU type.
_INTRA_LATENCY_S = 3e-6
_INTER_LATENCY_S = 6e-6
_RESERVED = 4 * GiB
_BUS_EFFICIENCY = 0.8

# NVIDIA H100 SXM5 80GB datasheet: 989 TFLOPS dense BF16, 67 TFLOPS FP32, 3.35 TB/s HBM3,
# NVLink 4 900 GB/s (450 GB/s each way); DGX H100: 8 x 400 Gb/s ConnectX-7, one per GPU.
# nvidia-smi reports 81559 MiB.
_H100 = Hardware(
    "H100 SXM 80GB",
    81559 * 2**20,
    _RESERVED,
    989e12,
    67e12,
    3.35e12,
    0.8,
    8,
    _INTRA_LATENCY_S,
    _BUS_EFFICIENCY * 450e9,
    _INTER_LATENCY_S,
    _BUS_EFFICIENCY * 50e9,
)

GPUS: dict[str, Hardware] = {
    "h100": _H100,
    # NVIDIA H200 SXM datasheet: H100's compute, 141 GB HBM3e at 4.8 TB/s, same NVLink 4 and
    # NICs (DGX H200). nvidia-smi reports 143771 MiB.
    "h200": dataclasses.replace(_H100, name="H200 SXM 141GB", memory_bytes=143771 * 2**20, memory_bandwidth=4.8e12),
    # NVIDIA H800 SXM (export variant of H100): same compute and HBM, NVLink cut to
    # 400 GB/s (200 GB/s each way); 8 x 400 Gb/s NICs as in the veScale-FSDP paper's clusters.
    "h800": dataclasses.replace(_H100, name="H800 SXM 80GB", intra_node_bandwidth=_BUS_EFFICIENCY * 200e9),
    # NVIDIA A100 SXM4 80GB datasheet: 312 TFLOPS dense BF16, 19.5 TFLOPS FP32, 2.04 TB/s
    # HBM2e, NVLink 3 600 GB/s (300 GB/s each way); DGX A100: 8 x 200 Gb/s HDR NICs.
    # nvidia-smi reports 81920 MiB.
    "a100": Hardware(
        "A100 SXM 80GB",
        81920 * 2**20,
        _RESERVED,
        312e12,
        19.5e12,
        2.04e12,
        0.8,
        8,
        _INTRA_LATENCY_S,
        _BUS_EFFICIENCY * 300e9,
        _INTER_LATENCY_S,
        _BUS_EFFICIENCY * 25e9,
    ),
}


def load_hardware(gpu: str, path: str | None = None) -> Hardware:
    """``GPUS[gpu]``, with the fields in the JSON file ``path`` (if given) replacing its own.

    Raises ``ValueError`` naming an unknown GPU or field.
    """
    if gpu not in GPUS:
        raise ValueError(f"--gpu {gpu!r} is not known; use one of {sorted(GPUS)} or --hardware-file")
    hardware = GPUS[gpu]
    if path is None:
        return hardware
    with open(path) as f:
        overrides = json.load(f)
    known = {f.name for f in dataclasses.fields(Hardware)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"{path}: unknown hardware fields {unknown}; known fields: {sorted(known)}")
    return dataclasses.replace(hardware, **overrides)
