"""Replaceable capabilities behind registry slots. Importing this package registers
every implementation; nothing here imports models, runtime, rl or plan."""

from bumblebee.primitives import (  # noqa: F401  (imported to register)
    attention,
    cp,
    linear_attention,
    loss,
    moe,
    pipeline,
    recompute,
    sharding,
)
