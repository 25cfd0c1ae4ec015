"""State sharding: none (single process), zero1 (distributed optimizer), fsdp2 (ZeRO-3)."""

from bumblebee.primitives.sharding import fsdp2, none, zero1  # noqa: F401  (registers implementations)
