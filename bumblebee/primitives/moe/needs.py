"""Requirements the MoE exchanges declare about the run (``registry.Need``), shared by several."""

from __future__ import annotations

from bumblebee.registry import Need

# all experts on one rank
ONE_RANK = Need(
    "parallel.ep = 1 (it keeps every expert on one rank; with ep > 1 use 'alltoall')",
    lambda f: f.ep == 1,
)
# an exchange at ep = 1 moves nothing: it runs, but the planner prices the local dispatch there
EXCHANGES = Need(
    "parallel.ep > 1 (with ep = 1 there is no exchange: the planner prices 'local')",
    lambda f: f.ep > 1,
    plan_only=True,
)
