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

from bumblebee.plan.layout import Layout
from bumblebee.plan.memory import BF16, FP32
from bumblebee.plan.spec import ModelSpec

DSA_UNION = 1.0  # fraction of the visible remote keys a rank fetches (the most: an all-gather's)
COLLECTIVES = 4  # per forward pass: indexer-key all-gather, counts, row ids, rows


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


def dsa_bytes(spec: ModelSpec, lay: Layout, t: int, block: int) -> tuple[float, float, str]:
    """(bytes per local token kept by the core for its backward, fixed transient bytes of one
    query block in forward + backward, formula). Kept: the indexer's q [Hi x Di], key [Di] and
    fp32 head weights [Hi], the absorbed queries [N x (C + R)] and latent outputs [N x C]
    (bf16), the row's latents + indexer keys (cp x (C + R + Di): all-gathered indexer keys and,
    at ``DSA_UNION``, as many fetched latent rows), and under CP the selection as int32 slots
    [K]. One block (``block`` queries against S = t x cp keys): the selection (two fp32 and two
    bool [block, S]), the gathered latents and indexer keys [block, K, C + R + Di] bf16, fp32
    scores and probabilities [block, N, K]; twice in backward (recompute + gradients)."""
    if not spec.dsa_topk:
        return 0.0, 0.0, ""
    n, c, r = spec.n_heads / lay.tp, spec.mla_kv_rank, spec.mla_rope_dim
    hi, di, S = spec.dsa_heads, spec.dsa_dim, t * lay.cp
    k = min(spec.dsa_topk, S)
    kept = (hi * di + di + n * (2 * c + r)) * BF16 + hi * FP32 + lay.cp * (c + r + di) * BF16
    if lay.cp > 1:
        kept += k * 4
    select = block * S * (2 * FP32 + 2)
    one = select + block * k * (c + r + di) * BF16 + block * n * k * 2 * FP32
    why = (
        f"DSA: kept {kept:.0f} B/token (indexer q/k/w, absorbed q, latent out, the row's latents "
        f"and indexer keys{', int32 top-k slots' if lay.cp > 1 else ''}); block of {block} queries "
        f"x {S} keys: selection {select / 2**20:.0f} MiB, {2 * one / 2**30:.2f} GiB in backward"
    )
    return kept, 2 * one, why
