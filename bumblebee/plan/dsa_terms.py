"""DeepSeek Sparse Attention's planner terms: the bytes a DSA layer holds and moves, from its code
(``primitives/attention/dsa.py``, ``dsa_cp.py``, ``sparse_mla.py``).

Memory (``dsa_bytes``): per local token, what the layer keeps between its core's forward and
backward, and one query block's transients (a fixed amount: ``primitives.dsa_block`` queries
against the S keys of the row). The selection's buffer is ``block x S`` fp32 twice (the running
head sum and one head's products: the indexer heads are summed one at a time) plus two
``block x S`` bool masks, never ``[block, Hi, S]``.

Communication under CP (``dsa_cp_traffic``): the indexer keys are all-gathered ((cp - 1) x t x Di
bf16 received per pass), then each rank fetches the union of the latent rows its queries
selected from their owners (C + R bf16 per row, and a 4 B row id sent per row asked). The union
is data: the planner takes its largest value, every key the rank's queries may see
(``DSA_UNION`` = 1: (cp - 1) x t remote rows), what the dry run assumes too
(``dsa_cp.assume_every_key``); a trained indexer's locality makes it smaller (skills/models/
dsa.md: the fraction measured on random weights). Backward returns the same volumes (the
indexer keys' gradients by a reduce-scatter, the fetched rows' by the reverse all-to-all). Not a
ring: the fetch follows the selection and precedes the attention, so nothing hides it.
"""

from __future__ import annotations

from typing import NamedTuple

from bumblebee.plan.layout import Layout
from bumblebee.plan.memory import BF16, FP32
from bumblebee.plan.spec import ModelSpec

DSA_UNION = 1.0  # fraction of the visible remote keys a rank fetches (the most: an all-gather's)
COLLECTIVES = 4  # per forward pass: indexer-key all-gather, counts, row ids, rows
DENSE_FWD, DENSE_BWD = 29, 30  # bytes x block x S of a dense warm-up block (dsa_bytes)


def dsa_cp_traffic(spec: ModelSpec, lay: Layout, t: int, union: float = DSA_UNION) -> dict:
    """Bytes one rank receives per DSA layer and pass with ``t`` local tokens: ``forward`` (indexer
    keys + fetched rows + their ids), ``backward`` (the gradients of both), beside what the
    other CP schemes would move for the same layer: ``allgather`` (latents + indexer keys,
    forward) and ``latent_ring`` (MLA's ring of latents, ``ring_latent.py``: C + R per token
    and hop, forward). Zero without CP or DSA."""
    if lay.cp == 1 or not spec.dsa_topk:
        return dict.fromkeys(("forward", "backward", "allgather", "latent_ring"), 0.0)
    remote = (lay.cp - 1) * t
    lat, di = spec.mla_kv_rank + spec.mla_rope_dim, spec.dsa_dim
    rows = union * remote
    return {
        "forward": remote * di * BF16 + rows * (lat * BF16 + 4),
        "backward": remote * di * BF16 + rows * lat * BF16,
        "allgather": remote * (lat + di) * BF16,
        "latent_ring": remote * lat * BF16,
    }


class DSABytes(NamedTuple):
    """A DSA layer's memory terms (bytes; ``dsa_bytes``)."""

    kept: float  # per local token, kept by the core between its forward and backward
    fwd_block: float  # one query block's transients in forward
    bwd_saved: float  # per token, the mixer's tensors its core's backward reads (recomputed: full)
    bwd_grads: float  # per token, the core's input gradients in flight in its backward
    bwd_block: float  # one query block's transients at its backward's peak
    why: str


