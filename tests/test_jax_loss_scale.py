"""JAX loss scales: pytrees under jit, the same trajectory as srround's (and torch's) rule."""

from __future__ import annotations

import warnings

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
        growth_tracker=jnp.int32(3),
        overflow_tracker=jnp.int32(1),
        growth_factor=4.0,
        backoff_factor=0.25,
        growth_interval=7,
        hysteresis=2,
        min_scale=8.0,
        max_scale=2.0**20,
    )
    leaves, treedef = jax.tree_util.tree_flatten(scale)
    assert len(leaves) == 3  # jmp: 2 (no overflow tracker, min_loss_scale dropped)
    again = jax.tree_util.tree_unflatten(treedef, leaves)
    assert again == scale
    assert again.min_scale == 8.0 and again.hysteresis == 2
    for kind in (StaticLossScale(jnp.float32(4.0)), NoOpLossScale()):
        leaves, treedef = jax.tree_util.tree_flatten(kind)
        assert jax.tree_util.tree_unflatten(treedef, leaves) == kind


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


def test_unscaled_nan_is_the_positive_quiet_nan():
    """A NaN gradient of either sign (bf16 leaves promote to float32) and 0 * inf unscale to
    +qNaN 0x7FC00000 (x86 keeps the NaN's sign and gives -qNaN for 0 * inf, as jmp's plain
    multiply does on a CPU); finite products are unchanged."""
    g32 = np.array([0xFFC00000, 0x7FC00001, 0, 0x40000000], np.uint32).view(np.float32)
    g16 = np.array([0xFFC1, 0x3F80], np.uint16).view(jnp.bfloat16)
    for ls, nans in (
        (DynamicLossScale(jnp.float32(2.0)), 2),
        (StaticLossScale(jnp.float32(2.0**-149)), 3),  # inverse inf: 0 * inf
    ):
        out = jax.jit(ls.unscale)({"a": jnp.asarray(g32), "b": jnp.asarray(g16)})
        a, b = (np.asarray(out[k]).view(np.uint32) for k in ("a", "b"))
        assert [hex(v) for v in a[:nans]] == ["0x7fc00000"] * nans
        assert hex(b[0]) == "0x7fc00000" and out["b"].dtype == jnp.float32
    assert float(out["b"][1]) == np.inf and float(out["a"][3]) == np.inf


def test_scale_unscale_all_finite_select():
    grads = {"w": jnp.ones(3, jnp.bfloat16), "b": jnp.ones(2, jnp.float16)}
    ls = DynamicLossScale(jnp.float32(1024.0))
    assert float(ls.scale(jnp.float32(0.5))) == 512.0
    back = ls.unscale(jax.tree_util.tree_map(lambda g: g * 1024, grads))
    assert all(bool((v == 1).all()) for v in jax.tree_util.tree_leaves(back))
    assert back["w"].dtype == jnp.float32  # promoted, as jmp
    assert bool(jax.jit(all_finite)(grads))
    assert not bool(all_finite({"w": jnp.array([1.0, jnp.nan])}))
    picked = select_tree(jnp.bool_(False), {"a": jnp.ones(2)}, {"a": jnp.zeros(2)})
    assert float(picked["a"].sum()) == 0.0
    assert NoOpLossScale().unscale(grads) is grads
    assert StaticLossScale(jnp.float32(8.0)).adjust(jnp.bool_(False)).loss_scale == 8.0


def test_reachable_as_documented():
    assert srround.adapters.jax.DynamicLossScale is DynamicLossScale  # lazy submodule access


# -- jmp conventions (issue findings) ----------------------------------------------------------


def test_jmp_positional_order_is_an_error_not_a_silent_third_order():
    with pytest.raises(TypeError):
        DynamicLossScale(jnp.float32(2.0), 0, 20, 2)  # jmp's (scale, counter, period, factor)
    ls = DynamicLossScale(jnp.float32(2.0), growth_interval=20, growth_factor=2.0)
    assert ls.growth_interval == 20


