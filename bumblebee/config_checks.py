"""Value checks of a run configuration (``validate``): each section on its own, in milliseconds,
before any model is built or device touched, each failure one ``ConfigError`` line that says
what is wrong and what would be valid. Cross-checks that need the model, the registered
primitives or the world size are in runtime/resolve.py. ``cfg`` is a ``bumblebee.config.Config``
(not imported here: config.py imports this module); ``t`` / ``d`` its train / data sections."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os

from bumblebee.errors import ConfigError, gather

DATA_SOURCES = ("synthetic", "jsonl", "tokens", "text", "chat")


INT_LIMIT = 2**63  # torch's int64, the widest integer a count, step or seed can be held in


def check_int_range(section: str, obj) -> None:
    """Integers of a config dataclass fit in int64: TOML and --set read any size, and a step
    count of 1e22 would start a run that never ends or overflow once it meets a tensor."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if (
            isinstance(value, int)
            and not isinstance(value, bool)
            and not -INT_LIMIT < value < INT_LIMIT
        ):
            raise ConfigError(
                f"{section}.{f.name} = {value} is beyond a 64-bit integer (|value| < 2^63)"
            )


def validate(cfg) -> None:
    """Every section's values; each section's first problem is reported, all sections together
    (one ConfigError, a line each)."""
    gather(
        *[
            (lambda f=f: check_int_range(f.name, getattr(cfg, f.name)))
            for f in dataclasses.fields(cfg)
        ],
        lambda: _check_mtp(cfg),
        lambda: _check_lora(cfg.model.lora, cfg.train.dtype),
        lambda: _check_train(cfg.train),
        lambda: _check_moe(cfg),
        lambda: _check_parallel(cfg),
        lambda: _check_eval_every(cfg),
        lambda: _check_data(cfg.data, cfg.train),
        lambda: _check_synthetic(cfg),
        lambda: _check_primitives(cfg),
    )


# the packages train.emulate_cuda = "real_kernels" runs (FLA's Triton kernels, Triton's interpreter)
REAL_KERNEL_PACKAGES = {"triton": "triton", "fla": "fla-core"}


def _check_emulate_cuda(value) -> None:
    if isinstance(value, bool):
        return
    if value != "real_kernels":
        raise ConfigError(
            f"train.emulate_cuda must be true, false or 'real_kernels', got {value!r}"
        )
    absent = [
        pip for mod, pip in REAL_KERNEL_PACKAGES.items() if importlib.util.find_spec(mod) is None
    ]
    if absent:
        raise ConfigError(
            f"train.emulate_cuda = 'real_kernels' runs FLA's Triton kernels on CPU: "
            f"{' and '.join(absent)} not installed (pip install triton fla-core)"
        )


def _check_eval_every(cfg) -> None:
    if cfg.train.eval_every != "auto" and not (
        isinstance(cfg.train.eval_every, int) and cfg.train.eval_every >= 0
    ):
        raise ConfigError(f"train.eval_every must be >= 0 or 'auto', got {cfg.train.eval_every!r}")


def _check_lora(lora, train_dtype: str) -> None:
    if not (isinstance(lora.rank, int) and 0 <= lora.rank < 2**16):
        raise ConfigError(f"model.lora.rank must be >= 0 (0: no adapters), got {lora.rank!r}")
    if not (math.isfinite(lora.alpha) and lora.alpha > 0):
        raise ConfigError(f"model.lora.alpha must be a finite number > 0, got {lora.alpha}")
    if not all(isinstance(t, str) and t for t in lora.targets):
        raise ConfigError(
            f"model.lora.targets must be module names (q_proj, experts, ...), got {lora.targets!r}"
        )
    if lora.base_dtype not in ("auto", "bfloat16", "float32"):
        raise ConfigError(
            f"model.lora.base_dtype must be 'auto', 'bfloat16' or 'float32', got {lora.base_dtype!r}"
        )
    if lora.rank and lora.base_dtype == "bfloat16" and train_dtype != "bfloat16":
        raise ConfigError(
            "model.lora.base_dtype = 'bfloat16' needs train.dtype = 'bfloat16' (the frozen bf16 "
            "matrices are computed under bf16 autocast; fp32 compute keeps an fp32 base)"
        )


