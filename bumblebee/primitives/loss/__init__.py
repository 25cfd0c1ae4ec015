"""Loss primitives: LM head + cross-entropy (materialized reference, fused linear CE)."""

from bumblebee.primitives.loss import ce  # noqa: F401  (registers implementations)
from bumblebee.primitives.loss.ce import cross_entropy  # noqa: F401
