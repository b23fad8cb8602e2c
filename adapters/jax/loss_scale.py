"""Loss scales for JAX as immutable pytrees (the jmp interface), usable inside ``jit``.

``scale(tree)`` multiplies a loss (or any tree) by the scale, ``unscale(tree)`` multiplies
gradients by its inverse, ``adjust(grads_finite)`` returns the next loss scale. Every field
survives ``tree_flatten``/``tree_unflatten``: the arrays are children, the settings are the
(static) auxiliary data - so a ``min_scale`` is never lost (jmp's flatten drops it).

``DynamicLossScale.adjust`` is ``srround.update_scale``'s rule, so
its trajectory equals ``torch.amp.GradScaler``'s for ``hysteresis=1``::

    if not grads_finite:
        growth = 0; overflows += 1
        if overflows >= hysteresis: scale = max(scale * backoff_factor, min_scale); overflows = 0
    else:
        overflows = 0; growth += 1
        if growth == growth_interval:
            grown = scale * growth_factor                   # float32
            if isfinite(grown): scale = min(grown, max_scale)
            growth = 0
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


def _scale_tree(tree, factor):
    return jax.tree_util.tree_map(lambda x: x * factor.astype(x.dtype), tree)


def _unscale_tree(tree, scale):
    inverse = (1.0 / scale).astype(jnp.float32)
    return jax.tree_util.tree_map(lambda g: (g.astype(jnp.float32) * inverse).astype(g.dtype), tree)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """Dynamic loss scale (a pytree).

    Attributes:
        loss_scale: float32 scalar array.
        growth_tracker: int32 scalar, clean steps since the last change.
        overflow_tracker: int32 scalar, consecutive overflows (for ``hysteresis``).
        growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale:
            the settings (torch GradScaler's, plus hysteresis and bounds).
    """

    loss_scale: jax.Array
    growth_tracker: jax.Array = dataclasses.field(default_factory=lambda: jnp.int32(0))
    overflow_tracker: jax.Array = dataclasses.field(default_factory=lambda: jnp.int32(0))
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: float = 0.0
    max_scale: float = float("inf")

    def __post_init__(self):
        if self.growth_interval < 1 or self.hysteresis < 1:
            raise ValueError(
                "growth_interval and hysteresis: expected ints >= 1, got"
                f" {self.growth_interval} and {self.hysteresis}"
            )

    def tree_flatten(self):
        """Pytree protocol: (array leaves, static settings)."""
        children = (self.loss_scale, self.growth_tracker, self.overflow_tracker)
        settings = (
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
            self.hysteresis,
            self.min_scale,
            self.max_scale,
        )
        return children, settings

    @classmethod
    def tree_unflatten(cls, settings, children):
        """Pytree protocol: rebuild from ``tree_flatten``'s output."""
        return cls(*children, *settings)

    def scale(self, tree):
        """``tree`` with every floating leaf multiplied by the loss scale."""
        return _scale_tree(tree, jnp.asarray(self.loss_scale, jnp.float32))

    def unscale(self, tree):
        """``tree`` with every floating leaf divided by the loss scale."""
        return _unscale_tree(tree, jnp.asarray(self.loss_scale, jnp.float32))

    def adjust(self, grads_finite) -> DynamicLossScale:
        """The next loss scale after a step whose gradients were (not) all finite."""
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
        return dataclasses.replace(
            self,
            loss_scale=jnp.where(grads_finite, scale_good, scale_bad),
            growth_tracker=jnp.where(grads_finite, growth_good, 0).astype(jnp.int32),
            overflow_tracker=jnp.where(grads_finite, 0, overflows_bad).astype(jnp.int32),
        )


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class StaticLossScale:
    """A fixed loss scale (a pytree); ``adjust`` returns it unchanged."""

    loss_scale: jax.Array

    def tree_flatten(self):
        """Pytree protocol: (array leaves, static settings)."""
        return (self.loss_scale,), None

    @classmethod
    def tree_unflatten(cls, _, children):
        """Pytree protocol: rebuild from ``tree_flatten``'s output."""
        return cls(*children)

    def scale(self, tree):
        """``tree`` with every floating leaf multiplied by the loss scale."""
        return _scale_tree(tree, jnp.asarray(self.loss_scale, jnp.float32))

    def unscale(self, tree):
        """``tree`` with every floating leaf divided by the loss scale."""
        return _unscale_tree(tree, jnp.asarray(self.loss_scale, jnp.float32))

    def adjust(self, grads_finite) -> StaticLossScale:
        """The next loss scale: this one, whatever ``grads_finite`` says."""
        del grads_finite
        return self


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class NoOpLossScale:
    """No loss scaling (a pytree with no leaves): every method is the identity."""

    @property
    def loss_scale(self):
        """Always 1.0 (float32)."""
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
        """The next loss scale: this one, whatever ``grads_finite`` says."""
        del grads_finite
        return self


def all_finite(tree) -> jax.Array:
    """A bool scalar: every element of every leaf of ``tree`` is finite."""
    leaves = jax.tree_util.tree_leaves(tree)
    if not leaves:
        return jnp.bool_(True)
    return jnp.stack([jnp.isfinite(x).all() for x in leaves]).all()


def select_tree(pred, on_true, on_false):
    """``on_true`` where the scalar ``pred`` holds, else ``on_false`` (same structure), e.g.
    to keep the old parameters and optimizer state on a step with non-finite gradients."""
    return jax.tree_util.tree_map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


__all__ = ["DynamicLossScale", "NoOpLossScale", "StaticLossScale", "all_finite", "select_tree"]
