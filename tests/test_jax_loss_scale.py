"""JAX loss scales: pytrees under jit, the same trajectory as srround's (and torch's) rule."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import srround  # noqa: E402
from srround.adapters.jax.loss_scale import (  # noqa: E402
    DynamicLossScale,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
    select_tree,
)


def test_pytree_round_trip_keeps_every_field():
    scale = DynamicLossScale(
        jnp.float32(2.0**15),
        jnp.int32(3),
        jnp.int32(1),
        growth_factor=4.0,
        backoff_factor=0.25,
        growth_interval=7,
        hysteresis=2,
        min_scale=8.0,
        max_scale=2.0**20,
    )
    leaves, treedef = jax.tree_util.tree_flatten(scale)
    assert len(leaves) == 3
    again = jax.tree_util.tree_unflatten(treedef, leaves)
    assert again == scale
    assert again.min_scale == 8.0 and again.hysteresis == 2
    for kind in (StaticLossScale(jnp.float32(4.0)), NoOpLossScale()):
        leaves, treedef = jax.tree_util.tree_flatten(kind)
        assert type(jax.tree_util.tree_unflatten(treedef, leaves)) is type(kind)


@pytest.mark.parametrize("hysteresis", [1, 2])
def test_jitted_trajectory_equals_update_scale(hysteresis):
    events = np.random.default_rng(0).random(300) < 0.1
    adjust = jax.jit(lambda s, finite: s.adjust(finite))
    ours = DynamicLossScale(
        jnp.float32(2.0**16),
        growth_interval=9,
        hysteresis=hysteresis,
        min_scale=1.0,
        max_scale=2.0**18,
    )
    scale, growth, overflows = np.float32([2.0**16]), np.zeros(1, np.int32), np.zeros(1, np.int32)
    for overflow in events:
        ours = adjust(ours, jnp.bool_(not overflow))
        srround.update_scale(
            scale,
            growth,
            np.float32([overflow]),
            overflow_tracker=overflows,
            growth_interval=9,
            hysteresis=hysteresis,
            min_scale=1.0,
            max_scale=2.0**18,
        )
        assert float(ours.loss_scale) == scale[0]
        assert int(ours.growth_tracker) == growth[0]
        assert int(ours.overflow_tracker) == overflows[0]


def test_scale_unscale_all_finite_select():
    grads = {"w": jnp.ones(3, jnp.bfloat16), "b": jnp.ones(2, jnp.float16)}
    ls = DynamicLossScale(jnp.float32(1024.0))
    assert float(ls.scale(jnp.float32(0.5))) == 512.0
    back = ls.unscale(jax.tree_util.tree_map(lambda g: g * 1024, grads))
    assert all(bool((v == 1).all()) for v in jax.tree_util.tree_leaves(back))
    assert back["w"].dtype == jnp.bfloat16
    assert bool(jax.jit(all_finite)(grads))
    assert not bool(all_finite({"w": jnp.array([1.0, jnp.nan])}))
    picked = select_tree(jnp.bool_(False), {"a": jnp.ones(2)}, {"a": jnp.zeros(2)})
    assert float(picked["a"].sum()) == 0.0
    assert NoOpLossScale().unscale(grads) is grads
    assert StaticLossScale(jnp.float32(8.0)).adjust(jnp.bool_(False)).loss_scale == 8.0


def test_reachable_as_documented():
    assert srround.adapters.jax.DynamicLossScale is DynamicLossScale  # lazy submodule access
