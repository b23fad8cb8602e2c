"""Loss scales for JAX as immutable pytrees (jmp's interface and dtype rules), usable inside ``jit``
and ``shard_map``.

``scale(tree)`` multiplies a loss (or any tree) by the float32 scale, ``unscale(tree)`` multiplies
gradients by its float32 inverse, ``adjust(grads_finite)`` returns the next loss scale. As in jmp,
every leaf is multiplied by a float32 scalar and promoted as JAX promotes: bf16/fp16/int leaves
become float32 (scaling an fp16 loss by 2**16 cannot overflow, unscaled fp16 gradients keep values
below fp16's range), float32 stays float32 and float64 (under ``jax_enable_x64``) float64;
``float0`` leaves (``jax.grad(..., allow_int=True)`` of integer inputs) pass through. Every
field survives ``tree_flatten``/``tree_unflatten``: the arrays are children, the settings are the
(static) auxiliary data - so a ``min_scale`` is never lost (jmp's flatten drops it).

Arguments after the scale are keyword-only: jmp's positional order ``(loss_scale, counter,
period, factor)`` is a ``TypeError``, never a silent third order. ``grads_finite`` and
``select_tree``'s ``pred`` must be bool scalars (``ValueError``/``TypeError`` otherwise; jmp
asserts). The scale itself must be a float scalar (kept as float32, the trackers as int32).

``DynamicLossScale.adjust`` is ``srround.update_scale``'s rule, so its trajectory equals
``torch.amp.GradScaler``'s for ``hysteresis=1`` and ``min_scale=0`` - and jmp's for
``backoff_factor = 1 / growth_factor`` and the default ``min_scale=1`` (jmp's minimum). The
factors are float32 here, as in jmp (JAX computes in float32): a factor that float32 cannot
hold (1.1, 0.9) gives other bits than ``srround.update_scale`` and torch, which multiply by the
float64 factor and round once; powers of two (the defaults) give the same bits::

    if not grads_finite:
        growth = 0; overflows += 1
        if overflows >= hysteresis: scale = max(scale * backoff_factor, min_scale); overflows = 0
    else:
        overflows = 0; growth += 1
        if growth == growth_interval:
            grown = scale * growth_factor                   # float32
            if isfinite(grown): scale = min(grown, max_scale)
            growth = 0

Under ``shard_map``, ``all_finite(tree, axis_name=...)`` reduces over the named mesh axes, so
every device sees the same flag and adjusts its (replicated) scale identically; under ``jit``
with sharded arrays ``all_finite`` is a global reduction already.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from srround import _validate

from ._api import check_arrays
from ._callback import _varying_axes


def _is_placeholder(x) -> bool:
    """JAX rebuilds pytrees with ``object()`` or ``None`` leaves to learn their structure: no
    checks or conversions for those."""
    return x is None or type(x) is object


def _float_scale(x, name: str):
    """A float scalar scale as float32 (numbers and arrays of any float dtype: ``adjust``
    computes in float32, and the scale keeps its type through loops and conditionals)."""
    if _is_placeholder(x):
        return x
    if isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a float scalar, got a bool")
    if isinstance(x, (int, float, np.integer, np.floating)):
        return np.asarray(x, np.float32)  # 0-d arrays: flax.nnx takes NumPy scalars as static
    if isinstance(x, np.ndarray):
        x = x.astype(np.float32) if np.issubdtype(x.dtype, np.number) else x
    dtype = getattr(x, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"{name}: expected a float scalar (float32 array or Python float), got"
            f" {type(x).__name__} of dtype {dtype}"
        )
    if np.ndim(x) != 0:
        raise ValueError(f"{name}: expected a scalar, got shape {tuple(np.shape(x))}")
    return x if dtype == jnp.float32 else x.astype(jnp.float32)


def _bool_scalar(x, name: str):
    """``x`` as a bool scalar array; a clear error for vectors and non-bool values (a vector of
    flags would silently turn the scale into a vector)."""
    if isinstance(x, (bool, np.bool_)):
        return jnp.bool_(x)
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        raise TypeError(f"{name}: expected a bool scalar, got {type(x).__name__}")
    if np.ndim(x) != 0:
        raise ValueError(
            f"{name}: expected a bool scalar, got shape {tuple(np.shape(x))} (reduce the flags"
            " first, e.g. with all_finite)"
        )
    if dtype != jnp.bool_:
        raise TypeError(f"{name}: expected a bool scalar, got dtype {dtype}")
    return x


def _int_scalar(x, name: str):
    if _is_placeholder(x):
        return x
    if isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)):
        return np.asarray(x, np.int32)
    dtype = getattr(x, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer) or np.ndim(x) != 0:
        raise TypeError(f"{name}: expected an int scalar, got {type(x).__name__} {dtype}")
    return x if dtype == jnp.int32 else x.astype(jnp.int32)  # as adjust computes it


def _is_float0(x) -> bool:
    """A ``float0`` leaf (the gradient of an integer input): no arithmetic, kept as it is."""
    return getattr(x, "dtype", None) == jax.dtypes.float0


def _scale_tree(tree, factor, canonical=False):
    """Every leaf times the float32 scalar ``factor``, promoted as JAX's standard promotion
    does (jmp's rule), also where the user set ``jax_numpy_dtype_promotion="strict"``;
    ``float0`` leaves as they are. ``canonical``: NaN products as +qNaN (``_canonical_nan``)."""

    def scaled(x):
        if _is_float0(x):
            return x
        with jax.numpy_dtype_promotion("standard"):
            y = jnp.asarray(x * factor)
        return _canonical_nan(y) if canonical else y

    return jax.tree_util.tree_map(scaled, tree)


def _canonical_nan(x):
    """``x`` with every NaN its dtype's +qNaN (float32: 0x7FC00000), in integer ops: the NaN
    srround writes for a NaN it computes (x86 keeps a NaN operand's sign, GPUs do not)."""
    dtype = jnp.dtype(x.dtype)
    if not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize < 2:
        return x
    uint = jnp.dtype(f"uint{8 * dtype.itemsize}")
    qnan, inf = (np.array(v, dtype).view(uint) for v in (np.nan, np.inf))
    bits = lax.bitcast_convert_type(x, uint)
    magnitude = bits & uint.type((1 << (8 * dtype.itemsize - 1)) - 1)
    return lax.bitcast_convert_type(jnp.where(magnitude > inf, qnan, bits), dtype)


def _inverse(scale):
    return jnp.float32(1.0) / jnp.asarray(scale, jnp.float32)


# DynamicLossScale's static settings: checked together, the pytree's auxiliary data
_SETTINGS = (
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "hysteresis",
    "min_scale",
    "max_scale",
)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """Dynamic loss scale (a pytree).

    Example::

        ls = DynamicLossScale(jnp.float32(2.0**15), growth_interval=2000)
        loss = ls.scale(loss)                   # float32
        grads = ls.unscale(grads)               # float32 leaves
        finite = all_finite(grads)
        ls = ls.adjust(finite)

    Attributes:
        loss_scale: float scalar, kept as float32 (a number or an array of any float dtype;
            anything after it is keyword-only).
        growth_tracker: int32 scalar, clean steps since the last change (jmp's ``counter``).
        overflow_tracker: int32 scalar, consecutive overflows (for ``hysteresis``).
        growth_factor: float, the growth per ``growth_interval`` clean steps (jmp's ``factor``).
        backoff_factor: float, the factor on an overflow (jmp: ``1 / factor``).
        growth_interval: int >= 1 (jmp's ``period``).
        hysteresis: int >= 1, overflows in a row before backing off.
        min_scale: float >= 0, the floor of the scale (default 1, as jmp).
        max_scale: float, the ceiling (default inf).

    Raises:
        TypeError: positional settings, a non-float scale, non-int trackers.
        ValueError: a non-scalar scale or tracker, a concrete scale that is not positive and
            finite, growth_factor < 1, backoff_factor outside (0, 1], growth_interval or
            hysteresis < 1, min_scale < 0 or > max_scale.
    """

    loss_scale: jax.Array
    _: dataclasses.KW_ONLY
    growth_tracker: jax.Array = dataclasses.field(default_factory=lambda: np.zeros((), np.int32))
    overflow_tracker: jax.Array = dataclasses.field(default_factory=lambda: np.zeros((), np.int32))
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: float = 1.0
    max_scale: float = float("inf")

    def __post_init__(self):
        set_ = object.__setattr__
        scale = _float_scale(self.loss_scale, "loss_scale")
        set_(self, "loss_scale", scale)
        if not isinstance(scale, jax.core.Tracer) and not _is_placeholder(scale):
            # a concrete scale (one read, when the scale is made; adjust skips this):
            # the scale the updates start from must be positive and finite
            value = float(scale)
            if not 0 < value < np.inf:
                raise ValueError(f"loss_scale: expected a positive finite scale, got {value}")
        set_(self, "growth_tracker", _int_scalar(self.growth_tracker, "growth_tracker"))
        set_(self, "overflow_tracker", _int_scalar(self.overflow_tracker, "overflow_tracker"))
        # checked as srround's own loss scaling checks them
        checked = _validate.scale_update(*(getattr(self, name) for name in _SETTINGS))
        for name, value in zip(_SETTINGS, checked):
            set_(self, name, value)

    def tree_flatten(self):
        """Pytree protocol: (array leaves, static settings)."""
        children = (self.loss_scale, self.growth_tracker, self.overflow_tracker)
        return children, tuple(getattr(self, name) for name in _SETTINGS)

    @classmethod
    def tree_unflatten(cls, settings, children):
        """Pytree protocol: rebuild from ``tree_flatten``'s output, unchecked - the settings
        were checked when the scale was made, and the leaves may be JAX's placeholders or a
        scale the updates brought to its floor (``min_scale=0``)."""
        self = object.__new__(cls)
        names = ("loss_scale", "growth_tracker", "overflow_tracker", *_SETTINGS)
        for name, value in zip(names, (*children, *settings)):
            object.__setattr__(self, name, value)
        return self

    def _with(self, *children) -> DynamicLossScale:
        """This scale with new leaves (scale, growth tracker, overflow tracker), unchecked."""
        return self.tree_unflatten(self.tree_flatten()[1], children)

    def scale(self, tree):
        """``tree`` times the float32 scale (leaves promoted as JAX promotes)."""
        return _scale_tree(tree, jnp.asarray(self.loss_scale, jnp.float32))

    def unscale(self, tree):
        """``tree`` times the float32 ``1 / scale`` (leaves promoted as JAX promotes); a NaN
        product is +qNaN on every device."""
        return _scale_tree(tree, _inverse(self.loss_scale), canonical=True)

    def adjust(self, grads_finite) -> DynamicLossScale:
        """The next loss scale after a step whose gradients were (not) all finite
        (``grads_finite``: a bool scalar). Inside ``shard_map``, a flag that varies over mesh
        axes the scale does not (a per-device flag, typed so by ``check_vma``) is a
        ``ValueError``: each device would adjust a scale of its own."""
        grads_finite = _bool_scalar(grads_finite, "grads_finite")
        rest = sorted(_varying_axes(grads_finite) - _varying_axes(self.loss_scale))
        if rest:
            raise ValueError(
                f"grads_finite: varies over mesh axes {rest} that the loss scale does not: each"
                " device would adjust its own scale (reduce the flags over them, e.g. with"
                " all_finite(grads, axis_name=...))"
            )
        scale = jnp.asarray(self.loss_scale, jnp.float32)
        growth = jnp.asarray(self.growth_tracker, jnp.int32)
        overflows = jnp.asarray(self.overflow_tracker, jnp.int32)
        # overflow branch
        over = overflows + 1
        back = over >= self.hysteresis
        scale_bad = jnp.where(
            back,
            jnp.maximum(scale * jnp.float32(self.backoff_factor), jnp.float32(self.min_scale)),
            scale,
        )
        overflows_bad = jnp.where(back, 0, over)
        # clean branch
        successful = growth + 1
        grow = successful == self.growth_interval
        grown = scale * jnp.float32(self.growth_factor)
        scale_good = jnp.where(
            grow & jnp.isfinite(grown), jnp.minimum(grown, jnp.float32(self.max_scale)), scale
        )
        growth_good = jnp.where(grow, 0, successful)
        return self._with(
            jnp.where(grads_finite, scale_good, scale_bad),
            jnp.where(grads_finite, growth_good, 0).astype(jnp.int32),
            jnp.where(grads_finite, 0, overflows_bad).astype(jnp.int32),
        )


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class StaticLossScale:
    """A fixed loss scale; ``adjust`` returns it unchanged. A pytree with no leaves, as jmp's
    (the scale is static: a Python float or a concrete float scalar)."""

    loss_scale: float

    def __post_init__(self):
        value = _float_scale(self.loss_scale, "loss_scale")
        if isinstance(value, jax.core.Tracer):
            raise TypeError("loss_scale: StaticLossScale needs a concrete scale, got a tracer")
        if not _is_placeholder(value):
            value = np.float32(value)
            if not 0 < value < np.inf:  # as DynamicLossScale: unscale would flip or poison
                raise ValueError(f"loss_scale: expected a positive finite scale, got {value}")
            object.__setattr__(self, "loss_scale", value)

    def tree_flatten(self):
        """Pytree protocol: (array leaves, static settings)."""
        return (), float(self.loss_scale)

    @classmethod
    def tree_unflatten(cls, scale, children):
        """Pytree protocol: rebuild from ``tree_flatten``'s output."""
        del children
        return cls(scale)

    def scale(self, tree):
        """``tree`` times the float32 scale (leaves promoted as JAX promotes)."""
        return _scale_tree(tree, jnp.float32(self.loss_scale))

    def unscale(self, tree):
        """``tree`` times the float32 ``1 / scale`` (leaves promoted as JAX promotes); a NaN
        product is +qNaN on every device."""
        return _scale_tree(tree, _inverse(self.loss_scale), canonical=True)

    def adjust(self, grads_finite) -> StaticLossScale:
        """``self``: a static scale does not change (``grads_finite``: a bool scalar)."""
        _bool_scalar(grads_finite, "grads_finite")
        return self


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class NoOpLossScale:
    """No loss scaling (a pytree with no leaves): every method is the identity."""

    @property
    def loss_scale(self):
        """1.0 (float32)."""
        return jnp.float32(1.0)

    def tree_flatten(self):
        """Pytree protocol: (array leaves, static settings)."""
        return (), None

    @classmethod
    def tree_unflatten(cls, _, children):
        """Pytree protocol: rebuild from ``tree_flatten``'s output."""
        return cls()

    def scale(self, tree):
        """``tree`` unchanged."""
        return tree

    def unscale(self, tree):
        """``tree`` unchanged."""
        return tree

    def adjust(self, grads_finite) -> NoOpLossScale:
        """``self``: a static scale does not change (``grads_finite``: a bool scalar)."""
        _bool_scalar(grads_finite, "grads_finite")
        return self


def all_finite(tree, *, axis_name=None) -> jax.Array:
    """A bool scalar: every element of every leaf of ``tree`` is finite (``True`` for an empty
    tree). Under ``jit`` with sharded leaves the reduction is global. Inside ``shard_map`` pass
    ``axis_name`` (a mesh axis name or a tuple of them, the axes the leaves are split over):
    the local flags are combined with ``lax.pmin``, so every device returns the same value.
    A leaf that varies over a mesh axis ``axis_name`` does not name (any axis, with
    ``axis_name=None``; typed so by ``shard_map``'s ``check_vma``) is a ``ValueError``: the
    flag would differ across it.
    """
    leaves = jax.tree_util.tree_leaves(tree)
    check_arrays(("tree", leaves))
    if axis_name is None:
        reduced = set()
    else:
        reduced = {axis_name} if isinstance(axis_name, str) else set(axis_name)
    for k, x in enumerate(leaves):
        rest = sorted(_varying_axes(x) - reduced) if isinstance(x, jax.Array) else []
        if rest:
            raise ValueError(
                f"tree[{k}]: varies over mesh axes {rest} that axis_name={axis_name!r} does"
                " not reduce over: the devices would disagree on the flag (name every axis"
                " the leaves are split over)"
            )
    if not leaves:
        finite = jnp.bool_(True)
    else:
        finite = jnp.stack([jnp.isfinite(x).all() for x in leaves]).all()
    if axis_name is not None:
        finite = lax.pmin(finite.astype(jnp.int32), axis_name) == 1
    return finite


def select_tree(pred, on_true, on_false):
    """``on_true`` where the bool scalar ``pred`` holds, else ``on_false`` (same structure),
    e.g. to keep the old parameters and optimizer state on a step with non-finite gradients.

    Raises:
        ValueError: ``pred`` is not a scalar; TypeError: ``pred`` is not bool.
    """
    pred = _bool_scalar(pred, "pred")
    return jax.tree_util.tree_map(lambda a, b: lax.select(pred, a, b), on_true, on_false)


__all__ = ["DynamicLossScale", "NoOpLossScale", "StaticLossScale", "all_finite", "select_tree"]
