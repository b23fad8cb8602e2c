"""srround: stochastic rounding, fused low-precision optimizer updates and loss scaling, as
Numba kernels for CPU and CUDA, usable from NumPy, CuPy, PyTorch and JAX."""

import importlib

from srround import _cache, _threads

# before any kernel module is decorated: Numba's cache keyed on srround's sources (_cache.py)
_cache.install()
_threads.select_threading_layer()  # before any kernel runs: safe with threads and fork

from srround import audit  # noqa: E402
from srround._api import (  # noqa: E402
    adamw_step,
    round_nearest,
    sgd_step,
    stochastic_add,
    stochastic_round,
    to_float32,
    unscale_and_check,
    update_scale,
)
from srround._blocks import QuantizedBlocks, dequantize_blocks, quantize_blocks  # noqa: E402
from srround._formats import FORMATS, Format  # noqa: E402
from srround._rng import manual_seed  # noqa: E402
from srround._state8 import STATE_BLOCK  # noqa: E402

__version__ = "0.1.0"


def __getattr__(name: str):
    """``srround.adapters`` (``srround.adapters.torch.AdamW`` after a plain ``import srround``),
    imported on first use: the core never imports an adapter itself."""
    if name == "adapters":
        return importlib.import_module("srround.adapters")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FORMATS",
    "Format",
    "QuantizedBlocks",
    "STATE_BLOCK",
    "adamw_step",
    "audit",
    "dequantize_blocks",
    "manual_seed",
    "quantize_blocks",
    "round_nearest",
    "sgd_step",
    "stochastic_add",
    "stochastic_round",
    "to_float32",
    "unscale_and_check",
    "update_scale",
]
