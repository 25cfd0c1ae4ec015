"""Context-parallel Gated DeltaNet: per-rank peak memory, bytes received and forward+backward
time of one GDN layer, cp = 1 vs cp = 2 / 4 over gloo on this machine, for

- ``gather``: the gather-everything approach: all-gather the layer input, run the layer on
  the whole sequence on every rank, keep the local tokens (backward: reduce-scatter);
- ``zigzag``: ``linear_attention/cp.py`` on the zigzag shards (state scan, no relayout);
- ``relayout``: the same scan on contiguous shards, converting the input zigzag ->
  contiguous and the output back (``cp/relayout.py``);
- ``relay``: no state probe: the state passed rank to rank through the core's initial state
  (``linear_attention/cp_relay.py``, zigzag shards, ``primitives.linear_attention_cp = "relay"``).

    python benchmarks/gdn_cp.py                          # 8K and 32K tokens, cp 2 and 4
    python benchmarks/gdn_cp.py --seq 4096 --cp 2        # quick
    python benchmarks/gdn_cp.py --mixer kda --impls zigzag # Kimi Delta Attention's layer

The layer: hidden 256, 2 key / 4 value heads of dim 64, conv kernel 4, chunked core; one
row of packed 8K-token documents. ``--mixer kda``: a Kimi Delta Attention layer instead (4 heads
of dim 64, per-channel decay; the same CP code), for its bytes beside GDN's. Memory is the peak
of the tensors allocated inside the call (perf.memory.MemoryTracker: activations, temporaries
and gradients; inputs and weights excluded). Bytes are what one rank receives (all-gather: the
other ranks' parts; P2P: the receive buffers; gloo's all-reduce stands in for a reduce-scatter and is counted as one).
Times share this machine's cores between ranks, so they show work per rank plus exchange,
not a speed-up; nothing passes or fails on them. ``cpu s`` is the rank's own CPU time (work
done, waiting excluded): the scan-vs-relay work difference; ``time s`` (wall) includes the
relay's waits for the previous segment's state (its serialized chain).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
import uuid

import torch
import torch.distributed as dist
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from bumblebee.perf.memory import MemoryTracker
from bumblebee.primitives.cp.allgather import GatherSequence
from bumblebee.primitives.cp.zigzag import build_cp_shards, shard_sequence
from bumblebee.primitives.linear_attention.cp import gated_delta_net_cp
from bumblebee.primitives.linear_attention.gated_delta_rule import gated_delta_rule_chunked
from bumblebee.primitives.linear_attention.gdn import GatedDeltaNet
from bumblebee.primitives.linear_attention.kda import KimiDeltaAttention
from bumblebee.primitives.packed import doc_layout
from bumblebee.primitives.recompute import NoRecompute

HIDDEN, KEY_HEADS, VALUE_HEADS, DIM, DOC = 256, 2, 4, 64, 8192


def make_layer(mixer: str = "gdn"):
    torch.manual_seed(0)
    if mixer == "kda":
        return KimiDeltaAttention(HIDDEN, VALUE_HEADS, DIM, 4, 1e-6, gated_delta_rule_chunked,
                                  NoRecompute())  # fmt: skip
    return GatedDeltaNet(
        HIDDEN, KEY_HEADS, VALUE_HEADS, DIM, DIM, 4, 1e-6, gated_delta_rule_chunked, NoRecompute()
    )


def inputs(seq: int):
    g = torch.Generator().manual_seed(0)
    return torch.randn(1, seq, HIDDEN, generator=g), (torch.arange(seq) % min(DOC, seq))[None]


class ByteCounter:
    """Counts the bytes this rank receives through the collectives the CP paths use."""

    def __init__(self):
        self.bytes, self._orig = 0, {}

    def __enter__(self):
        for name in ("all_gather", "all_reduce", "batch_isend_irecv"):
            self._orig[name] = getattr(dist, name)
        C = dist.get_world_size()

        def all_gather(parts, x, *a, **k):
            self.bytes += (len(parts) - 1) * x.nbytes
            return self._orig["all_gather"](parts, x, *a, **k)

        def all_reduce(x, *a, **k):
            self.bytes += x.nbytes * (C - 1) // C  # as the reduce-scatter it replaces on gloo
            return self._orig["all_reduce"](x, *a, **k)

        def batch_isend_irecv(ops):
            self.bytes += sum(op.tensor.nbytes for op in ops if op.op is dist.irecv)
            return self._orig["batch_isend_irecv"](ops)

        dist.all_gather, dist.all_reduce, dist.batch_isend_irecv = (
            all_gather,
            all_reduce,
            batch_isend_irecv,
        )
        return self

    def __exit__(self, *exc):
        for name, fn in self._orig.items():
            setattr(dist, name, fn)


def timed(fn, x, w):
    """(seconds, peak bytes, received bytes, CPU seconds) of forward + backward; best of 2 after a
    warm-up."""
    best, peak, received, cpu = float("inf"), 0, 0, float("inf")
    for i in range(3):
        leaf = x.detach().requires_grad_()
        if dist.is_initialized():
            dist.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        counter = ByteCounter() if dist.is_initialized() else None
        with MemoryTracker("cpu") as mem, counter or contextlib.nullcontext():
            (fn(leaf) * w).sum().backward()
        elapsed, cpu_used = time.perf_counter() - start, time.process_time() - cpu_start
        if i:
            best, peak, cpu = min(best, elapsed), max(peak, mem.peak_bytes), min(cpu, cpu_used)
            received = counter.bytes if counter else 0
    return best, peak, received, cpu


def single(seq: int, mixer: str):
    layer = make_layer(mixer)
    x, pos = inputs(seq)
    layout = doc_layout(pos)
    return timed(lambda t: layer(t, layout)[0], x, torch.ones(1, seq, HIDDEN))


def gather_everything(layer, x_BLD, layout, docs):
    """All-gather the input ([B, Tl, D] viewed as [B, 1, Tl, D]), run the whole sequence (document
    layout ``docs``) on every rank, keep this rank's tokens."""
    x_BTD = GatherSequence.apply(x_BLD[:, None], layout)[:, 0]
    y_BTD, _ = layer(x_BTD, docs)
    return y_BTD[:, layout.index_L]


