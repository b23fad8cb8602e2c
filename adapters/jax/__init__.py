"""srround for JAX: the functional API on ``jax.Array`` s, optimizers and loss scales.

* ``stochastic_round``, ``round_nearest``, ``to_float32``, ``stochastic_add``,
  ``quantize_blocks``, ``dequantize_blocks``: the functional API, jit-able on any backend
  (``srround.stochastic_round(jax_array)`` etc. delegate here).
* ``apply_updates`` (``optax.apply_updates`` with stochastic rounding), ``adamw`` and ``sgd``
  (fused optimizers that are optax ``GradientTransformation`` s, states ``AdamWState`` and
  ``SGDState``; ``ADAMW_STATIC_ARGS``/``SGD_STATIC_ARGS``: their ``static_args`` under
  ``optax.inject_hyperparams``); ``stochastic_write_back`` (last in an ``optax.chain``: any
  optimizer's updates written back with stochastic rounding by ``optax.apply_updates``).
* ``DynamicLossScale``, ``StaticLossScale``, ``NoOpLossScale``, ``all_finite``,
  ``select_tree``: loss scaling with jmp's interface.
"""

from . import _requires  # noqa: F401  (an older JAX than the adapter needs: ImportError here)
from ._api import (
    dequantize_blocks,
    quantize_blocks,
    round_nearest,
    stochastic_add,
    stochastic_round,
    to_float32,
)
from .loss_scale import (
    DynamicLossScale,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
    select_tree,
)
from .optim import (
    ADAMW_STATIC_ARGS,
    SGD_STATIC_ARGS,
    AdamWState,
    SGDState,
    WriteBackState,
    adamw,
    apply_updates,
    sgd,
    stochastic_write_back,
)

__all__ = [
    "ADAMW_STATIC_ARGS",
    "SGD_STATIC_ARGS",
    "AdamWState",
    "DynamicLossScale",
    "NoOpLossScale",
    "SGDState",
    "StaticLossScale",
    "WriteBackState",
    "adamw",
    "all_finite",
    "apply_updates",
    "dequantize_blocks",
    "quantize_blocks",
    "round_nearest",
    "select_tree",
    "sgd",
    "stochastic_add",
    "stochastic_round",
    "stochastic_write_back",
    "to_float32",
]
