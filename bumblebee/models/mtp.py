"""Multi-token prediction (MTP) as a model part: D sequential modules after the decoder.

DeepSeek-V3 report (arXiv:2412.19437, sec. 2.2, eq. 21-25): module k (1..D) predicts the
token k+1 places ahead. At position i it combines the previous depth's hidden state
(depth 0: the main model's final-norm output) with the embedding of token i+k,

    h'_k[i] = M_k [ RMSNorm(Emb(t[i+k])) ; RMSNorm(h_{k-1}[i]) ]   (M_k: [2H -> H])
    h_k = Norm_k( Layer_k(h'_k) )                                  (one decoder layer)
    P_k[i] = softmax(Head(h_k[i]))  -> target t[i+k+1]

with the embedding and the LM head shared with the main model. The concatenation order
(embedding first) and the output norm are those of the released checkpoints and of the
Hugging Face / vLLM MTP code. The loss is ``loss_weight / D x sum_k`` of the summed token
losses of depth k through the configured ``loss`` primitive (linear CE: no [T, V] logits),
divided by the main loss's token count (so it is the same for every layout).

Under pipeline parallelism the MTP modules run on the last stage (they need its hidden
states and the LM head); the embedding lives on stage 0, which embeds the shifted tokens and
sends them down the pipeline beside the hidden states (``CausalLM._layers``), so there is one
embedding and its gradient comes back through the pipeline's own backward.

Targets and inputs are shifted on the *global* sequence: with context parallelism the
token ids and labels of the whole row are all-gathered (T integers) and this rank's zigzag
positions read back, so a shard edge is no document edge; a target whose position i+k lies
in another document (or past the row) is ignored, and the MTP block attends within
documents like every layer, so packed rows equal separate documents.

A family runs depth k through ``CausalLM.mtp_forward`` (built on ``combine`` below) and
names the modules whose forward does it (``mtp_units``: FSDP units). The shared head is read
once for all depths and the main loss (``CausalLM.apply_head``: one FSDP2 gather of the head
and one reduction of its gradient per micro-batch). DeepSeek-V3 holds one
module per depth (projection, norms and layer together); Qwen3.5 shares the projection and
norms and holds one layer per depth.

Legend: B batch, T tokens (local), H hidden, D depth.
"""

from __future__ import annotations

import torch

from bumblebee.primitives.cp.zigzag import CPShards, unshard_sequence


def _global(x_BT: torch.Tensor, layout) -> torch.Tensor:
    """The whole row of an integer [B, Tl] tensor (all-gathered over the CP group)."""
    if not isinstance(layout, CPShards):
        return x_BT
    import torch.distributed as dist

    parts = [torch.empty_like(x_BT) for _ in range(layout.size)]
    dist.all_gather(parts, x_BT.contiguous(), group=layout.group)
    return unshard_sequence(parts)


def shift_global(x_BT, layout, k: int, fill: int):
    """``x`` of position i+k for this rank's positions i (the row all-gathered under CP), ``fill``
    where i+k is in another document or past the row."""
    device = x_BT.device
    if isinstance(layout, CPShards):
        doc_BT, index = layout.doc_BT, layout.index_L
    else:
        doc_BT, index = layout.doc_ids(device), torch.arange(x_BT.shape[1], device=device)
    x_G = _global(x_BT, layout)
    T = x_G.shape[1]
    src = (index + k).clamp(max=T - 1)
    ok_BT = (index + k < T) & (doc_BT[:, src] == doc_BT[:, index])
    return torch.where(ok_BT, x_G[:, src], torch.full_like(x_G[:, src], fill))


def shifted_inputs(ids_BT, labels_BT, layout, k: int):
    """(ids of position i+k, label of position i+k, ignored where i+k is in another document
    or past the row) for this rank's positions i."""
    return shift_global(ids_BT, layout, k, 0), shift_global(labels_BT, layout, k, -100)


def combine(enorm, hnorm, proj, emb_BTH, h_BTH):
    """The MTP input projection M [ RMSNorm(Emb(t[i+k])) ; RMSNorm(h_{k-1}[i]) ]."""
    return proj(torch.cat([enorm(emb_BTH), hnorm(h_BTH)], dim=-1))


def mtp_hidden(model, h_BTH, ids_BT, labels_BT, cos, sin, layout, embs=None):
    """Every trained depth's output-normed hidden states [B x T, H] and labels [B x T] (shifted
    by k + 1 places), and the router stats vectors of the MTP MoE layers. The losses are taken
    by the caller in one LM head call together with the main loss (``CausalLM.loss_terms``).
    ``embs``: the embeddings of the shifted tokens per depth when they were computed elsewhere
    (pipeline parallelism: on stage 0, which holds the embedding; ``ids_BT`` is then unused)."""
    h = h_BTH
    hidden, labels, stats = [], [], []
    for k in range(1, model.mtp_depth + 1):
        if embs is None:
            ids_k, labels_k = shifted_inputs(ids_BT, labels_BT, layout, k)
            emb = model.model.embed_tokens(ids_k)
        else:
            labels_k, emb = shift_global(labels_BT, layout, k, -100), embs[k - 1]
        h, a = model.mtp_forward(k - 1, h, emb, cos, sin, layout)
        hidden.append(h.reshape(-1, h.shape[-1]))
        labels.append(labels_k.reshape(-1))
        if a.dim() == 1:  # a MoE layer's router stats (primitives/moe/balance.py)
            stats.append(a)
    return hidden, labels, stats


def mtp_loss_sum(model, sums, labels):
    """(loss_weight / D x sum over depths of the summed token losses ``sums``, [per-depth summed
    losses, detached], [per-depth valid tokens])."""
    total = sums[0].new_zeros((), dtype=torch.float32)
    for s in sums:
        total = total + s.float()
    counts = [(labels_T != -100).sum() for labels_T in labels]
    return total * (model.mtp_loss_weight / model.mtp_depth), [s.detach() for s in sums], counts
