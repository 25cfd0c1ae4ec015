"""Fake-tensor rehearsal (benchmarks/rehearsal.py): one token mixer's forward + backward on fake
meta tensors through the kernels CUDA would run, with saved and peak bytes. At tiny shapes
here (the running case's figures come from benchmarks/fake_cuda_rehearsal.py)."""

import sys
from pathlib import Path

from bumblebee.models.presets import preset
from bumblebee.models.qwen3_5_moe.arch import Qwen3_5MoeArch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from rehearsal import rehearse  # noqa: E402  (a benchmark module, not part of the package)


def arch():
    return Qwen3_5MoeArch.from_hf_dict(preset("qwen3_5_moe", "tiny"))


def test_rehearsal_runs_cuda_kernels_on_fake_tensors():
    a = arch()
    attn = rehearse(a, "attention", rows=2, tokens=256)
    gdn = rehearse(a, "gdn", rows=2, tokens=256, fla=True)
    assert (
        attn.kernel.startswith("varlen_attn (flash") and gdn.kernel == "fla chunk_gated_delta_rule"
    )
    for r in (attn, gdn):
        assert 0 < r.saved_bytes < r.peak_bytes
    # the saved activations are at least the bf16 input of the layer's first projection
    assert gdn.saved_bytes >= 2 * 256 * a.hidden_size * 2


def test_chunked_core_saves_no_per_chunk_tensors():
    """The pure-PyTorch chunked core keeps only its inputs (the per-chunk fp32 tensors are
    rebuilt in backward), so it saves about what the layer saves around FLA's op."""
    a = arch()
    fla = rehearse(a, "gdn", rows=1, tokens=512, kernel="fla_chunk")
    torch_chunked = rehearse(a, "gdn", rows=1, tokens=512, kernel="torch_chunked")
    assert torch_chunked.saved_bytes <= 1.1 * fla.saved_bytes, (
        torch_chunked.saved_bytes,
        fla.saved_bytes,
    )
