"""Weights out of the Engine for a rollout engine: bucketed, Hugging Face named, gathered just in time.

Pushing a policy to an inference engine tensor by tensor costs one round trip per tensor
(thousands for a MoE model: every expert's projections); in buckets of a few hundred MB it
costs a few dozen. ``weight_buckets(bucket_bytes, dtype, names)`` yields lists of
``(name, tensor)``:

- names are the checkpoint's own (``names="hf"``, what vLLM / SGLang ``load_weights``
  take): experts split per expert and projection, and the prefixes of the checkpoint the
  model was loaded from (the multimodal ``Qwen3_5MoeForConditionalGeneration`` keeps the
  language model under ``model.language_model.``; a rollout engine serving that checkpoint
  expects those names); ``names="transformers"`` gives transformers 5's in-memory names
  (fused ``mlp.experts.gate_up_proj`` / ``down_proj`` per layer; rl/weight_names.py), so
  ``load_state_dict`` on a transformers model covers every parameter;
  ``names="bumblebee"`` gives the model's own names (stacked experts);
- each parameter is gathered when its turn comes (FSDP2 shards all-gathered, expert slices
  concatenated over the ep group), after casting this rank's shard to ``dtype``, so the
  gather moves ``dtype`` bytes and no full fp32 copy of the model ever exists; a stacked expert
  tensor ([E, 2F, H] per layer, 0.8 GB in bf16 for Qwen3-30B-A3B) larger than a bucket is
  streamed in pieces of experts (``expert_pieces``: each FSDP shard broadcast piece by piece from
  its holder, each piece all-gathered over ep), so it is never whole on a rank;
- a bucket holds at most ``bucket_bytes`` (a single larger tensor gets a bucket of its own);
  the generator drops its references when it yields, so a rank holds the bucket being filled
  and the one the consumer still holds: at most 2 buckets beyond the model (measured in
  tests/unit/test_rl_engine_surface.py), as long as no single HF tensor is larger than a bucket;
- every rank iterates the same sequence (the gathers are collective).

``weight_version`` counts the applied optimizer steps (and loads), so a rollout engine can tell
stale weights. ``sync_weights(transport)`` hands each bucket to a transport, a callable per
bucket; ``BroadcastTransport`` (transport.py) broadcasts every bucket as one flat buffer from a source rank
over a process group (gloo or NCCL), names, shapes and dtypes first.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from bumblebee.models.base import persistent_buffers
from bumblebee.models.hf import _weight_files, hf_state_dict
from bumblebee.models.hf_stored import stored_entry
from bumblebee.models.hf_write import write_hf
from bumblebee.models.lora import (
    factor_names,
    is_lora_name,
    merge,
    merged_stream,
)
from bumblebee.rl.weight_names import hf_expert_names, transformers_named


class _FullModel:
    """A model's architecture plus its full (gathered) parameters, as ``hf_state_dict`` reads them."""

    def __init__(self, arch, named):
        self.arch, self._named = arch, named

    def named_parameters(self):
        return self._named


