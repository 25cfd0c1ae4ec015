import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))  # for `import dist_utils`
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _restore_global_torch_state():
    """Trainer(deterministic=True) flips process-wide torch flags; keep tests independent."""
    det = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(det)
