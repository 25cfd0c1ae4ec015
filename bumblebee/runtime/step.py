"""One optimizer step, shared by the Trainer, the pipeline schedule, the RL Engine and ``pair``.

    local = local_batch(rows, ...)           1. this rank's rows, then its zigzag CP share of them
    sums = accumulate(micro_batches, ...)    2. forward + backward per micro-batch; the sharding
                                                syncs gradients on the last one (fsdp2: on every
                                                one by default, train.grad_accum)
       or accumulate_global_balance(...)        train.balance = "step" (default) over all the
                                                micro-batches, or "micro_batch_global" per one:
                                                forwards, one all-reduce of the router stats,
                                                backwards
    (or the pipeline schedule runs step 2 when pp > 1: runtime/pipeline.py)
    optimizer_tail(...)                      3. reduce -> clip (global norm, pp-aware) -> finite? ->
                                                LR -> update -> zero
    model.update_router_bias(counts, rate)   4. routers with a selection bias follow the step's load

Loss scaling (what makes every layout give the single-process loss): each rank's
loss is its share of the global mean, the summed token loss of a micro-batch divided
by the valid tokens of the *global* batch, so gradients are summed across ranks, never
averaged (primitives/sharding/common.py). The balance loss is a mean over every
micro-batch of the global batch: its coefficient is divided by ``balance_denominator``
(micro-batches x dp ranks x cp ranks; cp ranks hold identical copies of it), for the
per-micro-batch definitions (``train.balance`` = "micro_batch" | "hf"). "step" takes the
expert frequencies of every layer over the whole optimizer step (primitives/moe/balance.py):
``accumulate_global_balance`` runs every micro-batch's forward first, sums the router stats over
micro-batches and over the dp x cp group in one all-reduce, then gives each micro-batch its
exact share of the global loss and runs the backwards. The price is that every micro-batch's
autograd graph lives until the backward phase (under full recompute: the layer inputs), as one
larger micro-batch would; "micro_batch_global" pools each micro-batch over the dp x cp group on
its own (a window of one) and averages over the micro-batches, at the price of a loss that
depends on the split into micro-batches.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from bumblebee.data import Batch
from bumblebee.primitives.cp.zigzag import shard_sequence
from bumblebee.primitives.layer_tape import LayerTape, recording
from bumblebee.primitives.moe import balance
from bumblebee.primitives.moe.balance import split_stats
from bumblebee.primitives.moe.overlap_mb import Pair, SlotStreams, backward_part, forward_done
from bumblebee.primitives.replay_check import ReplayCheck
from bumblebee.runtime.nonfinite import check_finite
from bumblebee.runtime.optim import lr_at, set_lr


def autocast_for(device: torch.device, dtype: str):
    """The compute-dtype context of a run: bf16 autocast, or nothing for fp32."""
    return (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if dtype == "bfloat16"
        else contextlib.nullcontext()
    )


def shard_rows(
    tensors: dict[str, torch.Tensor], rows: int, dp_rank: int, cp: int, cp_rank: int
) -> dict:
    """This rank's part of [B, T] tensors: rows ``[dp_rank * rows, (dp_rank + 1) * rows)``,
    then with cp > 1 its zigzag share of every row (tokens, labels, positions alike)."""
    out = {k: v[dp_rank * rows : (dp_rank + 1) * rows] for k, v in tensors.items()}
    if cp > 1:
        out = {k: shard_sequence(v, cp, cp_rank) for k, v in out.items()}
    return out


def local_batch(rows: Batch, cp: int, cp_rank: int, device) -> Batch:
    """This rank's training rows (the data source builds only those) cut to its zigzag CP share
    (``shard_rows``), moved to ``device``."""
    part = shard_rows(
        {"input_ids": rows.input_ids, "labels": rows.labels, "position_ids": rows.position_ids},
        rows.input_ids.shape[0],
        0,
        cp,
        cp_rank,
    )
    return Batch(**part).to(device)


def micro_batches(local: Batch, micro_batch: int) -> list[Batch]:
    n = local.input_ids.shape[0]
    return [local.rows(i, i + micro_batch) for i in range(0, n, micro_batch)]


def balance_denominator(micro: int, dp: int, cp: int) -> int:
    """How many balance-loss copies the global batch's mean runs over."""
    return micro * dp * cp


