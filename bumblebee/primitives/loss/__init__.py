"""Loss primitives: LM head + cross-entropy (materialized reference, fused linear CE)."""

from bumblebee.primitives.loss import ce, linear_ce  # noqa: F401  (registers implementations)
from bumblebee.primitives.loss.ce import cross_entropy  # noqa: F401
from bumblebee.primitives.loss.linear_ce import linear_cross_entropy  # noqa: F401