@pytest.mark.parametrize("flags", [jnp.array([True, False]), np.array([True])])
def test_adjust_and_select_tree_reject_vectors(flags):
    ls = DynamicLossScale(jnp.float32(8.0))
    with pytest.raises(ValueError, match="grads_finite: expected a bool scalar"):
        ls.adjust(flags)
    with pytest.raises(ValueError, match="pred: expected a bool scalar"):
        select_tree(flags, {"a": jnp.ones(2)}, {"a": jnp.zeros(2)})
    with pytest.raises(TypeError, match="pred: expected a bool scalar, got dtype"):
        select_tree(jnp.float32(1.0), {"a": jnp.ones(2)}, {"a": jnp.zeros(2)})
    with pytest.raises(ValueError, match="grads_finite"):
        jax.jit(lambda s, f: s.adjust(f))(ls, flags)


def test_scale_multiplies_in_float32_as_jmp():
    ls = DynamicLossScale(jnp.float32(65536.0))
    loss = jnp.float16(2.0)
    scaled = ls.scale(loss)
    assert scaled.dtype == jnp.float32 and float(scaled) == 131072.0  # fp16 would be inf
    tiny = DynamicLossScale(jnp.float32(2.0**20)).unscale(jnp.float16(2.0**-10))
    assert tiny.dtype == jnp.float32 and float(tiny) == 2.0**-30  # fp16 would flush to 0
    odd = StaticLossScale(3.0)
    assert float(odd.scale(jnp.bfloat16(1.0))) == 3.0
    assert odd.scale(jnp.int32(5)).dtype == jnp.float32  # not truncated
    assert float(odd.scale(jnp.int32(5))) == 15.0
    assert DynamicLossScale(2).loss_scale.dtype == np.float32  # a Python number: float32


def test_default_min_scale_is_one():
    ls = DynamicLossScale(jnp.float32(4.0))
    for _ in range(10):
        ls = ls.adjust(jnp.bool_(False))
    assert float(ls.loss_scale) == 1.0


def test_bad_settings_name_the_argument():
    with pytest.raises(TypeError, match="loss_scale: expected a float scalar"):
        DynamicLossScale(jnp.int32(1))
    with pytest.raises(ValueError, match="loss_scale: expected a scalar"):
        DynamicLossScale(jnp.ones(2))
    with pytest.raises(ValueError, match="growth_interval"):
        DynamicLossScale(jnp.float32(1.0), growth_interval=0)
    with pytest.raises(ValueError, match="min_scale"):
        DynamicLossScale(jnp.float32(1.0), min_scale=4.0, max_scale=2.0)
    # a scale that cannot start the updates, factors that do not grow / back off (before: taken)
    for scale in (-1.0, 0.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="^loss_scale: expected a positive finite scale"):
            DynamicLossScale(scale)
        # a concrete array too (before: taken, as README's "not positive and finite" was not)
        with pytest.raises(ValueError, match="^loss_scale: expected a positive finite scale"):
            DynamicLossScale(jnp.float32(scale))
    with pytest.raises(ValueError, match="^growth_factor: "):
        DynamicLossScale(2.0**15, growth_factor=0.5)
    with pytest.raises(ValueError, match="^backoff_factor: "):
        DynamicLossScale(2.0**15, backoff_factor=2.0)


def test_a_scale_the_updates_bring_to_zero_is_no_error():
    """The check is for a scale as it is made: ``adjust`` and the pytree round trip (eager,
    and out of ``jit``) take a scale that ``min_scale=0`` lets back off to 0, and read nothing
    from the device."""
    ls = DynamicLossScale(jnp.float32(2.0**-148), min_scale=0.0)
    for _ in range(3):
        ls = ls.adjust(jnp.bool_(False))
    assert float(ls.loss_scale) == 0.0
    ls = jax.jit(lambda s: s.adjust(jnp.bool_(False)))(ls)
    assert float(ls.loss_scale) == 0.0 and ls.min_scale == 0.0


