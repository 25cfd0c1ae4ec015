"""Context parallelism: zigzag sequence sharding and CP attention (allgather, ring)."""

from bumblebee.primitives.cp import allgather, ring  # noqa: F401  (registers implementations)
from bumblebee.primitives.cp.zigzag import CPShards, build_cp_shards, shard_sequence, zigzag_index  # noqa: F401
