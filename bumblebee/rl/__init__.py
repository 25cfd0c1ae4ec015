"""Reinforcement learning on top of the training stack: fused policy-gradient losses
(``losses``), packed rollout batches (``batch``; shared-prefix trees: ``shared_prefix``), the
actor API an RL framework drives (``actor.Engine``, exported as ``bumblebee.Engine``), and the embedded GRPO run behind
``bumblebee rl`` (``toy``, ``sampler``, ``run``, ``cli``). Imports models, primitives
and runtime; only the CLI and ``bumblebee/__init__`` import it."""

from bumblebee.rl.batch import RLBatch, pack_sequences  # noqa: F401
from bumblebee.rl.losses import (
    PolicyInputs,
    PolicyLoss,
    TokenNLL,
    aggregation_weights,  # noqa: F401
    grpo_advantages,
    kl_penalty,
    ppo_clip,
    token_logprobs,
)
from bumblebee.rl.shared_prefix import Segment, pack_shared_prefix, pack_tree

__all__ = [
    "RLBatch",
    "pack_sequences",
    "Segment",
    "pack_tree",
    "pack_shared_prefix",
    "PolicyInputs",
    "PolicyLoss",
    "TokenNLL",
    "aggregation_weights",
    "grpo_advantages",
    "kl_penalty",
    "ppo_clip",
    "token_logprobs",
]
