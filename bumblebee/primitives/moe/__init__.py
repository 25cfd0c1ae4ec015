"""MoE primitives: router, expert FFNs, token dispatch/combine."""

from bumblebee.primitives.moe import alltoall, chunked, experts, local, router, sigmoid_bias  # noqa: F401  (registers implementations)
