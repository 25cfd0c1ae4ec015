"""FSDP2 gradient accumulation keeps gradients sharded (``train.grad_accum = "sharded"``).

After the first of several micro-batches every parameter already holds its *sharded*
gradient (a DTensor shard, in fp32 even with a bf16 reduce): the reduce-scatter ran, so
no unsharded gradient waits inside FSDP for the last micro-batch. The old behaviour
(``"unsharded"``) leaves ``.grad`` empty until the synced micro-batch. Parity of whole
runs with accumulation against the single process is in test_sharding_parity.py.
"""

import io
import math

import torch
from dist_utils import run_distributed
from torch.distributed.tensor import DTensor

from bumblebee import load_config
from bumblebee.runtime.trainer import Trainer

BASE = [
    "model.arch.num_hidden_layers=2",
    "model.arch.hidden_size=64",
    "model.arch.moe_intermediate_size=32",
    "model.arch.num_experts=4",
    "model.arch.intermediate_size=96",
    "train.seq_len=64",
    "train.global_batch=4",
    "train.micro_batch=1",
    "primitives.sharding=fsdp2",
    "train.dtype=bfloat16",
]


def _after_first_micro_batch(rank, world, out_dir, mode, reduce_dtype):
    cfg = load_config(
        None,
        BASE
        + [
            f"train.grad_accum={mode}",
            f"train.reduce_dtype={reduce_dtype}",
            f"train.out_dir={out_dir}/{rank}",
        ],
    )
    trainer = Trainer(cfg, stream=io.StringIO())
    assert trainer.accum == 2
    batch = trainer.source.global_batch_at(0).rows(rank * 2, rank * 2 + 1)
    trainer.sharding.set_grad_sync(False)  # what the step does before micro-batch 1 of 2
    with trainer.autocast:
        terms = trainer.model.loss_terms(batch.input_ids, batch.labels, batch.position_ids)
    terms.loss_sum.backward()
    grads = {}
    for name, p in trainer.model.named_parameters():
        g = p.grad
        grads[name] = (
            None
            if g is None
            else (isinstance(g, DTensor), g.to_local().shape == p.to_local().shape, g.dtype)
        )
    loss = float(trainer.train_step()["loss"])  # a whole step still runs (with the extra syncs)
    return grads, loss


def test_gradients_are_sharded_after_each_micro_batch(tmp_path):
    for reduce_dtype in ("float32", "bfloat16"):
        grads, loss = run_distributed(
            _after_first_micro_batch, 2, str(tmp_path), "sharded", reduce_dtype
        )[0]
        assert grads and all(g == (True, True, torch.float32) for g in grads.values()), (
            reduce_dtype,
            grads,
        )
        assert math.isfinite(loss), (
            reduce_dtype,
            loss,
        )  # a finite step (inf == inf would pass a self-compare)
    grads, _ = run_distributed(_after_first_micro_batch, 2, str(tmp_path), "unsharded", "float32")[
        0
    ]
    assert all(g is None for g in grads.values()), (
        "unsharded accumulation holds gradients inside FSDP"
    )


def _param_group(unit):
    """A unit's FSDP2 parameter group (torch 2.11 keeps one, 2.13 a list)."""
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    return groups[0] if groups is not None else state._fsdp_param_group


