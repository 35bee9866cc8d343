"""GPU types: dense bf16 peaks (what MFU divides by, ``train.metrics.peak_tflops`` finds the
run's GPU among them), and what the planner needs besides: memory per GPU and the per-GPU link
rates communication is timed at. Memory and links are the vendors' datasheet figures (assumptions,
not measured here); the compute rate is measured on one H200 (``MEASURED``).
"""

from __future__ import annotations

from dataclasses import dataclass

# Dense bf16 tensor-core peaks (TFLOP/s, without sparsity), per the vendors' datasheets.
PEAK_BF16_TFLOPS: dict[str, float] = {
    "H100 PCIe": 756.0,
    "H100": 989.4,
    "H200": 989.4,
    "B200": 2250.0,
    "B300": 2250.0,
}


@dataclass(frozen=True)
class GPU:
    """One GPU type: memory (GiB, as ``cluster.gpu_memory_gib``) and per-GPU link rates."""

    name: str
    memory_gib: float
    nvlink_gb_s: float  # GB/s one GPU sends to the GPUs of its node (NVLink, one direction)
    network_gb_s: float  # GB/s one GPU sends to other nodes (its scale-out NIC)

    @property
    def peak_tflops(self) -> float:
        """Dense bf16 peak (``PEAK_BF16_TFLOPS``)."""
        return PEAK_BF16_TFLOPS[self.name]


# Datasheets: HBM capacity; NVLink 4 (H100, H200) 900 GB/s and NVLink 5 (B200, B300) 1.8 TB/s
# both directions together; one 400 Gb/s NIC per GPU (ConnectX-7), 800 Gb/s on B300 (ConnectX-8).
GPUS: dict[str, GPU] = {
    g.name: g
    for g in (
        GPU("H100", 80.0, 450.0, 50.0),
        GPU("H200", 141.0, 450.0, 50.0),
        GPU("B200", 180.0, 900.0, 50.0),
        GPU("B300", 288.0, 900.0, 100.0),
    )
}


@dataclass(frozen=True)
class Measurement:
    """A rate measured by this project's benchmarks (``benchmarks/RESULTS.md``)."""

    gpu: str
    model_tflops: float  # model TFLOP/s per GPU, the design's FLOP convention
    peak_gib: float  # the most memory PyTorch allocated in that run
    what: str
    source: str  # the JSON under benchmarks/results/ the figure comes from

    @property
    def fraction_of_peak(self) -> float:
        return self.model_tflops / GPUS[self.gpu].peak_tflops


# `moe train` as printed, QuACK grouped GEMMs + FlashAttention 4 (``what`` and ``source`` say
# which run: the second of two that session beside Olmo-core 3; the first printed 479.9).
MEASURED = Measurement(
    gpu="H200",
    model_tflops=480.23,
    peak_gib=71.47,
    what=(
        "moe train, OLMoE-1B-7B (16 layers), pure-bf16, sequence 4096, micro-batch 4, "
        "one H200, median of 20 timed steps (commit 5b23ed7)"
    ),
    source="benchmarks/results/trainer_step_quack_flash4_run2_h200_5b23ed7.json",
)
