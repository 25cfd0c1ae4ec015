"""What a sharding implementation keeps per parameter and what it communicates, declared next to
its code (``register(..., costs=ShardingCosts(...))``) and read by the planner through the registry
(plan/memory.py, timeline.py, perf.py), so that the planner never interprets a sharding by name.

Bytes per parameter of a bf16 run with fp32 master weights; "sharded" is over the ranks that
hold a copy (dense: dp_shard * cp, experts: edp).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ShardingCosts:
    param_bytes: int  # the parameters as held between steps ...
    grad_bytes: int  # ... their gradients ...
    optim_bytes: int  # ... and the optimizer state (fp32 master and Adam moments where separate)
    params_sharded: bool  # parameters and gradients held as shards (else whole on every rank)
    optim_sharded: bool  # optimizer state held, and updated, as shards
    gathers_per_layer: bool  # all-gathers each layer's parameters in forward and backward
    sync_bytes_per_param: int  # a once-per-step gradient / parameter sync (0: none)
    # --explain formula, str.format with shard and full (billions of parameters), where, dpcp, edp
    explain: str
