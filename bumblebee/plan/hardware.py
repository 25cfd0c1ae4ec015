"""Hardware table and the few efficiency constants the planner's models use.

Peak figures are public spec sheets (dense bf16, no sparsity) as listed in
the vendors' public spec sheets; every efficiency below is a fraction of such a peak that a
well-tuned kernel or collective reaches in practice, with the source of the
figure beside it. The throughput model (``perf.py``) and the memory model
(``memory.py``) read nothing else about the machine, so adding a GPU is one row.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from bumblebee.config import ConfigError

GB = 1e9  # decimal gigabytes, as GPU memory is quoted


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_tflops: float  # dense bf16 peak, TFLOP/s
    hbm_gb: float  # capacity, GB
    hbm_gbps: float  # HBM bandwidth, GB/s
    nvlink_gbps: float  # NVLink, GB/s per direction per GPU
    # inter-node per GPU per direction: 8 x 400 Gb/s IB per 8-GPU node (typical H100 cluster networking)
    ib_gbps: float = 50.0
    gpus_per_node: int = 8
    # host <-> GPU per direction: PCIe 5.0 x16 is 64 GB/s nominal; ~50 GB/s is what copies from
    # pinned memory reach (recompute = "offload" moves layer inputs over it)
    pcie_gbps: float = 50.0


# Public spec sheets, dense bf16 (NVIDIA H100 SXM, H200, B200 datasheets).
GPUS: dict[str, GPU] = {
    "h100": GPU("H100 SXM", 989.0, 80.0, 3350.0, 450.0),
    "h200": GPU("H200", 989.0, 141.0, 4800.0, 450.0),
    "b200": GPU("B200", 2250.0, 180.0, 8000.0, 900.0),
}


def get_gpu(name: str) -> GPU:
    if name.lower() not in GPUS:
        raise ConfigError(f"unknown --gpu {name!r}; valid: {', '.join(GPUS)}")
    return GPUS[name.lower()]


@dataclass(frozen=True)
class Efficiency:
    """Achieved fraction of peak for each class of work (all physically meaningful;
    change one and every prediction moves coherently)."""

    # Large bf16 GEMMs reach ~70% of the dense peak with cuBLAS on H100 (public
    # cuBLAS/Transformer-Engine GEMM sweeps: ~650-750 of 989 TFLOP/s).
    gemm: float = 0.70
    # A GEMM whose smallest dim is d runs at d / (d + gemm_half_dim) of that: tile
    # quantization and too few waves for thin matrices (a 128-wide tile is half used
    # at d = 128 on average). Grouped GEMMs pay an extra scheduling factor.
    gemm_half_dim: float = 128.0
    grouped: float = 0.80
    # Causal flash attention (FA2/FA3, cuDNN) on H100 in bf16 reaches ~40-60% of
    # peak forward and ~30-45% backward (FlashAttention-3 paper, Shah et al. 2024);
    # head_dim 256 and the per-step blocks of context-parallel attention sit at the
    # low end. Calibrated within that range on the published Qwen3.5-35B-A3B points.
    attn_fwd: float = 0.42
    attn_bwd: float = 0.30
    # Chunked gated-delta-rule kernels (flash-linear-attention Triton) are far from
    # the tensor-core peak: small per-chunk matmuls and a sequential chunk scan.
    gdn: float = 0.12
    # Memory-bound elementwise / norm / permute kernels: fraction of HBM bandwidth.
    hbm: float = 0.75
    # NCCL collectives: achieved bus bandwidth over link bandwidth (nccl-tests on
    # H100 NVLink4 all-gather/reduce-scatter ~360-370 of 450 GB/s; all-to-all lower).
    collective: float = 0.80
    all_to_all: float = 0.55
    # Fixed per-kernel cost (launch + ramp-up + tail), microseconds: what makes
    # short local sequences and many small chunks slow (CUDA launch ~3-5 us,
    # plus the idle tail of a partly filled last wave).
    kernel_us: float = 8.0
    # Fraction of FSDP / data-parallel communication that prefetch overlaps with
    # compute when the compute is long enough (FSDP2 prefetches one unit ahead).
    comm_overlap: float = 0.9
    # Materialized CE: bytes moved per logit element over forward+backward (bf16
    # write, fp32 upcast, max/exp/sum passes, log-softmax, its gradient, bf16 grad).
    ce_bytes_per_logit: float = 48.0
    # published: a chunked linear CE made the loss layer ~1.3x slower in one GPU implementation.
    linear_ce_slowdown: float = 1.3

    def for_flash(self, impl: str) -> Efficiency:
        """These efficiencies for the flash kernel that will run: ``attn_fwd`` / ``attn_bwd`` above
        are FA3-class; "FA2" scales them by ``FA2_OVER_FA3``."""
        if impl == "FA3":
            return self
        if impl != "FA2":
            raise ValueError(f"flash kernel must be 'FA2' or 'FA3', got {impl!r}")
        return replace(
            self, attn_fwd=self.attn_fwd * FA2_OVER_FA3, attn_bwd=self.attn_bwd * FA2_OVER_FA3
        )


# FlashAttention-2's attention throughput over FlashAttention-3's on H100 in bf16: FA3 runs ~1.5-2x
# FA2 (Shah et al. 2024, "FlashAttention-3", figures for head dims 64-256, causal); 1/1.6 is the
# middle of that range, to be re-fitted by a GPU run that measures the kernel torch really runs.
FA2_OVER_FA3 = 1 / 1.6


# Allocator / framework overhead added to every moment of the timeline (timeline.py):
# FIXED_OVERHEAD_GB for what PyTorch allocates beside the model (cuBLAS workspaces, NCCL
# communicator buffers registered through the caching allocator) and FRAGMENTATION x the
# moment's transient bytes (activations, MoE and all-gather buffers; the few huge loss
# blocks fragment little). FITTED: these two are the only memory constants tuned to the
# two published Qwen3.5-35B-A3B peaks (32 x H100, 128K; tests/unit/test_plan_calibration.py):
# 1.6 GB + 7% of the transient bytes (a grid minimizing the larger residual) puts stage 0 at
# 43.97 GB (published 42.91, TP2/PP4) and 54.54 GB (published 55.91, TP1/PP2), within 2.5%.
# Both values sit inside what is commonly seen when the peak is read from the caching
# allocator (the CUDA context, ~0.5 GB, is outside it): workspaces + NCCL ~0.5-2 GB,
# fragmentation ~0-30% (lower with expandable segments). No layout is special-cased.
# A candidate fits when its peak is at most (1 - MEMORY_MARGIN) x the spec-sheet HBM
# (decimal GB; an "80 GB" H100 exposes ~85 GB to PyTorch, so the total margin is ~10%):
# room for the model's error and the context.
MEMORY_MARGIN = 0.05
FIXED_OVERHEAD_GB = 1.6
FRAGMENTATION = 0.07
