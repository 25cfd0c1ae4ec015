"""Linear-attention primitives: Gated DeltaNet's gated delta rule (slot ``linear_attention``),
its causal conv1d, and the layer that composes them."""

from bumblebee.primitives.linear_attention import gated_delta_rule  # noqa: F401  (registers implementations)
