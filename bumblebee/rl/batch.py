"""RL batches: packed variable-length sequences with loss masks, advantages and log-probs.

A rollout batch is a list of sequences (prompt + response) of different lengths,
packed back to back into rows of ``seq_len`` tokens as in ``data/packing.py``:
``position_ids`` restart at 0 at every sequence, which is what separates them for
attention; the tail of a row is a padding pseudo-sequence.

Alignment: every per-token tensor is aligned to ``input_ids``. ``x[b, t]`` concerns
the token ``input_ids[b, t]``: its log-probability given its prefix *within its
sequence*, whether the update trains on it (``loss_mask``: response tokens), its
advantage, and its log-probability under the behaviour (old) and reference
policies. A sequence's first token has no prefix: its log-prob is 0 and it is
never trained. This is the convention ``Engine.compute_logprobs`` returns.

The model predicts token ``t + 1`` at position ``t``; ``shift_left`` moves token-aligned
values to those prediction positions and ``shift_right`` brings results back.
``prediction_view`` is what the Engine computes on: targets (next-token ids, -100 where
nothing is trained), aggregation weights of the whole batch, and the per-token inputs,
all at prediction positions.

Legend: B rows, T tokens per row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from bumblebee.rl.losses import aggregation_weights

IGNORE = -100
OPTIONAL = (
    "advantages",
    "old_logprobs",
    "ref_logprobs",
    "rollout_logprobs",
)  # per-token loss inputs
# what a loss sees per token: OPTIONAL, then values prediction_view derives from the whole batch
LOSS_INPUTS = OPTIONAL + ("rollout_seq_log_ratio",)
INTEGER_FIELDS = ("input_ids", "position_ids", "seq_index", "routing", "attach")


def _first(where_BT: torch.Tensor) -> tuple[int, ...]:
    """The first (row, column) index where ``where_BT`` holds."""
    return tuple(int(i) for i in where_BT.nonzero()[0])


@dataclass
class RLBatch:
    input_ids: torch.Tensor  # [B, T] int64
    position_ids: torch.Tensor  # [B, T] int64, restart at 0 per sequence
    loss_mask: torch.Tensor  # [B, T] bool: tokens the update trains on
    advantages: torch.Tensor | None = None  # [B, T] float32
    old_logprobs: torch.Tensor | None = None  # [B, T] float32, behaviour policy
    ref_logprobs: torch.Tensor | None = None  # [B, T] float32, reference policy (KL penalty)
    # [B, T] float32: the rollout engine's log-probs of its sampled tokens (off-policy correction)
    rollout_logprobs: torch.Tensor | None = None
    seq_index: torch.Tensor | None = None  # [B, T] int64: packed sequence index, -1 on padding
    # [B, T, L, K] int64: the experts each token was routed to in each MoE layer (L MoE layers in order,
    # K per token), from a rollout engine or compute_logprobs(return_routing=True); replayed when given
    routing: torch.Tensor | None = None
    # [B, T] int64: a shared-prefix tree (rl/shared_prefix.py): 1 + the column where the parent of
    # the token's document starts (it attends to / continues that document's chain), 0 for none
    attach: torch.Tensor | None = None

    def __post_init__(self):
        if self.input_ids.dim() != 2:
            raise ValueError(
                f"input_ids must be [rows, seq_len], got shape {tuple(self.input_ids.shape)}"
            )
        shape = self.input_ids.shape
        for f in dataclasses.fields(self):
            t = getattr(self, f.name)
            if f.name == "routing" and t is not None and (t.dim() != 4 or t.shape[:2] != shape):
                raise ValueError(
                    f"RLBatch.routing has shape {tuple(t.shape)}, expected [{shape[0]}, {shape[1]}, "
                    "MoE layers, experts per token] (aligned to input_ids)"
                )
            if t is not None and f.name != "routing" and t.shape != shape:
                raise ValueError(
                    f"RLBatch.{f.name} has shape {tuple(t.shape)}, expected {tuple(shape)} "
                    "(every per-token tensor is aligned to input_ids)"
                )
        for name in INTEGER_FIELDS:
            t = getattr(self, name)
            if t is not None and (t.dtype.is_floating_point or t.dtype.is_complex):
                raise TypeError(
                    f"RLBatch.{name} must be an integer tensor, got {t.dtype} "
                    "(float ids would be truncated)"
                )
        if self.position_ids.numel() and int(self.position_ids.min()) < 0:
            at = _first(self.position_ids < 0)
            raise ValueError(f"RLBatch.position_ids must be >= 0, got a negative value at {at}")
        self.loss_mask = self.loss_mask.bool()
        for name in OPTIONAL:
            t = getattr(self, name)
            # only where the update reads them: a log-prob of -inf at an untrained token is harmless
            if t is not None and t.numel() and not bool(torch.isfinite(t[self.loss_mask]).all()):
                at = _first(~torch.isfinite(t) & self.loss_mask)
                raise ValueError(
                    f"RLBatch.{name} is not finite at trained token {at} (value {float(t[at])}): "
                    "the loss of the step would be NaN / inf"
                )

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    def replace(self, **changes) -> RLBatch:
        return dataclasses.replace(self, **changes)

    def select_rows(self, start: int, stop: int) -> RLBatch:
        return RLBatch(
            **{
                f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[start:stop]
                for f in dataclasses.fields(self)
            }
        )

    def unpack(self, values_BT: torch.Tensor) -> list[torch.Tensor]:
        """Per-sequence slices of a token-aligned tensor, in packing order (needs ``seq_index``)."""
        if self.seq_index is None:
            raise ValueError("unpack needs seq_index (batches from pack_sequences have it)")
        n = int(self.seq_index.max()) + 1 if self.seq_index.numel() else 0
        return [values_BT[self.seq_index == i] for i in range(n)]


def pack_sequences(
    tokens: Sequence[Sequence[int]],
    loss_masks: Sequence[Sequence[bool]],
    seq_len: int,
    *,
    advantages=None,
    old_logprobs=None,
    ref_logprobs=None,
    rollout_logprobs=None,
    pad_id: int = 0,
) -> RLBatch:
    """Pack sequences first-fit, in order, into rows of ``seq_len`` tokens.
    ``advantages``: one float per sequence (broadcast over its tokens) or one list per
    sequence; ``old_logprobs`` / ``ref_logprobs`` / ``rollout_logprobs``: one list per
    sequence (token-aligned)."""
    n = len(tokens)
    if n == 0:
        raise ValueError("pack_sequences needs at least one sequence, got none")
    if len(loss_masks) != n:
        raise ValueError(f"{n} sequences but {len(loss_masks)} loss masks")
    for i, (t, m) in enumerate(zip(tokens, loss_masks)):
        if not 0 < len(t) <= seq_len or len(m) != len(t):
            raise ValueError(
                f"sequence {i}: length {len(t)} (mask {len(m)}) must be in 1..seq_len={seq_len}"
            )
    given = {
        "advantages": advantages,
        "old_logprobs": old_logprobs,
        "ref_logprobs": ref_logprobs,
        "rollout_logprobs": rollout_logprobs,
    }
    for name, values in given.items():
        if values is not None:
            _check_per_sequence(name, values, tokens, scalar_ok=name == "advantages")
    rows: list[list[int]] = []  # sequence indices per row
    free: list[int] = []
    for i, t in enumerate(tokens):
        row = next((r for r, f in enumerate(free) if f >= len(t)), None)
        if row is None:
            rows.append([])
            free.append(seq_len)
            row = len(rows) - 1
        rows[row].append(i)
        free[row] -= len(t)
    B = len(rows)
    ids = torch.full((B, seq_len), pad_id, dtype=torch.long)
    pos = torch.zeros(B, seq_len, dtype=torch.long)
    mask = torch.zeros(B, seq_len, dtype=torch.bool)
    index = torch.full((B, seq_len), -1, dtype=torch.long)
    fields = given
    out = {k: None if v is None else torch.zeros(B, seq_len) for k, v in fields.items()}
    for b, members in enumerate(rows):
        at = 0
        for i in members:
            L = len(tokens[i])
            s = slice(at, at + L)
            seq = torch.as_tensor(tokens[i])
            if seq.dtype.is_floating_point or seq.dtype.is_complex or seq.dtype == torch.bool:
                raise TypeError(
                    f"sequence {i}: token ids must be integers, got {seq.dtype} "
                    "(float ids would be truncated)"
                )
            ids[b, s] = seq.long()
            pos[b, s] = torch.arange(L)
            mask[b, s] = torch.as_tensor(loss_masks[i], dtype=torch.bool)
            index[b, s] = i
            for k, v in fields.items():
                if v is not None:
                    out[k][b, s] = torch.as_tensor(v[i], dtype=torch.float32)  # a float broadcasts
            at += L
        pos[b, at:] = torch.arange(seq_len - at)  # padding: its own pseudo-sequence
    return RLBatch(ids, pos, mask, seq_index=index, **out)


def _check_per_sequence(name: str, values, tokens, *, scalar_ok: bool) -> None:
    """``values``: one entry per sequence, each a list as long as the sequence (or, with
    ``scalar_ok``, one number broadcast over it)."""
    if len(values) != len(tokens):
        raise ValueError(f"{name}: {len(values)} entries for {len(tokens)} sequences")
    for i, v in enumerate(values):
        if torch.is_tensor(v):
            n = v.numel() if v.dim() else None
        else:
            n = len(v) if hasattr(v, "__len__") else None
        if n is None:
            if not scalar_ok:
                raise ValueError(
                    f"{name}[{i}]: one value per token expected ({len(tokens[i])}), got a number"
                )
        elif n != len(tokens[i]):
            raise ValueError(
                f"{name}[{i}] has {n} values for a sequence of {len(tokens[i])} tokens"
            )


# ------------------------------------------------------------------------------ alignment helpers
def has_prefix(position_ids_BT: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: the token continues a sequence (it has a predecessor in it)."""
    out = torch.zeros_like(position_ids_BT, dtype=torch.bool)
    out[:, 1:] = position_ids_BT[:, 1:] == position_ids_BT[:, :-1] + 1
    return out


