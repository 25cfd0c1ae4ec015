"""Chunked EP overlap vs no chunking: one MoE layer's forward + backward per local sequence.

Two (``--nproc``) gloo ranks on this machine, ep = nproc, one MoE block (router,
dispatch, SwiGLU experts, combine) on each rank's local tokens; ``moe_comm``
``alltoall`` (no-chunk) against ``chunked`` with k = 2, 3, 4. Per configuration:

- step time: slowest rank, median of ``--repeats`` runs after a warm-up; runs
  alternate between configurations so background load hits them alike;
- exposed comm: seconds the compute thread spent blocked on all-to-alls (inside a
  blocking ``all_to_all_single`` for alltoall, inside ``wait()`` for chunked): the
  part of the communication nothing overlapped;
- peak memory: ``bumblebee.perf.MemoryTracker`` (live tensor bytes, one tracked run);
- ``--sync-control`` adds ``chunkK-sync``: the same chunked code with every all-to-all
  completed when issued, so its difference to ``chunkK`` is what the overlap itself buys
  and its difference to no-chunk is what the leaner chunked backward buys.

``--skew F`` plants routing skew: rank 0's experts receive about F x the rows of each other
rank's (a constant input feature and a router bias on rank 0's experts, tuned before timing; the
measured share is printed). ``--weights 0.15,0.6,0.25`` (repeatable) adds chunked runs with those
uneven token shares (``primitives.moe_chunk_weights``; ``bumblebee plan --skew F`` chooses them).

``--micro-batches 2`` runs every configuration on two micro-batches of ``seq`` local tokens per
step (one after the other) and adds ``overlap_mb``: the same two as a ``Pair`` (moe_comm =
overlap_mb, each exchange hidden under the other micro-batch's compute). ``--dense F`` puts a
dense SwiGLU block of FFN F before the MoE block (a stand-in for the attention of a decoder
layer: the compute a partner micro-batch's exchange can hide under), ``--layers N`` stacks N
such layers. For overlap_mb the exposed comm is the time blocked in a wait *after* the partner
ran (plus the blocking count exchanges); the time a thread waits for the baton is the partner's
compute, not communication.

``--recompute full`` wraps the layer in the full-recompute policy's checkpoint, so
the backward includes the recompute forward (where chunked skips fc2 and the combine).
``--profile-dir DIR`` also writes a ``torch.profiler`` Chrome trace of one forward +
backward per configuration and rank (open in chrome://tracing or Perfetto); the
``chunked.*`` spans mark issue / wait / GEMM phases and ``gloo:all_to_all`` the
transfers on gloo's worker threads. Figures only; nothing is asserted.

Issue setting (takes long on a CPU):

    python benchmarks/ep_overlap.py --seqs 4096 8192 16384 32768

Quick run with a trace:

    python benchmarks/ep_overlap.py --seqs 1024 2048 --repeats 2 --profile-dir /tmp/ep_trace
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid

import torch
import torch.distributed as dist
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from bumblebee import registry
from bumblebee.config import PrimitivesConfig
from bumblebee.models.blocks import MLP, MoE
from bumblebee.models.qwen3_moe import Qwen3MoeArch
from bumblebee.perf.memory import MemoryTracker
from bumblebee.plan.perf_layer import chunk_phases
from bumblebee.primitives.moe import chunk_plan, chunked
from bumblebee.primitives.moe.overlap_mb import Pair
from bumblebee.primitives.parallel import ParallelGroups


class _Done:
    def wait(self):
        return True


class ExposedComm:
    """Seconds this thread spends blocked on all-to-alls (patched in the worker process only).
    With ``force_sync`` the chunked schedule's asynchronous all-to-alls complete at issue (the
    no-overlap control: same code and work, nothing hidden)."""

    def __init__(self):
        self.seconds, self.force_sync = 0.0, False
        self.count_seconds = 0.0  # of which blocking count exchanges (integer tensors)
        a2a, wait = dist.all_to_all_single, chunked._Pending.wait

        def blocking_a2a(*args, async_op=False, **kwargs):
            if async_op and not self.force_sync:
                return a2a(*args, async_op=True, **kwargs)
            t0 = time.perf_counter()
            out = a2a(*args, **kwargs)
            self.seconds += time.perf_counter() - t0
            if not args[0].is_floating_point():
                self.count_seconds += time.perf_counter() - t0
            return _Done() if async_op else out

        def timed_wait(pending):
            t0 = time.perf_counter()
            out = wait(pending)
            self.seconds += time.perf_counter() - t0
            return out

        dist.all_to_all_single, chunked._Pending.wait = blocking_a2a, timed_wait


class Layer(torch.nn.Module):
    """Optional dense SwiGLU (the stand-in for attention), then the MoE block; both residual."""

    def __init__(self, dense, moe):
        super().__init__()
        self.dense, self.moe = dense, moe

    def forward(self, x):
        if self.dense is not None:
            x = x + self.dense(x)
        y, stats = self.moe(x)
        return x + y, stats


class Stack(torch.nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)
        self.gate = layers[0].moe.gate  # rank0_share / the skew bias read the first router

    def forward(self, x, recompute):
        for layer in self.layers:
            x, _stats = recompute.layer(layer, x)  # router stats: not a loss here
        return x


def build(args, k):
    """k: 0 (alltoall), "overlap_mb", a chunk count, or a tuple of chunk weights."""
    torch.manual_seed(0)  # same weights for every configuration (each rank its own experts)
    layers = [
        Layer(
            MLP(args.hidden, args.dense) if args.dense else None,
            build_moe(args, k),
        )
        for _ in range(args.layers)
    ]
    return Stack(layers)


def build_moe(args, k):
    arch = Qwen3MoeArch(
        vocab_size=256,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        moe_intermediate_size=args.ffn,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=args.experts,
        num_experts_per_tok=args.topk,
    )
    comm = "alltoall" if k == 0 else k if isinstance(k, str) else "chunked"
    weights = k if isinstance(k, tuple) else ()
    dispatch = registry.get("moe_comm", comm).factory(
        num_experts=args.experts,
        ep_group=dist.group.WORLD,
        num_chunks=len(weights) or (k if isinstance(k, int) else 0) or 2,
        chunk_weights=weights,
    )
    return MoE(
        arch,
        PrimitivesConfig(experts=args.experts_impl),
        dispatch,
        ParallelGroups(ep_group=dist.group.WORLD),
    )


def init_weights(stack, args):
    for p in stack.parameters():
        torch.nn.init.normal_(p, std=0.02)
    if args.skew_bias:  # feature 0 of the input is constant 1: a bias on rank 0's experts
        with torch.no_grad():
            w = next(stack.gate.parameters())
            w[:, 0] = 0.0
            w[: args.experts // dist.get_world_size(), 0] = args.skew_bias
    return stack


def rank0_share(args, moe, x_BTH) -> float:
    """Fraction of all ranks' routed rows that go to rank 0's experts."""
    with torch.no_grad():
        idx = moe.gate(x_BTH.reshape(-1, args.hidden)).idx_TK
    n = torch.tensor(
        [(idx < args.experts // dist.get_world_size()).sum(), idx.numel()], dtype=torch.float64
    )
    dist.all_reduce(n)
    return (n[0] / n[1]).item()


def tune_skew(args, x_BTH) -> float:
    """The router bias that sends rank 0 about ``skew`` x each other rank's rows (bisection)."""
    R = dist.get_world_size()
    target = args.skew / (args.skew + R - 1)
    lo, hi = 0.0, 50.0
    for _ in range(30):
        args.skew_bias = (lo + hi) / 2
        if rank0_share(args, init_weights(build(args, 0), args), x_BTH) < target:
            lo = args.skew_bias
        else:
            hi = args.skew_bias
    return args.skew_bias


