"""Shared-prefix (tree) RL batches: a prompt shared by a group, or a trajectory tree, computed once.

A GRPO group of G samples shares its prompt; agentic rollouts branch off long common prefixes.
Instead of G full sequences, a tree is packed: each shared segment once, each branch after it,
and the model (``primitives/prefix_tree.py``) lets a branch attend to its parent chain's keys
and continue its linear-attention state. Loss and gradients equal those of the G full
sequences (the shared tokens' gradients sum over the branches through autograd) for
G x fewer prefix tokens.

Input: ``Segment`` trees (``pack_tree``), or one prompt and its continuations
(``pack_shared_prefix``). A sample is a root-to-leaf path. Only leaves are trained: a shared
token that several samples train on would need the samples' weights summed per token, which
the sequence-level aggregations do not express (refused).

Layout of one tree in a row (depth first): a segment with children keeps its tokens but the
last, which opens each child's document instead: the model predicts a child's first token from
that token's hidden state, which therefore must be computed once per child (one token per
branch, the price of exact next-token log-probs at every branch point). Position ids continue
along each path, so RoPE and the loss see every sample as in full; a sample's trained tokens
are the only trained tokens of its position-id "sequence", so every loss aggregation
(token-mean, sequence means) counts samples as the unshared batch does. ``seq_index`` names
each leaf's own tokens (``RLBatch.unpack`` returns the trained part of each sample).

Single process so far (cp = 1, pp = 1, row micro-batches): ``check_tree_batch`` says why not
otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from bumblebee.rl.batch import RLBatch

VALUES = ("advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs")


@dataclass
class Segment:
    """A node of a rollout tree: its tokens and children. A leaf (no children) ends a sample:
    ``loss_mask`` (default: every token trained), ``advantages`` (a float or one per token) and
    the token-aligned ``old_logprobs`` / ``ref_logprobs`` / ``rollout_logprobs`` of its tokens.
    A segment with children is shared and never trained."""

    tokens: Sequence[int]
    children: list[Segment] = field(default_factory=list)
    loss_mask: Sequence[bool] | None = None
    advantages: float | Sequence[float] | None = None
    old_logprobs: Sequence[float] | None = None
    ref_logprobs: Sequence[float] | None = None
    rollout_logprobs: Sequence[float] | None = None

    def leaves(self) -> list[list[Segment]]:
        """Root-to-leaf paths, depth first (the samples, in packing order)."""
        if not self.children:
            return [[self]]
        return [[self] + p for c in self.children for p in c.leaves()]


def _check(node: Segment, where: str) -> None:
    n = len(node.tokens)
    if n == 0:
        raise ValueError(f"{where}: a segment needs at least one token")
    if node.children:
        if any(v is not None for v in (node.loss_mask, *(getattr(node, k) for k in VALUES))):
            raise ValueError(
                f"{where}: a shared segment (one with children) is never trained; give loss "
                "masks, advantages and log-probs on the leaves"
            )
        for i, c in enumerate(node.children):
            _check(c, f"{where}.children[{i}]")
        return
    for name in ("loss_mask", "old_logprobs", "ref_logprobs", "rollout_logprobs"):
        v = getattr(node, name)
        if v is not None and len(v) != n:
            raise ValueError(f"{where}: {name} has {len(v)} values for {n} tokens")
    a = node.advantages
    if a is not None and not isinstance(a, (int, float)) and len(a) != n:
        raise ValueError(f"{where}: advantages has {len(a)} values for {n} tokens")


def _token_values(node: Segment) -> dict[str, list]:
    n = len(node.tokens)
    out = {"loss_mask": [True] * n if node.loss_mask is None else [bool(m) for m in node.loss_mask]}
    for name in VALUES:
        v = getattr(node, name)
        out[name] = (
            None
            if v is None
            else [float(v)] * n
            if isinstance(v, (int, float))
            else list(map(float, v))
        )
    return out


def _flatten(root: Segment, first_leaf: int) -> dict[str, list]:
    """One tree as row columns: ids, positions, attach (1 + parent column), mask, leaf index, values."""
    cols = {k: [] for k in ("ids", "pos", "attach", "loss_mask", "seq_index", *VALUES)}
    leaf = [first_leaf]

    def emit(node: Segment, carry: int | None, pos0: int, parent_col: int | None):
        own = list(node.tokens[:-1] if node.children else node.tokens)
        doc = ([] if carry is None else [carry]) + own
        col = len(cols["ids"])
        n, lead = len(doc), 0 if carry is None else 1
        if n:
            cols["ids"] += doc
            cols["pos"] += range(pos0, pos0 + n)
            cols["attach"] += [0 if parent_col is None else parent_col + 1] * n
        if node.children:  # shared: nothing trained
            cols["loss_mask"] += [False] * n
            cols["seq_index"] += [-1] * n
            for name in VALUES:
                cols[name] += [0.0] * n
            here = col if n else parent_col  # an empty root document: its children are roots
            for c in node.children:
                emit(c, node.tokens[-1], pos0 + n, here)
            return
        vals = _token_values(node)
        cols["loss_mask"] += [False] * lead + vals["loss_mask"]
        cols["seq_index"] += [-1] * lead + [leaf[0]] * len(own)
        for name in VALUES:
            cols[name] += [0.0] * lead + (vals[name] or [0.0] * len(own))
        leaf[0] += 1

    emit(root, None, 0, None)
    return cols


def pack_tree(roots: Sequence[Segment], seq_len: int | None = None, pad_id: int = 0) -> RLBatch:
    """Pack rollout trees first-fit, whole, into rows of ``seq_len`` tokens (default: the largest
    tree). Per-token fields no leaf gives stay None."""
    for i, r in enumerate(roots):
        _check(r, f"tree {i}")
    flat, leaf = [], 0
    for r in roots:
        flat.append(_flatten(r, leaf))
        leaf += len(r.leaves())
    seq_len = seq_len or max(len(f["ids"]) for f in flat)
    rows, free = [], []
    for i, f in enumerate(flat):
        n = len(f["ids"])
        if n > seq_len:
            raise ValueError(f"tree {i} packs to {n} tokens, more than seq_len={seq_len}")
        row = next((r for r, room in enumerate(free) if room >= n), None)
        if row is None:
            rows.append([])
            free.append(seq_len)
            row = len(rows) - 1
        rows[row].append(i)
        free[row] -= n
    B = len(rows)
    out = {
        "input_ids": torch.full((B, seq_len), pad_id, dtype=torch.long),
        "position_ids": torch.zeros(B, seq_len, dtype=torch.long),
        "attach": torch.zeros(B, seq_len, dtype=torch.long),
        "loss_mask": torch.zeros(B, seq_len, dtype=torch.bool),
        "seq_index": torch.full((B, seq_len), -1, dtype=torch.long),
    }
    given = [
        k for k in VALUES if any(getattr(p[-1], k) is not None for r in roots for p in r.leaves())
    ]
    out.update({k: torch.zeros(B, seq_len) for k in given})
    for b, members in enumerate(rows):
        at = 0
        for i in members:
            f = flat[i]
            s = slice(at, at + len(f["ids"]))
            out["input_ids"][b, s] = torch.tensor(f["ids"])
            out["position_ids"][b, s] = torch.tensor(f["pos"])
            out["attach"][b, s] = torch.tensor(f["attach"]) + torch.tensor(f["attach"]).gt(0) * at
            out["loss_mask"][b, s] = torch.tensor(f["loss_mask"])
            out["seq_index"][b, s] = torch.tensor(f["seq_index"])
            for k in given:
                out[k][b, s] = torch.tensor(f[k])
            at = s.stop
        out["position_ids"][b, at:] = torch.arange(seq_len - at)  # padding: a pseudo-sequence
    return RLBatch(**out)


def pack_shared_prefix(
    prefix_ids: Sequence[int],
    continuations: Sequence[Sequence[int]],
    seq_len: int | None = None,
    **per_branch,
) -> RLBatch:
    """One group: a prompt ``prefix_ids`` and its G continuations (trained whole unless
    ``loss_mask`` is given). ``per_branch``: ``loss_mask``, ``advantages``, ``old_logprobs``,
    ``ref_logprobs``, ``rollout_logprobs``, each one entry per continuation (``Segment``'s)."""
    leaves = [
        Segment(list(c), **{k: v[i] for k, v in per_branch.items()})
        for i, c in enumerate(continuations)
    ]
    return pack_tree([Segment(list(prefix_ids), leaves)], seq_len)


def unshared(roots: Sequence[Segment]) -> list[dict]:
    """Each sample of the trees in full: ``tokens``, ``loss_mask`` and the token-aligned values
    (shared tokens untrained, zeros): what ``pack_sequences`` takes, for the reference run."""
    out = []
    for r in roots:
        for path in r.leaves():
            lead = sum(len(s.tokens) for s in path[:-1])
            vals = _token_values(path[-1])
            sample = {
                "tokens": [t for s in path for t in s.tokens],
                "loss_mask": [False] * lead + vals["loss_mask"],
            }
            for k in VALUES:
                sample[k] = None if vals[k] is None else [0.0] * lead + vals[k]
            out.append(sample)
    return out


def check_tree_batch(batch: RLBatch, *, budget: int | None, cp: int, pp: int) -> None:
    """A tree batch runs on one process's layout so far: whole rows (no token-budget repacking,
    which would cut a tree), no context parallelism (the CP layout would have to carry the tree
    to every rank), no pipeline stages (the stage schedule does not pass the layout yet)."""
    if batch.attach is None:
        return
    for what, bad in (
        ("max_tokens_per_micro_batch", budget is not None),
        ("parallel.cp > 1", cp > 1),
        ("parallel.pp > 1", pp > 1),
    ):
        if bad:
            raise ValueError(f"a shared-prefix (tree) batch cannot run with {what} yet")
