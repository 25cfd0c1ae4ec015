"""Suite-wide setup: thread count, `import dist_utils`, torch's global flags restored after
each test, and a hard stop when the `[test]` extra is missing.

The Hugging Face `transformers` models are the correctness reference of every model
family (parity, HF round trips, conversion), `peft` that of the LoRA adapter export.
Skipping them when the package is absent would turn a third of the evidence into a green
"skipped", so the run stops instead.
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # for `import dist_utils`
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

MISSING_EXTRA = (
    "{} is not installed: the Hugging Face reference tests need the [test] extra "
    '(pip install -e ".[test]")'
)


def pytest_configure(config):
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise pytest.UsageError(MISSING_EXTRA.format("transformers")) from None
    try:
        import peft  # noqa: F401  (the LoRA adapter round trip's reference)
    except ImportError:
        raise pytest.UsageError(MISSING_EXTRA.format("peft")) from None


@pytest.fixture(autouse=True)
def _restore_global_torch_state():
    """Trainer(deterministic=True) flips process-wide torch flags; keep tests independent."""
    det = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(det)
