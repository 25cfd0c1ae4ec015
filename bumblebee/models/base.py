"""The outer causal language model every family shares, and the protocol the runtime uses.

A family (``qwen3_moe.py``, ``qwen3_5_moe.py``) brings a decoder layer, its arch, presets and
a Hugging Face name map; everything around the layers lives here once:

- construction: the primitives named in the config are resolved (attention or the CP
  attention when the sequence is split, MoE dispatch, recompute policy, loss), the
  HF-named backbone ``model.{embed_tokens, layers, norm}`` and ``lm_head`` are built, and
  weights are initialized identically for every layout of a seed (per-block seeded draws,
  primitives/init.py), also when the model was built on the meta device and split before it
  got memory (``build_model(..., device="meta")``, then ``materialize``);
- entry points: ``hidden_states`` (optionally one pipeline stage of it), ``loss_terms``
  (what a training step needs from one micro-batch), ``scores`` (hidden states through the LM
  head with any function of (hidden, head weight): the RL engine's per-token log-probs) and
  ``forward`` (the public API);
- the LM head is a module whose forward *uses* its weight (``LMHead``): every reader of the
  head (the loss primitive, log-probs, logits) goes through it, so FSDP2 can make it a unit of
  its own, gathered just around that call and its backward;
- the protocol the runtime and the sharding primitives call instead of reaching into
  attribute paths or parameter names: ``fsdp_units``, ``is_expert_param``, ``keep_stages``
  (what a pipeline stage holds), ``layer_flops``, and ``new_kv_cache`` / ``forward_cached``
  (decoding with a K/V cache through the same layers, models/kv_cache.py); the routing and
  MTP part of it (routers, router-stat rows, balance loss, bias update, MTP depth) is the
  ``RoutingProtocol`` mixin of models/routing.py.

Legend: B batch, T tokens, H hidden, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from bumblebee import registry
from bumblebee.models.head import LMHead, check_token_ids, summed_losses
from bumblebee.models.kv_cache import KVCache, cache_aware
from bumblebee.models.routing import RoutingProtocol
from bumblebee.primitives import init
from bumblebee.primitives.cp.layout import build_cp_layout
from bumblebee.primitives.moe import replay as routing_replay
from bumblebee.primitives.moe.experts import Experts
from bumblebee.primitives.packed import default_position_ids, doc_layout
from bumblebee.primitives.parallel import ParallelGroups
from bumblebee.primitives.rope import rope_cos_sin
from bumblebee.primitives.sharding.common import row_extent


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


@dataclass
class LossTerms:
    """What a training step needs from one micro-batch's forward."""

    loss_sum: torch.Tensor  # summed token losses over the valid labels of this micro-batch
    num_tokens: torch.Tensor  # number of valid labels (int64 scalar)
    aux_loss: (
        torch.Tensor
    )  # load-balancing loss of the asked definition (0 if none, or "global_batch")
    router_stats: torch.Tensor | None = (
        None  # [L, 2E + 2] per MoE layer (primitives/moe/balance.py)
    )
    # multi-token prediction (models/mtp.py), already weighted into loss_sum: per-depth summed
    # token losses (detached, for logs) and valid-label counts; empty without MTP
    mtp_sums: list = field(default_factory=list)
    mtp_tokens: list = field(default_factory=list)


@dataclass(frozen=True)
class LayerParts:
    """What a family's decoder layer is built from (resolved once per model)."""

    prims: object  # the [primitives] section
    attend: object  # attention core: the attention slot, or the cp slot when the sequence is split
    dispatch: object  # moe_comm: token dispatch/combine around the experts
    recompute: object  # recompute policy
    groups: ParallelGroups


class Backbone(nn.Module):
    """HF ``model.*``: embeddings, decoder layers, final norm."""

    def __init__(self, embed_tokens: nn.Module, layers: list[nn.Module], norm: nn.Module):
        super().__init__()
        self.embed_tokens, self.layers, self.norm = embed_tokens, nn.ModuleList(layers), norm