def _two_micro_batches(rank, world, out_dir, reduce_dtype, comm):
    """comm: "default" (FSDP2's reduce-scatter), "gloo" (ours, the in-place all-reduce this group
    gets) or "collective" (ours as on NCCL: a reduce-scatter whose output may be its input's chunk)."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    from bumblebee.primitives.sharding import fsdp_comm
    from bumblebee.primitives.sharding.fsdp_comm import UnitReduceScatter

    if comm == "collective":
        fsdp_comm._gloo = lambda mesh: False
    cfg = load_config(
        None, BASE + [f"train.reduce_dtype={reduce_dtype}", f"train.out_dir={out_dir}/{rank}"]
    )
    trainer = Trainer(cfg, stream=io.StringIO())
    assert (
        all(
            getattr(_param_group(u)._reduce_scatter_comm, "gloo", None) == (comm == "gloo")
            for u in trainer.sharding.units
        )
        or comm == "default"
    )
    if comm == "default":
        for unit in trainer.sharding.units:
            unit.set_custom_reduce_scatter(DefaultReduceScatter())
    in_place = []
    call = UnitReduceScatter.__call__

    def counting(self, *a, **k):
        in_place.append(self._in_place)
        return call(self, *a, **k)

    UnitReduceScatter.__call__ = counting
    batch = trainer.source.global_batch_at(0)
    for i in range(2):
        part = batch.rows(rank * 2 + i, rank * 2 + i + 1)
        trainer.sharding.set_grad_sync(i == 1)
        with trainer.autocast:
            terms = trainer.model.loss_terms(part.input_ids, part.labels, part.position_ids)
        terms.loss_sum.backward()
    UnitReduceScatter.__call__ = call
    return {n: p.grad.to_local().clone() for n, p in trainer.model.named_parameters()}, in_place


def test_in_place_accumulating_reduce_scatter_is_bit_identical(tmp_path):
    """Micro-batches 2..n reduce-scatter in place into the input buffer (no output buffer): the
    sharded gradients are bit-identical to FSDP2's own reduce-scatter, fp32 and bf16 reduce, both
    through the gloo form (in-place all-reduce) and the collective form NCCL runs."""
    for reduce_dtype, comm in (
        ("float32", "gloo"),
        ("bfloat16", "gloo"),
        ("float32", "collective"),
    ):
        ours = run_distributed(_two_micro_batches, 2, str(tmp_path / "a"), reduce_dtype, comm)
        ref = run_distributed(_two_micro_batches, 2, str(tmp_path / "b"), reduce_dtype, "default")
        for rank in range(2):
            (grads, in_place), (expected, _) = ours[rank], ref[rank]
            n = len(in_place) // 2
            assert n and not any(in_place[:n]) and all(in_place[n:]), (
                in_place
            )  # in place from micro-batch 2
            assert grads.keys() == expected.keys()
            for name, g in grads.items():
                assert torch.equal(g, expected[name]), (reduce_dtype, comm, rank, name)


def _pipeline_reductions(rank, world, out_dir, mode):
    from bumblebee.primitives.sharding.fsdp_comm import UnitReduceScatter

    cfg = load_config(
        None,
        BASE
        + [
            "parallel.pp=2",
            "train.balance=micro_batch",
            "train.global_batch=8",
            f"train.grad_accum={mode}",
            f"train.out_dir={out_dir}/{mode}",
        ],
    )
    trainer = Trainer(cfg, stream=io.StringIO())
    inputs = []  # one reduction = one input allocation (then its output)
    allocate = UnitReduceScatter.allocate

    def counting(self, size, **k):
        inputs.append(self._input is None)
        return allocate(self, size, **k)

    UnitReduceScatter.allocate = counting
    try:
        trainer.train_step()
    finally:
        UnitReduceScatter.allocate = allocate
    return sum(inputs), trainer.pipeline.microbatches


def test_pipeline_stages_reduce_every_micro_batch_when_sharded(tmp_path):
    """pp = 2 x dp 2: with ``"sharded"`` each stage's FSDP units reduce-scatter in every
    micro-batch's backward (no unsharded gradient waits for the last one); ``"unsharded"``
    reduces once per unit per step."""
    sharded = run_distributed(_pipeline_reductions, 4, str(tmp_path), "sharded")
    unsharded = run_distributed(_pipeline_reductions, 4, str(tmp_path), "unsharded")
    for (n_sharded, micro), (n_once, _) in zip(sharded, unsharded):
        assert micro == 4 and n_once > 0 and n_sharded == micro * n_once, (n_sharded, n_once, micro)


def _forwards_then_backwards(rank, world, out_dir):
    """Sharded gradients of two micro-batches, each forward followed by its backward, then (from
    zero) both forwards before either backward, as the step-wide balance loss runs them."""
    cfg = load_config(None, BASE + [f"train.out_dir={out_dir}/{rank}"])
    trainer = Trainer(cfg, stream=io.StringIO())
    batch = trainer.source.global_batch_at(0)
    parts = [batch.rows(rank * 2 + i, rank * 2 + i + 1) for i in range(2)]

    def forward(part):
        with trainer.autocast:
            return trainer.model.loss_terms(part.input_ids, part.labels, part.position_ids)

    def backward(i, terms):
        trainer.sharding.set_grad_sync(i == 1)
        terms.loss_sum.backward()

    for i, part in enumerate(parts):
        backward(i, forward(part))
    interleaved = {n: p.grad.to_local().clone() for n, p in trainer.model.named_parameters()}
    trainer.optimizer.zero_grad(set_to_none=True)
    for i, terms in enumerate([forward(part) for part in parts]):
        backward(i, terms)
    grouped = {n: p.grad.to_local().clone() for n, p in trainer.model.named_parameters()}
    return interleaved, grouped


def test_every_forward_regathers_the_root_for_its_backward(tmp_path):
    """Two forwards, then two backwards: the second backward reads the root unit's parameters
    (the final norm) after the first backward resharded them, so FSDP2 must gather them again
    from the hook it put on that forward's ``LossTerms``. The gradients equal the interleaved
    order bit for bit (a missed gather reads freed storage: a segfault or a wrong gradient)."""
    for interleaved, grouped in run_distributed(_forwards_then_backwards, 2, str(tmp_path)):
        assert interleaved.keys() == grouped.keys()
        for name, g in grouped.items():
            assert torch.equal(g, interleaved[name]), name


def test_fsdp_sees_the_loss_terms_tensors():
    """FSDP2 finds a forward's output tensors with pytree on some torch versions (2.11): the
    dataclass must be a pytree node, not one opaque leaf."""
    from torch.utils._pytree import tree_leaves

    from bumblebee.models.head import LossTerms

    loss, stats = torch.ones((), requires_grad=True) * 2, torch.ones(2, 3, requires_grad=True) * 3
    leaves = tree_leaves(LossTerms(loss, torch.tensor(4), torch.zeros(()), stats))
    assert any(t is loss for t in leaves) and any(t is stats for t in leaves)
