"""Typed run configuration: TOML in, ``--set section.key=value`` overrides, value checks.

A run is described by six sections (model, parallel, primitives, train, data, moe),
each a keyword-only dataclass. ``parse_config`` merges defaults, a TOML file and
command-line overrides, then ``validate`` (config_checks.py) checks every value on its own (types,
ranges, files), so that bad input fails in milliseconds with one line that says what
is wrong and what would be valid. This module is part of the core and imports no
model or primitive: what needs them (the architecture, the registered primitives,
the layout at a world size) is checked by ``runtime/resolve.py``, and
``bumblebee.load_config`` runs both.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Union, get_args, get_origin, get_type_hints

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from bumblebee.config_checks import (
    check_filled,
    validate,  # noqa: F401  (re-exported: ``from bumblebee.config import validate``)
)
from bumblebee.errors import ConfigError  # noqa: F401  (re-exported: ``from bumblebee.config import ConfigError``)


@dataclass(kw_only=True)
class LoraConfig:
    """Low-rank adapters (models/lora.py): rank 0 trains every parameter; rank r > 0 freezes the
    base (no gradient, no optimizer state) and trains W + (alpha / r) B A on the targets."""

    rank: int = 0
    alpha: float = 16.0
    # module names to adapt (nn.Linear leaf names such as q_proj / in_proj_qkv / gate_proj, and
    # "experts" for the routed experts' stacked weights); []: every projection of the decoder layers
    targets: list = field(default_factory=list)
    # frozen base parameters: "auto" (bfloat16 when train.dtype is, else float32) | "bfloat16" | "float32"
    base_dtype: str = "auto"


@dataclass(kw_only=True)
class ModelConfig:
    name: str = "qwen3_moe"  # a registered model family (models/<family>/; the default run's)
    preset: str = "tiny"  # a name from bumblebee.models.presets, ignored when hf_path is set
    hf_path: str = ""  # a Hugging Face directory (config.json + safetensors) to start from
    # Architecture overrides on top of the preset, HF key names: {num_hidden_layers = 2, ...}
    arch: dict = field(default_factory=dict)
    lora: LoraConfig = field(default_factory=LoraConfig)  # {rank = 8, alpha = 16, targets = [...]}


@dataclass(kw_only=True)
class ParallelConfig:
    dp_shard: int | str = "auto"  # "auto" = world / (cp * tp * pp)
    cp: int = 1
    ep: int = 1
    tp: int = 1
    pp: int = 1


@dataclass(kw_only=True)
class PrimitivesConfig:
    attention: str = "varlen"
    cp: str = "ring"
    linear_attention: str = "chunked"
    # how context parallelism carries the Gated DeltaNet state: "scan" (all ranks at once, affine scan
    # with a [v | 0_K] state probe) | "relay" (rank to rank through the core's initial state, no probe)
    linear_attention_cp: str = "scan"
    router: str = "softmax_topk"
    experts: str = "grouped"
    moe_comm: str = "alltoall"
    moe_chunks: int = 2
    # chunked: token share of each chunk, [] even; one list for every MoE layer or one per MoE
    # layer (`bumblebee plan --skew / --from-run` chooses them: primitives/moe/chunk_plan.py)
    moe_chunk_weights: list = field(default_factory=list)
    loss: str = "linear_ce"
    sharding: str = "fsdp2"
    recompute: str = "full"
    recompute_modules: list = field(default_factory=list)
    pipeline: str = "1f1b"
    pp_microbatches: int = (
        0  # micro-batches per pipeline step; 0: this rank's rows / train.micro_batch
    )
    pp_virtual_stages: int = 1  # pipeline stages per rank (interleaved_1f1b: >= 2)
    pp_layout: list = field(
        default_factory=list
    )  # decoder layers of each stage, [[0, 1], [2, 3]]; []: balance cost
    # DeepSeek Sparse Attention (primitives/attention/sparse_mla.py): "dense_warmup" (every allowed key
    # attended, only the indexers train) then "sparse" (top-k keys); blockwise core or the dense reference
    dsa_stage: str = "sparse"
    dsa_impl: str = "blockwise"
    dsa_block: int = 128  # queries per block of the blockwise core
    dsa_indexer_loss: float = 1.0  # weight of the indexer KL
    # CUDA without a fused kernel's package (fla for Gated DeltaNet): run the slow PyTorch path instead of refusing
    allow_fallback: bool = False
    # the fused CUDA paths (FLA's causal conv, the compiled norms / SwiGLU / RoPE, the linear CE's
    # compiled tiles): "auto" takes them where the dispatch offers them, "off" runs the eager paths
    # (to rule them out when a GPU run misbehaves; primitives/dispatch.py)
    fused: str = "auto"


@dataclass(kw_only=True)
class TrainConfig:
    steps: int = 400
    seq_len: int = 2048
    global_batch: int = 2  # sequences per optimizer step over all data-parallel ranks
    micro_batch: int = 1  # sequences per forward on one rank
    lr: float = 2e-3
    warmup_steps: int = 10
    min_lr: float = 2e-5
    weight_decay: float = 0.01
    adamw: str = "fused"  # AdamW kernels: "fused" | "foreach" | "loop" (one tensor at a time)
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_grad: float = 1.0
    offload_optimizer: bool = (
        False  # fsdp2: keep sharded params/grads/optimizer state in host memory
    )
    # compute dtype: float32 | bfloat16 (parameters and optimizer state stay fp32); unset, a real-size
    # preset (model.preset other than "tiny", no hf_path) runs bfloat16, everything else float32
    dtype: str = "float32"
    grad_accum: str = "sharded"  # fsdp2: "sharded" (reduce-scatter every micro-batch) | "unsharded" (once per step)
    reduce_dtype: str = (
        "float32"  # fsdp2 with dtype = bfloat16: gradient reduce-scatter in float32 | bfloat16
    )
    seed: int = 0
    deterministic: bool = False
    out_dir: str = "runs/default"
    log_every: int = 1
    track_memory: bool = (
        False  # CPU: count live tensors on every step (slower), not only on the first
    )
    # tests: take the CUDA code paths on CPU tensors, each CUDA kernel replaced by its reference, every
    # collective and point-to-point call checked (primitives/emulation.py); CPU only, slow
    emulate_cuda: bool = False
    save_every: int = 0  # checkpoint every N steps and at the end (0: no checkpoints)
    keep_last: int = 2  # complete checkpoints kept in out_dir/checkpoints (0: all)
    resume: str = (
        ""  # "auto" (newest complete checkpoint of out_dir, if any) | a checkpoint or run directory
    )
    export_hf: bool = False  # write a Hugging Face directory to out_dir/hf at the end of training
    # log eval_loss (synthetic task: and eval_accuracy) on held-out data every N steps and at the end
    # (0: never); "auto": every 50 steps where the source has held-out data (synthetic: always)
    eval_every: int | str = "auto"
    tensorboard: bool = (
        False  # also write the metrics as TensorBoard scalars to out_dir/tensorboard
    )
    wandb: bool = (
        False  # also log them to Weights & Biases (pip install wandb), run named after out_dir
    )
    wandb_project: str = "bumblebee"
    max_restarts: int = (
        0  # --nproc runs: restart every rank after a failure, from the newest checkpoint
    )
    collective_timeout_s: float = (
        600.0  # every process group: a rank that hangs ends the job after this
    )
    on_nonfinite: str = "stop"  # NaN/Inf loss or grad norm: "stop" the run | "skip" the update
    # balance loss (weight: model.arch.router_aux_loss_coef): "global_batch" (expert frequencies over the
    # whole global batch; keeps every micro-batch's graph until the backwards) | "micro_batch" (per
    # micro-batch) | "hf" (transformers' aux_loss) | "auto": global_batch at pp = 1, micro_batch with pp > 1
    balance: str = "auto"


@dataclass(kw_only=True)
class DataConfig:
    source: str = "synthetic"  # synthetic | jsonl | tokens | text | chat
    # jsonl: a pre-tokenized JSONL file; tokens: a `bumblebee data prepare` directory;
    # text / chat: a .jsonl / .parquet file or a `datasets` directory
    path: str = ""
    tokenizer: str = ""  # text / chat: a local Hugging Face tokenizer directory
    chat_loss: str = "assistant"  # chat: loss on assistant turns only | "all"
    tools: str = ""  # chat: a JSON file, a list of tool schemas for the chat template (a record's own 'tools' wins)
    chat_template_kwargs: dict = field(
        default_factory=dict
    )  # chat: template variables, {enable_thinking = false}
    on_error: str = "raise"  # a bad record: "raise" (file:line: reason, exit 2) | "skip" (counted)
    # a document longer than train.seq_len: "split" into continuations at row boundaries | "truncate" |
    # "drop" (counted, with the share of tokens dropped); "auto": split, chat data truncate
    too_long: str = "auto"
    eval_fraction: float = 0.0  # tokens / text / chat: rows held out for train.eval_every
    eval_path: str = ""  # ... or a separate held-out input (same format as path)
    eval_batches: int = 1  # held-out global batches per evaluation
    # synthetic key-value retrieval task (data/synthetic.py): records per document (at most 26),
    # document lengths in tokens (the top grows from min to max over ramp_steps), answer digits
    min_records: int = 1
    max_records: int = 1
    min_doc_len: int = 16
    max_doc_len: int = 2048
    ramp_steps: int = 200
    value_len: int = (
        2  # answer digits (the default run learns 2 within its 400 steps, not 3: see README)
    )
    eval_min_distance: int = (
        1024  # held-out queries ask about records at least this many tokens back
    )
    eval_docs: int = 32  # held-out documents per evaluation (rounded up to whole global batches)


@dataclass(kw_only=True)
class MoeConfig:
    bias_update_rate: float = (
        0.001  # router sigmoid_bias: bias += rate * sign(mean load - load) after each step
    )
    load_histogram_every: int = (
        0  # every N steps: per-layer per-expert token counts (metrics field expert_load)
    )
    capacity_factor: float = (
        0.0  # > 0: each expert takes <= ceil(f * T * K / E) of a forward's T tokens; rest dropped
    )


@dataclass(kw_only=True)
class MTPConfig:
    """Multi-token prediction (models/mtp.py) on models that hold MTP modules."""

    depth: int | str = "auto"  # MTP depths trained: "auto" = every module the model holds, 0 = none
    loss_weight: float = (
        0.1  # the MTP loss weight (lambda / depth per depth; DeepSeek-V3: 0.3, then 0.1)
    )


@dataclass(kw_only=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    primitives: PrimitivesConfig = field(default_factory=PrimitivesConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
    mtp: MTPConfig = field(default_factory=MTPConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}
_SECTION_TYPES = get_type_hints(Config)


# ----------------------------------------------------------------------------------------------
# loading and overriding


def _suggest(word: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(word, valid, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"{hint}; valid: {', '.join(valid)}"


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Check/convert one value against a field's type hint."""
    origin = get_origin(hint)
    if origin is Union or origin is types.UnionType:  # Union[a, b] and a | b
        errors = []
        for arm in get_args(hint):
            try:
                return _coerce(value, arm, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(
            f"{where}: {value!r} is not valid ({' or '.join(a.__name__ for a in get_args(hint))})"
        )
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    if hint is list or origin is list:
        if isinstance(value, list):
            return value
        raise ConfigError(f"{where}: expected a list, got {value!r}")
    if hint is dict or origin is dict:
        if isinstance(value, dict):
            return value
        raise ConfigError(f"{where}: expected a table, got {value!r}")
    if dataclasses.is_dataclass(hint):  # a nested table (model.lora)
        if isinstance(value, hint):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a table, got {value!r}")
        hints = get_type_hints(hint)
        out = hint()
        for key, v in value.items():
            if key not in hints:
                raise ConfigError(f"{where}: unknown key {key!r}{_suggest(key, list(hints))}")
            setattr(out, key, _coerce(v, hints[key], f"{where}.{key}"))
        return out
    raise AssertionError(f"unhandled type hint {hint} for {where}")


def _apply(cfg: Config, data: dict, source: str) -> None:
    for section, values in data.items():
        if section not in SECTIONS:
            raise ConfigError(
                f"{source}: unknown section [{section}]{_suggest(section, list(SECTIONS))}"
            )
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: [{section}] must be a table")
        obj = getattr(cfg, section)
        hints = get_type_hints(type(obj))
        for key, value in values.items():
            if key not in hints:
                raise ConfigError(
                    f"{source}: unknown key {section}.{key}{_suggest(key, list(hints))}"
                )
            setattr(obj, key, _coerce(value, hints[key], f"{source}: {section}.{key}"))


def parse_override(item: str) -> tuple[list[str], Any]:
    """``section.key=value`` -> (["section", "key"], value). Values are TOML literals;
    a bare word that is not a TOML literal is taken as a string (``--set model.preset=tiny``)."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected section.key=value")
    key, raw = item.split("=", 1)
    path = key.strip().split(".")
    if len(path) < 2 or not all(path):
        raise ConfigError(f"--set {item!r}: expected section.key=value")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return path, value


def read_toml(path: str) -> dict:
    """A TOML file as a dict; a missing or malformed file is a one-line ConfigError."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        kind = " (UTF-16: save it as UTF-8)" if raw[:2] in (b"\xff\xfe", b"\xfe\xff") else ""
        raise ConfigError(
            f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x}){kind}; TOML files are UTF-8"
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: malformed TOML: {e}") from None
    except RecursionError:
        raise ConfigError(f"{path}: malformed TOML: nested too deeply") from None