def add_stat(sums: dict, name: str, value: torch.Tensor) -> None:
    """Fold one micro-batch's stat into ``sums``: summed, or kept as a maximum for a name
    ending in ``_max`` (a max of nonnegative values; e.g. the largest importance ratio)."""
    v = value.detach().float()
    if name not in sums:
        sums[name] = v
    else:
        sums[name] = torch.maximum(sums[name], v) if name.endswith("_max") else sums[name] + v


def run_micro_batches(
    fns: list, sharding=None, paired: bool = False, chain: bool = False, streams=None
) -> list:
    """Call ``fns`` (one per micro-batch) in order, or with ``paired`` two at a time on a
    ``Pair`` (moe_comm = overlap_mb: each one's all-to-alls hide under the other's compute);
    with ``chain`` too, all on one chained ``Pair`` (1F1B: micro-batch k's forward beside k - 1's
    backward; each fn calls ``forward_done()`` between them). Their results in order.
    ``sharding``: tell it which call (or pair) holds the last backward (``set_grad_sync``; a
    chain is one group: overlap_mb runs with zero1, whose gradients sync after the step's
    micro-batches anyway). ``streams``: the step's ``SlotStreams`` (CUDA) for the pairs."""
    if paired and chain:
        if sharding is not None:
            sharding.set_grad_sync(True)
        return Pair(streams).run(*fns, chain=True)
    out, step = [], 2 if paired else 1
    for i in range(0, len(fns), step):
        if sharding is not None:
            sharding.set_grad_sync(i + step >= len(fns))
        out += Pair(streams).run(*fns[i : i + 2]) if paired else [fns[i]()]
    return out


def _tape(paired: bool) -> LayerTape | None:
    """Paired micro-batches cut their forward at every layer and run the backward layer by layer,
    handing over between layers: on CUDA autograd's device thread runs each backward call, where
    no hand-over can happen (primitives/layer_tape.py)."""
    return LayerTape() if paired else None


def _backward(loss: torch.Tensor, tape: LayerTape | None) -> None:
    if tape is None:
        loss.backward()
    else:
        tape.backward(loss, backward_part)


def _streams(parts: list, paired: bool):
    return SlotStreams.for_device(parts[0].input_ids.device) if paired and parts else None


def accumulate(parts: list, sharding, forward, paired: bool = False) -> dict[str, torch.Tensor]:
    """Forward and backward over micro-batches ``parts``; ``set_grad_sync`` says which is the
    last (FSDP2 reduce-scatters every one unless ``train.grad_accum = "unsharded"``).
    ``forward(part) -> (loss to differentiate, {name: detached stat})``;
    returns each stat summed over the micro-batches (fp32; ``_max`` names: their maximum).
    ``paired``: two micro-batches in flight, 1F1B (``run_micro_batches`` with ``chain``)."""

    def one(part):
        with recording(_tape(paired)) as tape:
            loss, stats = forward(part)
        forward_done()
        _backward(loss, tape)
        return stats

    fns = [lambda p=p: one(p) for p in parts]
    sums: dict[str, torch.Tensor] = {}
    streams = _streams(parts, paired)
    for stats in run_micro_batches(fns, sharding, paired, chain=True, streams=streams):
        for k, v in stats.items():
            add_stat(sums, k, v)
    return sums


def _counts(terms) -> dict[str, torch.Tensor]:
    """The router counts [L, E] of a forward and its capacity-dropped pairs (none without MoE layers)."""
    if terms.router_stats is None:
        return {}
    stats = terms.router_stats.detach()
    return {"router_counts": split_stats(stats)[0], "router_dropped": balance.dropped_pairs(stats)}


