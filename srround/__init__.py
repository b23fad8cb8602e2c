"""srround: stochastic rounding, fused low-precision optimizer updates and loss scaling, as
Numba kernels for CPU and CUDA, usable from NumPy, CuPy, PyTorch and JAX."""

from srround import _cache

# before any kernel module is decorated: Numba's cache keyed on srround's sources (_cache.py)
_cache.install()

from srround import audit
from srround._api import (
    adamw_step,
    round_nearest,
    sgd_step,
    stochastic_add,
    stochastic_round,
    to_float32,
    unscale_and_check,
    update_scale,
)
from srround._formats import FORMATS, Format
from srround._rng import manual_seed

__version__ = "0.1.0"

__all__ = [
    "FORMATS",
    "Format",
    "adamw_step",
    "audit",
    "manual_seed",
    "round_nearest",
    "sgd_step",
    "stochastic_add",
    "stochastic_round",
    "to_float32",
    "unscale_and_check",
    "update_scale",
]