def dsa_bytes(spec: ModelSpec, lay: Layout, t: int, block: int, dense: bool = False) -> DSABytes:
    """A DSA layer's memory from its code (``primitives/attention/sparse_mla.py``, ``dsa.py``,
    ``dsa_cp.py``; bf16 compute), ``t`` local tokens, ``block`` queries per block, S = t x cp keys.

    Forward: kept per token, the indexer's q [Hi x Di], key [Di] and fp32 head weights [Hi], the
    absorbed queries [N x (C + R)] and latent outputs [N x C] (bf16), the row's latents + indexer
    keys (cp x (C + R + Di): all-gathered indexer keys and, at ``DSA_UNION``, as many fetched
    latent rows), and under CP the selection as int32 slots [K]. One block: the selection (two
    fp32 and two bool [block, S]), the gathered latents and indexer keys [block, K, C + R + Di]
    bf16, fp32 scores and probabilities [block, N, K].

    Backward (the dry run's live set at the peak of a block's backward, by tensor): the mixer's
    tensors the core's backward reads (absorbed q [N x (C + R)], q [N x (nope + rope)], the q
    latent and its norm [q_rank] fp32 + 2 bf16, the kv latent likewise [C], the indexer's q twice
    (projected, roped), its keys three times and its fp32 weights twice, the row's latents, under
    CP the int32 slots), the core's input gradients (absorbed q, latent outputs [N x C], the
    row's latents and indexer keys), and one block at the largest of three moments of its backward
    (below: its recomputed gathered latents, their gradients, the probabilities). The selection
    is gone by then (a local of the recompute at cp = 1; outside the block under CP), and the
    indexer's fp32 [block, Hi, K] products are freed first (its backward runs before the main
    attention's).

    ``dense`` (``primitives.dsa_stage = "dense_warmup"``): every allowed key, the latents
    all-gathered under CP (no slots), and a block of [block, S] buffers only, the heads of both
    the indexer and the main attention taken one at a time (``dsa.IndexScores``,
    ``_attend_dense``): forward the selection mask, the indexer's running sum and one head's
    products, one main head's scores / masked scores / probabilities (fp32) and their bf16
    casts, the heads' mean and the KL's log-softmax and target terms, 29 B x block x S
    (MemoryTracker, three dim sets: 29.0), beside the block's latent output [block, N, C] bf16;
    backward (the recompute and the indexer's gradient, head by head) 30 B x block x S beside
    the same output (measured 30.0)."""
    if not spec.dsa_topk:
        return DSABytes(0.0, 0.0, 0.0, 0.0, 0.0, "")
    n, c, r = spec.n_heads / lay.tp, spec.mla_kv_rank, spec.mla_rope_dim
    hi, di, S = spec.dsa_heads, spec.dsa_dim, t * lay.cp
    k = min(spec.dsa_topk, S)
    slots = k * 4 if lay.cp > 1 and not dense else 0.0
    row = lay.cp * (c + r + di) * BF16  # the row's latents and indexer keys (gathered / fetched)
    kept = (hi * di + di + n * (2 * c + r)) * BF16 + hi * FP32 + row + slots
    select = block * S * (2 * FP32 + 2)
    one = select + block * k * (c + r + di) * BF16 + block * n * k * 2 * FP32
    q_lat = (FP32 + 2 * BF16) * (spec.mla_q_rank + c)
    bwd_saved = (
        n * (c + r + spec.head_dim) * BF16
        + q_lat
        + (2 * hi * di + 3 * di + c + r) * BF16
        + 2 * hi * FP32
        + slots
    )
    bwd_grads = n * (2 * c + r) * BF16 + row
    # the peak is one of three moments of the block's backward, each holding the recomputed
    # gathered latents and the gathered indexer keys' gradient [block, K, Di], and: (a) after the
    # value product's backward, the latents' [.., :C] gradient and its copy padded to full width,
    # the probabilities fp32 and bf16 (the largest at DeepSeek-V3.2's dims); (b) in softmax's
    # backward, the padded gradient and three fp32 [block, N, K] (probabilities, their gradient,
    # the scores'; many heads, small latents); (c) after the score product's, both full-width
    # latent gradients, the bf16 probabilities and the block's q gradients (few heads)
    qk, qnk, lat = block * k, block * n * k, c + r
    bwd = max(
        qk * (2 * lat + c + di) * BF16 + qnk * (FP32 + BF16),
        qk * (2 * lat + di) * BF16 + qnk * 3 * FP32,
        qk * (3 * lat + di) * BF16 + qnk * BF16 + block * (n * lat + hi * di) * BF16,
    )
    if dense:  # [block, S] buffers, no head factor (docstring)
        select = block * S * DENSE_FWD
        one, bwd = select + block * n * c * BF16, (block * S * DENSE_BWD + block * n * c * BF16)
    stage, buffers = (" dense warm-up", "[block, S] buffers") if dense else ("", "selection")
    slot_note = ", int32 top-k slots" if slots else ""
    why = (
        f"DSA{stage}: kept {kept:.0f} B/token (indexer q/k/w, absorbed q, latent out, the row's "
        f"latents and indexer keys{slot_note}); block of {block} queries x {S} keys: {buffers} "
        f"{select / 2**20:.0f} MiB, {one / 2**30:.2f} GiB in forward; backward: {bwd_saved:.0f} "
        f"B/token read + {bwd_grads:.0f} B/token gradients + {bwd / 2**30:.2f} GiB of the block"
    )
    return DSABytes(kept, one, bwd_saved, bwd_grads, bwd, why)