def checkpoint_names(path: str) -> list[str]:
    """Tensor names of a HF checkpoint directory (from the index, or the safetensors headers)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return list(json.load(f)["weight_map"])
    from safetensors import safe_open

    names = []
    for file in _weight_files(path):
        with safe_open(file, framework="pt") as f:
            names += list(f.keys())
    return names


@torch.no_grad()
def gathered(model, ctx, dtype: torch.dtype | None):
    """(name, full tensor in ``dtype``) per parameter, gathered when it is reached: the local
    shard is cast first, then FSDP shards and expert slices are gathered (over ``ctx``, the
    rank's ``ParallelState``). With pipeline stages (``ctx.pp_group``) every stage's tensors are
    broadcast from the rank holding them, stage by stage, so every rank iterates the same
    sequence. Collective."""
    pp_group = ctx.pp_group
    if pp_group is None:
        yield from _gathered_here(model, ctx, dtype)
        return
    ep = ctx.ep_size
    mine = [
        (
            n,
            (
                (p.shape[0] * ep if ep > 1 and model.is_expert_param(n) else p.shape[0]),
                *p.shape[1:],
            ),
            dtype if dtype is not None and _cast(model, n, p) else p.dtype,
            isinstance(p, torch.nn.Parameter),
        )
        for n, p in _state(model)
    ]
    every = [None] * ctx.layout.pp
    dist.all_gather_object(every, mine, group=pp_group)
    here, me = _gathered_here(model, ctx, dtype), ctx.pp_rank
    device = next(model.parameters()).device
    for params in (
        True,
        False,
    ):  # every stage's parameters, then every stage's buffers (a whole model's order)
        for r, entries in enumerate(every):
            for name, shape, dt, _ in (e for e in entries if e[3] == params):
                t = (
                    next(here)[1].contiguous()
                    if r == me
                    else torch.empty(shape, dtype=dt, device=device)
                )
                dist.broadcast(t, src=dist.get_global_rank(pp_group, r), group=pp_group)
                yield name, t


def _cast(model, name: str, p) -> bool:
    """Whether a tensor is cast to the asked dtype before its gather: parameters, but neither LoRA
    factors nor their base tensors (merged in fp32 first and rounded once, models/lora.py), nor
    buffers."""
    info = getattr(model, "lora_info", None)
    if info is not None and (is_lora_name(name) or name in info.bases):
        return False
    return isinstance(p, torch.nn.Parameter)


def _state(model) -> list[tuple[str, torch.Tensor]]:
    """Parameters, then the buffers that are model state (e.g. the sigmoid_bias router's
    ``e_score_correction_bias``: replicated, exported like a parameter)."""
    return list(model.named_parameters()) + persistent_buffers(model)


def _gathered_here(model, ctx, dtype):
    for name, p in _state(model):
        yield name, _gather(model, name, p, ctx, dtype)


@torch.no_grad()
def _gather(model, name: str, p, ctx, dtype) -> torch.Tensor:
    """The full tensor of parameter ``p`` in ``dtype``: this rank's shard cast, FSDP shards gathered,
    expert slices concatenated over the ep group; a buffer as it is (replicated; kept in its own dtype,
    e.g. an fp32 router bias). Collective."""
    t = p.detach()
    if dtype is not None and t.dtype != dtype and _cast(model, name, p):
        t = t.to(dtype)
    if isinstance(t, DTensor):
        t = t.full_tensor()
    ep = ctx.ep_size
    if ep > 1 and model.is_expert_param(name):
        full = torch.empty((ep * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
        dist.all_gather(list(full.chunk(ep)), t.contiguous(), group=ctx.ep_group)
        t = full
    return t


@torch.no_grad()
def expert_pieces(p, ctx, dtype: torch.dtype | None, piece_bytes: int):
    """(first global expert, tensor [n, ...]) pieces of a stacked expert parameter ``p``, each at most
    ``piece_bytes`` after the ep gather (at least one expert), so a large [E, 2F, H] stack is never
    whole on a rank. FSDP2 shards (dim 0, ``torch.chunk`` over the edp mesh) are broadcast from the
    rank holding them piece by piece, then each piece is all-gathered over the ep group (expert
    ``q * E_local + i`` lives on ep rank ``q``; ``ctx``: the rank's ``ParallelState``). Collective;
    every rank yields the same sequence."""
    local, mesh = p.detach(), None
    if isinstance(local, DTensor):
        mesh, local = local.device_mesh, local.to_local()
    group = None if mesh is None else mesh.get_group()
    if dtype is not None and local.dtype != dtype:
        local = local.to(dtype)
    ep, ep_group = ctx.ep_size, ctx.ep_group
    e_local, row_shape = p.shape[0], tuple(p.shape[1:])
    row_bytes = torch.Size(row_shape).numel() * local.element_size()
    per_piece = max(1, piece_bytes // (row_bytes * ep))
    world = 1 if mesh is None else mesh.size()  # the shards' mesh carries its size and our place
    sizes = [len(c) for c in torch.arange(e_local).chunk(world)]
    sizes += [0] * (world - len(sizes))
    offsets = [sum(sizes[:r]) for r in range(world)]
    me = 0 if mesh is None else mesh.get_local_rank()
    for r in range(world):
        for i in range(0, sizes[r], per_piece):
            n = min(per_piece, sizes[r] - i)
            piece = (
                local[i : i + n].contiguous()
                if r == me
                else torch.empty((n, *row_shape), dtype=local.dtype, device=local.device)
            )
            if group is not None:
                dist.broadcast(piece, src=dist.get_global_rank(group, r), group=group)
            if ep == 1:
                yield offsets[r] + i, piece
                continue
            full = torch.empty((ep * n, *row_shape), dtype=piece.dtype, device=piece.device)
            dist.all_gather(list(full.chunk(ep)), piece, group=ep_group)
            for q in range(ep):
                yield q * e_local + offsets[r] + i, full[q * n : (q + 1) * n]


class EngineWeights:
    """Mixin of ``rl.engine.Engine``: named_weights, weight_buckets, sync_weights, export_hf."""

    def _source_prefixes(self, hf_path: str | None) -> dict[str, str]:
        """{our prefix: the checkpoint's} for the family's renamed prefixes the source uses."""
        if not hf_path:
            return {}
        from bumblebee.models import family_of

        names = checkpoint_names(hf_path)
        return {
            ours: theirs
            for theirs, ours in family_of(self.arch).hf_prefixes.items()
            if any(n.startswith(theirs) for n in names)
        }

    def _renamed(self, pairs):
        """The source checkpoint's prefixes (``hf_prefixes``) on HF names."""
        for name, t in pairs:
            for ours, theirs in self.hf_prefixes.items():
                if name.startswith(ours):
                    name = theirs + name[len(ours) :]
                    break
            yield name, t

    def _hf_named(self, named):
        return self._renamed(hf_state_dict(_FullModel(self.arch, named)))

    @property
    def _lora(self):
        """The model's ``LoraInfo`` (models/lora.py), or None without adapters."""
        return getattr(self.model, "lora_info", None)

    def named_weights(
        self, *, hf_names: bool = True, dtype: torch.dtype | None = None, merged: bool = True
    ):
        """Stream (name, full tensor) for every parameter: the source checkpoint's HF names
        (experts split per expert) by default, bumblebee names with ``hf_names=False``. With
        LoRA adapters each adapted tensor comes merged (W + scale B A, rounded once to ``dtype``)
        and the factors are left out, unless ``merged=False`` (bumblebee names: the factors too).
        Collective: every rank iterates to the end. A tensor may share storage with the live
        parameter (replicated layouts): copy what you keep across an update."""
        self.offloader.require("params")
        named = gathered(self.model, self.ctx, dtype)
        if self._lora is not None and merged:
            named = merged_stream(named, self._lora.scale, dtype)
        return self._hf_named(named) if hf_names else named

    def _hf_stream(self, dtype, piece_bytes: int):
        """HF-named tensors, stacked experts larger than ``piece_bytes`` streamed in pieces of experts
        (``expert_pieces``), everything else as ``named_weights``. Pipeline stages: whole tensors."""
        if self.ctx.pp_group is not None:
            yield from self.named_weights(dtype=dtype)
            return
        self.offloader.require("params")
        F, ep = self.arch.moe_intermediate_size, self.ctx.ep_size
        from bumblebee.models import family_of

        stored = family_of(self.arch).hf_stored  # declared layouts: converted whole
        # the family's checkpoint names of the split experts, as hf_state_dict writes them
        out = family_of(self.arch).hf_name_out or (lambda arch, n: n)
        state, lora = _state(self.model), self._lora
        params = dict(state)
        for name, p in state:
            if is_lora_name(name):  # merged into its base tensor below
                continue
            ab = factor_names(name) if lora is not None else None
            ab = ab if ab is not None and ab[0] in params else None
            # the factors are small: gathered whole (every rank, same order), merged per piece
            a, b = [_gather(self.model, n, params[n], self.ctx, None) for n in ab] if ab else (0, 0)
            if (
                name.endswith(("experts.w_gate_up", "experts.w_down"))
                and not stored_entry(stored, name)
                and p.numel() * ep * (dtype or p.dtype).itemsize > piece_bytes
            ):
                for first, piece in expert_pieces(p, self.ctx, None if ab else dtype, piece_bytes):
                    if ab:
                        n = piece.shape[0]
                        piece = merge(
                            piece, a[first : first + n], b[first : first + n], lora.scale, dtype
                        )
                    split = hf_expert_names(name, first, piece, F)
                    yield from self._renamed((out(self.arch, n), t) for n, t in split)
            else:
                t = _gather(self.model, name, p, self.ctx, dtype)
                yield from self._hf_named([(name, merge(t, a, b, lora.scale, dtype) if ab else t)])

    def weight_buckets(
        self,
        bucket_bytes: int = 512 << 20,
        dtype: torch.dtype | None = torch.bfloat16,
        names: str = "hf",
    ):
        """Lists of (name, tensor) of at most ``bucket_bytes`` each (module docstring)."""
        if names not in ("hf", "transformers", "bumblebee"):
            raise ValueError(f"names must be 'hf', 'transformers' or 'bumblebee', got {names!r}")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        bucket, size = [], 0
        if names == "hf":
            stream = self._hf_stream(dtype, bucket_bytes)
        else:  # whole tensors: a fused expert stack larger than a bucket gets a bucket of its own
            stream = self.named_weights(hf_names=False, dtype=dtype)
            if names == "transformers":
                from bumblebee.models import family_of

                family = family_of(self.arch)
                stream = self._renamed(
                    transformers_named(stream, family.transformers_renames, family.hf_stored)
                )
        for name, t in stream:
            n = t.numel() * t.element_size()
            if bucket and size + n > bucket_bytes:
                out, bucket, size = bucket, [], 0
                yield out
                del out  # only the consumer holds the yielded bucket now
            bucket.append((name, t))
            size += n
        if bucket:
            yield bucket

    def sync_weights(self, transport, **bucket_args) -> int:
        """Every bucket through ``transport(bucket)`` (on every rank); returns ``weight_version``."""
        for bucket in self.weight_buckets(**bucket_args):
            transport(bucket)
            del bucket
        if hasattr(transport, "finish"):
            transport.finish(self.weight_version)
        return self.weight_version

    def export_hf(
        self, out_dir: str, dtype: torch.dtype = torch.float32, *, root: str | None = None
    ) -> None:
        """Write a HF directory (config.json + safetensors) from rank 0, one tensor at a time: each
        full tensor is gathered when it is reached and written (models/hf_write.py); the tensors of
        ``model.hf_path`` outside the language model (vision tower, MTP) are carried over. ``root``:
        a directory above ``out_dir`` below which no link is followed (``safe_write``: a link
        planted at ``out_dir`` inside a run directory is refused, not written through). Collective."""
        from bumblebee.models.hf_write import check_export_target

        check_export_target(out_dir, self.cfg.model.hf_path)  # every rank, before the collective
        named = self.named_weights(hf_names=False)
        if self.ctx.rank == 0:
            from bumblebee.models import build_model
            from bumblebee.runtime.checkpoint.export_dir import export_lock

            whole = build_model(self.arch, self.cfg.primitives, device="meta")
            shapes = [
                (n, tuple(p.shape)) for n, p in _state(whole)
            ]  # the stream's order: parameters, buffers
            # staged beside out_dir and moved in (write_hf): a killed export leaves no partial
            # model; the lock keeps two exports from mixing
            with export_lock(out_dir):
                write_hf(
                    out_dir,
                    self.arch,
                    shapes,
                    named,
                    dtype=dtype,
                    source=self.cfg.model.hf_path,
                    root=root,
                )
        else:
            for _ in named:
                pass
        self._barrier()
