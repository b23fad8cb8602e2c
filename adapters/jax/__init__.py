"""JAX: the functional API on ``jax.Array`` (jit-able), optimizers and loss scales."""

from ._lax import (  # noqa: F401
    IMPLS,
    _fma_bits,
    _threefry2x32,
    buffer_table,
    counter,
    inplace,
    round_nearest,
    source,
    stochastic_add,
    stochastic_round,
    target,
    to_float32,
)
from .loss_scale import (  # noqa: F401
    DynamicLossScale,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
    select_tree,
)
from .optim import AdamWState, FusedAdamW, adamw, apply_updates  # noqa: F401

__all__ = [
    "DynamicLossScale",
    "IMPLS",
    "NoOpLossScale",
    "StaticLossScale",
    "all_finite",
    "round_nearest",
    "select_tree",
    "stochastic_add",
    "stochastic_round",
    "to_float32",
]
