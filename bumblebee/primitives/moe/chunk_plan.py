"""Chunk sizes for chunked EP overlap (``moe_comm = chunked``): a timeline of its schedule and the
chunk count and weights that minimize a layer's time.

``chunked.py`` splits a layer's local tokens into k chunks and runs (per phase, one communication
stream beside the compute stream, each in issue order):

  forward    comm: dispatch 0..k-1 (all issued first), then combine i once GEMM i is done
             compute: GEMM i once dispatch i has arrived
  recompute  comm: dispatch 0..k-1; compute: fc1 of chunk i once dispatch i has arrived (no fc2,
             no combine: the recompute's output is discarded)
  backward   comm: combine-backward 0..k-1 (all issued first), then dispatch-backward i once
             dgrad i is done; compute: dgrad i once combine-backward i has arrived, then the
             weight gradients of every chunk

With chunk i carrying fraction f_i of the tokens (and so of the routed rows), each transfer and
GEMM of chunk i takes f_i of the phase's whole. Dispatch of chunk 0 and combine of chunk k-1
have nothing to hide under; with even chunks each is 1/k of the phase's transfers. Where the
GEMMs outlast the transfers, a smaller first and last chunk shrinks that exposed part; where the
transfers outlast the GEMMs, the communication stream bounds the phase whatever the split.

Skewed routing makes the busiest rank's GEMMs and transfers longer alike (it receives and sends
back ``skew`` x the balanced rows), so it scales a phase rather than changing its shape; it
changes the best chunk count through ``per_chunk_s``, the fixed cost every chunk adds (a count
exchange slot, launches, collective latency).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

COUNTS = (2, 3, 4)


@dataclass(frozen=True)
class PhaseTimes:
    """Seconds of one MoE layer's phase on the busiest rank, unchunked."""

    dispatch: float  # all-to-all of the routed rows to the experts
    gemm: float  # expert GEMMs that wait for the dispatch (forward: fc1 + fc2; backward: dgrad)
    combine: float  # all-to-all back home (forward); 0 in the recompute
    after: float = 0.0  # compute after the last chunk (backward: the weight gradients)


def forward_end(f, p: PhaseTimes) -> float:
    """The forward (and, with ``combine = 0``, the recompute) phase's end."""
    comm = 0.0
    arrived = []
    for x in f:
        comm += x * p.dispatch
        arrived.append(comm)
    done = 0.0
    for x, t in zip(f, arrived):
        done = max(done, t) + x * p.gemm
        if p.combine:
            comm = max(comm, done) + x * p.combine
    return max(done, comm) + p.after


def backward_end(f, p: PhaseTimes) -> float:
    """The backward: ``combine`` is the combine-backward (sent first), ``dispatch`` the
    dispatch-backward after each dgrad, ``after`` the weight gradients."""
    comm = 0.0
    arrived = []
    for x in f:
        comm += x * p.combine
        arrived.append(comm)
    done = 0.0
    for x, t in zip(f, arrived):
        done = max(done, t) + x * p.gemm
        comm = max(comm, done) + x * p.dispatch
    return max(done + p.after, comm)


@dataclass(frozen=True)
class ChunkPlan:
    weights: tuple[float, ...]
    seconds: float  # the phases' ends summed, per-chunk costs included
    exposed: float  # of which communication nothing hid


def evaluate(f, phases: list[tuple[str, PhaseTimes]], per_chunk_s: float = 0.0) -> ChunkPlan:
    total = compute = 0.0
    for kind, p in phases:
        total += (backward_end if kind == "backward" else forward_end)(f, p)
        compute += p.gemm + p.after
    total += len(f) * per_chunk_s * len(phases)
    return ChunkPlan(tuple(f), total, total - compute)


def even(k: int) -> tuple[float, ...]:
    return (1.0 / k,) * k


def best(
    phases: list[tuple[str, PhaseTimes]],
    per_chunk_s: float = 0.0,
    counts=COUNTS,
    steps: int = 20,
) -> ChunkPlan:
    """The chunk weights (multiples of 1/``steps``, each > 0) and count with the shortest
    timeline; even chunks win ties."""
    out = None
    for k in counts:
        cands = [even(k)] + [
            tuple((b - a) / steps for a, b in zip((0, *cut), (*cut, steps)))
            for cut in itertools.combinations(range(1, steps), k - 1)
        ]
        for f in cands:
            plan = evaluate(f, phases, per_chunk_s)
            if out is None or plan.seconds < out.seconds - 1e-12:
                out = plan
    return out


def token_bounds(T: int, weights) -> list[tuple[int, int]]:
    """[lo, hi) of each chunk: ``weights`` (normalized) of ``T`` tokens, rounded so that the
    bounds are non-decreasing and cover every token (a chunk may be empty)."""
    total = float(sum(weights))
    bounds, acc = [0], 0.0
    for w in weights[:-1]:
        acc += w
        bounds.append(min(T, max(bounds[-1], round(T * acc / total))))
    bounds.append(T)
    return list(zip(bounds[:-1], bounds[1:]))


def chunk_bounds(T: int, k: int, weights=None) -> list[tuple[int, int]]:
    """[lo, hi) of each of ``k`` chunks of ``T`` tokens: ``token_bounds`` of ``weights``, or, without
    weights, an even split (the first ``T % k`` chunks one token longer)."""
    if weights is not None:
        return token_bounds(T, weights)
    sizes = [T // k + (i < T % k) for i in range(k)]
    starts = [sum(sizes[:i]) for i in range(k)]
    return [(s, s + n) for s, n in zip(starts, sizes)]
