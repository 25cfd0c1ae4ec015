"""Context parallelism: zigzag sequence sharding and CP attention (allgather, ring)."""

from bumblebee.primitives.cp import allgather, ring  # noqa: F401  (registers implementations)
from bumblebee.primitives.cp.layout import CPLayout, build_cp_layout, shard_sequence, zigzag_index  # noqa: F401
