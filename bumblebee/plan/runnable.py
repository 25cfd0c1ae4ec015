"""A planned candidate as a run: the config ``bumblebee train --config`` takes, checked by the
runtime's own resolver (``runtime/resolve.py``) so the planner cannot recommend what the
runtime refuses."""

from __future__ import annotations

import json
import os

from bumblebee.config import Config, ConfigError, validate
from bumblebee.config_parse import dump_toml
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
        cfg.model.hf_path = (
            os.path.dirname(os.path.abspath(model)) if model.endswith(".json") else model
        )
    lay = cand.layout
    cfg.parallel.dp_shard, cfg.parallel.cp, cfg.parallel.ep, cfg.parallel.tp, cfg.parallel.pp = (
        lay.dp_shard,
        lay.cp,
        lay.ep,
        lay.tp,
        lay.pp,
    )
    p = cand.prims
    cfg.primitives.sharding, cfg.primitives.loss, cfg.primitives.recompute = (
        p.sharding,
        p.loss,
        p.recompute,
    )
    cfg.primitives.moe_comm, cfg.primitives.moe_chunks = p.moe_comm, p.moe_chunks
    cfg.primitives.moe_chunk_weights = list(p.moe_chunk_weights)
    cfg.train.seq_len, cfg.train.global_batch, cfg.train.micro_batch = (
        work.seq,
        work.global_batch,
        work.micro_batch,
    )
    cfg.train.balance = work.balance
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
    """The whole config as TOML: only for the ``tiny`` CPU demo presets, whose demo settings
    (synthetic task, lr, out_dir) are the right ones (``emit_toml`` decides)."""
    return "# written by bumblebee plan\n" + dump_toml(cfg)


# what a plan cannot decide for a real-size run: the user fills each before `bumblebee train`
# accepts the file (config_checks.check_filled)
_REQUIRED = {
    "model": {
        "hf_path": "the Hugging Face directory to start from (config.json + *.safetensors), "
        'or "" for a random init of the preset'
    },
    "train": {
        "steps": "optimizer steps of the run",
        "lr": "peak learning rate (after warm-up)",
        "warmup_steps": "linear warm-up steps",
        "min_lr": "learning rate at the end of the cosine decay",
        "save_every": "checkpoint every N steps (0: none)",
        "out_dir": "the run's output directory (metrics, checkpoints)",
    },
    "data": {
        "source": "tokens | text | chat | jsonl",
        "path": "the training data (data.source = tokens: a `bumblebee data prepare` directory)",
    },
}


def emit_toml(cfg: Config, header: str) -> str:
    """``plan --emit-config``: what the plan decided (layout with ``dp_shard = "auto"``, the
    primitives it assumed, sequence length, batch, dtype) and a ``"REQUIRED: ..."`` marker for
    everything it cannot decide (weights, data, lr schedule, checkpoint cadence, out_dir), so no
    CPU-demo default (synthetic data, lr 2e-3, no checkpoints, runs/default) reaches a real run.
    The router is left out: the runtime takes the architecture's (DeepSeek-V3: sigmoid_bias).
    ``tiny`` presets (the laptop flow) get the whole demo config instead."""
    if cfg.model.preset == "tiny" and not cfg.model.hf_path:
        return config_toml(cfg)
    p, t = cfg.parallel, cfg.train
    given = {
        "model": {"name": cfg.model.name},
        "parallel": {"dp_shard": "auto", "cp": p.cp, "ep": p.ep, "tp": p.tp, "pp": p.pp},
        "primitives": {
            k: getattr(cfg.primitives, k)
            for k in ("sharding", "loss", "recompute", "moe_comm", "moe_chunks")
        }
        | (
            {"moe_chunk_weights": cfg.primitives.moe_chunk_weights}
            if cfg.primitives.moe_chunk_weights
            else {}
        ),
        "train": {k: getattr(t, k) for k in ("seq_len", "global_batch", "micro_batch", "dtype")}
        # a balance the plan was asked for (--set train.balance); the default goes unwritten
        | ({"balance": t.balance} if t.balance != "auto" else {}),
        "data": {},
    }
    if cfg.model.hf_path:  # --model named a Hugging Face directory: decided
        given["model"]["hf_path"] = cfg.model.hf_path
    else:
        given["model"]["preset"] = cfg.model.preset
    lines = [
        header,
        '# Filled in: what the plan decided. Every "REQUIRED: ..." value is yours to set;',
        "# `bumblebee train` refuses this file while one is left (or give it with --set KEY=VALUE).",
        "",
    ]
    for section, values in given.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
        if section == "parallel":
            lines.append(f"# dp_shard resolves to {p.dp_shard} at the planned world size")
        if section == "primitives":
            lines.append("# router: the architecture's, chosen by the runtime")
        lines += [
            f"{k} = {json.dumps('REQUIRED: ' + why)}"
            for k, why in _REQUIRED.get(section, {}).items()
            if not (section == "model" and k == "hf_path" and cfg.model.hf_path)
        ]
        lines.append("")
    return "\n".join(lines)