def sequence_ids(position_ids_BT: torch.Tensor) -> torch.Tensor:
    """[B, T] int64, equal exactly within one packed sequence (distinct across rows)."""
    B, T = position_ids_BT.shape
    starts = ~has_prefix(position_ids_BT)
    return (
        torch.cumsum(starts.long(), dim=1) - 1 + torch.arange(B, device=starts.device)[:, None] * T
    )


def shift_left(x_BT: torch.Tensor, fill=0) -> torch.Tensor:
    """Token-aligned -> prediction positions: ``out[:, t] = x[:, t + 1]``."""
    out = torch.full_like(x_BT, fill)
    out[:, :-1] = x_BT[:, 1:]
    return out


def shift_right(x_BT: torch.Tensor, fill=0) -> torch.Tensor:
    """Prediction positions -> token-aligned: ``out[:, t] = x[:, t - 1]``."""
    out = torch.full_like(x_BT, fill)
    out[:, 1:] = x_BT[:, :-1]
    return out


def trained_tokens(batch: RLBatch) -> torch.Tensor:
    """[B, T] bool: the tokens an update trains on (masked and with a prefix)."""
    return batch.loss_mask & has_prefix(batch.position_ids)


def prediction_view(
    batch: RLBatch,
    agg: str | None,
    totals: torch.Tensor | None = None,
    *,
    all_targets: bool = False,
) -> dict[str, torch.Tensor]:
    """Batch -> [B, T] tensors at prediction positions. ``agg``: the training view (targets
    only where trained, ``mask`` of trained tokens, aggregation weights); None: every token
    with a prefix. ``totals``: the aggregation denominators of the whole global batch when
    ``batch`` is one rank's part of it (``losses.aggregation_totals``, summed over ranks).
    ``all_targets``: targets at every token with a prefix even with ``agg`` (a forward-only
    pass that scores the loss and returns every log-prob)."""
    prefix = has_prefix(batch.position_ids)
    trained = batch.loss_mask & prefix if agg else prefix
    targeted = prefix if all_targets else trained
    out = {
        "input_ids": batch.input_ids,
        "position_ids": batch.position_ids,
        "targets": shift_left(torch.where(targeted, batch.input_ids, IGNORE), IGNORE),
    }
    if batch.routing is not None:  # the experts of the token at each position: not shifted
        out["routing"] = batch.routing
    if batch.attach is not None:  # the document tree: a property of the columns, not shifted
        out["attach"] = batch.attach
    if agg:
        out["mask"] = shift_left(trained, False)
        out["weights"] = shift_left(
            aggregation_weights(trained, sequence_ids(batch.position_ids), agg, totals=totals)
        )
        for name in OPTIONAL:
            t = getattr(batch, name)
            if t is not None:  # zero off the mask: garbage there must not reach the loss
                out[name] = shift_left(torch.where(trained, t.float(), 0.0))
        if batch.old_logprobs is not None and batch.rollout_logprobs is not None:
            # summed over whole sequences here, before micro-batches and CP shards split them
            log_ratio = torch.where(trained, batch.old_logprobs - batch.rollout_logprobs, 0.0)
            seq_sum = sequence_sums(log_ratio.float(), sequence_ids(batch.position_ids))
            out["rollout_seq_log_ratio"] = shift_left(torch.where(trained, seq_sum, 0.0))
    return out


