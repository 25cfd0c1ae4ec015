"""The outer causal language model every family shares (``CausalLM``).

A family (``models/<family>/``) brings its decoder layers (``make_layer``, usually the shared
pre-norm layer of models/blocks.py over its mixer and MLP), its arch, presets and a Hugging
Face name map; everything around the layers lives here once: construction (the primitives
the config names: attention or the CP attention when the sequence is split, MoE dispatch,
recompute policy, loss; the HF-named ``model.{embed_tokens, layers, norm}`` and ``lm_head``)
and the entry points: ``hidden_states`` (optionally one pipeline stage of it), ``loss_terms``
(what a training step needs from one micro-batch), ``scores`` (hidden states through the LM
head with any function of (hidden, head weight): the RL engine's per-token log-probs) and
``forward`` (the public API). Every reader of the head goes through ``LMHead``'s forward, so
FSDP2 gathers it just around that call and its backward.

The rest is in mixins, one file each: ``WeightInit`` (models/weights.py: layout-independent
initialization), ``Placement`` (models/placement.py: expert parameters, FSDP units, pipeline
stages), ``RoutingProtocol`` (models/routing.py: routers, router-stat rows, balance loss, bias
update, MTP depth) and ``CachedDecoding`` (models/kv_cache.py: decoding with a K/V cache
through the same layers).

Legend: B batch, T tokens, H hidden, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from bumblebee import registry
from bumblebee.models.head import (
    LMHead,
    LossTerms,
    check_forward_inputs,
    summed_losses,
)
from bumblebee.models.kv_cache import CachedDecoding, cache_aware
from bumblebee.models.placement import Placement
from bumblebee.models.routing import RoutingProtocol
from bumblebee.models.weights import WeightInit
from bumblebee.primitives import layer_tape
from bumblebee.primitives.cp.zigzag import build_cp_shards
from bumblebee.primitives.moe import replay as routing_replay
from bumblebee.primitives.packed import default_position_ids, doc_layout
from bumblebee.primitives.parallel import ParallelState
from bumblebee.primitives.rope import rope_cos_sin, yarn_inv_freq


def persistent_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of the buffers that are model state (saved in checkpoints, exported to HF):
    e.g. the ``sigmoid_bias`` router's ``e_score_correction_bias``. Not parameters, no gradient."""
    if not hasattr(module, "named_modules"):  # a stand-in holding parameters only
        return []
    return [
        (f"{mn}.{bn}" if mn else bn, b)
        for mn, m in module.named_modules()
        for bn, b in m.named_buffers(recurse=False)
        if b is not None and bn not in m._non_persistent_buffers_set
    ]


@dataclass(frozen=True)
class LayerParts:
    """What a family's decoder layer is built from (resolved once per model)."""

    prims: object  # the [primitives] section
    attend: object  # attention core: the attention slot, or the cp_attention slot when the sequence is split
    dispatch: object  # moe_comm: token dispatch/combine around the experts
    recompute: object  # recompute policy
    groups: ParallelState


class Backbone(nn.Module):
    """HF ``model.*``: embeddings, decoder layers, final norm."""

    def __init__(self, embed_tokens: nn.Module, layers: list[nn.Module], norm: nn.Module):
        super().__init__()
        self.embed_tokens, self.layers, self.norm = embed_tokens, nn.ModuleList(layers), norm


