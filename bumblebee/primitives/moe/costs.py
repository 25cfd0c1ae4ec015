"""What a MoE exchange (``moe_comm``) holds in memory and how it hides its exchanges, declared
next to its code (``register(..., costs=MoeCommCosts(...))``) and read by the planner through the
registry (plan/routed_bytes.py, perf_layer.py, recipe.py), so that the planner never interprets
an exchange by name.

Routed buffers are counted in units of one bf16 [k*t, H] row tensor (X) and one bf16 [k*t, F]
tensor (A), split into home-side tensors (this rank's own k*t rows: permuted, sent, returned) and
expert-side ones (rows this rank's experts receive, which routing skew scales), at the MoE
block's largest moment of each phase; ``plan/routed_bytes.py`` says how each was counted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# ((home X, home A), (expert-side X, expert-side A)) of one phase
Units = tuple[tuple[float, float], tuple[float, float]]


def both_grads(fc1: float, fc2: float, phase: str) -> float:
    """The experts' weight gradients alive in backward: fc1's and fc2's together."""
    return fc1 + fc2


@dataclass(frozen=True, kw_only=True)
class MoeCommCosts:
    # phase ("fwd", "recompute", "bwd", optionally "bwd_wgrad") -> the candidate moments of its
    # routed units (the planner takes the largest by unskewed bytes), given the chunk count c and
    # ``last`` (1 when the layer's last saving op is the combine: no shared expert after it, so a
    # recompute stops before allocating the combine's product)
    routed: Callable[[float, int], dict[str, tuple[Units, ...]]]
    # tokens cross ranks: the all-to-all time counts, and skewed routing scales the expert side
    exchanges: bool = True
    # how the exchanges hide: "none" (exposed), "chunks" (pipelined in c chunks under its own
    # expert GEMMs), "partner" (under the other micro-batch of a pair's whole layer pass)
    overlap: str = "none"
    # all-to-alls of a full recompute's forward pass (chunked skips the combine's)
    recompute_exchanges: int = 2
    # bytes of expert weight gradients alive at a backward phase, from fc1's and fc2's
    expert_grads: Callable[[float, float, str], float] = both_grads
    # the primitives.* variants the recipe searches (empty: only where --set fixes it), and its
    # rank among the exchanges searched (higher first: equal candidates list it first)
    searched: tuple[dict[str, Any], ...] = ({},)
    preference: int = 0
    # its planner label from the run's primitives (default: the name)
    label: Callable[[Any], str] | None = None
    # the implementation its gain is measured against, also what a comparison falls back to
    # where this one's needs are not met ("": none)
    baseline: str = ""
    # the recipe's reason for it, str.format with prims and gain (tokens/s vs the baseline)
    explain: str = ""
