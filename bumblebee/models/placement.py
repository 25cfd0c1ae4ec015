"""Where a model's parts live (the ``Placement`` part of ``CausalLM``, models/base.py): the
protocol the runtime and the sharding primitives call instead of reaching into attribute paths
or parameter names: the decoder layers, the routed-expert parameters (sharded over ep), the
FSDP2 units in wrapping order, and what a pipeline stage keeps. A mixin: it reads the model's
``model``, ``lm_head``, ``mtp`` and ``mtp_units``.
"""

from __future__ import annotations

from torch import nn

from bumblebee.primitives.moe.experts import Experts


class Elsewhere(nn.Module):
    """Stands in for a decoder layer that another pipeline stage holds (no parameters)."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def forward(self, *args):
        raise RuntimeError(f"decoder layer {self.index} lives on another pipeline stage")


class Placement:
    """What the runtime asks a model about where its parameters go."""

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