def step(model, xs, probe_BTH, recompute, paired):
    """Forward + backward of every micro-batch in ``xs``: one after the other, or as a Pair."""

    def one(x_BTH):
        x = x_BTH.detach().requires_grad_()
        (model(x, recompute) * probe_BTH).sum().backward()

    fns = [lambda x=x: one(x) for x in xs]
    if paired:
        Pair().run(*fns)
    else:
        for fn in fns:
            fn()
    model.zero_grad(set_to_none=True)


def worker(args):
    dist.init_process_group("gloo")
    torch.set_num_threads(args.threads)
    rank = dist.get_rank()
    configs = [("no-chunk", 0)] + [(f"chunk{k}", k) for k in args.chunks]
    configs += [(f"chunk{k}-sync", k) for k in args.chunks] if args.sync_control else []
    configs += [(weights_label(w), w) for w in args.weights]
    configs += [("overlap_mb", "overlap_mb")] if args.micro_batches == 2 else []
    recompute = registry.get("recompute", args.recompute).factory([])
    exposed = ExposedComm()
    out = {}
    for seq in args.seqs:
        g = torch.Generator().manual_seed(rank)
        xs = [torch.randn(1, seq, args.hidden, generator=g) for _ in range(args.micro_batches)]
        x_BTH = xs[0]
        probe_BTH = torch.randn(1, seq, args.hidden, generator=g)
        args.skew_bias = 0.0
        if args.skew > 1:
            for x in xs:
                x[..., 0] = 1.0
            tune_skew(args, x_BTH)
            share = rank0_share(args, init_weights(build(args, 0), args), x_BTH)
            R = dist.get_world_size()
            out[(seq, "skew")] = share * (R - 1) / (1 - share)  # rank 0 over each other rank
        moes = {label: init_weights(build(args, k), args) for label, k in configs}
        for label, moe in moes.items():  # warm-up, tracked: peak live bytes
            exposed.force_sync = label.endswith("-sync")
            with MemoryTracker("cpu", model=moe) as mem:
                step(moe, xs, probe_BTH, recompute, label == "overlap_mb")
            out[(seq, label, "peak")] = mem.peak_bytes
        times = {label: [] for label in moes}
        comm = {label: [] for label in moes}
        counts = {label: [] for label in moes}
        for _ in range(args.repeats):
            for label, moe in moes.items():
                dist.barrier()
                exposed.force_sync = label.endswith("-sync")
                exposed.seconds, exposed.count_seconds, t0 = 0.0, 0.0, time.perf_counter()
                step(moe, xs, probe_BTH, recompute, label == "overlap_mb")
                elapsed = torch.tensor(
                    [time.perf_counter() - t0, exposed.seconds, exposed.count_seconds],
                    dtype=torch.float64,
                )
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                times[label].append(elapsed[0].item())
                comm[label].append(elapsed[1].item())
                counts[label].append(elapsed[2].item())
        for label in moes:
            out[(seq, label, "time")] = statistics.median(times[label])
            out[(seq, label, "comm")] = statistics.median(comm[label])
            out[(seq, label, "counts")] = statistics.median(counts[label])
        if args.profile_dir:
            os.makedirs(args.profile_dir, exist_ok=True)
            for label, moe in moes.items():
                dist.barrier()
                exposed.force_sync = label.endswith("-sync")
                with torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU]
                ) as prof:
                    step(moe, xs, probe_BTH, recompute, label == "overlap_mb")
                prof.export_chrome_trace(
                    os.path.join(args.profile_dir, f"ep_overlap_{seq}_{label}_rank{rank}.json")
                )
    dist.destroy_process_group()
    return out


