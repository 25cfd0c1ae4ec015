"""MoE primitives: router, expert FFNs, token dispatch/combine."""

from bumblebee.primitives.moe import (  # noqa: F401  (registers implementations)
    alltoall,
    chunked,
    experts,
    local,
    overlap_mb,
    router,
    sigmoid_bias,
)