def parse_config(
    path: str | None = None, overrides: list[str] | None = None, check: bool = True
) -> Config:
    """Defaults <- TOML file <- ``--set`` overrides, then ``validate`` unless ``check`` is
    false (values only; see ``bumblebee.load_config`` for the full check)."""
    cfg = Config()
    data = read_toml(path) if path else {}
    check_filled(data, path, overrides or [])
    if path:
        _apply(cfg, data, path)
    dtype_given = isinstance(data.get("train"), dict) and "dtype" in data["train"]
    for item in overrides or []:
        keys, value = parse_override(item)
        if len(keys) > 2 and keys[0] == "model" and keys[1] == "arch":
            cfg.model.arch = {**cfg.model.arch, ".".join(keys[2:]): value}
            continue
        if len(keys) == 3 and keys[:2] == ["model", "lora"]:  # one key of the nested table
            lora = dataclasses.asdict(cfg.model.lora)
            _apply(cfg, {"model": {"lora": {**lora, keys[2]: value}}}, "--set")
            continue
        if len(keys) != 2:
            raise ConfigError(f"--set {item!r}: expected section.key=value")
        _apply(cfg, {keys[0]: {keys[1]: value}}, "--set")
        dtype_given = dtype_given or keys == ["train", "dtype"]
    if not dtype_given and cfg.model.preset != "tiny" and not cfg.model.hf_path:
        cfg.train.dtype = (
            "bfloat16"  # real-size presets: bf16 compute (the grouped expert GEMM), fp32 masters
        )
    if check:
        validate(cfg)
    return cfg


def dump_toml(cfg: Config) -> str:
    """The resolved config as TOML (written next to every run's metrics)."""
    lines = []
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if isinstance(value, dict):
                inner = ", ".join(f"{k} = {json.dumps(v)}" for k, v in value.items())
                lines.append(f"{key} = {{{inner}}}")
            else:
                lines.append(f"{key} = {json.dumps(value)}")
        lines.append("")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# helpers the runtime reads


def balance_mode(cfg: Config, pp: int) -> str:
    """The balance-loss definition a run computes: ``train.balance``, where "auto" is "global_batch"
    (needs every micro-batch's router counts before the first backward) unless a pipeline schedule
    (pp > 1), which backs micro-batches up one by one, makes that impossible: then "micro_batch"."""
    if cfg.train.balance != "auto":
        return cfg.train.balance
    return "micro_batch" if pp > 1 else "global_batch"


def eval_interval(cfg: Config) -> int:
    """Steps between held-out evaluations (0: none): ``train.eval_every``, where "auto" is every
    50 steps for the synthetic task or a source given held-out data, else never."""
    every = cfg.train.eval_every
    if every != "auto":
        return every
    d = cfg.data
    return 50 if d.source == "synthetic" or d.eval_fraction or d.eval_path else 0
