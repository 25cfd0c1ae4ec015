"""Micro-batches of one rank's RL batch: by rows, or by a token budget; the same count on every dp rank.

The Engine computes on ``prediction_view`` tensors ([B, T] at prediction positions, rl/batch.py)
and splits them into micro-batches in one of two ways:

- rows (``train.micro_batch`` rows each): consecutive rows, as the trainer does;
- a token budget (``max_tokens_per_micro_batch``): the packed sequences are taken out of their
  rows and repacked, whole, into micro-batches of one row of at most that many tokens, so a
  micro-batch's cost follows its real tokens rather than the row padding. A sequence longer
  than the budget is an error (it cannot be split: attention needs all of it).

Every dp rank must run the same number of forwards (FSDP all-gathers, EP all-to-alls and
the gradient reduce-scatter are collectives), so the count is exchanged: each rank asks
first-fit-decreasing how many micro-batches its sequences need, the maximum over dp ranks
is used everywhere, and each rank spreads its sequences over that many micro-batches longest
first onto the least-loaded one (LPT, Graham 1969), which evens the tokens per micro-batch.
A rank with fewer rows than the others gets empty micro-batches (one padding token sequence,
no trained token). ``assign_to_ranks`` spreads a global batch's sequences over dp ranks the same
way (balanced token counts per rank).

Every micro-batch carries ``index``: for each of its positions the flat position in the rank's
[B, T] it came from (-1: padding), so per-token results go back in place (``scatter_back``).

Legend: B rows, T tokens per row, S sequences (spans).
"""

from __future__ import annotations

import torch

IGNORE = -100


def spans(
    position_ids_BT: torch.Tensor, seq_index_BT: torch.Tensor | None = None
) -> list[tuple[int, int]]:
    """(flat start, length) of every packed sequence in [B, T] (position ids restart at 0 at each,
    and a row's first token always starts one). With ``seq_index`` (-1 on padding), the padding
    pseudo-sequences at the end of rows are dropped."""
    B, T = position_ids_BT.shape
    starts_BT = torch.ones_like(position_ids_BT, dtype=torch.bool)
    starts_BT[:, 1:] = position_ids_BT[:, 1:] != position_ids_BT[:, :-1] + 1
    starts = starts_BT.reshape(-1).nonzero().flatten()
    ends = torch.cat([starts[1:], torch.tensor([B * T], device=starts.device)])
    out = list(zip(starts.tolist(), (ends - starts).tolist()))
    if seq_index_BT is not None:
        flat = seq_index_BT.reshape(-1)
        out = [(s, n) for s, n in out if bool((flat[s : s + n] >= 0).any())]
    return out


def ffd_bins(lengths: list[int], budget: int) -> int:
    """How many bins of ``budget`` first-fit-decreasing needs for ``lengths``."""
    free: list[int] = []
    for n in sorted(lengths, reverse=True):
        for i, f in enumerate(free):
            if f >= n:
                free[i] -= n
                break
        else:
            free.append(budget - n)
    return len(free)


