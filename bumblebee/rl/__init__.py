"""Reinforcement learning on top of the training stack: fused policy-gradient losses
(``losses``), packed rollout batches (``batch``), the actor API an RL framework drives
(``actor.Engine``), and the embedded GRPO run behind ``bumblebee rl`` (``toy``,
``sampler``, ``run``, ``cli``). Imports models, primitives and runtime; only the CLI
and ``bumblebee/__init__`` import it."""
