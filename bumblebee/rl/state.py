"""The Engine's resumable state and its placement: per-rank checkpoints, offload / onload.

A checkpoint is one file per rank holding that rank's *local* tensors: its shards of
the parameters (FSDP2 DTensor shards, or full replicas), the optimizer state, and the
optimizer's own parameters when they are not the model's (zero1 keeps fp32 master
slices). Restoring therefore needs the same world size, layout and sharding; the
layout-free way out is ``Engine.export_hf`` (weights only). On load, optimizer
state that belongs to a DTensor parameter is re-wrapped as a DTensor with that
parameter's mesh and placements, so ``Optimizer.load_state_dict`` sees what it saved.

Offload moves the same tensors (parameters, optimizer state, master slices) to host
memory and back. ``Module.to`` keeps every ``Parameter`` object (FSDP2 re-registers
its sharded storage in ``_apply``), so optimizer references stay valid.
"""

from __future__ import annotations

import os

import torch
from torch.distributed.tensor import DTensor

from bumblebee.config import ConfigError
from bumblebee.primitives.sharding.common import local

FORMAT = 1


def _optimizer(engine):
    return engine.sharding.optimizer


def _extra_params(engine) -> list[torch.Tensor]:
    """Optimizer parameters that are not model parameters (zero1's master slices)."""
    own = {id(p) for p in engine.model.parameters()}
    return [p for g in _optimizer(engine).param_groups for p in g["params"] if id(p) not in own]


def _to_local(obj):
    if isinstance(obj, dict):
        return {k: _to_local(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_local(v) for v in obj]
    if torch.is_tensor(obj):
        return local(obj).detach().cpu().clone()
    return obj


def _signature(engine) -> dict:
    return {"world": engine.ctx.layout.world, "layout": engine.ctx.layout.describe(),
            "sharding": engine.cfg.primitives.sharding}


def rank_state(engine) -> dict:
    return {"format": FORMAT, **_signature(engine), "step": engine.step,
            "model": {n: _to_local(p) for n, p in engine.model.named_parameters()},
            "extra_params": [_to_local(p) for p in _extra_params(engine)],
            "optimizer": _to_local(_optimizer(engine).state_dict())}


@torch.no_grad()
def load_rank_state(engine, path: str) -> None:
    if not os.path.isfile(path):
        raise ConfigError(f"no Engine checkpoint for rank {engine.ctx.rank} at {path}")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("format") != FORMAT:
        raise ConfigError(f"{path}: not an Engine checkpoint (format {state.get('format')!r})")
    mine = _signature(engine)
    saved = {k: state[k] for k in mine}
    if saved != mine:
        raise ConfigError(f"{path}: saved with {saved}, this Engine runs {mine}; resume on the same layout "
                          "(or start a new Engine from export_hf)")
    params = dict(engine.model.named_parameters())
    if params.keys() != state["model"].keys():
        raise ConfigError(f"{path}: parameter names differ from this model's")
    for name, p in params.items():
        local(p).copy_(state["model"][name])
    for p, t in zip(_extra_params(engine), state["extra_params"], strict=True):
        p.copy_(t)
    opt = _optimizer(engine)
    sd = state["optimizer"]
    order = [p for g in opt.param_groups for p in g["params"]]
    for idx, entry in sd["state"].items():
        p = order[int(idx)]
        for k, v in entry.items():
            if isinstance(p, DTensor) and v.dim() > 0:
                entry[k] = DTensor.from_local(v.to(local(p).device), p.device_mesh, p.placements, run_check=False,
                                              shape=p.shape, stride=p.stride())
    opt.load_state_dict(sd)
    engine.step = int(state["step"])


@torch.no_grad()
def move_state(engine, device: torch.device) -> None:
    """Parameters, optimizer state and master slices to ``device`` (nothing moves twice)."""
    if any(local(p).device != device for p in engine.model.parameters()):
        engine.model.to(device)
    for p in _extra_params(engine):
        if p.device != device:
            p.data = p.data.to(device)
    for entry in _optimizer(engine).state.values():
        for k, v in entry.items():
            if torch.is_tensor(v) and v.dim() > 0 and local(v).device != device:  # scalar 'step' stays put
                entry[k] = v.to(device)
