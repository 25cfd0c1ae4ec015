"""A run's pieces, built once in one order: the Trainer and the RL Engine (and through the
Trainer, pair) call ``build_run``.

plan (``check_run``) -> parallel state (meshes) -> seed -> sharding primitive -> the model on
the meta device, cut to this rank's pipeline stages and wrapped by the sharding, then
materialized -> the sharding's fp32 state -> the optimizer.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from bumblebee import registry
from bumblebee.config import Config
from bumblebee.models import build_model, materialize, resolve_arch
from bumblebee.primitives.parallel import ParallelState
from bumblebee.runtime.mesh import build_context, single_process
from bumblebee.runtime.optim import build_optimizer
from bumblebee.runtime.resolve import RunPlan, check_run
from bumblebee.runtime.step import autocast_for


def pick_device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def seed_everything(seed: int, deterministic: bool) -> None:
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=False)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def check_world(cfg: Config, **kwargs) -> RunPlan:
    """The run resolved for the current process group (one process without one)."""
    return check_run(cfg, dist.get_world_size() if dist.is_initialized() else 1, **kwargs)


def build_initial_model(
    cfg: Config, device: torch.device, groups: ParallelState | None = None, split=None, arch=None
):
    """The model a config describes, holding this rank's share only: built on the meta device,
    cut by ``split(model) -> model`` while it has no memory (the pipeline keeps this rank's
    stages, the sharding primitive wraps it: FSDP2 shards, expert slices), then materialized on
    ``device`` and filled in place: the random init of ``train.seed`` (identical for every
    layout), or each rank's slices of ``model.hf_path``."""
    arch = arch or resolve_arch(cfg.model)
    model = build_model(
        arch,
        cfg.primitives,
        groups or ParallelState(),
        device="meta",
        lora=cfg.model.lora if cfg.model.lora.rank else None,
        train_dtype=cfg.train.dtype,
    )
    # before the split: the last pipeline stage runs MTP
    model.set_mtp(cfg.mtp.depth, cfg.mtp.loss_weight)
    if split is not None:
        model = split(model)
    return materialize(
        model,
        device,
        seed=cfg.train.seed,
        hf_path=cfg.model.hf_path,
        init_on_device=cfg.train.init_device == "device",
    )


@dataclass
class Run:
    """What ``build_run`` built; ``pipeline`` is None unless parallel.pp > 1."""

    plan: RunPlan
    ctx: ParallelState
    device: torch.device
    autocast: Any
    sharding: Any
    model: Any
    optimizer: Any
    pipeline: Any = None


def build_run(
    cfg: Config,
    plan: RunPlan,
    device: torch.device,
    pipeline: Callable | None = None,
    capacity: bool = False,
) -> Run:
    """Build the run ``plan`` describes on ``device`` (collective). ``pipeline(cfg, plan, ctx,
    model, device, autocast)``: the stage runner made from the meta model when pp > 1 (it keeps
    this rank's stages); ``capacity``: set ``moe.capacity_factor`` on the model."""
    ctx = single_process(device) if plan.layout.world == 1 else build_context(plan.layout, device)
    seed_everything(cfg.train.seed, cfg.train.deterministic)
    autocast = autocast_for(device, cfg.train.dtype)
    sharding = registry.get("sharding", cfg.primitives.sharding).factory(ctx, cfg.train)
    stages = []

    def split(model):  # on the meta device: nothing allocated yet
        if plan.layout.pp > 1:  # this rank's stages only: that part is what gets sharded
            stages.append(pipeline(cfg, plan, ctx, model, device, autocast))
        return sharding.wrap(model)

    model = build_initial_model(cfg, device, ctx, split, arch=plan.arch)
    if capacity:  # 0: every token reaches its k experts
        model.set_capacity(cfg.moe.capacity_factor)
    sharding.after_load()  # e.g. zero1 takes its fp32 master slices of the weights
    optimizer = build_optimizer(cfg.train, sharding)
    return Run(plan, ctx, device, autocast, sharding, model, optimizer, (stages or [None])[0])