def worker(seqs, impls, mixer):
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    C, r = dist.get_world_size(), dist.get_rank()
    layer, out = make_layer(mixer), {}
    for seq in seqs:
        x, pos = inputs(seq)
        x, pos_local = shard_sequence(x, C, r).contiguous(), shard_sequence(pos, C, r)
        layout, docs = build_cp_shards(pos_local, dist.group.WORLD), doc_layout(pos)
        w = torch.ones_like(x)
        fns = {
            "gather": lambda t: gather_everything(layer, t, layout, docs),
            "zigzag": lambda t: gated_delta_net_cp(layer, t, layout),
            "relayout": lambda t: gated_delta_net_cp(layer, t, layout, relayout=True),
            "relay": lambda t: gated_delta_net_cp(layer, t, layout, carry="relay"),
        }
        for impl in impls:
            out[(seq, impl)] = timed(fns[impl], x, w)
    dist.destroy_process_group()
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seq", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    p.add_argument(
        "--impls",
        nargs="+",
        default=["gather", "zigzag", "relayout", "relay"],
        choices=["gather", "zigzag", "relayout", "relay"],
    )
    p.add_argument("--mixer", choices=["gdn", "kda"], default="gdn")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    rows = [(seq, 1, "single", *single(seq, args.mixer)) for seq in args.seq]
    for cp in args.cp:
        cfg = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=cp,
            run_id=uuid.uuid4().hex[:8],
            rdzv_backend="c10d",
            rdzv_endpoint="127.0.0.1:0",
            max_restarts=0,
            start_method="spawn",
        )
        per_rank = elastic_launch(cfg, worker)(args.seq, args.impls, args.mixer)
        for seq in args.seq:
            for impl in args.impls:
                res = [per_rank[r][(seq, impl)] for r in range(cp)]
                rows.append(
                    (
                        seq,
                        cp,
                        impl,
                        max(r[0] for r in res),
                        max(r[1] for r in res),
                        max(r[2] for r in res),
                        max(r[3] for r in res),
                    )
                )
    base = {seq: (t, m) for seq, cp, _, t, m, _, _ in rows if cp == 1}
    print(
        f"{args.mixer.upper()} layer fwd+bwd, hidden {HIDDEN}, {KEY_HEADS}/{VALUE_HEADS} heads of dim "
        f"{DIM}, fp32, gloo, 1 thread per rank"
    )
    print(
        f"{'tokens':>7} {'cp':>3} {'impl':<9} {'time s':>7} {'x cp=1':>7} {'cpu s':>7} {'peak MiB/rank':>14} "
        f"{'x cp=1':>7} {'recv MiB/rank':>14}"
    )
    order = {"single": 0, "gather": 1, "zigzag": 2, "relayout": 3, "relay": 4}
    for seq, cp, impl, t, m, b, c in sorted(rows, key=lambda row: (row[0], row[1], order[row[2]])):
        print(
            f"{seq:>7} {cp:>3} {impl:<9} {t:>7.2f} {t / base[seq][0]:>7.2f} {c:>7.2f} {m / 2**20:>14.1f} "
            f"{m / base[seq][1]:>7.2f} {b / 2**20:>14.2f}"
        )
    print(
        "time: slowest rank (wall), best of 2 after a warm-up; cpu: the busiest rank's own CPU time; "
        "peak and bytes: the most loaded rank (bytes: forward + backward)"
    )


if __name__ == "__main__":
    main()