class Elsewhere(nn.Module):
    """Stands in for a decoder layer that another pipeline stage holds (no parameters)."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def forward(self, *args):
        raise RuntimeError(f"decoder layer {self.index} lives on another pipeline stage")


class CausalLM(RoutingProtocol, nn.Module):
    """The public model object: ``model(input_ids, position_ids=None, labels=None)``.

    Subclasses set ``family`` and ``norm_cls`` and implement ``make_layer`` (and may
    override ``rotary_dim``, ``rope_tables`` and ``init_vectors``)."""

    family = ""
    norm_cls: type = nn.Module

    def __init__(self, arch, prims=None, groups: ParallelGroups | None = None):
        super().__init__()
        from bumblebee.config import PrimitivesConfig

        self.arch = arch
        self.prims = prims = prims or PrimitivesConfig()
        self.groups = groups = groups or ParallelGroups()
        dispatch = registry.get("moe_comm", prims.moe_comm).factory(
            num_experts=arch.num_experts,
            ep_group=groups.ep_group,
            num_chunks=prims.moe_chunks,
            chunk_weights=prims.moe_chunk_weights,
        )
        self.recompute = registry.get("recompute", prims.recompute).factory(prims.recompute_modules)
        self.loss_fn = registry.get("loss", prims.loss).factory
        # one attention core for the whole model: the CP implementation when the sequence is split
        attend = (
            registry.get("cp", prims.cp)
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
        for j, layer in enumerate(layer for layer in self.model.layers if layer.is_moe):
            layer.mlp.moe_index = j  # its slot in router stats and routing replay ids
            if hasattr(dispatch, "for_layer"):  # a dispatcher with per-layer settings
                layer.mlp.dispatch = dispatch.for_layer(j, self.main_moe_layers)
        self.mtp = self.make_mtp(parts)  # multi-token prediction modules (models/mtp.py) or None
        for k, block in enumerate(self.mtp_moe_blocks()):
            block.moe_index = (
                self.main_moe_layers + k
            )  # router stats rows after the decoder's MoE layers
        # counted once: a pipeline stage without the last layers drops the MTP part (keep_stages)
        self.mtp_held, self.mtp_moe_held = self.mtp_modules(), len(self.mtp_moe_blocks())
        self.mtp_depth = self.mtp_held  # depths trained (``set_mtp``)
        self.mtp_loss_weight = 0.1
        self.stage_layers: dict[int, list[int]] | None = (
            None  # pipeline stage -> its layers (keep_stages)
        )
        self.num_stages = (
            1  # parameters are left as constructed: build_model / materialize initialize them
        )

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

    def init_vectors(self, std: float) -> dict:
        """Fill rules (primitives/init.py) for what is not a matrix: parameter or buffer name ->
        ``fill``; may also override a matrix's rule. Default: ones for every 1-D parameter (RMSNorm
        weights). Buffers without a rule keep their constructor values (zeros after ``materialize``)."""
        return {name: init.const(1.0) for name, p in self.named_parameters() if p.dim() == 1}

    def rope_tables(self, position_ids_BT, dtype):
        """RoPE (cos, sin) [B, T, rotary_dim] in ``dtype`` (a family with scaled RoPE overrides this)."""
        return rope_cos_sin(position_ids_BT, self.rotary_dim(), self.arch.rope_theta, dtype)

    def layer_flops(self, seq_len: int) -> tuple[list[float], float]:
        """Forward FLOPs of one ``seq_len``-token sequence per decoder layer, and of the LM head:
        the family's ``ModelSpec``, the one source of FLOPs (the planner reads the same)."""
        return self.arch.to_spec().layer_flops(seq_len)

    # ------------------------------------------------------------------ weights
    def init_rules(self, std: float) -> dict:
        """How every parameter starts: name -> ``fill(block, generator)``. HF-style: normal(0, std)
        for matrices, then the family's ``init_vectors``."""
        rules = {name: init.normal(std) for name, p in self.named_parameters() if p.dim() > 1}
        rules.update(self.init_vectors(std))
        from bumblebee.models.lora import lora_init_rules

        rules.update(lora_init_rules(self.named_parameters(), init))
        return rules

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02, seed: int | None = None, only=None) -> None:
        """Initialize in place, identically for every layout of ``seed``: each value is a function
        of (seed, tensor name, position) only (primitives/init.py), so an expert slice, an FSDP2
        shard or a pipeline stage gets exactly its part of the full tensors, generated one block
        at a time. ``seed=None`` draws one from torch's global generator. Nothing to do on meta.
        ``only(name) -> bool``: the parameters to fill (the adapters of a model loaded from HF)."""
        if any(
            p.is_meta or is_fake(p) for p in self.parameters()
        ):  # shapes only (meta, or the planner's fakes)
            return
        if seed is None:
            seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
        rules = self.init_rules(std)
        ep, r = self.groups.ep_size, self.groups.ep_rank
        for name, p in self.named_parameters():
            if only is not None and not only(name):
                continue
            if name not in rules:
                raise NotImplementedError(
                    f"{type(self).__name__}: no init rule for {name} (init_vectors)"
                )
            shape, lo, part = row_extent(p, self.is_expert_param(name), r, ep)
            init.fill_rows(part, shape, lo, rules[name], seed, name)
        for name, b in self.named_buffers():
            if name in rules and only is None:
                init.fill_rows(b, tuple(b.shape), 0, rules[name], seed, name)

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

    # ------------------------------------------------------------------ protocol for the runtime
    @property
    def decoder_layers(self) -> nn.ModuleList:
        return self.model.layers

    def expert_modules(self) -> list[nn.Module]:
        return [m for m in self.modules() if isinstance(m, Experts)]

    def is_expert_param(self, name: str) -> bool:
        """Whether parameter ``name`` is a routed-expert weight (sharded over ep, reduced over edp)."""
        names = self.__dict__.get("_expert_names")
        if names is None:
            names = {
                f"{mn}.{pn}"
                for mn, m in self.named_modules()
                if isinstance(m, Experts)
                for pn, _ in m.named_parameters()
            }
            self.__dict__["_expert_names"] = names
        return name in names

    def fsdp_units(self):
        """(module, "expert" | "dense" | "embedding") in wrapping order: the embedding (when the LM
        head does not share it; "embedding": dense mesh, and not gathered for its backward, which
        reads only the token ids), each decoder layer's experts (over the expert mesh), then the
        layer itself (dense mesh); the MTP part likewise; then the LM head (``LMHead``: gathered
        around each ``apply_head`` call and its backward). Each of the two [V, H] tables is thus
        gathered only while it is used, not for the whole step as the parameters of the root
        unit (the model itself: final norm, and the embedding when tied) are."""
        if self.model.embed_tokens is not None and self.lm_head is not None:
            yield self.model.embed_tokens, "embedding"
        mtp = [] if self.mtp is None else self.mtp_units()
        for layer in list(self.model.layers) + mtp:
            for m in layer.modules():
                if isinstance(m, Experts):
                    yield m, "expert"
            yield layer, "dense"
        if self.lm_head is not None:
            yield self.lm_head, "dense"

    def keep_stages(self, stage_layers: dict[int, list[int]], num_stages: int) -> None:
        """Keep only this rank's pipeline stages: their layers (placeholders elsewhere, so
        parameter names stay global), the embedding with stage 0, the final norm and LM head
        with the last stage."""
        kept = {i for layers in stage_layers.values() for i in layers}
        for i in range(len(self.model.layers)):
            if i not in kept:
                self.model.layers[i] = Elsewhere(i)
        if 0 not in stage_layers:
            self.model.embed_tokens = None
        if num_stages - 1 not in stage_layers:
            self.model.norm = self.lm_head = self.mtp = None
        self.stage_layers, self.num_stages = stage_layers, num_stages
        self.__dict__.pop("_expert_names", None)

    def layer_context(self, position_ids_BT, dtype):
        """What every decoder layer takes besides its input: RoPE (cos, sin) in ``dtype`` and the
        document layout (the CP layout when the sequence is split)."""
        cp_group = self.groups.cp_group if self.groups.cp_size > 1 else None
        layout = (
            build_cp_layout(position_ids_BT, cp_group)
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
            x = self.model.embed_tokens(inputs)
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
                stats.append(s)
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
        balance loss of definition ``balance`` (``micro_batch`` | ``hf``; ``global_batch``: 0 here,
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
        sums = self.apply_head(summed_losses, hidden, labels, self.loss_fn)
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
        if balance != "global_batch":
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
        check_token_ids(input_ids, self.arch.vocab_size)
        if labels is None:
            h_BTH, _ = self.routed_hidden_states(input_ids, position_ids)
            return self.apply_head(F.linear, h_BTH)
        terms = self.loss_terms(input_ids, labels, position_ids)
        return terms.loss_sum / terms.num_tokens.clamp(min=1)

    # ------------------------------------------------------------------ decoding with a K/V cache
    def new_kv_cache(self, rows: int, length: int) -> KVCache:
        """An empty cache for ``rows`` sequences of up to ``length`` tokens (full attention only)."""
        if any(
            getattr(layer, "layer_type", "full_attention") != "full_attention"
            for layer in self.decoder_layers
        ):
            raise NotImplementedError(
                f"{self.family}: K/V-cache decoding needs full attention in every layer "
                "(linear attention would carry a recurrent state instead)"
            )
        a, w = self.arch, self.lm_head_weight
        return KVCache(
            len(self.decoder_layers),
            rows,
            a.num_key_value_heads,
            length,
            a.head_dim,
            w.dtype,
            w.device,
        )

    @torch.no_grad()
    def forward_cached(
        self, ids_RT, position_ids_RT, cache: KVCache, start: int, mask_R1TS
    ) -> torch.Tensor:
        """Logits [R, T, V] (fp32) of new tokens ``ids_RT`` whose keys/values go to cache slots
        ``[start, start + T)``; ``mask_R1TS`` says which slots each new token attends."""
        x = self.model.embed_tokens(ids_RT)
        cos, sin = self.rope_tables(position_ids_RT, x.dtype)
        cache.start, cache.mask_R1TS = start, mask_R1TS
        for i, layer in enumerate(self.decoder_layers):
            cache.layer = i
            x, _ = layer(x, cos, sin, cache)
        return self.apply_head(F.linear, self.model.norm(x)).float()
