"""Typed run configuration: the sections of a run and their defaults, value checks.

A run is described by seven sections (model, parallel, primitives, train, data, moe, mtp),
each a keyword-only dataclass. ``parse_config`` (config_parse.py) merges defaults, a TOML file
and command-line overrides, then ``validate`` (config_checks.py) checks every value on its own (types,
ranges, files), so that bad input fails in milliseconds with one line that says what
is wrong and what would be valid. This module is part of the core and imports no
model or primitive: what needs them (the architecture, the registered primitives,
the layout at a world size) is checked by ``runtime/resolve.py``, and
``bumblebee.load_config`` runs both.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from bumblebee.config_checks import (
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
    # the attention core under context parallelism (the degree is parallel.cp)
    cp_attention: str = "ring"
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
    # (to rule them out when a GPU run misbehaves; primitives/kernel_choice.py)
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
    # where the random initial values are drawn: "cpu" (the same weights on every device and layout)
    # | "device" (on the training device: fast at real width; the same for every layout of one device type)
    init_device: str = "cpu"
    deterministic: bool = False
    out_dir: str = "runs/default"
    log_every: int = 1
    track_memory: bool = (
        False  # CPU: count live tensors on every step (slower), not only on the first
    )
    # tests: take the CUDA code paths on CPU tensors, each CUDA kernel replaced by its reference, every
    # collective and point-to-point call checked (primitives/emulation.py); CPU only, slow.
    # "real_kernels": the same with FLA's own Triton kernels run through Triton's interpreter in
    # place of their references (needs triton and fla-core; slower still)
    emulate_cuda: bool | str = False
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
    # balance loss (weight: model.arch.router_aux_loss_coef): "step" (expert frequencies over the
    # whole optimizer step; keeps every micro-batch's graph until the backwards) |
    # "micro_batch_global" (each micro-batch's over the dp x cp group; one micro-batch in flight) |
    # "micro_batch" (per micro-batch, this rank) | "hf" (transformers' aux_loss) | "auto": step at
    # pp = 1, micro_batch with pp > 1
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
    value_len: int = 2  # answer digits (the default run learns 2 within its 400 steps, not 3: see docs/commands.md)
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


# ----------------------------------------------------------------------------------------------
# helpers the runtime reads


def balance_mode(cfg: Config, pp: int) -> str:
    """The balance-loss definition a run computes: ``train.balance``, where "auto" is "step"
    (needs every micro-batch's router counts before the first backward; the loss does not depend
    on the layout) unless a pipeline schedule (pp > 1), which backs micro-batches up one by one,
    makes that impossible: then "micro_batch". "micro_batch_global" (each micro-batch's statistics
    over the dp x cp group) keeps one micro-batch in flight instead, at the price of a loss that
    depends on how the global batch is split into micro-batches."""
    if cfg.train.balance != "auto":
        return cfg.train.balance
    return "micro_batch" if pp > 1 else "step"


def eval_interval(cfg: Config) -> int:
    """Steps between held-out evaluations (0: none): ``train.eval_every``, where "auto" is every
    50 steps for the synthetic task or a source given held-out data, else never."""
    every = cfg.train.eval_every
    if every != "auto":
        return every
    d = cfg.data
    return 50 if d.source == "synthetic" or d.eval_fraction or d.eval_path else 0
