"""Two micro-batches in flight (moe_comm = overlap_mb) are paired with ``alltoall`` on 2 gloo ranks.

One spawn, ep = 2, zero1, two micro-batches per rank and step (one pair). Each run trains 3
steps; ``alltoall`` and ``overlap_mb`` must give bit-identical loss and grad-norm traces, the
same gradients of every parameter in step 1 and the same parameters after step 3, with recompute
none and full (global-batch balance loss: forwards paired, then backwards paired) and with the
micro-batch balance loss (the 1F1B chain: B's forward beside A's backward). overlap_mb keeps
alltoall's ops and their order; a sum of two micro-batches' gradients does not depend on which
lands first, so nothing is allowed to differ.

That the exchanges really run under the partner: every dispatch / combine all-to-all hands the
rank to the other micro-batch before waiting, in forward, in backward (inside autograd's
engine) and in the recompute forward. The hand-overs are counted per phase.

A dropped wait must fail: one full-recompute run uses a comm whose output buffer holds NaN (the
counts: -1) until ``wait()`` copies the exchanged rows in (the bytes move at issue, blocking), so reading it
before the wait poisons the loss.

Plus the one-line refusals (pp > 1, ep = 1, one micro-batch per rank, fsdp2), without processes.
Three micro-batches per rank run a pair, then the last one alone.
"""

import io
import sys

import pytest
import torch
from dist_utils import run_distributed

from bumblebee import load_config
from bumblebee.errors import ConfigError
from bumblebee.primitives.moe import chunked, overlap_mb
from bumblebee.runtime.resolve import check_run
from bumblebee.runtime.trainer import Trainer

STEPS = 3
BASE = [
    "model.arch.num_hidden_layers=2",
    "model.arch.hidden_size=64",
    "model.arch.moe_intermediate_size=32",
    "model.arch.num_experts=8",
    "model.arch.num_experts_per_tok=3",
    "model.arch.mlp_only_layers=[1]",
    "model.arch.intermediate_size=96",
    "train.seq_len=96",
    "train.global_batch=4",
    "train.micro_batch=1",
    f"train.steps={STEPS}",
    "data.min_records=2",
    "data.max_records=6",
    "train.lr=1e-2",
    "train.warmup_steps=1",
    "parallel.ep=2",
    "primitives.sharding=zero1",
]
# (recompute, balance, lazy comm, as on CUDA: emulated, no hand-over inside a backward call,
# micro-batches per rank: 3 runs a pair, then the last one alone)
RUNS = [("none", "step", False, False, 2), ("full", "step", False, False, 2)]
RUNS += [("full", "micro_batch", False, False, 2), ("full", "step", True, False, 2)]
RUNS += [("full", "step", False, True, 2), ("full", "step", False, False, 3)]


class _Lazy:
    """A pending exchange whose rows appear only at ``wait()``."""

    def __init__(self, out, data):
        self.out, self.data = out, data

    def wait(self):
        return self.out.copy_(self.data)


def lazy_a2a(self, x, send=None, recv=None):
    data = self.__class__.a2a_real(self, x, send, recv).wait()  # moved now, blocking
    poison = float("nan") if data.is_floating_point() else -1  # counts: negative splits
    return _Lazy(torch.full_like(data, poison), data)


def _train(rank, out_dir, comm, rc, balance, lazy, cuda, micro):
    cfg = load_config(
        None,
        BASE
        + [
            f"train.global_batch={2 * micro}",
            f"primitives.moe_comm={comm}",
            f"primitives.recompute={rc}",
            f"train.balance={balance}",
            f"train.emulate_cuda={str(cuda).lower()}",
            f"train.out_dir={out_dir}/{comm}{rc}{balance}{lazy}{cuda}{micro}/{rank}",
        ],
    )
    trainer = Trainer(cfg, stream=io.StringIO())
    grads, step = [], trainer.sharding.step

    def snapshot(optimizer):  # the reduced gradients of the first step
        if not grads:
            grads.extend(p.grad.clone() for p in trainer.model.parameters())
        step(optimizer)

    trainer.sharding.step = snapshot
    calls = {k: 0 for k in ("fwd", "bwd", "part", "fwd_handed", "bwd_handed", "part_handed")}
    real = overlap_mb.Pair._switch

    def counted(self, slot):  # every switch point, and those with a partner in flight to run
        if sys._getframe(1).f_code.co_name == "_part":
            phase = "part"  # between two layers' backward calls (layer_tape)
        else:
            phase = "bwd" if torch._C._current_graph_task_id() != -1 else "fwd"
        if phase == "bwd" and cuda:  # autograd's CUDA device thread: no hand-over possible
            return
        calls[phase] += 1
        calls[f"{phase}_handed"] += self._other(slot) is not None
        real(self, slot)

    overlap_mb.Pair._switch, chunked._Comm.a2a_real = counted, chunked._Comm.a2a
    if lazy:
        chunked._Comm.a2a = lazy_a2a
    try:
        trace = [trainer.train_step() for _ in range(STEPS)]
    finally:
        overlap_mb.Pair._switch, chunked._Comm.a2a = real, chunked._Comm.a2a_real
    params = [p.detach().clone() for p in trainer.model.parameters()]
    return [(r["loss"], r["grad_norm"]) for r in trace], grads, params, calls


