"""The routing and multi-token-prediction protocol of ``CausalLM`` (models/base.py): which
routers this rank holds and which rows of the whole model's router stats they are, the
balance loss of a micro-batch (or of one pipeline stage's share of it), expert capacity,
the ``sigmoid_bias`` routers' bias update, routing recording for replay, and how many MTP
depths train. A mixin: it reads the model's ``model.layers``, ``mtp``, ``groups`` and
layer counts, and holds no state of its own."""

from __future__ import annotations

import torch
from torch import nn

from bumblebee.primitives.moe import balance
from bumblebee.primitives.moe import replay as routing_replay


class RoutingProtocol:
    def routers(self) -> list[nn.Module]:
        """The router of every MoE layer this rank holds, in layer order (the order of the rows of
        ``LossTerms.router_stats``), then those of the trained MTP depths (``router_rows()`` says
        which rows of the whole model's router stats they are)."""
        mtp = [block.gate for block in self.mtp_moe_blocks()[: self.mtp_depth]]
        return [
            layer.mlp.gate for layer in self.model.layers if getattr(layer, "is_moe", False)
        ] + mtp

    def router_row_count(self) -> int:
        """Rows of the whole model's router stats: its decoder MoE layers, then the trained MTP
        depths' MoE layers (the same on every pipeline stage)."""
        return self.main_moe_layers + min(self.mtp_depth, self.mtp_moe_held)

    def router_rows(self, stage: int | None = None) -> list[int]:
        """Rows (``moe_index``) of the whole model's router stats that pipeline ``stage`` produces, in
        its stats' order (None: every MoE layer this rank holds, ``routers()``' order)."""
        ids = range(len(self.model.layers)) if stage is None else self.stage_layers[stage]
        rows = [
            self.model.layers[i].mlp.moe_index
            for i in ids
            if getattr(self.model.layers[i], "is_moe", False)
        ]
        if stage is None or stage == self.num_stages - 1:
            rows += [block.moe_index for block in self.mtp_moe_blocks()[: self.mtp_depth]]
        return rows

    def mtp_moe_blocks(self) -> list[nn.Module]:
        """The MoE blocks of the MTP part, depth by depth."""
        if getattr(self, "mtp", None) is None:
            return []
        return [m for unit in self.mtp_units() for m in unit.modules() if hasattr(m, "moe_index")]

    def set_capacity(self, capacity_factor: float) -> None:
        """Expert capacity with token dropping in every MoE layer (0: off; primitives/moe/capacity.py)."""
        for layer in self.model.layers:
            if getattr(layer, "is_moe", False):
                layer.mlp.capacity_factor = float(capacity_factor)

    @torch.no_grad()
    def update_router_bias(self, counts_LE: torch.Tensor, rate: float) -> None:
        """After an optimizer step: routers with a selection bias (``sigmoid_bias``) move it by the
        step's global expert load ``counts_LE`` (``router_row_count()`` rows: the whole model's MoE
        layers; a pipeline stage reads the rows of the layers it holds)."""
        assert counts_LE.shape[0] == self.router_row_count(), (
            self.router_row_count(),
            counts_LE.shape,
        )
        for router, row in zip(self.routers(), self.router_rows(), strict=True):
            if hasattr(router, "update_bias"):
                router.update_bias(counts_LE[row], rate)

    def balance_loss(
        self,
        stats_LS: torch.Tensor | None,
        mode: str = "micro_batch",
        num_layers: int | None = None,
    ) -> torch.Tensor:
        """The balance loss of one micro-batch from its router stats: ``micro_batch`` (per layer, mean
        over the model's MoE layers, ``num_layers`` with the MTP ones) or ``hf`` (transformers' pooled
        definition); sums span the sequence under CP. 0 without MoE layers."""
        if stats_LS is None:
            return torch.zeros((), dtype=torch.float32, device=next(self.parameters()).device)
        cp_group = self.groups.cp_group if self.groups.cp_size > 1 else None
        if mode == "hf":
            return balance.hf_loss(stats_LS, cp_group)
        assert mode == "micro_batch", mode
        return balance.micro_batch_loss(stats_LS, num_layers or self.num_moe_layers, cp_group)

    def set_mtp(self, depth: int | str = "auto", loss_weight: float = 0.1) -> None:
        """Train the first ``depth`` MTP modules ("auto": all the model holds, 0: none) with the
        weight ``loss_weight`` (config ``[mtp]``)."""
        held = self.mtp_held
        depth = held if depth == "auto" else depth
        if not 0 <= depth <= held:
            raise ValueError(
                f"mtp.depth {depth} is more than the {held} MTP module(s) this model holds "
                f"(set the architecture's MTP layer count to add modules)"
            )
        self.mtp_depth, self.mtp_loss_weight = depth, float(loss_weight)

    @property
    def pipelined_mtp(self) -> bool:
        """MTP trained on the last of several pipeline stages: stage 0 embeds the shifted tokens
        and the stages pass those embeddings on beside the hidden states."""
        return self.num_stages > 1 and self.mtp_depth > 0

    @torch.no_grad()
    def record_routing(self, input_ids, position_ids=None) -> torch.Tensor:
        """The experts every MoE layer chooses for ``input_ids`` [B, T]: ids [B, T, L, K] (L MoE
        layers in order), from a no-grad forward; feed them back as ``RoutingScope(replay_BTLK=...)``."""
        from bumblebee.models.head import check_forward_inputs

        check_forward_inputs(self, input_ids, position_ids)
        scope = routing_replay.RoutingScope(record={})
        self.hidden_states(input_ids, position_ids, routing=scope)
        return scope.recorded()

    def part_balance(self, stats_LS: torch.Tensor | None, stage: int | None) -> torch.Tensor:
        """The balance loss of what this part ran: a pipeline ``stage`` averages over the whole
        model's router rows (its share of the mean), the whole model over its own MoE layers."""
        return self.balance_loss(
            stats_LS, num_layers=self.router_row_count() if stage is not None else None
        )
