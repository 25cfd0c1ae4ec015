"""Measured throughput of a run: model TFLOP/s per GPU and MFU (model FLOPs utilization).

model FLOPs per token come from the model's ``ModelSpec`` (``models/spec.py``,
``model_flops_per_token``: forward + backward, 3x forward, no recompute counted, causal
attention at half the square) -- the same arithmetic the planner predicts with, so a run's
log can be held against ``bumblebee plan``'s TFLOPs/GPU. Recomputed forwards are not
counted (MFU, not hardware FLOPs utilization: Chowdhery et al. 2022, PaLM, appendix B).

The peak is the device's dense spec-sheet figure for the run's compute dtype, found by the
CUDA device name in ``PEAKS``; a GPU not in the table, and the CPU, get TFLOP/s without MFU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Peak:
    name: str  # substring of torch.cuda.get_device_name(), matched in table order
    bf16_tflops: float  # dense bf16 tensor-core peak
    fp32_tflops: float  # plain fp32 (no TF32: PyTorch's matmul default)


# Public vendor datasheets, dense (no sparsity). More specific names first ("H100 PCIe" before "H100",
# "GB200" before "B200"); bumblebee/plan/hardware.py holds the planner's figures for h100/h200/b200.
PEAKS: tuple[Peak, ...] = (
    Peak("GB200", 2500.0, 80.0),
    Peak("B200", 2250.0, 80.0),
    Peak("H200", 989.0, 67.0),
    Peak("H100 PCIe", 756.0, 51.0),
    Peak("H100", 989.0, 67.0),  # SXM (and NVL at a similar figure)
    Peak("H800", 989.0, 67.0),
    Peak("H20", 148.0, 44.0),
    Peak("A100", 312.0, 19.5),
    Peak("A800", 312.0, 19.5),
    Peak("L40S", 362.0, 91.6),
    Peak("A10G", 70.0, 31.2),
    Peak("L4", 121.0, 30.3),
)


def peak_tflops(device_name: str, dtype: str) -> float | None:
    """Dense peak TFLOP/s of the GPU named ``device_name`` for ``dtype`` ("bfloat16" | "float32"),
    or None when the device is not in the table."""
    for peak in PEAKS:
        if peak.name.lower() in device_name.lower():
            return peak.bf16_tflops if dtype == "bfloat16" else peak.fp32_tflops
    return None


def device_peak(device: torch.device, dtype: str) -> tuple[str, float | None]:
    """(device name, dense peak TFLOP/s or None) of the device a run computes on; the CPU has none."""
    if device.type != "cuda":
        return "cpu", None
    name = torch.cuda.get_device_name(device)
    return name, peak_tflops(name, dtype)


class Throughput:
    """Per step: ``tflops_per_gpu`` (model FLOPs over the step time and every rank) and ``mfu``
    (that over the device's peak; only where the peak is known)."""

    def __init__(self, flops_per_token: float, world: int, peak: float | None):
        self.flops_per_token, self.world, self.peak = flops_per_token, world, peak

    def fields(self, tokens: int, seconds: float) -> dict[str, float]:
        if seconds <= 0:
            return {}
        tflops = self.flops_per_token * tokens / seconds / self.world / 1e12
        out = {"tflops_per_gpu": tflops}
        if self.peak:
            out["mfu"] = tflops / self.peak
        return out