def _check_mtp(cfg) -> None:
    m = cfg.mtp
    if m.depth != "auto" and not (isinstance(m.depth, int) and m.depth >= 0):
        raise ConfigError(f"mtp.depth must be >= 0 or 'auto', got {m.depth!r}")
    if not (math.isfinite(m.loss_weight) and m.loss_weight >= 0):
        raise ConfigError(f"mtp.loss_weight must be a finite number >= 0, got {m.loss_weight}")


def _check_train(t) -> None:
    for f in dataclasses.fields(t):  # TOML reads nan and inf: every number must be finite
        value = getattr(t, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"train.{f.name} must be a finite number, got {value}")
    for name in ("steps", "seq_len", "global_batch", "micro_batch"):
        if getattr(t, name) <= 0:
            raise ConfigError(f"train.{name} must be a positive integer, got {getattr(t, name)}")
    for name in ("warmup_steps", "log_every", "save_every", "keep_last", "max_restarts"):
        if getattr(t, name) < 0:
            raise ConfigError(f"train.{name} must be >= 0, got {getattr(t, name)}")
    if t.lr <= 0 or t.min_lr < 0 or t.min_lr > t.lr:
        raise ConfigError(
            f"train.lr must be > 0 and 0 <= train.min_lr <= train.lr (got lr={t.lr}, min_lr={t.min_lr})"
        )
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(t, name) < 1:
            raise ConfigError(
                f"train.{name} must be in [0, 1) (AdamW's moment decay), got {getattr(t, name)}"
            )
    if t.eps <= 0 or t.weight_decay < 0:
        raise ConfigError(
            f"train.eps must be > 0 and train.weight_decay >= 0 (got eps={t.eps}, "
            f"weight_decay={t.weight_decay})"
        )
    _check_emulate_cuda(t.emulate_cuda)
    if not t.out_dir.strip():
        raise ConfigError("train.out_dir is empty; give the directory the run writes to")
    if t.clip_grad < 0:
        raise ConfigError(f"train.clip_grad must be >= 0 (0 disables clipping), got {t.clip_grad}")
    if t.resume not in ("", "auto") and not os.path.isdir(t.resume):
        raise ConfigError(
            f"train.resume: no such directory {t.resume!r}; give a checkpoint directory or 'auto'"
        )
    if not 0 < t.collective_timeout_s < 1e7:
        raise ConfigError(
            f"train.collective_timeout_s must be > 0 seconds, got {t.collective_timeout_s}"
        )
    if t.init_device not in ("cpu", "device"):
        raise ConfigError(f"train.init_device must be 'cpu' or 'device', got {t.init_device!r}")
    if t.adamw not in ("fused", "foreach", "loop"):
        raise ConfigError(f"train.adamw must be 'fused', 'foreach' or 'loop', got {t.adamw!r}")
    if t.on_nonfinite not in ("stop", "skip"):
        raise ConfigError(f"train.on_nonfinite must be 'stop' or 'skip', got {t.on_nonfinite!r}")
    if t.dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"train.dtype must be 'float32' or 'bfloat16', got {t.dtype!r}")
    if t.grad_accum not in ("sharded", "unsharded"):
        raise ConfigError(
            f"train.grad_accum must be 'sharded' or 'unsharded', got {t.grad_accum!r}"
        )
    if t.reduce_dtype not in ("float32", "bfloat16"):
        raise ConfigError(
            f"train.reduce_dtype must be 'float32' or 'bfloat16', got {t.reduce_dtype!r}"
        )
    if t.balance not in ("auto", "step", "micro_batch_global", "micro_batch", "hf"):
        raise ConfigError(
            "train.balance must be 'auto', 'step', 'micro_batch_global', 'micro_batch' or 'hf', "
            f"got {t.balance!r}"
        )