def lm_forward(
    model,
    global_tokens: int,
    balance_coef: float,
    micro: int,
    dp: int,
    cp: int,
    autocast,
    balance: str = "micro_batch",
):
    """The training forward of one micro-batch (a ``Batch``) for ``accumulate``: its token-loss
    share plus its balance-loss share (definition ``balance``: "micro_batch" | "hf"); stats
    ``loss_sum``, ``aux`` (balance loss / micro), ``router_counts`` (this micro-batch's
    expert counts per MoE layer) and ``router_dropped`` (pairs dropped by capacity)."""
    denominator = balance_denominator(micro, dp, cp)

    def forward(mb: Batch):
        with autocast:
            terms = model.loss_terms(mb.input_ids, mb.labels, mb.position_ids, balance=balance)
        loss = terms.loss_sum / global_tokens + balance_coef * terms.aux_loss / denominator
        return loss, {
            "loss_sum": terms.loss_sum,
            "aux": terms.aux_loss.detach() / micro,
            **_counts(terms),
        }

    return forward


# train.balance definitions reduced over the dp x cp group -> micro-batches pooled per window
# (None: the whole optimizer step)
GROUP_BALANCE: dict[str, int | None] = {"step": None, "micro_batch_global": 1}


def accumulate_global_balance(
    parts: list,
    sharding,
    model,
    global_tokens: int,
    balance_coef: float,
    autocast,
    group,
    paired: bool = False,
    window: int | None = None,
) -> dict[str, torch.Tensor]:
    """``accumulate`` with a balance loss over the dp x cp group: forward the micro-batches of a
    window, sum their router stats and all-reduce them over ``group`` (every token of the
    window's micro-batches on every rank), then backward each micro-batch's token-loss share
    plus its share of that window's balance loss (``balance.step_loss_share``). ``window``: the
    micro-batches pooled, None: all of ``parts`` (``train.balance = "step"``: the optimizer
    step's frequencies); 1 (2 when ``paired``): each one on its own ("micro_batch_global": one
    micro-batch's graph alive at a time); each window's loss weighted by its share of the
    step's micro-batches. Returns ``loss_sum`` (this rank's), ``aux`` (the balance loss, the
    windows' weighted mean, identical on every rank), ``router_counts`` (this rank's counts
    [L, E], summed over its micro-batches) and ``router_dropped``. ``paired``: the forwards two
    at a time, then the backwards two at a time (``run_micro_batches``)."""
    size = len(parts) if window is None else max(window, 2 if paired else 1)
    windows = [parts[i : i + size] for i in range(0, len(parts), size)]
    out: dict[str, torch.Tensor] = {}
    for n, chunk in enumerate(windows):
        last = n == len(windows) - 1
        if not last and sharding is not None:
            sharding.set_grad_sync(False)
        weight = len(chunk) / len(parts)
        sums = _window_balance(
            chunk,
            sharding if last else None,
            model,
            global_tokens,
            balance_coef * weight if weight != 1 else balance_coef,
            autocast,
            group,
            paired,
        )
        if "router_counts" in sums and weight != 1:
            sums["aux"] = sums["aux"] * weight
        for k, v in sums.items():
            out[k] = v if k not in out else out[k] + v
    return out


def _window_balance(
    parts: list,
    sharding,
    model,
    global_tokens: int,
    balance_coef: float,
    autocast,
    group,
    paired: bool,
) -> dict[str, torch.Tensor]:
    """One window of ``accumulate_global_balance``: its forwards, one all-reduce, its backwards."""
    tapes = [_tape(paired) for _ in parts]
    streams = _streams(parts, paired)

    def terms(part, tape):
        with autocast, recording(tape):
            return model.loss_terms(part.input_ids, part.labels, part.position_ids, balance="step")

    fns = [lambda p=p, tape=tape: terms(p, tape) for p, tape in zip(parts, tapes)]
    kept = run_micro_batches(fns, paired=paired, streams=streams)
    stats = [t.router_stats for t in kept if t.router_stats is not None]
    loss_sum = sum(t.loss_sum.detach().float() for t in kept)
    if not stats:  # no MoE layer: plain accumulation
        run_micro_batches(
            [
                lambda t=t, tape=tape: _backward(t.loss_sum / global_tokens, tape)
                for t, tape in zip(kept, tapes)
            ],
            sharding,
            paired,
            streams=streams,
        )
        return {"loss_sum": loss_sum, "aux": torch.zeros_like(loss_sum)}
    local_LS = torch.stack([s.detach() for s in stats]).sum(0)
    global_LS = local_LS.clone()
    if group is not None:
        dist.all_reduce(global_LS, group=group)

    def backward(t, tape):
        share = balance.step_loss_share(t.router_stats, global_LS)
        _backward(t.loss_sum / global_tokens + balance_coef * share, tape)

    fns = [lambda t=t, tape=tape: backward(t, tape) for t, tape in zip(kept, tapes)]
    run_micro_batches(fns, sharding, paired, streams=streams)
    kept.clear()
    return {
        "loss_sum": loss_sum,
        "aux": balance.step_loss(global_LS),
        "router_counts": split_stats(local_LS)[0],
        "router_dropped": balance.dropped_pairs(local_LS),
    }


