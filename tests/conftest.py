"""Suite-wide setup: thread count, `import dist_utils`, torch's global flags restored after
each test, a hard stop when the `[test]` extra is missing, and the Hugging Face linear-attention
references kept on their PyTorch path where fla-core is installed.

The Hugging Face `transformers` models are the correctness reference of every model
family (parity, HF round trips, conversion), `peft` that of the LoRA adapter export.
Skipping them when the package is absent would turn a third of the evidence into a green
"skipped", so the run stops instead.
"""

import importlib
import importlib.util
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


# transformers replaces its Gated DeltaNet / KDA functions by fla-core's Triton kernels wherever
# `fla` imports (the torch-2.11 CI environment has it; CPU has no Triton to run them). The
# parity references are transformers' PyTorch path, so those modules get it back there.
HF_LINEAR_ATTENTION = ("qwen3_next", "qwen3_5_moe", "kimi_linear")


def _fla_fallbacks(module):
    """(name, PyTorch function) of each function of ``module`` that transformers bound to another
    package's implementation (its fallback wrapper keeps both: ``implementation`` in its closure,
    the PyTorch function as ``__wrapped__``)."""
    out = []
    for name, fn in vars(module).items():
        code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
        if code is None or "implementation" not in code.co_freevars:
            continue
        impl = cells[code.co_freevars.index("implementation")].cell_contents
        if impl is not getattr(fn, "__wrapped__", impl):
            out.append((name, fn.__wrapped__))
    return out


@pytest.fixture(autouse=True, scope="session")
def _hf_references_on_their_pytorch_path():
    if importlib.util.find_spec("fla") is None:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        for family in HF_LINEAR_ATTENTION:
            module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
            swaps = _fla_fallbacks(module)
            if not swaps:
                raise pytest.UsageError(
                    f"fla is installed but no FLA-backed function was found in {module.__name__}: "
                    "transformers changed how it binds FLA; its reference would run Triton"
                )
            for name, torch_fn in swaps:
                mp.setattr(module, name, torch_fn)
        yield