def _ranks(rank, world, out_dir):
    out = {}
    for rc, balance, lazy, cuda, micro in RUNS:
        # the lazy comm changes overlap_mb only: alltoall's run is shared
        ref = (
            out[(rc, balance, False, cuda, micro)][0]
            if lazy
            else _train(rank, out_dir, "alltoall", rc, balance, False, cuda, micro)
        )
        got = _train(rank, out_dir, "overlap_mb", rc, balance, lazy, cuda, micro)
        out[(rc, balance, lazy, cuda, micro)] = [ref, got]
    return out


def test_pairs_equal_alltoall(tmp_path):
    results = run_distributed(_ranks, 2, str(tmp_path))
    for rank, per_run in enumerate(results):
        for (rc, balance, lazy, cuda, micro), (ref, got) in per_run.items():
            case = f"rank {rank} recompute={rc} balance={balance} lazy={lazy} cuda={cuda}"
            case += f" micro-batches={micro}"
            assert got[0] == ref[0], f"{case}: loss / grad-norm trace {got[0]} vs {ref[0]}"
            assert all(torch.equal(a, b) for a, b in zip(got[1], ref[1])), f"{case}: step-1 grads"
            assert all(torch.equal(a, b) for a, b in zip(got[2], ref[2])), f"{case}: params"
            assert ref[0][-1][0] < ref[0][0][0], f"{case}: does not train"
            assert not any(ref[3].values()), f"{case}: alltoall switched"
            # per step and micro-batch: 1 MoE layer x (counts + dispatch + combine) forward,
            # (combine + dispatch) backward, and the recompute forward's three inside backward;
            # 4 backward parts (the loss, 2 layers, the embedding)
            assert got[3]["fwd"] == 3 * micro * STEPS, (case, got[3])
            inside = 0 if cuda else (5 if rc == "full" else 2) * micro * STEPS
            assert got[3]["bwd"] == inside, (case, got[3])
            assert got[3]["part"] == 4 * micro * STEPS, (case, got[3])
            # the micro-batches really ran beside each other: pairs forward beside forward and
            # backward beside backward (between layers even where no hand-over can happen
            # inside a backward call), the 1F1B chain (micro-batch balance) B's forward beside
            # A's backward
            assert got[3]["fwd_handed"] > 0 and got[3]["part_handed"] > 0, (case, got[3])
            assert cuda or got[3]["bwd_handed"] > 0, (case, got[3])


@pytest.mark.parametrize(
    "overrides, world, why",
    [
        (["parallel.pp=2", "parallel.ep=1"], 2, "pp = 1 only"),
        (["parallel.ep=1"], 2, "parallel.ep > 1"),
        (["train.global_batch=2"], 2, "at least two micro-batches per rank and step (got 1"),
        (["primitives.sharding=fsdp2"], 2, "sharding = 'zero1'"),
    ],
)
def test_refusals(overrides, world, why):
    base = [b for b in BASE if not b.startswith("train.global_batch")] + ["train.global_batch=4"]
    cfg = load_config(None, base + ["primitives.moe_comm=overlap_mb"] + overrides)
    with pytest.raises(ConfigError, match="moe_comm = 'overlap_mb' needs") as err:
        check_run(cfg, world)
    assert why in str(err.value)
    assert check_run(load_config(None, base + ["primitives.moe_comm=overlap_mb"]), 2).paired
