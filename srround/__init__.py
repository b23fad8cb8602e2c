"""srround: stochastic rounding, fused low-precision optimizer updates and loss scaling, as
Numba kernels for CPU and CUDA, usable from NumPy, CuPy, PyTorch and JAX."""

from srround import audit
from srround._api import adamw_step
from srround._api import round_nearest
from srround._api import sgd_step
from srround._api import stochastic_add
from srround._api import stochastic_round
from srround._api import to_float32
from srround._api import unscale_and_check
from srround._api import update_scale
from srround._formats import FORMATS
from srround._formats import Format
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