# -- jmp's own tests (google-deepmind/jmp jmp/_src/loss_scale_test.py), adapted -----------------
# Names: counter -> growth_tracker, period -> growth_interval, factor -> growth_factor (with
# backoff_factor = 1 / factor), min_loss_scale -> min_scale (a static float). Differences:
# DynamicLossScale has three leaves (the overflow tracker), an int scale is a TypeError (jmp
# warns), and the settings are keyword-only.


def _dynamic(init, period, factor, **kw):
    return DynamicLossScale(
        jnp.float32(init),
        growth_tracker=jnp.int32(0),
        growth_interval=period,
        growth_factor=float(factor),
        backoff_factor=1.0 / factor,
        **kw,
    )


def test_jmp_no_op_loss_scale():
    tree = {"a": jnp.ones([])}
    assert NoOpLossScale().scale(tree) is tree
    assert NoOpLossScale().unscale(tree) is tree


@pytest.mark.parametrize("cls", [StaticLossScale, DynamicLossScale])
@pytest.mark.parametrize("scale", [2, 3, 4])
def test_jmp_static_loss_scale(cls, scale):
    loss_scale = cls(scale)
    tree = {"a": jnp.array(1.0)}
    scaled = loss_scale.scale(tree)
    assert float(scaled["a"]) == 1.0 * scale
    assert float(loss_scale.unscale(scaled)["a"]) == 1.0


# jmp's test makes StaticLossScale(0); srround refuses a scale that is not positive and finite
@pytest.mark.parametrize("create", [NoOpLossScale, lambda: StaticLossScale(1)])
def test_jmp_static_empty_trees(create):
    assert jax.tree_util.tree_leaves(create()) == []


@pytest.mark.parametrize("scale", [0.0, -8.0, np.inf, np.nan])
@pytest.mark.parametrize("cls", [StaticLossScale, DynamicLossScale])
def test_a_scale_that_is_not_positive_and_finite_is_refused(cls, scale):
    """A static scale of -8 unscaled gradients to their negation (training ascends), 0 to
    inf, inf to 0, NaN to NaN, silently; the dynamic scale refused them already."""
    with pytest.raises(ValueError, match="loss_scale: expected a positive finite scale"):
        cls(scale)


def test_jmp_dynamic_loss_scale_no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DynamicLossScale(2.0**15)


def test_jmp_dynamic_loss_scale_tree():
    scale, counter = jnp.ones([]), jnp.zeros([], jnp.int32)
    ls = DynamicLossScale(scale, growth_tracker=counter, growth_interval=2000, growth_factor=2)
    assert jax.tree_util.tree_leaves(ls)[:2] == [scale, counter]
    assert jax.tree_util.tree_map(lambda x: x, ls) == ls


@pytest.mark.parametrize(("period", "factor"), [(20, 2), (30, 3)])
def test_jmp_adjust_increases_on_finite(period, factor):
    finite = jnp.bool_(True)
    ls = _dynamic(10, period, factor)
    for i in range(1, period):
        ls = ls.adjust(finite)
        assert ls.loss_scale == 10 and ls.growth_tracker == i
        assert ls.growth_interval == period and ls.growth_factor == factor
    ls = ls.adjust(finite)  # wraps
    assert ls.loss_scale == 10 * factor and ls.growth_tracker == 0


@pytest.mark.parametrize(("period", "factor"), [(20, 2), (30, 3)])
def test_jmp_adjust_reduce_on_non_finite(period, factor):
    init = 10.0
    ls = _dynamic(init, period, factor)
    assert init / factor**100 < 1
    for i in range(100):
        ls = ls.adjust(jnp.bool_(False))
        np.testing.assert_allclose(ls.loss_scale, max(1, init / factor ** (i + 1)), rtol=1e-5)
        assert ls.growth_tracker == 0