def _check_moe(cfg) -> None:
    m = cfg.moe
    if not (math.isfinite(m.bias_update_rate) and m.bias_update_rate >= 0):
        raise ConfigError(
            f"moe.bias_update_rate must be a finite number >= 0, got {m.bias_update_rate}"
        )
    if not (math.isfinite(m.capacity_factor) and m.capacity_factor >= 0):
        raise ConfigError(
            f"moe.capacity_factor must be a finite number >= 0 (0: no capacity limit), "
            f"got {m.capacity_factor}"
        )
    if m.load_histogram_every < 0:
        raise ConfigError(f"moe.load_histogram_every must be >= 0, got {m.load_histogram_every}")


def _check_parallel(cfg) -> None:
    p = cfg.parallel
    for name in ("cp", "ep", "tp", "pp"):
        if getattr(p, name) < 1:
            raise ConfigError(f"parallel.{name} must be >= 1, got {getattr(p, name)}")
    if isinstance(p.dp_shard, str) and p.dp_shard != "auto":
        raise ConfigError(
            f"parallel.dp_shard must be a positive integer or 'auto', got {p.dp_shard!r}"
        )
    if isinstance(p.dp_shard, int) and p.dp_shard < 1:
        raise ConfigError(f"parallel.dp_shard must be >= 1, got {p.dp_shard}")


def _check_synthetic(cfg) -> None:
    d = cfg.data
    if not 1 <= d.min_records <= d.max_records <= 26:
        raise ConfigError(
            f"data needs 1 <= min_records <= max_records <= 26 (one key letter each), "
            f"got {d.min_records}, {d.max_records}"
        )
    for name in ("min_doc_len", "max_doc_len", "value_len", "eval_docs"):
        if getattr(d, name) < 1:
            raise ConfigError(f"data.{name} must be a positive integer, got {getattr(d, name)}")
    for name in ("ramp_steps", "eval_min_distance"):
        if getattr(d, name) < 0:
            raise ConfigError(f"data.{name} must be >= 0, got {getattr(d, name)}")
    if d.min_doc_len > d.max_doc_len:
        raise ConfigError(
            f"data.min_doc_len = {d.min_doc_len} > data.max_doc_len = {d.max_doc_len}; "
            "the shortest document must not be longer than the longest"
        )


def _check_primitives(cfg) -> None:
    pr = cfg.primitives
    if not all(isinstance(s, list) and all(type(i) is int for i in s) for s in pr.pp_layout):
        raise ConfigError(
            f"primitives.pp_layout must be a list of stages, each a list of decoder layer indices "
            f"(integers), e.g. [[0, 1], [2, 3]]; got {pr.pp_layout}"
        )
    if not all(isinstance(m, str) for m in pr.recompute_modules):
        raise ConfigError(
            f"primitives.recompute_modules must be a list of module names, got {pr.recompute_modules}"
        )
    if pr.linear_attention_cp not in ("scan", "relay"):
        raise ConfigError(
            f"primitives.linear_attention_cp must be 'scan' or 'relay', got {pr.linear_attention_cp!r}"
        )
    if pr.fused not in ("auto", "off"):
        raise ConfigError(f"primitives.fused must be 'auto' or 'off', got {pr.fused!r}")
    if pr.dsa_stage not in ("sparse", "dense_warmup") or pr.dsa_impl not in (
        "blockwise",
        "reference",
    ):
        raise ConfigError(
            f"primitives.dsa_stage must be 'sparse' or 'dense_warmup' and primitives.dsa_impl "
            f"'blockwise' or 'reference', got {pr.dsa_stage!r}, {pr.dsa_impl!r}"
        )
    if pr.dsa_block < 1 or pr.dsa_indexer_loss < 0:
        raise ConfigError(
            f"primitives.dsa_block must be >= 1 and dsa_indexer_loss >= 0, got {pr.dsa_block}, "
            f"{pr.dsa_indexer_loss}"
        )
    for name in ("moe_chunks", "pp_microbatches", "pp_virtual_stages"):
        if getattr(pr, name) < 0:
            raise ConfigError(f"primitives.{name} must be >= 0, got {getattr(pr, name)}")
    _check_contracts(pr)