def sequence_sums(x_BT: torch.Tensor, seq_ids_BT: torch.Tensor) -> torch.Tensor:
    """[B, T]: at every token, the sum of ``x`` over the tokens of its sequence."""
    _, inverse = torch.unique(seq_ids_BT.reshape(-1), return_inverse=True)
    sums = torch.zeros(int(inverse.max()) + 1 if inverse.numel() else 0, device=x_BT.device)
    sums.scatter_add_(0, inverse, x_BT.reshape(-1))
    return sums[inverse].view_as(x_BT)


def pad_batch(batch: RLBatch, rows: int, cols: int) -> RLBatch:
    """Widen to ``rows`` x ``cols`` with padding: empty rows (one padding sequence each) and
    columns that restart their own padding sequence; nothing there is trained."""
    B, T = batch.input_ids.shape
    if (rows, cols) == (B, T):
        return batch
    fields = {}
    for f in dataclasses.fields(batch):
        v = getattr(batch, f.name)
        if v is not None:
            x = torch.full(
                (rows, cols, *v.shape[2:]),
                -1 if f.name == "seq_index" else 0,
                dtype=v.dtype,
                device=v.device,
            )
            x[:B, :T] = v
            fields[f.name] = x
    pos = fields["position_ids"]
    pos[B:] = torch.arange(cols, device=pos.device)
    pos[:B, T:] = torch.arange(cols - T, device=pos.device)
    return RLBatch(**fields)


def gather_tokens(batch: RLBatch, index: torch.Tensor) -> RLBatch:
    """One row holding the tokens at flat positions ``index`` of ``batch`` (whole sequences)."""
    fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    return RLBatch(
        **{
            k: None if v is None else v.reshape(-1, *v.shape[2:])[index][None]
            for k, v in fields.items()
        }
    )
