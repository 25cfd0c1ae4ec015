"""What a loss implementation holds in memory and how it runs, declared next to its code
(``register(..., costs=LossCosts(...))``) and read by the planner through the registry
(plan/memory.py, timeline.py, perf.py), so that the planner never interprets a loss by name.

Per micro-batch of ``t`` tokens, the vocabulary shard ``v = V / tp`` and the hidden size ``h``;
bytes of a bf16 run. The final norm's saved tensors are the planner's (the model's), not here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class LossCosts:
    kept_per_token: int  # bytes per token a finished forward keeps for its backward ...
    kept_per_logit: int  # ... and per logit of its [t, v] block
    work_per_logit: int  # bytes per logit alive while it runs (forward + backward, or eval)
    work_per_hidden: int  # bytes per element of [t, h]: the hidden-side gradients it holds itself
    head_grad_per_weight: int  # bytes per element of the [v, h] head: a gradient it holds itself
    workspace: int  # fixed bytes alive while it runs (its tiles)
    tiled_head: bool  # the head GEMM runs in vocabulary tiles inside it (plan: linear_ce_slowdown)
    # --explain formulas, str.format with t, v, h and norm (the final norm's bytes per token)
    explain: str
    explain_eval: str