def _check_contracts(pr) -> None:
    """What the chosen implementations declare they need of the config alone (registry.Need),
    and their own options set for another one; the layout's needs are checked at launch. Every
    caller has registered the implementations (runtime/resolve.py imports bumblebee.primitives)."""
    from bumblebee import registry

    defaults = type(pr)()
    if unmet := registry.unmet(registry.RunFacts(prims=pr, moe_bias=None), defaults):
        raise ConfigError("\n".join(unmet))


def _check_data(d, t) -> None:
    choices = {
        "source": DATA_SOURCES,
        "chat_loss": ("assistant", "all"),
        "on_error": ("raise", "skip"),
        "too_long": ("auto", "split", "truncate", "drop"),
    }
    for key, valid in choices.items():
        if getattr(d, key) not in valid:
            raise ConfigError(
                f"data.{key} must be one of {', '.join(valid)}; got {getattr(d, key)!r}"
            )
    if d.source != "synthetic":
        if not d.path:
            raise ConfigError(f"data.source = '{d.source}' needs data.path")
        for key in ("path", "eval_path"):
            p = getattr(d, key)
            if p and not os.path.exists(p):
                raise ConfigError(f"data.{key} not found: {p}")
    if d.tools and not os.path.isfile(d.tools):
        raise ConfigError(
            f"data.tools not found: {d.tools} (a JSON file with a list of tool schemas)"
        )
    if (d.tools or d.chat_template_kwargs) and d.source != "chat":
        raise ConfigError(
            f"data.tools and data.chat_template_kwargs apply to chat data; data.source is "
            f"'{d.source}'"
        )
    if d.source in ("text", "chat") and not d.tokenizer:
        raise ConfigError(
            f"data.source = '{d.source}' needs data.tokenizer (a local Hugging Face tokenizer directory)"
        )
    if not 0.0 <= d.eval_fraction < 1.0:
        raise ConfigError(f"data.eval_fraction must be in [0, 1), got {d.eval_fraction}")
    held_out = d.eval_fraction or d.eval_path
    if t.eval_every != "auto" and t.eval_every and d.source != "synthetic" and not held_out:
        raise ConfigError(
            "train.eval_every needs held-out data: set data.eval_fraction or data.eval_path"
        )
    if d.eval_batches < 1:
        raise ConfigError(f"data.eval_batches must be >= 1, got {d.eval_batches}")


def config_warnings(cfg) -> list[str]:
    """Settings that run but are probably not what was meant (printed as warnings at start)."""
    t, out = cfg.train, []
    if t.warmup_steps > t.steps:
        out.append(
            f"train.warmup_steps = {t.warmup_steps} > train.steps = {t.steps}: the learning rate is still "
            f"warming up when the run ends and never reaches train.lr = {t.lr:g}; set train.warmup_steps "
            f"below train.steps"
        )
    return out


# the value `bumblebee plan --emit-config` writes where the user must decide (data, lr schedule, ...)
REQUIRED_MARK = "REQUIRED:"


def unfilled(data: dict) -> list[str]:
    """``section.key`` of every value of a TOML dict still holding the ``REQUIRED:`` marker."""
    return [
        f"{section}.{key}"
        for section, values in data.items()
        if isinstance(values, dict)
        for key, value in values.items()
        if isinstance(value, str) and value.startswith(REQUIRED_MARK)
    ]


def check_filled(data: dict, path: str | None, overrides: list[str]) -> None:
    """A config written by ``plan --emit-config`` holds ``"REQUIRED: ..."`` where the plan cannot
    decide (weights, data, lr schedule, checkpoints, out_dir): refuse it, naming every such key,
    until each is filled in the file or by ``--set``. The markers ``--set`` fills are dropped
    from ``data`` (they are not values of their type)."""
    given = {item.split("=", 1)[0].strip() for item in overrides if "=" in item}
    missing = [key for key in unfilled(data) if key not in given]
    if missing:
        raise ConfigError(
            f"{path}: required field(s) not filled in: {', '.join(missing)}; replace each "
            f'"REQUIRED: ..." value (or give it with --set KEY=VALUE)'
        )
    for key in unfilled(data):
        section, name = key.split(".", 1)
        del data[section][name]