def lpt(lengths: list[int], bins: int, budget: float = float("inf")) -> list[list[int]] | None:
    """Indices of ``lengths`` spread over ``bins`` bins, longest first onto the least-loaded one
    (ties: the lowest bin); each bin's indices in increasing order. None if a bin would exceed
    ``budget``."""
    load, out = [0] * bins, [[] for _ in range(bins)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        b = min(range(bins), key=lambda b: (load[b], b))
        if load[b] + lengths[i] > budget:
            return None
        load[b] += lengths[i]
        out[b].append(i)
    return [sorted(b) for b in out]


def token_bins(lengths: list[int], budget: int, count: int) -> list[list[int]]:
    """Sequences per micro-batch: ``count`` micro-batches (>= what FFD needs), balanced by LPT,
    falling back to first-fit-decreasing (plus empty bins) when LPT would overflow the budget."""
    balanced = lpt(lengths, count, budget)
    if balanced is not None:
        return balanced
    bins: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, f in enumerate(free):
            if f >= lengths[i]:
                free[b] -= lengths[i]
                bins[b].append(i)
                break
        else:
            bins.append([i])
            free.append(budget - lengths[i])
    return [sorted(b) for b in bins] + [[] for _ in range(count - len(bins))]


def check_budget(lengths: list[int], budget: int) -> None:
    longest = max(lengths, default=0)
    if longest > budget:
        raise ValueError(
            f"a sequence of {longest} tokens does not fit max_tokens_per_micro_batch={budget} "
            "(sequences are never split across micro-batches)"
        )


def assign_to_ranks(lengths: list[int], ranks: int) -> list[list[int]]:
    """Sequences of a global batch per dp rank, balanced on token count (LPT)."""
    return lpt(lengths, ranks)


# ------------------------------------------------------------------------------ building micro-batches
def row_micro_batches(P: dict[str, torch.Tensor], micro: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive rows of ``micro``; ``index`` = flat positions in [B, T]."""
    B, T = P["input_ids"].shape
    index = torch.arange(B * T, device=P["input_ids"].device).view(B, T)
    return [
        {**{k: v[i : i + micro] for k, v in P.items()}, "index": index[i : i + micro]}
        for i in range(0, B, micro)
    ]


def token_micro_batches(
    P: dict[str, torch.Tensor], spans_: list[tuple[int, int]], bins: list[list[int]]
) -> list[dict[str, torch.Tensor]]:
    """One row per bin: its sequences back to back (an empty bin: a one-token padding row)."""
    device = P["input_ids"].device
    out = []
    for members in bins:
        if not members:
            out.append(empty_micro_batch(P, 1))
            continue
        index = torch.cat(
            [
                torch.arange(spans_[i][0], spans_[i][0] + spans_[i][1], device=device)
                for i in members
            ]
        )
        out.append(
            {
                **{k: v.reshape(-1, *v.shape[2:])[index][None] for k, v in P.items()},
                "index": index[None],
            }
        )
    return out


def empty_micro_batch(P: dict[str, torch.Tensor], width: int) -> dict[str, torch.Tensor]:
    """One row of ``width`` padding tokens: nothing trained, nothing returned."""
    device = P["input_ids"].device
    mb = {
        k: torch.full(
            (1, width, *v.shape[2:]), IGNORE if k == "targets" else 0, dtype=v.dtype, device=device
        )
        for k, v in P.items()
    }
    mb["position_ids"] = torch.arange(width, device=device)[None]
    mb["index"] = torch.full((1, width), -1, dtype=torch.long, device=device)
    return mb


def pad_columns(mb: dict[str, torch.Tensor], multiple: int) -> dict[str, torch.Tensor]:
    """Widen to a multiple of ``multiple`` columns with a padding sequence of its own (CP needs
    2 x cp equal chunks): position ids restart at 0, no target, index -1."""
    b, T = mb["input_ids"].shape
    cols = -(-T // multiple) * multiple
    if cols == T:
        return mb
    out = {}
    for k, v in mb.items():
        x = torch.full(
            (b, cols, *v.shape[2:]),
            IGNORE if k == "targets" else (-1 if k == "index" else 0),
            dtype=v.dtype,
            device=v.device,
        )
        x[:, :T] = v
        out[k] = x
    out["position_ids"][:, T:] = torch.arange(cols - T, device=v.device)
    return out


def scatter_back(values: list[torch.Tensor], indices: list[torch.Tensor], shape) -> torch.Tensor:
    """Per-micro-batch results [b, w, ...] -> [B, T, ...] at their ``index`` positions (0 elsewhere)."""
    extra = tuple(values[0].shape[2:])
    out = torch.zeros(shape[0] * shape[1], *extra, dtype=values[0].dtype, device=values[0].device)
    for v, index in zip(values, indices):
        keep = index >= 0
        out[index[keep]] = v[keep]
    return out.view(*shape, *extra)
