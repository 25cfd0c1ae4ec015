"""Attention primitives: causal attention cores over packed documents."""

from bumblebee.primitives.attention import sdpa  # noqa: F401  (registers implementations)
