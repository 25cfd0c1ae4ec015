"""A planned candidate as a run: the config ``bumblebee train --config`` takes, checked by the
runtime's own resolver (``runtime/resolve.py``) so the planner cannot recommend what the
runtime refuses."""

from __future__ import annotations

import os

from bumblebee.config import Config, ConfigError, dump_toml, validate
from bumblebee.models import FAMILIES


def run_config(model: str, family: str, cand, work) -> Config:
    """The runtime config of ``cand`` for ``--model model`` (a preset name or a HF config path):
    the layout as ``[parallel]``, the primitives the prediction assumed, bf16 compute."""
    cfg = Config()
    preset = model.split("/")[-1]
    if preset in FAMILIES[family].presets:
        cfg.model.name, cfg.model.preset = family, preset
    else:
        cfg.model.name = family
        cfg.model.hf_path = os.path.dirname(os.path.abspath(model)) if model.endswith(".json") else model
    lay = cand.layout
    cfg.parallel.dp_shard, cfg.parallel.cp, cfg.parallel.ep, cfg.parallel.tp, cfg.parallel.pp = (
        lay.dp_shard, lay.cp, lay.ep, lay.tp, lay.pp)
    p = cand.prims
    cfg.primitives.sharding, cfg.primitives.loss, cfg.primitives.recompute = p.sharding, p.loss, p.recompute
    cfg.primitives.moe_comm, cfg.primitives.moe_chunks = p.moe_comm, p.moe_chunks
    cfg.train.seq_len, cfg.train.global_batch, cfg.train.micro_batch = work.seq, work.global_batch, work.micro_batch
    cfg.train.dtype = "bfloat16"
    return cfg


def runtime_problem(cfg: Config, world: int) -> str:
    """Why the runtime would refuse ``cfg`` on ``world`` ranks ('' if it accepts it)."""
    from bumblebee.runtime.resolve import check_run, validate_run

    try:
        validate(cfg)
        validate_run(cfg)
        check_run(cfg, world)
    except ConfigError as e:
        return str(e)
    return ""


def config_toml(cfg: Config) -> str:
    return "# written by bumblebee plan\n" + dump_toml(cfg)
