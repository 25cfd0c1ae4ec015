"""Aux-loss-free router (slot ``router``, implementation ``sigmoid_bias``).

The DeepSeek-V3 router (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", sec. 2.1.2;
Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts"):

  scores s = sigmoid(x W^T)                      fp32, autocast off (the bias steps are ~1e-3)
  choice  = s + b                                b: per-expert bias, used for *selection only*
  group-limited top-k (``n_group > 1``): experts form n_group equal groups; a group's
          score is the sum of its two best ``choice`` values; only the ``topk_group``
          best groups may be chosen from
  idx     = top-k of ``choice`` (within the kept groups)
  weights = s[idx] (unbiased), / their sum if ``norm_topk_prob`` (+1e-20), * routed_scaling_factor

After every optimizer step the runtime calls ``update_bias(load_E, rate)`` with the step's
expert load over the *global* batch (all micro-batches, dp and cp ranks; runtime/step.py):
``b += rate * sign(mean(load) - load)``, so overloaded experts get chosen less. ``b`` is the
buffer ``e_score_correction_bias`` (Hugging Face's name: checkpoints carry it, export writes
it as ``model.layers.{i}.mlp.gate.e_score_correction_bias``); it gets no gradient.

``probs_TE`` (what a balance loss multiplies) are the normalized scores s / sum(s), as in
DeepSeek-V3's complementary sequence-wise balance loss; set the arch's
``router_aux_loss_coef = 0`` for a purely aux-loss-free run.

Replay: ``forward(x, idx_TK=given)`` skips the selection and computes the weights of the given
experts from the current scores (they receive gradients as usual).

Legend: T tokens, H hidden, E experts, K experts per token, G groups.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bumblebee.errors import ConfigError
from bumblebee.primitives.moe.router import Routing
from bumblebee.registry import register


def check_groups(num_experts: int, top_k: int, n_group: int, topk_group: int) -> None:
    """One-line errors for a group-limited top-k that cannot be built."""
    if n_group < 1 or num_experts % n_group:
        raise ConfigError(
            f"n_group must be >= 1 and divide num_experts ({num_experts}), got {n_group}"
        )
    if not 1 <= topk_group <= n_group:
        raise ConfigError(f"topk_group must be in 1..n_group ({n_group}), got {topk_group}")
    per_group = num_experts // n_group
    if n_group > 1 and per_group < 2:
        raise ConfigError(
            f"group-limited routing scores a group by its two best experts; "
            f"num_experts / n_group = {per_group} < 2"
        )
    if top_k > topk_group * per_group:
        raise ConfigError(
            f"num_experts_per_tok ({top_k}) exceeds the experts of the kept groups "
            f"(topk_group {topk_group} x {per_group})"
        )


def select_experts(
    choice_TE: torch.Tensor, top_k: int, n_group: int, topk_group: int
) -> torch.Tensor:
    """Top-k expert ids of ``choice_TE`` (biased scores), limited to the ``topk_group`` best of
    ``n_group`` groups (group score: sum of its two best experts). Ties go to the lower id."""
    if n_group > 1:
        T, E = choice_TE.shape
        grouped_TGX = choice_TE.view(T, n_group, E // n_group)
        group_score_TG = grouped_TGX.topk(2, dim=-1).values.sum(dim=-1)
        keep_TG = torch.zeros_like(group_score_TG, dtype=torch.bool)
        keep_TG.scatter_(1, group_score_TG.topk(topk_group, dim=-1).indices, True)
        choice_TE = grouped_TGX.masked_fill(~keep_TG[..., None], float("-inf")).view(T, E)
    return choice_TE.topk(top_k, dim=-1).indices


@register(
    "router",
    "sigmoid_bias",
    summary="sigmoid scores, load-driven selection bias (aux-loss-free), group-limited top-k",
)
class SigmoidBiasRouter(nn.Module):
    """``SigmoidBiasRouter(hidden, num_experts, top_k, norm_topk_prob, *, n_group=1, topk_group=1,
    routed_scaling_factor=1.0)``; parameter ``weight`` [E, H], buffer ``e_score_correction_bias`` [E]."""

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        *,
        n_group: int = 1,
        topk_group: int = 1,
        routed_scaling_factor: float = 1.0,
    ):
        super().__init__()
        check_groups(num_experts, top_k, n_group, topk_group)
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.register_buffer(
            "e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32)
        )
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.n_group, self.topk_group, self.routed_scaling_factor = (
            n_group,
            topk_group,
            float(routed_scaling_factor),
        )

    def scores(self, x_TH: torch.Tensor) -> torch.Tensor:
        """sigmoid(x W^T) in fp32 (autocast off: the bias steps need the fp32 resolution)."""
        with torch.autocast(x_TH.device.type, enabled=False):
            return torch.sigmoid(F.linear(x_TH.float(), self.weight.float()))

    def forward(self, x_TH: torch.Tensor, idx_TK: torch.Tensor | None = None) -> Routing:
        s_TE = self.scores(x_TH)
        if idx_TK is None:
            with torch.no_grad():
                choice_TE = s_TE + self.e_score_correction_bias.to(s_TE.device)
                idx_TK = select_experts(choice_TE, self.top_k, self.n_group, self.topk_group)
        w_TK = s_TE.gather(1, idx_TK)
        if self.norm_topk_prob:
            w_TK = w_TK / (w_TK.sum(dim=-1, keepdim=True) + 1e-20)
        w_TK = w_TK * self.routed_scaling_factor
        probs_TE = s_TE / s_TE.sum(dim=-1, keepdim=True)
        return Routing(probs_TE, idx_TK, w_TK.to(x_TH.dtype))

    @torch.no_grad()
    def update_bias(self, load_E: torch.Tensor, rate: float) -> None:
        """``b += rate * sign(mean(load) - load)``: ``load_E`` is the step's token count per expert
        over the global batch (identical on every rank, so every replica stays identical)."""
        load_E = load_E.to(self.e_score_correction_bias.device, torch.float32)
        self.e_score_correction_bias.add_(torch.sign(load_E.mean() - load_E), alpha=rate)