@pytest.mark.parametrize(
    ("period", "factor", "floor"), [(20, 2, 0.3125), (30, 3, 0.37), (5, 2, 0.0)]
)
def test_jmp_explicit_min_loss_scale(period, factor, floor):
    init = 10.0
    ls = _dynamic(init, period, factor, min_scale=floor)
    for i in range(100):
        ls = ls.adjust(jnp.bool_(False))
        np.testing.assert_allclose(ls.loss_scale, max(floor, init / factor ** (i + 1)), rtol=1e-5)
        assert ls.growth_tracker == 0


def test_jmp_int_loss_scale():
    with pytest.raises(TypeError, match="loss_scale: expected a float"):  # jmp: a warning
        DynamicLossScale(jnp.asarray(1, dtype=jnp.int32))


@pytest.mark.parametrize("non_finite", [jnp.inf, jnp.nan])
def test_jmp_all_finite(non_finite):
    assert all_finite(None)
    assert all_finite({})
    assert not all_finite({"a": jnp.array(non_finite)})
    assert not all_finite({"a": jnp.ones([]), "b": jnp.array(non_finite)})
    assert not all_finite({"a": jnp.array(non_finite), "b": jnp.ones([])})
    assert all_finite({"a": jnp.ones([]), "b": jnp.ones([])})


def test_jmp_select_tree():
    a = {"a": jnp.ones([]), "b": jnp.zeros([])}
    b = {"a": jnp.zeros([]), "b": jnp.ones([])}
    assert select_tree(jnp.bool_(True), None, None) is None
    assert select_tree(jnp.bool_(False), None, None) is None
    assert select_tree(jnp.bool_(True), a, b) == a
    assert select_tree(jnp.bool_(False), a, b) == b


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_half_precision_scale_keeps_its_type_in_loops(dtype):
    """jmp's README makes its scale in half precision (``jmp.half_dtype()(2 ** 15)``). The
    scale is float32 (what ``scale``/``unscale`` multiply by), the trackers int32, whatever
    arrays they were made with: before, ``adjust`` turned an fp16/bf16 scale (or an int16
    tracker) into float32 (int32), and a ``lax.scan``/``lax.cond`` carrying the loss scale
    failed on the changed type."""
    ls = DynamicLossScale(
        jnp.asarray(2.0**15, dtype), growth_tracker=jnp.int16(0), growth_interval=1
    )
    assert ls.loss_scale.dtype == jnp.float32 and ls.growth_tracker.dtype == jnp.int32
    out, _ = jax.lax.scan(lambda s, _: (s.adjust(jnp.bool_(True)), None), ls, None, length=2)
    assert float(out.loss_scale) == 2.0**17
    skipped = jax.lax.cond(True, lambda s: s.adjust(jnp.bool_(False)), lambda s: s, ls)
    assert float(skipped.loss_scale) == 2.0**14


def test_float0_gradients_pass_through():
    """``jax.grad(..., allow_int=True)`` gives ``float0`` gradients for integer leaves, which
    support no arithmetic: ``scale``/``unscale`` return them as they are (before: JAX's
    "Called multiply with a float0 array"; jmp fails the same way), ``all_finite`` counts
    them as finite."""
    params = {"w": jnp.ones(3, jnp.float32), "step": jnp.arange(2)}
    grads = jax.grad(lambda p: p["w"].sum() * 4.0, allow_int=True)(params)
    assert grads["step"].dtype == jax.dtypes.float0
    for ls in (DynamicLossScale(jnp.float32(2.0)), StaticLossScale(2.0)):
        out = ls.unscale(ls.scale(grads))
        assert out["step"] is grads["step"]
        np.testing.assert_array_equal(np.asarray(out["w"]), np.full(3, 4.0, np.float32))
    assert bool(all_finite(grads))


