"""Names for the weights an Engine streams: the checkpoint's (serving engines) or transformers 5's
in-memory ones (a ``transformers`` model's ``load_state_dict``).

A checkpoint stores each routed expert's projections apart
(``mlp.experts.{e}.gate_proj.weight`` ...): that is what vLLM and SGLang load, and what
``weight_buckets(names="hf")`` yields. transformers 5 keeps the experts of a layer fused in
memory (``Qwen3MoeExperts``: ``mlp.experts.gate_up_proj`` [E, 2F, H], gate rows first, and
``mlp.experts.down_proj`` [E, H, F]) and converts the checkpoint's names when it loads a
file, so checkpoint names given to ``model.load_state_dict`` miss every expert. bumblebee's
stacked ``w_gate_up`` / ``w_down`` have exactly those layouts: ``names="transformers"`` renames
them (whole tensors, one per layer and projection) and keeps every other name as the
checkpoint's, with the source checkpoint's prefixes (``model.language_model.`` for the
multimodal Qwen3.5 wrapper). Multi-token-prediction modules (``mtp.*``) are left out: a
transformers model holds none.
"""

from __future__ import annotations

from bumblebee.models.hf_stored import stored_entry


def hf_expert_names(name: str, first: int, piece, F: int):
    """Checkpoint (name, tensor) of a piece of stacked experts (``w_gate_up`` [n, 2F, H] / ``w_down``
    [n, H, F]) whose first expert is ``first``: one tensor per expert and projection."""
    base = name.rsplit(".", 1)[0]
    for k in range(piece.shape[0]):
        e = first + k
        if name.endswith("w_gate_up"):
            yield f"{base}.{e}.gate_proj.weight", piece[k, :F]
            yield f"{base}.{e}.up_proj.weight", piece[k, F:]
        else:
            yield f"{base}.{e}.down_proj.weight", piece[k]


FUSED = {"experts.w_gate_up": "experts.gate_up_proj", "experts.w_down": "experts.down_proj"}


def transformers_name(name: str, renames: dict | None = None) -> str | None:
    """A bumblebee parameter / buffer name -> transformers 5's in-memory name (before the source
    checkpoint's prefixes); None for a tensor a transformers model does not hold. ``renames``:
    the family's own name endings (``Family.transformers_renames``)."""
    if name.startswith("mtp."):
        return None
    for ours, theirs in {**FUSED, **(renames or {})}.items():
        if name.endswith(ours):
            return name[: -len(ours)] + theirs
    return name


def transformers_named(pairs, renames: dict | None = None, stored=()):
    """(transformers name, tensor) from (bumblebee name, tensor) pairs, MTP tensors dropped.
    ``stored``: the family's ``hf_stored`` declarations (models/hf_stored.py): those tensors keep
    their checkpoint name and layout (gpt-oss: transformers holds its experts as stored)."""
    for name, t in pairs:
        if entry := stored_entry(stored, name):
            yield entry.checkpoint_name(name), entry.to_checkpoint(t)
            continue
        out = transformers_name(name, renames)
        if out is not None:
            yield out, t
