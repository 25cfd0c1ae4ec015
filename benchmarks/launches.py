"""Kernel launches and host syncs per layer per micro-batch, before and after the kernel regions
(``primitives/kernel_region.py``: the emulated kernels counted as the kernels they stand for).

    python benchmarks/launches.py                  # both parts
    python benchmarks/launches.py --part mixers    # only the real-width mixers (seconds)
    python benchmarks/launches.py --part moe       # MoE row writes, before / after (minutes)
    python benchmarks/launches.py --part probe     # one GDN CP layer: extended call vs two calls

Two parts:

- ``layers``: before (``kernel_choice.unfused()``: eager glue, the conv's channel blocks, as CUDA ran
  them before) and after (the fused paths); kernels counted as kernels in both. One
  emulated-CUDA training step (``train.emulate_cuda``, 2 gloo ranks, tiny
  presets with the families' layer patterns: Qwen3.5-35B-A3B cp2, Qwen3-30B-A3B ep2 chunked,
  DeepSeek-V3 cp2 ep2 chunked) at two depths; the difference divided by the added layers and
  the micro-batches is one layer's cost per micro-batch (forward, recompute, backward and its
  optimizer share), head and step overhead cancelled. Counts per layer do not depend on the
  width but through the causal conv's 1024-channel blocks (the second part has them at the
  real width) and on the documents per row only through the references (now in regions).
- ``mixers``: Qwen3.5-35B-A3B's two token mixers (Gated DeltaNet through FLA's op, gated
  attention through ``varlen_attn``) at the real widths, forward + backward, on fake meta
  tensors (``benchmarks/rehearsal.py``), no recompute. Before: the glue as the CPU kernel choice runs
  it (eager norms, RoPE, the conv's channel blocks x taps, the gated norm's token blocks), i.e.
  CUDA before this change; after: the CUDA dispatch under the emulated-CUDA mode (compiled glue,
  FLA's conv), every kernel counted as the kernels it stands for.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)


def _rank(rank, world, sets, out_dir, before):
    """One counted step -> (launches, syncs, micro-batches)."""
    from bumblebee import load_config
    from bumblebee.perf.syncs import SyncCounter
    from bumblebee.primitives.emulation import emulate_cuda
    from bumblebee.primitives.kernel_choice import unfused
    from bumblebee.runtime.trainer import Trainer

    cfg = load_config(
        None,
        sets + [f"train.out_dir={out_dir}/{rank}", "train.eval_every=0", "train.emulate_cuda=true"],
    )
    trainer = Trainer(cfg, stream=io.StringIO())
    with unfused() if before else contextlib.nullcontext():
        trainer.train_step()
        with emulate_cuda(check_comm=False), SyncCounter() as c:
            trainer.train_step()
    return c.launches, c.syncs, trainer.accum


def layers(seq: int, depths: tuple[int, int], case: str = "", after_only: bool = False) -> None:
    from dist_utils import run_distributed
    from host_syncs import CASES

    base = [
        f"train.seq_len={seq}",
        "train.global_batch=4",
        "train.micro_batch=1",
        "train.dtype=bfloat16",
    ]
    lo, hi = depths
    print(
        f"per layer per micro-batch: emulated-CUDA step, tiny presets, {seq} tokens per row, "
        f"layers {lo} -> {hi} (difference / {hi - lo} layers / micro-batches)"
    )
    for name, sets in CASES.items():
        if case not in name:
            continue
        per = {True: (float("nan"),) * 2}
        for before in (False,) if after_only else (True, False):
            got = {}
            for n in depths:
                got[n] = run_distributed(
                    _rank,
                    2,
                    base + sets + [f"model.arch.num_hidden_layers={n}"],
                    f"/tmp/bb_launches/{name}/{n}{before}",
                    before,
                )[0]
            micro = got[hi][2]
            per[before] = [(got[hi][i] - got[lo][i]) / ((hi - lo) * micro) for i in range(2)]
        print(
            f"  {name}: launches {per[True][0]:.0f} -> {per[False][0]:.0f}, "
            f"host syncs {per[True][1]:.2f} -> {per[False][1]:.2f}"
        )


def mixers(tokens: int, rows: int) -> None:
    import torch
    from rehearsal import rehearse

    from bumblebee.models.presets import preset
    from bumblebee.models.qwen3_5_moe.arch import Qwen3_5MoeArch
    from bumblebee.perf.syncs import SyncCounter
    from bumblebee.primitives.emulation import emulate_cuda

    print(
        f"Qwen3.5-35B-A3B mixers at the real width, {rows} x {tokens} tokens, fwd + bwd (fake meta):"
    )
    for name in ("tiny", "qwen3.5-35b-a3b"):
        try:
            arch = Qwen3_5MoeArch.from_hf_dict(preset("qwen3_5_moe", name))
        except Exception as e:  # noqa: BLE001  (a preset missing here: say so, go on)
            print(f"  preset {name}: {e}")
            continue
        for mixer in ("gdn", "attention"):
            for after in (False, True):
                c = SyncCounter(launch_sites=True)
                with emulate_cuda(check_comm=False) if after else contextlib.nullcontext():
                    rehearse(arch, mixer, rows=rows, tokens=tokens, dtype=torch.bfloat16, counter=c)
                print(
                    f"  {name:15} {mixer:9} {'after ' if after else 'before'}: "
                    f"{c.launches:5d} launches, {c.syncs} syncs; top: "
                    + ", ".join(f"{s} {n}" for s, n in c.by_launch_site.most_common(3))
                )


def _moe_rank(rank, world, comm, before, T, H, F, E, K):
    """One MoE block (Qwen3-MoE's, ``H`` hidden, ``F`` expert FFN) under full recompute, forward and
    backward, emulated CUDA: (row writes, by kernel). A row write: a kernel other than a GEMM or a
    collective that writes at least a chunk's rows (T / 2) of width H (a copy, a gather, a fill,
    an elementwise product, a sum's output); a compiled function counts once, by its outputs."""
    import collections

    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from bumblebee import registry
    from bumblebee.config import PrimitivesConfig
    from bumblebee.models.blocks import MoE
    from bumblebee.models.qwen3_moe import Qwen3MoeArch
    from bumblebee.perf.syncs import NO_KERNEL
    from bumblebee.primitives.emulation import emulate_cuda
    from bumblebee.primitives.kernel_choice import unfused
    from bumblebee.primitives.moe import local
    from bumblebee.primitives.parallel import ParallelGroups

    aten = torch.ops.aten
    gemms = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten._grouped_mm.default}

    rows_min = T // 2  # a chunk's tokens (2 chunks)

    def big(x):
        return (
            isinstance(x, torch.Tensor)
            and x.dim() >= 2
            and x.shape[-1] == H
            and x.shape[0] * (x.numel() // (x.shape[0] * H)) >= rows_min
        )

    class RowWrites(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.by_kernel, self.inside = collections.Counter(), False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            skip = self.inside or func in gemms or func in NO_KERNEL or func.is_view
            if not skip and func.namespace == "aten" and any(big(x) for x in tree_leaves(out)):
                self.by_kernel[str(func)] += 1
            return out

    counter = RowWrites()
    original = local.compiled_call

    def counted(name, launches, fn, *args):  # a compiled kernel writes its outputs only
        counter.inside = True
        try:
            out = original(name, launches, fn, *args)
        finally:
            counter.inside = False
        written = tree_leaves(out) if out is not None else [args[0]]  # *_into: the out argument
        if any(big(x) for x in written):
            counter.by_kernel[f"compiled {name}"] += 1
        return out

    local.compiled_call = counted  # the benchmark's probe (the package never patches)

    arch = Qwen3MoeArch(
        vocab_size=97,
        hidden_size=H,
        intermediate_size=2 * F,
        moe_intermediate_size=F,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=E,
        num_experts_per_tok=K,
    )
    group = dist.group.WORLD
    disp = registry.get("moe_comm", comm).factory(num_experts=E, ep_group=group, num_chunks=2)
    moe = MoE(arch, PrimitivesConfig(), disp, ParallelGroups(ep_group=group))
    g = torch.Generator().manual_seed(rank)
    x_TH = torch.randn(T, H, generator=g).requires_grad_()
    w_TK = torch.rand(T, K, generator=g).requires_grad_()
    idx_TK = torch.rand(T, E, generator=g).topk(K, dim=-1).indices
    probe_TH = torch.randn(T, H, generator=g)
    rc = registry.get("recompute", "full").factory([])
    with emulate_cuda(check_comm=False), unfused() if before else contextlib.nullcontext():
        with counter:
            y = rc.layer(lambda x, w: moe.dispatch(x, idx_TK, w, moe._run_experts), x_TH, w_TK)
            torch.autograd.backward(y, probe_TH)
    local.compiled_call = original
    return sum(counter.by_kernel.values()), dict(counter.by_kernel)


def moe(tokens: int) -> None:
    from dist_utils import run_distributed

    T, H, F, E, K = tokens, 64, 48, 8, 4
    print(
        f"MoE permutation: kernels writing [>= {T // 2}, {H}] rows (not GEMMs, not collectives), one "
        f"MoE layer, full recompute, forward + backward, ep 2 (gloo), {T} tokens, top-{K} of {E}:"
    )
    for comm in ("alltoall", "chunked"):
        got = {}
        for before in (True, False):
            got[before] = run_distributed(_moe_rank, 2, comm, before, T, H, F, E, K)[0]
        print(f"  {comm}: {got[True][0]} -> {got[False][0]} row writes")
        for before in (True, False):
            top = sorted(got[before][1].items(), key=lambda kv: -kv[1])
            print(
                f"    {'before' if before else 'after '}: " + ", ".join(f"{k} {n}" for k, n in top)
            )


def _probe_rank(rank, world, docs):
    """One GDN layer through the CP scan (this one-rank group: two zigzag segments), forward, full
    recompute and backward, emulated CUDA, bf16, counted after a first uncounted pass: launches of
    the extended call and of the two-call form (cp_probe.py), and the call sites that differ."""
    import torch
    import torch.distributed as dist

    from bumblebee import registry
    from bumblebee.perf.syncs import SyncCounter
    from bumblebee.primitives.cp.zigzag import build_cp_shards, shard_sequence
    from bumblebee.primitives.emulation import emulate_cuda
    from bumblebee.primitives.linear_attention import cp
    from bumblebee.primitives.linear_attention.gated_delta_rule import gated_delta_rule_chunked
    from bumblebee.primitives.linear_attention.gdn import GatedDeltaNet
    from bumblebee.primitives.recompute import NoRecompute

    pos = torch.cat([torch.arange(n) for n in docs])[None]
    got, probe = {}, cp.takes_probe
    for two_calls in (False, True):
        torch.manual_seed(0)  # the tiny preset's mixer: hidden 128, 2 x 32 key, 4 x 32 value heads
        layer = GatedDeltaNet(128, 2, 4, 32, 32, 4, 1e-6, gated_delta_rule_chunked, NoRecompute())
        layer = layer.to(torch.bfloat16)
        x = torch.randn(1, pos.shape[1], 128, dtype=torch.bfloat16, requires_grad=True)
        rc = registry.get("recompute", "full").factory([])
        cp.takes_probe = probe if two_calls else (lambda q: False)  # the benchmark's switch
        with emulate_cuda(check_comm=False):
            layout = build_cp_shards(shard_sequence(pos, world, rank), dist.group.WORLD)
            for _ in range(2):  # the first pass builds the layout caches
                with SyncCounter(launch_sites=True) as c:
                    y = rc.layer(lambda x: cp.gated_delta_net_cp(layer, x, layout), x)
                    y.float().sum().backward()
        cp.takes_probe = probe
        got[two_calls] = (c.launches, c.by_launch_site)
    return got


def probe(tokens: int) -> None:
    from dist_utils import run_distributed

    print(f"one GDN CP layer ({tokens} tokens, 1 rank, 2 segments), fwd + full recompute + bwd:")
    for name, docs in (("one document", [tokens]), ("16-token documents", [16] * (tokens // 16))):
        got = run_distributed(_probe_rank, 1, docs)[0]
        (a, sa), (b, sb) = got[False], got[True]
        diff = sorted(set(sa) | set(sb), key=lambda k: -abs(sb[k] - sa[k]))
        print(f"  {name}: extended call {a} -> two calls {b} launches ({b - a:+d}); by site: "
              + ", ".join(f"{k} {sa[k]}->{sb[k]}" for k in diff[:6] if sa[k] != sb[k]))  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--part", choices=("layers", "mixers", "moe", "probe", "both"), default="both")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--depths", default="4,8", help="two layer counts (Qwen3.5: multiples of 4)")
    p.add_argument("--tokens", type=int, default=16384, help="mixers: tokens per row")
    p.add_argument("--rows", type=int, default=2, help="mixers: rows per rank")
    p.add_argument("--case", default="", help="layers: only the cases whose name contains this")
    p.add_argument("--after-only", action="store_true", help="layers: skip the unfused 'before'")
    a = p.parse_args()
    if a.part == "moe":
        moe(256)
    if a.part == "probe":
        probe(128)
    if a.part in ("mixers", "both"):
        mixers(a.tokens, a.rows)
    if a.part in ("layers", "both"):
        lo, hi = (int(x) for x in a.depths.split(","))
        layers(a.seq, (lo, hi), a.case, a.after_only)


if __name__ == "__main__":
    main()