def optimizer_tail(
    sharding,
    optimizer,
    train_cfg,
    step: int,
    *,
    lr: float | None = None,
    loss=None,
    pp_group=None,
    params=None,
    replay: ReplayCheck | None = None,
) -> tuple[torch.Tensor, float, bool]:
    """Reduce gradients, clip on the global norm, check they are finite, set the scheduled LR,
    update, zero. With pipeline parallelism (``pp_group``) the norm covers every stage's
    gradients: each stage's squared norm is summed over the pipeline group before clipping
    ``params``. ``loss`` (the global loss, identical on every rank) and the norm are checked
    under ``train.on_nonfinite`` (runtime/nonfinite.py): "stop" raises before the update,
    "skip" drops it. ``replay``: the check of the step's recomputes (primitives/replay_check.py),
    read with the loss and the norm; a recompute that routed unlike its forward raises here,
    before the update. Returns (grad norm, lr, whether the update was applied)."""
    sharding.reduce_grads()
    max_norm = train_cfg.clip_grad if train_cfg.clip_grad > 0 else float("inf")
    if pp_group is None:
        grad_norm = sharding.clip_grad_norm(max_norm)
    else:
        grad_norm = _clip_over_stages(sharding, params, max_norm, pp_group)
    lr = lr_at(step, train_cfg) if lr is None else lr
    applied = check_finite(
        step + 1, 0.0 if loss is None else loss, grad_norm, train_cfg.on_nonfinite, replay
    )
    if applied:
        set_lr(optimizer, lr)
        sharding.step(optimizer)
    sharding.zero_grad(optimizer)
    return grad_norm, lr, applied


def _clip_over_stages(sharding, params, max_norm: float, pp_group) -> torch.Tensor:
    """Norm of all gradients of all stages; scale them by min(1, max_norm / (norm + 1e-6))."""
    from bumblebee.primitives.sharding.common import local

    stage_norm = sharding.clip_grad_norm(
        float("inf")
    )  # this stage's norm (multiplies gradients by 1)
    sq = stage_norm.detach().float().pow(2).reshape(1)
    dist.all_reduce(sq, group=pp_group)
    total = sq.sqrt()[0]
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            local(p.grad).mul_(coef.to(p.grad.dtype))
    return total


class ExpertLoad:
    """The expert counts of the forwards since the last optimizer step, for the ``sigmoid_bias``
    bias update of a caller that runs its own forwards (the RL Engine): [R, E] in the rows of the
    whole model's router stats (``CausalLM.router_rows``; a pipeline stage fills its layers' rows)."""

    def __init__(self, model):
        self.model, self.counts = model, None

    def add(self, counts_RE: torch.Tensor | None) -> None:
        if counts_RE is not None:
            counts_RE = counts_RE.detach().float()
            self.counts = counts_RE if self.counts is None else self.counts + counts_RE

    def add_stats(self, stats_LS: torch.Tensor | None) -> None:
        """One forward's router stats, holding every row (pp = 1)."""
        if stats_LS is not None:
            self.add(split_stats(stats_LS.detach())[0])

    def update_bias(self, rate: float, applied: bool, group, distributed: bool, device) -> None:
        """Sum the counts over ``group`` (every rank that saw other tokens of the step: dp x cp, or
        all ranks under pipeline parallelism), move the biases if the update was ``applied``, and
        start over. Collective when ``distributed`` and the model has MoE layers."""
        rows = self.model.router_row_count()
        counts, self.counts = self.counts, None
        if not rows:
            return
        if counts is None:
            counts = torch.zeros(rows, self.model.arch.num_experts, device=device)
        if distributed:
            dist.all_reduce(counts, group=group)
        if applied:
            self.model.update_router_bias(counts, rate)