class CausalLM(RoutingProtocol, Placement, WeightInit, CachedDecoding, nn.Module):
    """The public model object: ``model(input_ids, position_ids=None, labels=None)``.

    Subclasses set ``family`` and ``norm_cls`` and implement ``make_layer`` (and may
    override ``rotary_dim``, ``rope_tables`` and ``init_vectors``). Parameters are left as
    constructed: ``build_model`` / ``materialize`` initialize them (``reset_parameters``)."""

    family = ""
    norm_cls: type = nn.Module

    def __init__(self, arch, prims=None, groups: ParallelState | None = None):
        super().__init__()
        from bumblebee.config import PrimitivesConfig

        self.arch = arch
        self.prims = prims = prims or PrimitivesConfig()
        self.groups = groups = groups or ParallelState()
        dispatch = registry.get("moe_comm", prims.moe_comm).factory(
            num_experts=arch.num_experts,
            ep_group=groups.ep_group,
            ep_size=groups.ep_size,  # carried: the layout's, not read back from the group
            num_chunks=prims.moe_chunks,
            chunk_weights=prims.moe_chunk_weights,
        )
        self.recompute = registry.get("recompute", prims.recompute).factory(prims.recompute_modules)
        # the loss slot (LM head + CE); not an RL `loss_fn`, which scores policy inputs
        self.head_loss = registry.get("loss", prims.loss).factory
        # one attention core for the whole model: the CP implementation when the sequence is split
        attend = (
            registry.get("cp_attention", prims.cp_attention)
            if groups.cp_size > 1
            else registry.get("attention", prims.attention)
        )
        parts = LayerParts(prims, cache_aware(attend.factory), dispatch, self.recompute, groups)
        embed = nn.Embedding(arch.vocab_size, arch.hidden_size)
        layers = [self.make_layer(i, parts) for i in range(arch.num_hidden_layers)]
        self.model = Backbone(embed, layers, self.norm_cls(arch.hidden_size, arch.rms_norm_eps))
        self.lm_head = (
            None if arch.tie_word_embeddings else LMHead(arch.hidden_size, arch.vocab_size)
        )
        self.main_moe_layers = sum(int(layer.is_moe) for layer in self.model.layers)
        self.num_moe_layers = max(self.main_moe_layers, 1)
        moe_layers = [(i, layer) for i, layer in enumerate(self.model.layers) if layer.is_moe]
        for j, (i, layer) in enumerate(moe_layers):
            layer.mlp.moe_index = j  # its slot in router stats and routing replay ids
            layer.mlp.label = f"layer {i}"
            if hasattr(dispatch, "for_layer"):  # a dispatcher with per-layer settings
                layer.mlp.dispatch = dispatch.for_layer(j, self.main_moe_layers)
        self.mtp = self.make_mtp(parts)  # multi-token prediction modules (models/mtp.py) or None
        # the MTP part's router stats rows follow the decoder's MoE layers
        for k, block in enumerate(self.mtp_moe_blocks()):
            block.moe_index = self.main_moe_layers + k
            block.label = f"MTP MoE block {k}"
        # counted once: a pipeline stage without the last layers drops the MTP part (keep_stages)
        self.mtp_held, self.mtp_moe_held = self.mtp_modules(), len(self.mtp_moe_blocks())
        self.mtp_depth = self.mtp_held  # depths trained (``set_mtp``)
        self.mtp_loss_weight = 0.1
        self.stage_layers: dict[int, list[int]] | None = None  # stage -> its layers (keep_stages)
        self.num_stages = 1

    # ------------------------------------------------------------------ family hooks
    def make_layer(self, index: int, parts: LayerParts) -> nn.Module:
        """Decoder layer ``index``: ``forward(x_BTH, cos, sin, layout) -> (x_BTH, balance loss)``,
        with a boolean attribute ``is_moe``."""
        raise NotImplementedError

    def make_mtp(self, parts: LayerParts) -> nn.Module | None:
        """The family's multi-token-prediction part (``models/mtp.py``), or None."""
        return None

    def mtp_modules(self) -> int:
        """How many MTP depths the model holds (0 without an MTP part)."""
        return 0

    def mtp_forward(self, k: int, h_BTH, emb_BTH, cos, sin, layout):
        """MTP depth k: (output-normed hidden state, balance loss), under the recompute policy."""
        raise NotImplementedError

    def mtp_units(self) -> list[nn.Module]:
        """The modules whose forward runs the MTP depths (FSDP units)."""
        return []

    def set_step_tokens(self, tokens: int) -> None:
        """Tokens of a training step's global batch (every micro-batch of every data-parallel
        rank): a module injecting a per-token auxiliary loss in its forward (``step_tokens``,
        e.g. DSA's indexer KL) takes its share of the mean over them, as the step divides the LM
        loss by the global batch's tokens; 0 (default) takes the mean over each forward's own."""
        for m in self.modules():
            if hasattr(m, "step_tokens"):
                m.step_tokens = int(tokens)

    def rotary_dim(self) -> int:
        return self.arch.head_dim

    def rope_tables(self, position_ids_BT, dtype):
        """RoPE (cos, sin) [B, T, rotary_dim] in ``dtype``, YaRN-scaled where the arch keeps HF's
        ``rope_parameters`` with ``rope_type = "yarn"``."""
        a, dim, theta = self.arch, self.rotary_dim(), self.arch.rope_theta
        rope = getattr(a, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") == "default":
            return rope_cos_sin(position_ids_BT, dim, theta, dtype)
        if "_yarn" not in self.__dict__:  # host fp32 frequencies, kept out of .to(dtype)
            self.__dict__["_yarn"] = yarn_inv_freq(dim, theta, rope, a.max_position_embeddings)
        inv_freq, scale = self.__dict__["_yarn"]
        return rope_cos_sin(position_ids_BT, dim, theta, dtype, inv_freq=inv_freq, scale=scale)

    def layer_flops(self, seq_len: int) -> tuple[list[float], float]:
        """Forward FLOPs of one ``seq_len``-token sequence per decoder layer, and of the LM head:
        the family's ``ModelSpec``, the one source of FLOPs (the planner reads the same)."""
        return self.arch.to_spec().layer_flops(seq_len)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The head's parameter (its device, dtype, shape). Computing with it goes through
        ``apply_head``: under FSDP2 the parameter is a shard outside the head's forward."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def apply_head(self, fn, hidden, *args, **kwargs):
        """``fn(hidden, W, *args, **kwargs)`` with the LM head weight W [V, H], inside the head's
        forward (``LMHead``). Tied: W is the embedding, a root-unit parameter under FSDP2 (the
        root keeps it gathered from its forward to the end of backward)."""
        if self.lm_head is None:
            return fn(hidden, self.model.embed_tokens.weight, *args, **kwargs)
        return self.lm_head(fn, hidden, *args, **kwargs)

    def layer_context(self, position_ids_BT, dtype):
        """What every decoder layer takes besides its input: RoPE (cos, sin) in ``dtype`` and the
        document layout (the CP layout when the sequence is split)."""
        cp_group = self.groups.cp_group if self.groups.cp_size > 1 else None
        layout = (
            build_cp_shards(position_ids_BT, cp_group, self.groups.cp_size, self.groups.cp_rank)
            if cp_group is not None
            else doc_layout(position_ids_BT)
        )
        cos, sin = self.rope_tables(position_ids_BT, dtype)
        return cos, sin, layout

    # ------------------------------------------------------------------ entry points
    def hidden_states(
        self,
        inputs,
        position_ids_BT=None,
        *,
        stage: int | None = None,
        routing=None,
        return_stats: bool = False,
    ):
        """Final-norm hidden states [B, T, H] and this part's share of the mean balance loss over
        MoE layers (``micro_batch`` definition). With ``stage`` (pipeline parallelism) only that
        stage runs: ``inputs`` are token ids on stage 0, else the previous stage's output, and the
        final norm runs on the last stage only (a stage before the last returns what the next
        one takes: with MTP trained, the hidden states and the MTP embeddings, ``_layers``).
        ``routing``: a ``RoutingScope`` (primitives/moe/replay.py) to replay given experts and/or
        record the chosen ones. ``return_stats``: also the raw router stats [L, 2E + 2] (None
        without MoE layers), for the bias update of ``sigmoid_bias`` routers."""
        h, stats_LS = self.routed_hidden_states(
            inputs, position_ids_BT, stage=stage, routing=routing
        )
        aux = self.part_balance(stats_LS, stage)
        return (h, aux, stats_LS) if return_stats else (h, aux)

    def routed_hidden_states(
        self,
        inputs,
        position_ids_BT=None,
        *,
        stage: int | None = None,
        routing=None,
        context: list | None = None,
    ):
        """``hidden_states`` with the raw router stats [L, 2E + 2] of the MoE layers run (None if none).
        Internal to ``hidden_states`` / ``loss_terms`` (the FSDP2 entry points): not one itself.
        ``context`` (a list) receives the layers' (cos, sin, layout)."""
        with routing_replay.entered(routing):
            return self._layers(inputs, position_ids_BT, stage, context)

    def _layers(self, inputs, position_ids_BT, stage, context=None):
        """MTP under pipeline parallelism (``pipelined_mtp``): the embedding lives on stage 0, so
        stage 0 also embeds the shifted tokens of every depth (models/mtp.py) and each stage
        passes them on concatenated to its output ([B, T, H x (1 + D)]); the last stage splits
        them off (``context`` receives them) and their gradient flows back to the one embedding."""
        if position_ids_BT is None:  # (a later stage's inputs are hidden states [B, T, ...])
            position_ids_BT = default_position_ids(inputs if inputs.dim() == 2 else inputs[..., 0])
        first = stage is None or stage == 0
        last = stage is None or stage == self.num_stages - 1
        carry = stage is not None and self.pipelined_mtp
        layer_ids = range(len(self.model.layers)) if stage is None else self.stage_layers[stage]
        H, embs = self.arch.hidden_size, None
        if first:
            (x,) = layer_tape.cut(self.model.embed_tokens(inputs))
        elif carry:
            x, embs = inputs.split([H, inputs.shape[-1] - H], dim=-1)
            x = x.contiguous()
        else:
            x = inputs
        dtype = (
            torch.get_autocast_dtype(x.device.type)
            if torch.is_autocast_enabled(x.device.type)
            else x.dtype
        )
        cos, sin, layout = self.layer_context(position_ids_BT, dtype)
        if carry and first:
            from bumblebee.models.mtp import shift_global

            embs = torch.cat(
                [
                    self.model.embed_tokens(shift_global(inputs, layout, k, 0))
                    for k in range(1, self.mtp_depth + 1)
                ],
                dim=-1,
            )
        if context is not None:
            context.extend((cos, sin, layout))
            if carry and last:
                context.append([e.contiguous() for e in embs.split(H, dim=-1)])
        stats = []
        for i in layer_ids:
            x, s = self.recompute.decoder_layer(self.model.layers[i], x, cos, sin, layout)
            if s.dim() == 1:  # dense layers return a 0-d zero
                x, s = layer_tape.cut(x, s)
                stats.append(s)
            else:
                (x,) = layer_tape.cut(x)
        stats = torch.stack(stats) if stats else None
        if last:
            return self.model.norm(x), stats
        return (torch.cat([x, embs.to(x.dtype)], dim=-1) if carry else x), stats

    def loss_terms(
        self,
        inputs,
        labels_BT,
        position_ids_BT=None,
        *,
        stage: int | None = None,
        balance: str = "micro_batch",
        routing=None,
    ) -> LossTerms:
        """The summed token loss through the loss primitive (``stage``: the last pipeline stage), the
        balance loss of definition ``balance`` (``micro_batch`` | ``hf``; ``step``: 0 here,
        the step builds it from ``router_stats`` over the whole batch) and the router stats.
        ``routing``: a ``RoutingScope`` (replay given experts / record the chosen ones; the MTP
        layers are neither replayed nor recorded). With MTP trained, its weighted loss is added to
        ``loss_sum`` and its MoE layers' stats follow the decoder's rows (models/mtp.py)."""
        context: list = []
        h_BTH, stats_LS = self.routed_hidden_states(
            inputs, position_ids_BT, stage=stage, routing=routing, context=context
        )
        labels_T = labels_BT.reshape(-1)
        hidden, labels = [h_BTH.reshape(-1, h_BTH.shape[-1])], [labels_T]
        with_mtp = (
            self.mtp is not None
            and self.mtp_depth
            and (stage is None or stage == self.num_stages - 1)
        )
        if with_mtp:
            from bumblebee.models.mtp import mtp_hidden

            cos, sin, layout, *embs = (
                context  # embs: the MTP embeddings stage 0 sent (pipelined_mtp)
            )
            mtp_h, mtp_labels, mtp_stats = mtp_hidden(
                self, h_BTH, inputs, labels_BT, cos, sin, layout, embs=embs[0] if embs else None
            )
            hidden, labels = hidden + mtp_h, labels + mtp_labels
        # every loss that reads the head in one head call: one gather, one gradient reduction.
        # (Each [T, H] view above is taken where its hidden state is made, so the backward adds
        # the gradient contributions of a hidden state in the order it did with a head call per
        # depth: bit-identical sums.)
        sums = self.apply_head(summed_losses, hidden, labels, self.head_loss)
        loss_sum = sums[0]
        terms = LossTerms(
            loss_sum,
            (labels_T != -100).sum(),
            loss_sum.new_zeros((), dtype=torch.float32),
            stats_LS,
        )
        layers = self.num_moe_layers if stage is None else self.router_row_count()
        if with_mtp:
            from bumblebee.models.mtp import mtp_loss_sum

            mtp_sum, terms.mtp_sums, terms.mtp_tokens = mtp_loss_sum(self, sums[1:], labels[1:])
            terms.loss_sum = loss_sum + mtp_sum
            if mtp_stats:
                rows = torch.stack(mtp_stats)
                terms.router_stats = rows if stats_LS is None else torch.cat([stats_LS, rows])
                layers = self.main_moe_layers + len(mtp_stats)
        if balance != "step":
            terms.aux_loss = self.balance_loss(terms.router_stats, balance, layers)
        return terms

    def scores(
        self,
        inputs,
        position_ids_BT,
        fn,
        *args,
        stage: int | None = None,
        routing=None,
        return_stats: bool = False,
        **kwargs,
    ):
        """(``fn(h_TH, W, *args, **kwargs)`` on the final-norm hidden states [B x T, H] and the LM
        head weight, the balance loss as ``hidden_states`` gives it[, the raw router stats]): e.g.
        per-token log-probs. ``stage``: the last pipeline stage; ``routing``: a ``RoutingScope``."""
        h_BTH, stats_LS = self.routed_hidden_states(
            inputs, position_ids_BT, stage=stage, routing=routing
        )
        aux = self.part_balance(stats_LS, stage)
        out = self.apply_head(fn, h_BTH.reshape(-1, h_BTH.shape[-1]), *args, **kwargs)
        return (out, aux, stats_LS) if return_stats else (out, aux)

    def forward(self, input_ids, position_ids=None, labels=None):
        """Logits [B, T, V] without labels; with labels (already shifted, -100 ignored)
        the mean cross-entropy through the configured loss primitive."""
        check_forward_inputs(self, input_ids, position_ids, labels)
        if labels is None:
            h_BTH, _ = self.routed_hidden_states(input_ids, position_ids)
            return self.apply_head(F.linear, h_BTH)
        terms = self.loss_terms(input_ids, labels, position_ids)
        return terms.loss_sum / terms.num_tokens.clamp(min=1)
