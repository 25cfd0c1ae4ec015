"""Fully sharded data parallel, ZeRO stage 3 (slot ``sharding``, ``fsdp2``; the default).

Built on ``torch.distributed.fsdp.fully_shard``:

- the model says which modules are units (``fsdp_units``): each MoE layer's experts
  are one unit over the *expert* mesh (edp): every ep rank's own experts are sharded
  across the ranks that replicate them; each decoder layer is one unit over the
  *dense* mesh (dp_shard x cp); the embedding and the LM head are units of their own
  (dense mesh), so each [V, H] table and its full-size gradient exist only while it is
  used: the embedding is not gathered for its backward (it reads only the token ids,
  ``set_unshard_in_backward(False)``), the head is gathered around its forward (the
  loss reads it there, ``CausalLM.apply_head``) and again for that backward, and its
  gradient is reduce-scattered right after; the root (final norm, the embedding when
  tied) is the last unit and stays gathered for the whole step;
- parameters are sharded fp32 DTensors (the master copy the optimizer updates);
  with bf16 training the all-gathered compute copy is bf16
  (``MixedPrecisionPolicy(param_dtype=bf16)``) and gradients are reduce-scattered
  in ``train.reduce_dtype`` (fp32 by default);
- gradients are *summed* across ranks (divide factor 1): each rank's loss is its
  share of the global mean, see sharding/common.py;
- gradient accumulation (``train.grad_accum``):
  ``"sharded"`` (default) reduce-scatters every micro-batch and FSDP adds the
  result into the sharded fp32 ``.grad``, so accumulation holds no gradient
  beyond the sharded one (plus the unit being reduced). Each unit reduce-scatters
  through ``UnitReduceScatter`` (sharding/fsdp_comm.py): once the unit's sharded gradients exist
  (micro-batches 2..n), the reduce-scatter writes this rank's sum into its own chunk
  of the input buffer (in place) instead of a new output buffer, which FSDP would
  only add into ``.grad`` and drop: one sharded copy of the unit less at the moment
  of its reduction, same sums bit for bit;
  ``"unsharded"`` syncs only on the last micro-batch: fewer collectives, but FSDP
  keeps every unit's *unsharded* gradient between micro-batches, upcast to the
  reduce dtype (fp32: 4 bytes x all parameters per rank, ~26 GB at the
  Qwen3.5-35B-A3B running case), chosen only when communication-bound and memory is
  plentiful;
- ``train.reduce_dtype = "bfloat16"`` halves the reduce-scatter bytes; each
  micro-batch's reduced gradient is cast back to fp32 before it is added to the
  sharded gradient (FSDP casts to the parameter dtype), so accumulation stays fp32
  and only the cross-rank sum of one micro-batch is rounded to bf16 (8 mantissa
  bits: a relative error of ~2^-9 per element, growing with the number of ranks
  summed). Safe for data-parallel sums of a few tens of ranks; keep fp32 where
  gradient noise is small relative to the signal (late fine-tuning, tiny LRs);
- on gloo (CPU) every unit gathers and reduces in place (sharding/fsdp_comm.py): gloo's own
  all-gather and reduce-scatter stage full-size copies that NCCL does not;
- ``offload_optimizer`` keeps sharded parameters, gradients and optimizer state
  in host memory (``CPUOffloadPolicy``); the optimizer step runs on the CPU.

Memory per rank (ZeRO-3, Rajbhandari et al., 2020): (params + grads) x 6 / nGPU, optimizer x 12 /
nGPU, plus the all-gather buffers of the unit being computed.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)

from bumblebee.primitives.sharding.common import clip_grad_norm
from bumblebee.primitives.sharding.costs import ShardingCosts
from bumblebee.primitives.sharding.fsdp_comm import set_unit_comms
from bumblebee.primitives.sharding.none import NoSharding
from bumblebee.registry import register

# fp32 parameters (the master), fp32 gradients, two fp32 moments, all sharded; each layer's
# parameters all-gathered for its forward and backward, gradients reduce-scattered per layer
COSTS = ShardingCosts(
    param_bytes=4,
    grad_bytes=4,
    optim_bytes=2 * 4,
    params_sharded=True,
    optim_sharded=True,
    gathers_per_layer=True,
    sync_bytes_per_param=0,
    explain="4+4+8 B x {shard:.3f}B sharded params ({where}; / dp*cp={dpcp}, / edp={edp})",
)


@register(
    "sharding",
    "fsdp2",
    summary="FSDP2 fully_shard per layer; experts over the edp mesh",
    costs=COSTS,
)
class FSDP2(NoSharding):
    def wrap(self, model):
        t, g = self.train_cfg, self.groups
        if g.dense_mesh is None:  # single process: nothing to shard
            return super().wrap(model)
        bf16 = t.dtype == "bfloat16"
        reduce = torch.bfloat16 if t.reduce_dtype == "bfloat16" else torch.float32
        mp = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=reduce if bf16 else None
        )
        offload = CPUOffloadPolicy() if getattr(t, "offload_optimizer", False) else OffloadPolicy()
        units, meshes = [], []
        for m, kind in list(model.fsdp_units()):
            meshes.append(g.expert_mesh if kind == "expert" else g.dense_mesh)
            units.append(fully_shard(m, mesh=meshes[-1], mp_policy=mp, offload_policy=offload))
            if kind == "embedding":  # its backward reads only the token ids: no all-gather for it
                units[-1].set_unshard_in_backward(False)
        units.append(fully_shard(model, mesh=g.dense_mesh, mp_policy=mp, offload_policy=offload))
        meshes.append(g.dense_mesh)
        for method in (
            "loss_terms",
            "hidden_states",
            "scores",
        ):  # entry points other than forward()
            register_fsdp_forward_method(model, method)
        for unit, mesh in zip(units, meshes):
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
            set_unit_comms(unit, units, mesh)
        self.model, self.units = model, units
        self.named = list(model.named_parameters())
        return model

    def after_load(self) -> None:
        """A model wrapped on the meta device has new parameter objects since ``to_empty``."""
        if self.groups.dense_mesh is not None:
            self.named = list(self.model.named_parameters())

    def reshard(self) -> None:
        """The root unit stays gathered after a forward that has no backward (evaluation,
        sampling): ``named_parameters()`` then yields its unsharded parameters, which are not
        the optimizer's, and a checkpoint would miss their optimizer state. Reshard first."""
        if self.groups.dense_mesh is not None:
            for unit in self.units:
                unit.reshard()

    def set_grad_sync(self, enabled: bool) -> None:
        """Called before each micro-batch (enabled on the last). With ``grad_accum = "sharded"``
        every micro-batch is synced: a reduce-scatter per micro-batch keeps gradients sharded."""
        if self.groups.dense_mesh is not None:
            sync = enabled or self.train_cfg.grad_accum == "sharded"
            for unit in self.units:
                unit.set_requires_gradient_sync(sync, recurse=False)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        if self.groups.dense_mesh is None:
            return super().clip_grad_norm(max_norm)
        return clip_grad_norm(
            self.named,
            self.groups,
            max_norm,
            self.model.is_expert_param,
            dense_sharded=True,
            expert_sharded=True,
        )