def test_scaling_under_strict_dtype_promotion():
    """The documented promotion (a bf16/fp16/int leaf times the float32 scale is float32)
    holds under ``jax.numpy_dtype_promotion("strict")`` too, where JAX refuses the implicit
    bf16 x float32 promotion: it raised a TypePromotionError from srround's multiply."""
    tree = {"h": jnp.float16(2.0), "b": jnp.ones(2, jnp.bfloat16), "i": jnp.int32(3)}
    for ls in (DynamicLossScale(jnp.float32(2.0**16)), StaticLossScale(2.0**16)):
        want = ls.scale(tree), ls.unscale(tree)
        with jax.numpy_dtype_promotion("strict"):
            got = ls.scale(tree), ls.unscale(tree)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert a.dtype == jnp.float32
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _is_array(x) -> bool:
    """flax.nnx's test for a module attribute's leaf (``graphlib``): anything else, a NumPy
    scalar such as ``np.int32(0)`` included, is static - part of the compiled program's key."""
    return isinstance(x, (jax.Array, np.ndarray))


def test_leaves_are_arrays_as_flax_nnx_and_jmp_take_them():
    """A loss scale kept on an ``nnx.Module`` (``nnx.data``) and adjusted in an ``nnx.jit``
    step compiled the step twice: its default trackers (and a scale made from a number) were
    NumPy scalars, which nnx takes as static, and the first ``adjust`` turned them into arrays.
    jmp's trackers are 0-d arrays (``np.zeros([], np.int32)``); so are srround's now."""
    for scale in (DynamicLossScale(2.0**15), DynamicLossScale(np.float32(2.0**15))):
        for leaf in jax.tree_util.tree_leaves(scale):
            assert _is_array(leaf) and np.shape(leaf) == (), type(leaf)
        adjusted = jax.jit(lambda s: s.adjust(jnp.bool_(True)))(scale)
        for a, b in zip(jax.tree_util.tree_leaves(scale), jax.tree_util.tree_leaves(adjusted)):
            assert np.dtype(a.dtype) == b.dtype
    custom = DynamicLossScale(jnp.float32(4.0), growth_tracker=3, overflow_tracker=np.int64(1))
    assert all(_is_array(leaf) for leaf in jax.tree_util.tree_leaves(custom))


def test_flax_nnx_step_compiles_once():
    """The same with flax itself (not a CI dependency): a scale on the module, adjusted in
    the jitted step, compiles it once."""
    nnx = pytest.importorskip("flax.nnx")
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    class Model(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(3, jnp.float16))
            self.ls = nnx.data(DynamicLossScale(2.0**15, growth_interval=2))

    @nnx.jit
    def step(model):
        grads = model.ls.unscale({"w": model.ls.scale(model.w[...])})
        model.ls = model.ls.adjust(all_finite(grads))

    model = Model()
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for _ in range(4):
            step(model)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert float(model.ls.loss_scale) == 2.0**17
    assert len(compiles) == 1


def test_pickle_and_orbax_checkpoint_a_loss_scale(tmp_path):
    """README: pickle, and orbax (not a CI dependency), save and restore a loss scale,
    settings kept (``flax.serialization.to_bytes`` refuses it, as jmp's)."""
    import pickle

    scale = DynamicLossScale(2.0**15, growth_interval=7, hysteresis=2).adjust(jnp.bool_(False))
    assert pickle.loads(pickle.dumps(scale)) == scale
    ocp = pytest.importorskip("orbax.checkpoint")
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "scale", scale)
    checkpointer.wait_until_finished()
    again = checkpointer.restore(
        tmp_path / "scale", DynamicLossScale(2.0**15, growth_interval=7, hysteresis=2)
    )
    assert again.growth_interval == 7 and again.hysteresis == 2
    for a, b in zip(jax.tree_util.tree_leaves(again), jax.tree_util.tree_leaves(scale)):
        assert np.asarray(a).dtype == np.asarray(b).dtype and np.asarray(a) == np.asarray(b)
