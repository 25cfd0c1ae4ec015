"""Distributed optimizer, ZeRO stage 1 (slot ``sharding``, ``zero1``; the reference
for sharded training).

Parameters and gradients stay replicated on every data-parallel rank; only the
optimizer state is split. Each step:

  1. all-reduce (sum) the gradients: dense parameters over the dense group
     (dp_shard x cp), expert parameters over their edp group only;
  2. clip on the global norm (replicated gradients: no reduction needed, except
     across ep ranks that hold different experts);
  3. every rank runs AdamW on its 1/w slice of each flattened parameter (fp32
     master = the parameter itself, sliced);
  4. all-gather the updated slices so every replica holds the new parameters.

Memory per rank: params + grads in full (x6 bytes/param in bf16 mixed precision,
x8 here in fp32), optimizer state x12 / w (Rajbhandari et al., ZeRO, 2020).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from bumblebee.primitives.collectives import all_gather_single
from bumblebee.primitives.sharding.common import clip_grad_norm
from bumblebee.primitives.sharding.costs import ShardingCosts
from bumblebee.primitives.sharding.none import NoSharding
from bumblebee.registry import register


class _Slice:
    """One parameter's slice owned by this rank: flat range [lo, hi) of a padded length s*w."""

    def __init__(self, p: torch.Tensor, group, size: int, rank: int):
        self.p, self.group = p, group
        self.w, r = (1, 0) if group is None else (size, rank)
        self.s = math.ceil(p.numel() / self.w)
        self.lo, self.hi = min(p.numel(), r * self.s), min(p.numel(), (r + 1) * self.s)
        self.master = torch.nn.Parameter(p.detach().flatten()[self.lo : self.hi].clone())


def _flat_all_reduce(tensors: list[torch.Tensor], group, size: int) -> None:
    if not tensors or group is None or size == 1:
        return
    flat = torch.cat([t.flatten() for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


# bf16 parameters and fp32 gradients whole, fp32 master + two moments sharded; a step
# reduce-scatters fp32 gradients and all-gathers bf16 parameters
COSTS = ShardingCosts(
    param_bytes=2,
    grad_bytes=4,
    optim_bytes=12,
    params_sharded=False,
    optim_sharded=True,
    gathers_per_layer=False,
    sync_bytes_per_param=4 + 2,
    explain="(2+4) B x {full:.3f}B params + 12 B x {shard:.3f}B optimizer shard ({where})",
)


@register(
    "sharding",
    "zero1",
    summary="replicated params/grads, grads all-reduced, optimizer state sharded",
    costs=COSTS,
)
class Zero1(NoSharding):
    def wrap(self, model):
        self.model = model
        self.named = list(model.named_parameters())
        g = self.groups
        self.is_expert = model.is_expert_param
        self.slices = {  # trainable parameters only: a frozen one (LoRA base) has no optimizer state
            name: _Slice(p, g.expert_group, g.expert_size, g.expert_rank)
            if self.is_expert(name)
            else _Slice(p, g.dense_group, g.dense_size, g.dense_rank)
            for name, p in self.named
            if p.requires_grad
        }
        return model

    def param_groups(self, weight_decay: float) -> list[dict]:
        """The fp32 master slices this rank owns (decay on matrices and stacked experts)."""
        decay = [s.master for n, s in self.slices.items() if s.p.dim() >= 2]
        no_decay = [s.master for n, s in self.slices.items() if s.p.dim() < 2]
        return [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]

    def optimizer_param(self, name: str, optimizer):
        s = self.slices[name]
        return s.master, s.lo

    @torch.no_grad()
    def after_load(self) -> None:
        """The fp32 masters are slices of the (just loaded or initialized) parameters. A model
        wrapped on the meta device got new parameter objects since (``to_empty``): its slices
        are taken afresh here."""
        if any(s.master.is_meta for s in self.slices.values()):
            self.wrap(self.model)
            return
        for s in self.slices.values():
            s.master.copy_(s.p.detach().view(-1)[s.lo : s.hi])

    def reduce_grads(self) -> None:
        trained = [(n, p) for n, p in self.named if p.requires_grad]
        for _, p in trained:
            if p.grad is None:  # e.g. an expert that saw no token: its gradient is zero
                p.grad = torch.zeros_like(p)
        dense = [p.grad for n, p in trained if not self.is_expert(n)]
        experts = [p.grad for n, p in trained if self.is_expert(n)]
        g = self.groups
        _flat_all_reduce(dense, g.dense_group, g.dense_size)
        _flat_all_reduce(experts, g.expert_group, g.expert_size)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return clip_grad_norm(
            self.named,
            self.groups,
            max_norm,
            self.is_expert,
            dense_sharded=False,
            expert_sharded=False,
        )

    @torch.no_grad()
    def step(self, optimizer) -> None:
        for s in self.slices.values():
            s.master.grad = s.p.grad.flatten()[s.lo : s.hi]
        optimizer.step()
        for group in (self.groups.dense_group, self.groups.expert_group):
            self._all_gather([s for s in self.slices.values() if s.group is group])

    @staticmethod
    def _all_gather(slices: list[_Slice]) -> None:
        """Rebuild full parameters from every rank's updated slices (one collective)."""
        if not slices:
            return
        w = slices[0].w
        if w == 1:
            for s in slices:
                s.p.view(-1).copy_(s.master)
            return
        mine = torch.cat(
            [torch.nn.functional.pad(s.master.detach(), (0, s.s - (s.hi - s.lo))) for s in slices]
        )
        gathered = mine.new_empty(w * mine.numel())
        all_gather_single(gathered, mine, group=slices[0].group)
        gathered = gathered.view(w, -1)
        offset = 0
        for s in slices:
            full = gathered[:, offset : offset + s.s].reshape(-1)[: s.p.numel()]
            s.p.copy_(full.view_as(s.p))
            offset += s.s

    def zero_grad(self, optimizer) -> None:
        self.model.zero_grad(set_to_none=True)
        optimizer.zero_grad(set_to_none=True)