COMPUTE_SPANS = ("chunked.fwd.gemm", "chunked.bwd.dgrad", "chunked.bwd.wgrad")


def trace_overlap(path: str) -> tuple[float, float]:
    """(ms of gloo all_to_all on gloo's worker threads, ms of it under an expert GEMM span of the
    compute thread) in one Chrome trace. A gloo span also covers waiting for the peer rank."""
    import json

    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    compute = sorted(
        (e["ts"], e["ts"] + e["dur"]) for e in events if e["name"].startswith(COMPUTE_SPANS)
    )
    main_tid = {e["tid"] for e in events if e["name"].startswith("chunked.")}
    comm = [
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e["name"] == "gloo:all_to_all" and e["tid"] not in main_tid
    ]
    under = sum(max(0.0, min(b, d) - max(a, c)) for a, b in comm for c, d in compute)
    return sum(b - a for a, b in comm) / 1e3, under / 1e3


def weights_label(w) -> str:
    return "w" + "/".join(f"{v:g}" for v in w)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--seqs",
        type=int,
        nargs="+",
        default=[4096, 8192, 16384, 32768],
        help="local tokens per rank",
    )
    p.add_argument("--chunks", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--nproc", type=int, default=2, help="ranks = ep")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=128, help="expert FFN size")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--experts-impl", default="grouped", help="experts primitive (loop | grouped)")
    p.add_argument(
        "--recompute", default="none", help="recompute policy around the layer (none | full)"
    )
    p.add_argument("--repeats", type=int, default=3, help="timed runs per configuration")
    p.add_argument("--skew", type=float, default=1.0, help="rank 0's experts get F x the rows")
    p.add_argument(
        "--weights",
        type=lambda s: tuple(float(v) for v in s.split(",")),
        action="append",
        default=[],
        help="uneven chunk weights, e.g. 0.15,0.6,0.25 (repeatable)",
    )
    p.add_argument(
        "--micro-batches",
        type=int,
        default=1,
        choices=(1, 2),
        help="micro-batches of --seqs tokens per step (2: also run overlap_mb)",
    )
    p.add_argument("--dense", type=int, default=0, help="dense SwiGLU FFN before each MoE block")
    p.add_argument("--layers", type=int, default=1, help="layers (dense + MoE) stacked")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--profile-dir", default="", help="write torch.profiler Chrome traces here")
    p.add_argument(
        "--sync-control",
        action="store_true",
        help="also run chunkK-sync: the chunked code with every all-to-all completed at issue (no overlap)",
    )
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    cfg = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=args.nproc,
        run_id=uuid.uuid4().hex[:8],
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        start_method="spawn",
    )
    res = elastic_launch(cfg, worker)(args)[0]
    print(
        f"one MoE layer fwd+bwd, ep={args.nproc} gloo ranks on {os.cpu_count()} cores, hidden {args.hidden}, "
        f"expert ffn {args.ffn}, {args.experts} experts top-{args.topk}, experts={args.experts_impl}, "
        f"recompute={args.recompute}, fp32, {args.threads} thread(s)/rank, median of {args.repeats}, "
        f"{args.micro_batches} micro-batch(es)/step, {args.layers} layer(s), dense ffn {args.dense}"
    )
    head = (
        f"{'local seq':>9} {'config':<15} | {'step s':>7} {'vs no-chunk':>11} | {'exposed comm s':>14} "
        f"{'counts s':>8} | "
        f"{'peak MiB':>9} {'vs no-chunk':>11}"
    )
    print(head)
    print("-" * len(head))
    labels = ["no-chunk"] + [f"chunk{k}" for k in args.chunks]
    labels += [f"chunk{k}-sync" for k in args.chunks] if args.sync_control else []
    labels += [weights_label(w) for w in args.weights]
    labels += ["overlap_mb"] if args.micro_batches == 2 else []
    for seq in args.seqs:
        if (seq, "skew") in res:
            print(
                f"{seq:>9} planted skew: rank 0 gets {res[(seq, 'skew')]:.2f} x each other rank's rows"
            )
        base_t, base_m = res[(seq, "no-chunk", "time")], res[(seq, "no-chunk", "peak")]
        for label in labels:
            t, c, m = (
                res[(seq, label, "time")],
                res[(seq, label, "comm")],
                res[(seq, label, "peak")],
            )
            print(
                f"{seq:>9} {label:<15} | {t:>7.3f} {t / base_t:>11.2f} | {c:>14.3f} "
                f"{res[(seq, label, 'counts')]:>8.3f} | {m / 2**20:>9.1f} "
                f"{m / base_m:>11.2f}"
            )
    for seq in args.seqs:  # the schedule's timeline fed this machine's measured no-chunk phases
        comm = res[(seq, "no-chunk", "comm")]
        gemm = (res[(seq, "no-chunk", "time")] - comm) / 3  # forward; backward ~2x
        phases = chunk_phases(gemm, comm / 4, recompute=args.recompute == "full")
        for k in args.chunks:
            even = chunk_plan.evaluate(chunk_plan.even(k), phases)
            got = chunk_plan.best(phases, counts=(k,))
            print(
                f"{seq:>9} timeline x{k}: even exposes {even.exposed:.3f} s; best weights "
                f"{'/'.join(f'{v:g}' for v in got.weights)} expose {got.exposed:.3f} s "
                f"(all-to-all {comm / 4:.3f} s vs expert GEMMs {gemm:.3f} s per pass)"
            )
    if args.profile_dir:
        print(
            f"torch.profiler traces in {args.profile_dir} (rank 0): gloo all_to_all time on gloo's threads, "
            "and the part of it under an expert GEMM (fwd gemm / bwd dgrad / bwd wgrad spans)"
        )
        for seq in args.seqs:
            for label in labels:
                total, under = trace_overlap(
                    os.path.join(args.profile_dir, f"ep_overlap_{seq}_{label}_rank0.json")
                )
                print(
                    f"{seq:>9} {label:<11} | all_to_all {total:>8.1f} ms | under expert GEMMs {under:>8.1f} ms"
                )
    print(
        "step s: slowest rank; exposed comm: time blocked on all-to-alls (max over ranks), counts s: the\n"
        "part of it in blocking count exchanges (max over ranks); peak: rank 0's\n"
        "live tensor bytes (MemoryTracker). On a CPU the ranks and gloo's transfer threads share the same\n"
        "cores, so communication can only hide under compute where a core is idle."
    )


if __name__ == "__main__":
    main()
