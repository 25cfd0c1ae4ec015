"""A checkpoint's recompute replays its forward's MoE split sizes (``recompute_scope.host_read``),
so it must route exactly as the forward did; ``replay_check.py`` verifies that on the device.

- Regression: Qwen3.5 with cp = 2 and ep = 2, bf16, full recompute, two micro-batches, emulated
  CUDA. The forward ran FLA's op under the memory tracker's dispatch mode, where the op's body
  sees autocast off; the recompute ran the same kernel directly, with autocast on: another
  Gated DeltaNet output, other routing, and replayed split sizes that did not match the rows
  (a shape error in ``regroup_by_expert``). Every MoE router's input in the recompute must be
  bit-identical to the forward's.
- The guard: a routing difference planted in the recompute only (one layer's router input
  zeroed) raises ``ReplayMismatchError`` naming that layer, with alltoall (whose shape error
  it names) and with chunked EP (which would go on with wrong splits).
- No host sync: a step with full recompute (every MoE read replayed and compared) reads the host
  as often as one without recompute.
"""

import io

import torch
from dist_utils import run_distributed

QWEN3_5 = ["model.name=qwen3_5_moe", "model.preset=tiny", "model.arch.num_hidden_layers=3"]
QWEN3 = ["model.name=qwen3_moe", "model.preset=tiny", "model.arch.num_hidden_layers=2"]
COMMON = [
    "train.seq_len=128",
    "train.global_batch=2",
    "train.micro_batch=1",
    "train.dtype=bfloat16",
    "train.balance=micro_batch",
    "train.eval_every=0",
    "train.emulate_cuda=true",
    "primitives.fused=off",
]
CP_EP = ["parallel.cp=2", "parallel.ep=2"]
PLANTED_LAYER = 1


def _trainer(sets, out_dir):
    from bumblebee import load_config
    from bumblebee.runtime.trainer import Trainer

    cfg = load_config(None, COMMON + sets + [f"train.out_dir={out_dir}"])
    return Trainer(cfg, stream=io.StringIO())


def _gates(trainer):
    return [
        (i, layer.mlp.gate) for i, layer in enumerate(trainer.model.model.layers) if layer.is_moe
    ]


def _same_router_inputs(trainer) -> list[str]:
    """One step; the layers whose router input differed between the forward and the recompute."""
    from bumblebee.primitives.recompute_scope import in_recompute

    seen, recomputed, differ = {}, {}, []

    def hook(i):
        def record(_module, args):
            x = args[0].detach().clone()
            if not in_recompute():
                seen.setdefault(i, []).append(x)
                return
            n = recomputed[i] = recomputed.get(i, 0) + 1
            # balance = micro_batch: each micro-batch's backward (and recompute) before the next
            if not torch.equal(x, seen[i][n - 1]):
                differ.append(f"layer {i} (recompute {n})")

        return record

    for i, gate in _gates(trainer):
        gate.register_forward_pre_hook(hook(i))
    trainer.train_step()  # the first step runs under the memory tracker (as every CUDA step)
    assert recomputed and set(recomputed) == set(seen), (seen.keys(), recomputed)
    return differ


def _planted(trainer) -> str:
    """One step with layer ``PLANTED_LAYER``'s router input zeroed in its recompute only."""
    from bumblebee.primitives.recompute_scope import in_recompute
    from bumblebee.primitives.replay_check import ReplayMismatchError

    def zero(_module, args):
        if in_recompute():  # every token to the same experts: other counts than the forward's
            return (torch.zeros_like(args[0]),) + args[1:]

    dict(_gates(trainer))[PLANTED_LAYER].register_forward_pre_hook(zero)
    try:
        trainer.train_step()
    except ReplayMismatchError as e:
        return str(e)
    return "no error"


def _ranks(rank, world, out_dir):
    out = {"regression": _same_router_inputs(_trainer(QWEN3_5 + CP_EP, f"{out_dir}/reg{rank}"))}
    for comm in ("alltoall", "chunked"):
        sets = QWEN3 + ["parallel.ep=2", f"primitives.moe_comm={comm}"]
        out[comm] = _planted(_trainer(sets, f"{out_dir}/{comm}{rank}"))
    return out


def test_recompute_routes_as_its_forward_and_the_guard_names_the_layer(tmp_path):
    for rank, out in enumerate(run_distributed(_ranks, 2, str(tmp_path), timeout=600)):
        assert out["regression"] == [], f"rank {rank}: router inputs differ in {out['regression']}"
        for comm in ("alltoall", "chunked"):
            msg = out[comm]
            assert f"the recompute of layer {PLANTED_LAYER} routed differently" in msg, (
                f"rank {rank} {comm}: {msg}"
            )


def _syncs(rank, world, out_dir, plant):
    from bumblebee.perf.syncs import SyncCounter
    from bumblebee.primitives import replay_check
    from bumblebee.primitives.emulation import emulate_cuda

    compared = []
    original = replay_check.ReplayCheck.compare

    def compare(self, recomputed, recorded):
        compared.append(1)
        original(self, recomputed, recorded)
        if plant:  # a guard that reads the host per comparison
            bool(self.flags[-1])

    replay_check.ReplayCheck.compare = compare
    out = {}
    for recompute in ("none", "full"):
        sets = QWEN3 + [
            "parallel.ep=2",
            "train.global_batch=4",
            f"primitives.recompute={recompute}",
        ]
        trainer = _trainer(sets, f"{out_dir}/{recompute}{rank}")
        trainer.train_step()  # the first step builds what a run builds once
        compared.clear()
        with emulate_cuda(check_comm=False), SyncCounter() as c:
            trainer.train_step()
        expected = len(_gates(trainer)) * trainer.accum  # one read per MoE layer and micro-batch
        out[recompute] = (c.syncs, len(compared), expected, c.top(8))
    return out


def test_replay_check_adds_no_host_sync(tmp_path, plant=False):
    """(``plant=True``: a guard reading the host per comparison, which this must catch.)"""
    for rank, out in enumerate(run_distributed(_syncs, 2, str(tmp_path), plant)):
        (none, _, _, top_none), (full, compared, expected, top_full) = out["none"], out["full"]
        assert compared == expected, f"rank {rank}: {compared} comparisons, {expected} replayed"
        assert full == none, (
            f"rank {rank}: {full} syncs with full recompute vs {none}: {top_full} / {top_none}"
        )
