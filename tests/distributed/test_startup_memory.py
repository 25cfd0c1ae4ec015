"""Real-size memory, measured: a rank starting from a Hugging Face checkpoint holds its own
share of the model, never the model; an export holds a few tensors, never the model.

Each rank measures its own process: resident memory just before the step under test
(``/proc/self/statm``) and the process's peak resident memory after it (the kernel's high-water
mark ``VmHWM``, reset just before the step by writing 5 to ``/proc/self/clear_refs``).
``resource.getrusage(...).ru_maxrss`` would be the same mark, except that it also keeps the
peak of the image before ``exec``: a spawned rank starts as a fork of pytest, so its
``ru_maxrss`` is pytest's size from the first instruction. The checkpoint (~100 MB fp32) is much larger than
one rank's share (~1/2 with ep = 2 over 2 ranks), and the bound is derived from the share:
2 x (this rank's parameter bytes) + 32 MiB (the second share covers the memory-mapped
checkpoint pages the rank reads; 32 MiB for the allocator, one init block, Python objects).
Building the whole model on a rank (as before meta-device construction: about 2 x the
checkpoint with expert parallelism) exceeds it severalfold.
"""

from __future__ import annotations

import io
import os
import re

import torch
from dist_utils import run_distributed
from safetensors.torch import load_file

import bumblebee
from bumblebee import load_config
from bumblebee.models.qwen3_moe import Qwen3MoeArch
from bumblebee.primitives.sharding.common import local, row_extent
from bumblebee.runtime.checkpoint.export import BUCKET_BYTES

MiB = 2**20
# 2 layers x 32 experts x 3 x 512 x 256 fp32 = 100 MB of experts; the rest is small
ARCH = dict(
    vocab_size=272,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=32,
    num_experts_per_tok=2,
)


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark restarts at the current resident size


def rss_peak() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1024


def make_checkpoint(path) -> int:
    """A random Qwen3-MoE HF directory; returns its bytes."""
    torch.manual_seed(0)
    bumblebee.to_hf(bumblebee.build_model(Qwen3MoeArch(**ARCH)), str(path))
    return os.path.getsize(os.path.join(path, "model.safetensors"))


def _start(rank, world, hf_path, out_dir):
    from bumblebee.runtime.trainer import Trainer

    cfg = load_config(
        None,
        [
            "model.name=qwen3_moe",
            f"model.hf_path={hf_path}",
            "parallel.ep=2",
            "train.seq_len=64",
            "train.global_batch=2",
            "train.steps=1",
            f"train.out_dir={out_dir}",
        ],
    )
    reset_peak()
    before = rss_now()
    trainer = Trainer(cfg, stream=io.StringIO())
    grown = rss_peak() - before
    share = sum(local(p).numel() * local(p).element_size() for p in trainer.model.parameters())
    # what the rank read is exactly its rows of the checkpoint (whole model read by one process)
    whole = dict(bumblebee.from_hf(hf_path).named_parameters())
    model, g = trainer.model, trainer.model.groups
    for name, p in model.named_parameters():
        _, lo, part = row_extent(p, model.is_expert_param(name), g.ep_rank, g.ep_size)
        assert torch.equal(part, whole[name][lo : lo + part.shape[0]]), name
    trainer.checkpoint.save(0)  # for the export test
    return grown, share


def _export(rank, world, ckpt, out):
    from bumblebee.runtime.checkpoint.export import export_checkpoint

    reset_peak()
    before = rss_now()
    export_checkpoint(ckpt, out)
    return rss_peak() - before


def test_each_rank_reads_only_its_share_and_export_streams(tmp_path):
    size = make_checkpoint(tmp_path / "hf")
    for rank, (grown, share) in enumerate(
        run_distributed(_start, 2, str(tmp_path / "hf"), str(tmp_path / "run"))
    ):
        assert share < 0.6 * size, (
            share,
            size,
        )  # experts split over ep = 2, dense tensors over fsdp2
        bound = 2 * share + 32 * MiB
        assert grown <= bound, (
            f"rank {rank}: peak RSS grew {grown / MiB:.0f} MiB while starting from a "
            f"{size / MiB:.0f} MiB checkpoint; its share is {share / MiB:.0f} MiB, "
            f"bound {bound / MiB:.0f} MiB"
        )

    # export the training checkpoint: it reads a bucket of whole tensors at a time (at most BUCKET_BYTES) and
    # writes each as it is converted, so it holds a bucket + one converted tensor (the largest: one layer's
    # stacked experts), never the model (a whole-model export holds it twice: ~2 x size)
    largest = 32 * 2 * 512 * 256 * 4
    [grown] = run_distributed(_export, 1, str(tmp_path / "run"), str(tmp_path / "export"))
    bound = min(BUCKET_BYTES, size) + largest + 32 * MiB
    assert grown <= bound, (
        f"export: peak RSS grew {grown / MiB:.0f} MiB for a {size / MiB:.0f} MiB model; "
        f"bound {bound / MiB:.0f} MiB"
    )
    exported, source = (load_file(tmp_path / d / "model.safetensors") for d in ("export", "hf"))
    assert exported.keys() == source.keys()
    assert all(torch.equal(exported[k], source[k]) for k in source)  # the round trip is exact
