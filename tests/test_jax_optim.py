"""JAX optimizer layer, what is JAX's own: apply_updates (any optax optimizer), the native
path's leaf loops (one kernel per leaf shape) and coefficients, schedules and PRNG-key seeds, found_inf flags of any
kind, donated jit and the optax update path. The fused adamw's bits against ``adamw_step`` for
every mode and state dtype, with found_inf and inv_scale, are in tests/test_optim_contract.py."""

from __future__ import annotations

import functools
import re
import warnings
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp
from jax import lax

import srround
from srround import _optim
from srround.adapters import jax as sj
from srround.adapters.jax import _lax, _leaves, _pallas

from .reference import (
    assert_same_bits,
    assert_same_fma_bits,
    bits,
    fma32_bits,
    fma_hard_cases,
    normal_params,
)

IMPLS = ["native", "callback"]
APPLY_IMPLS = [None, "native", "callback"]  # None: on one CPU device, bits from the host
SHAPES = [(33,), (7, 5), (130,), (3,), (2, 2, 3)]
SEED = 0x1234_5678_9ABC


def _grads(t):
    rng = np.random.default_rng(100 + t)
    return [
        (rng.standard_normal(s) * 10.0 ** rng.integers(-3, 2)).astype(np.float32) for s in SHAPES
    ]


def _starts(arrays):
    return list(np.concatenate([[0], np.cumsum([a.size for a in arrays])[:-1]]))


# -- apply_updates ---------------------------------------------------------------------------

MIXED = [ml_dtypes.bfloat16, np.float32, np.float16, ml_dtypes.bfloat16, np.float32]


@pytest.mark.parametrize("step", [None, 5, "traced"])
@pytest.mark.parametrize("impl", APPLY_IMPLS)
def test_apply_updates_is_stochastic_add_per_leaf(impl, step):
    params = normal_params(SHAPES, MIXED)
    updates = [u * np.float32(1e-2) for u in _grads(0)]
    tree = {"a": [jnp.asarray(p) for p in params[:3]], "b": tuple(map(jnp.asarray, params[3:]))}
    utree = {"a": [jnp.asarray(u) for u in updates[:3]], "b": tuple(map(jnp.asarray, updates[3:]))}
    key = jax.random.key(7)
    seed = int(jax.random.key_data(key)[0]) | int(jax.random.key_data(key)[1]) << 32
    if step == "traced":
        fn = jax.jit(lambda p, u, k, s: sj.apply_updates(p, u, k, step=s, impl=impl))
        out = fn(tree, utree, key, jnp.int32(5))
        t = 5
    else:
        out = jax.jit(lambda p, u, k: sj.apply_updates(p, u, k, step=step, impl=impl))(
            tree, utree, key
        )
        t = step or 0
    got = jax.tree_util.tree_leaves(out)
    for p, u, start, g in zip(params, updates, _starts(params), got):
        if p.dtype == np.float32:
            assert_same_bits(g, p + u)
            continue
        w = p.copy()
        srround.stochastic_add(w, u, seed=seed, offset=(t << 36) + int(start))
        assert_same_bits(g, w)


@pytest.mark.parametrize("impl", APPLY_IMPLS)
def test_apply_updates_nan_is_the_positive_quiet_nan(impl):
    """NaN updates of both signs, a -NaN weight and inf + (-inf) give bf16 leaves +qNaN 0x7FC0
    (x86 keeps the NaN operand's sign and gives -qNaN for inf - inf)."""
    w = np.array([0x3F80, 0x3F80, 0xFFC1, 0x7F80, 0x3F80], np.uint16).view(ml_dtypes.bfloat16)
    u = np.array([0xFFC00000, 0x7FC00003, 0x3F800000, 0xFF800000, 0], np.uint32)
    out = sj.apply_updates(jnp.asarray(w), jnp.asarray(u.view(np.float32)), 4, impl=impl)
    assert [hex(v) for v in np.asarray(out).view(np.uint16)] == ["0x7fc0"] * 4 + ["0x3f80"]


def test_apply_updates_matches_optax_structure_and_none_leaves():
    params = {"w": jnp.ones(5, jnp.bfloat16), "none": None, "b": jnp.zeros(3, jnp.float32)}
    updates = {"w": jnp.full(5, 0.5, jnp.float32), "none": None, "b": jnp.ones(3, jnp.float32)}
    out = sj.apply_updates(params, updates, 0)
    assert out["none"] is None and out["w"].dtype == jnp.bfloat16
    assert_same_bits(out["w"], np.full(5, 1.5, ml_dtypes.bfloat16))  # exact sums are not rounded
    assert_same_bits(out["b"], np.ones(3, np.float32))


@pytest.mark.parametrize("impl", APPLY_IMPLS)
def test_apply_updates_none_updates_keep_any_leaf_as_equinox(impl):
    """An equinox model as params: ``eqx.filter_grad`` gives ``None`` for the leaves that are
    not float arrays (an activation function, an int field), and ``eqx.apply_updates`` keeps
    those leaves; updates may also be a prefix (``None`` for a whole frozen subtree). Such a
    leaf is kept and takes no place in the stream, so the bits are those of the filtered tree
    (``eqx.filter``: ``None`` params). Before: JAX's "not a valid JAX array type" TypeError for
    the function leaf, naming neither argument."""
    w = jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).astype(jnp.bfloat16)
    model = {"act": jax.nn.relu, "n": 3, "lin": [w, jnp.ones(5, jnp.bfloat16)], "frozen": [w]}
    u = jnp.full(12, 1e-3, jnp.float32)
    updates = {"act": None, "n": None, "lin": [u, jnp.full(5, -1e-3)], "frozen": None}
    filtered = {"act": None, "n": None, "lin": model["lin"], "frozen": [None]}
    got = sj.apply_updates(model, updates, 7, step=2, impl=impl)
    want = sj.apply_updates(filtered, updates | {"frozen": [None]}, 7, step=2, impl=impl)
    assert got["act"] is jax.nn.relu and got["n"] == 3 and got["frozen"][0] is w
    for a, b in zip(got["lin"], want["lin"]):
        assert a.dtype == jnp.bfloat16
        assert_same_bits(a, b)
    traced = jax.jit(
        lambda lin, up: sj.apply_updates(model | {"lin": lin}, up, 7, step=2, impl=impl)["lin"]
    )
    assert_same_bits(traced(model["lin"], updates)[0], want["lin"][0])
    with pytest.raises(TypeError, match=r"^params\[0\]: expected an array, got custom_jvp"):
        sj.apply_updates(model, updates | {"act": jnp.float32(1.0)}, 7, step=2, impl=impl)


def test_apply_updates_python_scalar_updates_under_x64():
    """A Python number as a bf16 leaf's update (optax broadcasts it) is a float32 update,
    with or without ``jax_enable_x64``: under x64 it was refused as float64, and an int as a
    non-float update."""
    params = {"w": jnp.full(4, 0.5, jnp.bfloat16)}
    want = sj.apply_updates(params, {"w": jnp.float32(1e-3)}, 3, step=1)
    for update in (1e-3, 0):
        with jax.enable_x64(True):
            got = sj.apply_updates(params, {"w": update}, 3, step=1)
        expected = want if update else params
        assert_same_bits(got["w"], expected["w"])
    with jax.enable_x64(True), pytest.raises(TypeError, match=r"updates\[0\]: .* got float64"):
        sj.apply_updates(params, {"w": jnp.float64(1e-3)}, 3, step=1)


@pytest.mark.parametrize("impl", APPLY_IMPLS)
def test_apply_updates_gradient_is_straight_through(impl):
    """``jax.grad`` through ``apply_updates`` is ``stochastic_add``'s straight-through
    derivative on bf16/fp16 leaves (1 for the param and the update), so a loss of the new
    params has optax's gradient there. Before, the bit operations gave 0 silently (native) and
    the callback path raised (no differentiation rule for custom_partitioning)."""
    optax = pytest.importorskip("optax")
    params = {"w": jnp.linspace(-1, 1, 8).astype(jnp.bfloat16), "b": jnp.ones(3, jnp.float32)}
    grads = {"w": jnp.full(8, 0.5, jnp.float32), "b": jnp.full(3, 0.25, jnp.float32)}

    def loss(apply, lr, p):
        new = apply(p, jax.tree.map(lambda g: -lr * g, grads))
        return sum(jnp.sum(v.astype(jnp.float32) * 3) for v in jax.tree.leaves(new))

    ours = functools.partial(sj.apply_updates, seed=1, step=1, impl=impl)
    got = jax.jit(jax.grad(functools.partial(loss, ours), argnums=(0, 1)))(1e-3, params)
    want = jax.grad(functools.partial(loss, optax.apply_updates), argnums=(0, 1))(1e-3, params)
    assert float(got[0]) == float(want[0]) == -14.25
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        assert_same_bits(a, b)


@pytest.mark.parametrize("impl", APPLY_IMPLS)
def test_apply_updates_0d_leaves(impl):
    """A scalar (0-d) leaf keeps its shape and gets the bits of the 1-element array."""
    params = {"s": jnp.asarray(0.01, jnp.bfloat16), "v": jnp.full((3,), 0.01, jnp.bfloat16)}
    updates = {"s": jnp.asarray(-1e-5, jnp.float32), "v": jnp.full((3,), -1e-5, jnp.float32)}
    new = sj.apply_updates(params, updates, seed=SEED, impl=impl)
    assert new["s"].shape == () and new["s"].dtype == jnp.bfloat16
    flat = sj.apply_updates(
        {"s": params["s"].reshape(1), "v": params["v"]},
        {"s": updates["s"].reshape(1), "v": updates["v"]},
        seed=SEED,
        impl=impl,
    )
    assert np.asarray(new["s"]).view(np.uint16) == np.asarray(flat["s"]).view(np.uint16)[0]


GROUPED_SHAPES = [
    (33,),
    (),
    (7, 5),
    (0,),
    (130,),
    (3,),
    (2, 0, 3),
    (2, 2, 3),
    (),
    (50,),
    (40,),
    (9, 9),
    (1,),
]
GROUPED_DTYPES = [
    ml_dtypes.bfloat16,
    ml_dtypes.bfloat16,
    np.float16,
    ml_dtypes.bfloat16,
    ml_dtypes.bfloat16,
    np.float32,
    np.float16,
    np.float16,
    np.float16,
    ml_dtypes.bfloat16,
    np.float32,
    ml_dtypes.bfloat16,
    ml_dtypes.bfloat16,
]


@pytest.mark.parametrize(
    "all_bf16, gap, size",
    [
        (False, 0, 36),  # (33,) and (3,) joined, two runs
        (False, 200, 201),  # the 165 positions between them taken in: one run
        (True, 0, 83),  # all but (130,), stream neighbours merged: two runs
        (True, None, 213),  # the default takes the 130 positions of (130,) in: one run
    ],
)
def test_apply_updates_callback_joins_small_leaves(all_bf16, gap, size, monkeypatch):
    """``impl="callback"`` on one CPU device hands the host the small leaves of one format
    joined (one operand for their params, one for their updates), each at its own place in
    the random stream: stream neighbours one run, and leaves apart by a small gap too (its
    positions computed and dropped: each run is a host call). It took every leaf as operands
    of its own and the host added them one by one (500 small bf16 leaves: 76 ms a step
    against the default's 9 ms, 2-core VM). The bits of ``srround.stochastic_add`` per
    leaf."""
    from srround.adapters.jax import optim

    monkeypatch.setattr(_leaves, "_SMALL_LEAF", 40)  # (130,) a leaf of its own, the rest small
    if gap is not None:
        monkeypatch.setattr(optim, "_APPLY_GAP", gap)
    jax.clear_caches()  # the inner jitted functions read both when traced
    dtypes = [ml_dtypes.bfloat16] * len(SHAPES) if all_bf16 else MIXED
    params = [jnp.asarray(p) for p in normal_params(SHAPES, dtypes)]
    updates = [jnp.asarray(u * np.float32(1e-2)) for u in _grads(0)]
    key = jax.random.key(7)
    fn = jax.jit(lambda p, u, k: sj.apply_updates(p, u, k, step=5, impl="callback"))
    text = fn.lower(params, updates, key).as_text()
    (call,) = [line for line in text.splitlines() if "custom_call @srround_host_call" in line]
    operands = call.split(" : (")[-1].split(") -> ")[0].split(", ")
    assert f"tensor<{size}xbf16>" in operands and f"tensor<{size}xf32>" in operands, operands
    assert not [o for o in operands if o.startswith(("tensor<33x", "tensor<3x"))], operands
    seed = int(jax.random.key_data(key)[0]) | int(jax.random.key_data(key)[1]) << 32
    for p, u, start, g in zip(params, updates, _starts(params), fn(params, updates, key)):
        p, u = np.array(p), np.asarray(u)
        if p.dtype == np.float32:
            assert_same_bits(g, p + u)
            continue
        srround.stochastic_add(p, u, seed=seed, offset=(5 << 36) + int(start))
        assert_same_bits(g, p)
    jax.clear_caches()  # no trace of the patched sizes is left for later tests


@pytest.mark.parametrize("lane_chunk", [None, 64])
@pytest.mark.parametrize("impl", [None, "native"])
@pytest.mark.parametrize("step", [None, 3, "traced"])
def test_apply_updates_native_many_leaves(step, impl, lane_chunk, monkeypatch):
    """The native apply_updates on 0-d, empty, fp32 (plain add), bf16 and fp16 leaves, several of
    one shape: the bits of ``stochastic_add`` per leaf at its start (every leaf's loop takes its
    start as a runtime scalar, ``_lax._opaque``: a traced step makes it one). Leaves up to 40
    elements are updated together (``_leaves._small_leaves_call``), larger ones one by one; with
    ``lane_chunk`` the larger ones in several runs of random lanes (``_leaves._lane_chunks``),
    one leaf (130 elements) longer than a run. ``impl=None``: the lanes from the host."""
    monkeypatch.setattr(_leaves, "_SMALL_LEAF", 40)
    if lane_chunk:
        monkeypatch.setattr(_leaves, "_LANE_BYTES", 2 * lane_chunk)  # one stream
    rng = np.random.default_rng(5)
    params = [rng.standard_normal(s).astype(d) for s, d in zip(GROUPED_SHAPES, GROUPED_DTYPES)]
    updates = [(rng.standard_normal(s) * 1e-2).astype(np.float32) for s in GROUPED_SHAPES]
    if step == "traced":
        fn = jax.jit(lambda p, u, s: sj.apply_updates(p, u, SEED, step=s, impl=impl))
        got = fn(list(map(jnp.asarray, params)), list(map(jnp.asarray, updates)), jnp.int32(3))
        t = 3
    else:
        got = sj.apply_updates(
            list(map(jnp.asarray, params)),
            list(map(jnp.asarray, updates)),
            SEED,
            step=step,
            impl=impl,
        )
        t = step or 0
    for p, u, start, g in zip(params, updates, _starts(params), got):
        assert g.shape == p.shape
        if p.dtype == np.float32:
            assert_same_bits(g, p + u)
            continue
        w = p.reshape(-1).copy()
        if w.size:
            srround.stochastic_add(w, u.reshape(-1), seed=SEED, offset=(t << 36) + int(start))
        assert_same_bits(g, w.reshape(p.shape))


def _distinct_kernels(fn, *args) -> int:
    """Distinct fused computations of ``fn``'s compiled CPU program (names, parameter numbers
    and metadata left out): what XLA's CPU backend compiles, identical fusions once."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    bodies = set()
    for block in re.split(r"\n\s*\n", text):
        block = block.strip()
        if block.startswith("%fused_computation"):
            block = re.sub(r", metadata=\{[^}]*\}", "", block)
            bodies.add(re.sub(r"%?[\w.\-]+(?=[ :=,)])", "x", block))
    return len(bodies)


def test_apply_updates_leaves_of_one_shape_share_a_kernel():
    """Leaves of one shape and dtype are one computation for XLA (each takes its start as a
    runtime scalar), so the first call compiles as many kernels for 12 leaves as for 3; the
    bits stay those of ``stochastic_add`` at each leaf's start
    (``test_apply_updates_native_many_leaves``)."""

    def step(p, u, key):
        return sj.apply_updates(p, u, key, impl="native")

    def kernels(n):
        size = _leaves._SMALL_LEAF + 1  # updated one by one
        params = [jnp.full((size,), 1.0 + i, jnp.bfloat16) for i in range(n)]
        updates = [jnp.full((size,), 1e-3, jnp.float32) for _ in range(n)]
        return _distinct_kernels(step, params, updates, jax.random.key(1))

    assert kernels(12) == kernels(3)


def test_small_leaves_are_one_loop():
    """Small leaves of the same dtypes (biases, norms) are updated in one loop over their
    concatenation, whatever their shapes: XLA's compile time grows with the number of loops.
    The bits are checked by ``test_apply_updates_native_many_leaves`` and
    ``test_adamw_native_leaves``. On one CPU device only (elsewhere leaves keep their
    shardings)."""
    if jax.default_backend() != "cpu":
        pytest.skip("small leaves are joined on one CPU device only")

    def step(p, u, key):
        return sj.apply_updates(p, u, key, impl="native")

    def loops(shapes):  # fused computations of more than a copy
        params = [jnp.full(s, 1.0, jnp.bfloat16) for s in shapes]
        updates = [jnp.full(s, 1e-3, jnp.float32) for s in shapes]
        text = jax.jit(step).lower(params, updates, jax.random.key(1)).compile().as_text()
        blocks = [b.strip() for b in re.split(r"\n\s*\n", text)]
        return sum(b.startswith("%fused_computation") and b.count("\n") > 50 for b in blocks)

    assert loops([(64,), (5, 7), (3,), (2, 3, 4), (100,), (9,)]) == loops([(64,)])


@pytest.mark.parametrize("impl", [None, "native"])
def test_small_leaves_split_back_in_one_kernel(impl):
    """The joined small leaves come back out of their loop at runtime offsets, so slices of
    one size are one kernel for XLA: 24 small leaves of one shape compile no more kernels than 6
    (at constant offsets each slice was a kernel of its own: 500 small leaves took 16 s to
    compile, 6 s now, on the 2-core VM)."""
    if jax.default_backend() != "cpu":
        pytest.skip("small leaves are joined on one CPU device only")

    def step(p, u, key):
        return sj.apply_updates(p, u, key, impl=impl)

    def kernels(n):
        params = [jnp.full((64,), 1.0 + i, jnp.bfloat16) for i in range(n)]
        updates = [jnp.full((64,), 1e-3, jnp.float32) for _ in range(n)]
        return _distinct_kernels(step, params, updates, jax.random.key(1))

    assert kernels(24) <= kernels(6)


def test_random_lanes_reuse_one_buffer(monkeypatch):
    """On one CPU device the random lanes of the leaves come in runs of ``_LANE_BYTES``, one
    run after another, so XLA keeps one run's buffer at a time: 16 leaves of
    4096 bf16 elements in runs of 4096 need about 8 KiB of lanes, not 128 KiB (2 bytes per
    element: fresh pages on every call of a large model, and memory). Both ways of making
    the lanes: ``jax.lax`` (``impl="native"``) and the host (the default)."""
    if jax.default_backend() != "cpu":
        pytest.skip("the lanes are a buffer on one CPU device only")
    monkeypatch.setattr(_leaves, "_SMALL_LEAF", 1000)  # each leaf a loop of its own
    monkeypatch.setattr(_leaves, "_LANE_BYTES", 2 * 4096)
    params = [jnp.full((4096,), 1.0, jnp.bfloat16) for _ in range(16)]
    updates = [jnp.full((4096,), 1e-3, jnp.float32) for _ in range(16)]
    for impl in (None, "native"):
        fn = jax.jit(lambda p, u, k, impl=impl: sj.apply_updates(p, u, k, impl=impl))
        compiled = fn.lower(params, updates, jax.random.key(1)).compile()
        assert compiled.memory_analysis().temp_size_in_bytes < 4 * 4096 * 2
        assert ("srround_host_call" in compiled.as_text()) == (impl is None)


def test_host_lanes_equal_lax_lanes():
    """The two makers of random lanes on one CPU device agree: the Numba kernels through the
    FFI target (``_callback.random_lanes``) and ``jax.lax`` (``_leaves._small_lanes``), for
    several ranges and streams that are not consecutive (each row its own high word)."""
    if jax.default_backend() != "cpu":
        pytest.skip("the host lanes are a CPU call")
    from srround.adapters.jax._callback import random_lanes

    k0, k1, high, zero = jnp.uint32(11), jnp.uint32(22), jnp.uint32(4 * 5), jnp.uint32(0)
    ranges = [(8, 40), (101, 9), (2**20 + 3, 70_000)]
    host = jax.jit(lambda: random_lanes(k0, k1, high, ranges, zero, (0, 2)))()
    starts = [jnp.uint32(s) for s, _ in ranges]
    sizes = [n for _, n in ranges]
    lax_lanes = jax.jit(
        lambda: _leaves._small_lanes(k0, k1, [high, high + 2], starts, sizes, zero)
    )()
    assert host.shape == lax_lanes.shape == (2, sum(sizes))
    assert_same_bits(host, lax_lanes)


def test_adamw_bf16_states_compute_the_update_once():
    """With bf16 params and states, a leaf's three outputs come from one loop that runs the
    AdamW math once (``_leaves._packed``): XLA's CPU backend would copy the math into a loop per
    output. Each leaf reads its random bits as a contiguous window (a dynamic slice), not by a
    gather. Compiled only; the bits are checked by ``test_adamw_native_leaves``. The HLO text
    checked is the CPU backend's (a GPU fuses differently)."""
    if jax.default_backend() != "cpu":
        pytest.skip("checks the CPU backend's compiled program")
    opt = sj.adamw(1e-3, seed=SEED, state_dtype=jnp.bfloat16, impl="native")
    shape = (129, 128)  # above _leaves._SMALL_LEAF: each leaf a loop of its own
    params = [jnp.ones(shape, jnp.bfloat16)] * 2
    grads = [jnp.full(shape, 1e-3, jnp.bfloat16)] * 2
    state = opt.init(params)
    text = jax.jit(lambda p, s, g: opt.step(g, s, p)).lower(params, state, grads).compile()
    blocks = re.split(r"\n\s*\n", text.as_text())
    math = [b for b in blocks if b.strip().startswith("%fused_computation") and "f64[129" in b]
    assert len(math) == 2
    assert " gather(" not in text.as_text() and " dynamic-slice(" in text.as_text()


def test_narrow_rounds_float64_to_float32_as_numpy():
    """``_lax.narrow`` (float64 -> float32; on a GPU in integer ops, which XLA cannot skip as
    it may a conversion pair) is NumPy's conversion: ties to even, subnormals, overflow, inf;
    NaN as +qNaN. Random patterns around float32's range and every rounding case near ties."""
    rng = np.random.default_rng(0)
    expo = rng.integers(1023 - 160, 1023 + 130, 200_000, dtype=np.uint64)
    mant = rng.integers(0, 2**52, 200_000, dtype=np.uint64)
    mant[::4] = (mant[::4] & ~np.uint64(2**30 - 1)) | np.uint64(2**28)  # exact ties
    mant[1::4] = (mant[1::4] & ~np.uint64(2**29 - 1)) | np.uint64(2**28)  # ties at bit 29
    sign = rng.integers(0, 2, 200_000, dtype=np.uint64) << np.uint64(63)
    x = (sign | (expo << np.uint64(52)) | mant).view(np.float64)
    specials = [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 3.5e38, 3.4028235677973366e38]
    x = np.concatenate([x, np.array(specials), np.float32(1e-45) * np.arange(-40.0, 40.0)])
    with np.errstate(over="ignore"):
        want = x.astype(np.float32)
    want[np.isnan(want)] = np.uint32(0x7FC00000).view(np.float32)
    # every branch, whatever the backend: XLA's conversion (CPU), integer ops (ROCm, TPU)
    for fn in (_lax.narrow, _lax._narrow_by_conversion, _lax._narrow_in_integers):
        with jax.enable_x64(True):
            got = np.asarray(jax.jit(fn)(jnp.asarray(x)))
        assert_same_bits(got, want)
    # CUDA's: the conversion itself; its subnormals are the GPU's (checked on a GPU), the
    # rest here (XLA's CPU backend flushes subnormal conversions)
    with jax.enable_x64(True):
        got = np.asarray(jax.jit(_lax._narrow_on_cuda)(jnp.asarray(x)))
    normal = ~((np.abs(want) < np.float32(2.0**-126)) & (want != 0))
    assert_same_bits(got[normal], want[normal])


@pytest.mark.parametrize("kw", [{}, {"nesterov": True}, {"eps_root": 1e-8}])
def test_adamw_divides_in_float64_on_a_gpu(kw):
    """XLA's GPU backend divides float32 with ``div.full`` (up to 1 ulp off: an H100 run gave
    1-ulp differences from the kernels): lowered for CUDA, every division and square root of
    the native step is a float64 op (then rounded once, ``_lax.div``); for the CPU, float32
    ops. float64 results reach float32 through XLA's conversion on both, not in integer ops
    (``_lax.narrow``: ROCm and TPUs)."""
    opt = sj.adamw(1e-3, seed=SEED, impl="native", **kw)
    params = [jnp.ones((8,), jnp.bfloat16), jnp.ones((3, 5), jnp.float32)]
    step = jax.jit(lambda p, s, g: opt.step(g, s, p)).trace(params, opt.init(params), params)
    for platform, wide in (("cuda", True), ("cpu", False)):
        text = step.lower(lowering_platforms=(platform,)).as_text()
        types = re.findall(r"stablehlo\.(?:divide|sqrt) .*: tensor<([^>]*)>", text)
        elementwise = [t for t in types if "x" in t]  # not the scalar coefficients
        assert elementwise, text
        assert all(t.endswith("f64") == wide for t in elementwise), (platform, types)
        assert str(0xFFFFFFFFE0000000) not in text, platform  # _narrow_in_integers' mask
        assert re.search(r"stablehlo\.convert .*f64>\) -> tensor<[^>]*f32>", text), platform


def test_buffer_values_widen_by_conversion_on_a_gpu():
    """Values read from buffers widen to float64 exactly, subnormals included: lowered for the
    CPU (whose XLA flushes subnormal conversions) they are rebuilt from their bits (2**-149
    quanta), lowered for CUDA they are XLA's conversion, which keeps subnormals there (an H100
    run: the same bits, the step 5 % faster)."""
    opt = sj.adamw(1e-3, seed=SEED, impl="native")
    params = [jnp.ones((8,), jnp.bfloat16), jnp.ones((3, 5), jnp.float32)]
    step = jax.jit(lambda p, s, g: opt.step(g, s, p)).trace(params, opt.init(params), params)
    quantum = re.compile(r"1\.40129\d*E-45")  # 2**-149 in float64
    assert not quantum.search(step.lower(lowering_platforms=("cuda",)).as_text())
    assert quantum.search(step.lower(lowering_platforms=("cpu",)).as_text())


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_fused_step_default_is_the_host_step_on_the_cpu_only(opt):
    """``impl=None``: lowered for the CPU the fused step is one call of srround's FFI target
    (the Numba step in XLA's buffers) and no elementwise math; lowered for CUDA (from this
    CPU machine, as ``jax.export`` does) it is the native ``jax.lax`` step. Settings the host
    step cannot run (``nesterov``, ``eps_root``, another ``mu_dtype``, fp8 states) run the
    native step everywhere, on the CPU with its random lanes from the host (the bits of
    ``impl="native"``). optax's ``mask`` is two host calls on the CPU (the leaves inside it,
    those outside with no weight decay): the bits of the native step too."""
    make = {
        "adamw": lambda **kw: sj.adamw(1e-3, seed=SEED, **kw),
        "sgd": lambda **kw: sj.sgd(1e-2, momentum=0.9, seed=SEED, **kw),
    }[opt]
    params = [jnp.ones((8,), jnp.bfloat16), jnp.ones((3, 5), jnp.float32)]

    def lowered(tx):
        """The step traced once, lowered for the CPU (lowered: run it with ``.compile()``) and
        for CUDA (its text)."""
        traced = jax.jit(lambda p, s, g: tx.step(g, s, p)).trace(params, tx.init(params), params)
        cpu = traced.lower(lowering_platforms=("cpu",))
        return cpu, traced.lower(lowering_platforms=("cuda",)).as_text()

    cpu, on_gpu = lowered(make())
    on_cpu = cpu.as_text()
    assert on_cpu.count("srround_host_call") == 1
    assert "srround_host_call" not in on_gpu
    assert re.search(r"stablehlo\.(divide|sqrt|multiply) .*tensor<8x", on_gpu)
    assert not re.search(r"stablehlo\.(divide|sqrt|multiply) .*tensor<8x", on_cpu)
    if opt == "adamw":
        for kw in (
            {"nesterov": True},
            {"eps_root": 1e-8},
            {"mask": [True, False]},
            {"mask": [False, True], "weight_decay": 0.5},
            {"state_dtype": jnp.float8_e4m3fn},
            {"state_dtype": jnp.float8_e4m3fn, "mask": [True, False]},
        ):
            tx = make(**kw)
            lowered_cpu, gpu = lowered(tx)
            cpu = lowered_cpu.as_text()
            if "mask" in kw and "state_dtype" not in kw:  # the host step, one call per group
                assert cpu.count("srround_host_call") == 2, kw
                assert "stablehlo.sqrt" not in cpu, kw
            else:
                assert "stablehlo.sqrt" in cpu, kw  # the native step
                if jax.default_backend() == "cpu":  # on one CPU device: the random lanes
                    assert "srround_host_call" in cpu, kw
            assert "srround_host_call" not in gpu, kw
            grads = [jnp.full(p.shape, 0.1, p.dtype) for p in params]
            native = make(impl="native", **kw)
            got = [
                lowered_cpu.compile()(params, tx.init(params), grads),
                jax.jit(lambda p, s, g: native.step(g, s, p))(params, native.init(params), grads),
            ]
            for a, b in zip(*map(jax.tree_util.tree_leaves, got)):
                assert_same_bits(a, b)


def test_apply_updates_fresh_noise_per_step():
    p = jnp.ones(4096, jnp.bfloat16)
    u = jnp.full(4096, 2.0**-10, jnp.float32)
    a = sj.apply_updates(p, u, 0, step=1)
    b = sj.apply_updates(p, u, 0, step=2)
    assert not np.array_equal(bits(a), bits(b))
    assert_same_bits(sj.apply_updates(p, u, 0, step=1), a)


# -- fused adamw: bits of srround.adamw_step ---------------------------------------------------


def _numpy_run(
    params, steps, *, rounding, state_dtype, lr=1e-2, lrs=None, seed=SEED, grads=_grads, **kw
):
    P = [p.copy() for p in params]
    npd = np.float32 if state_dtype == jnp.float32 else ml_dtypes.bfloat16
    M = [np.zeros(p.shape, npd) for p in P]
    V = [np.zeros(p.shape, npd) for p in P]
    aux = None
    if rounding == "master":
        aux = [None if p.dtype == np.float32 else p.astype(np.float32) for p in P]
    elif rounding == "kahan":
        aux = [None if p.dtype == np.float32 else np.zeros_like(p) for p in P]
    elif rounding == "remainder":
        aux = [None if p.dtype == np.float32 else np.zeros(p.shape, np.int16) for p in P]
    for t in range(steps):
        srround.adamw_step(
            P,
            grads(t),
            M,
            V,
            lr=lr if lrs is None else lrs[t],
            step=t + 1,
            seed=seed,
            rounding=rounding,
            aux=aux,
            **kw,
        )
    return P, M, V, aux


def _jax_run(params, steps, *, impl, rounding, state_dtype, lr=1e-2, seed=SEED, grads=_grads, **kw):
    """``steps`` fused steps (``inv_scale`` in ``kw`` goes to the step, the rest to ``adamw``)."""
    kw.setdefault("weight_decay", 1e-2)  # srround.adamw_step's default (optax's is 1e-4)
    inv_scale = kw.pop("inv_scale", None)
    tx = sj.adamw(lr, seed=seed, rounding=rounding, state_dtype=state_dtype, impl=impl, **kw)
    ps = [jnp.asarray(p) for p in params]
    state = tx.init(ps)
    fn = jax.jit(lambda g, s, p: tx.step(g, s, p, inv_scale=inv_scale))
    for t in range(steps):
        ps, state = fn([jnp.asarray(g) for g in grads(t)], state, ps)
    return ps, state


def _check_against_numpy(got, state, expected):
    P, M, V, aux = expected
    for a, b in zip(got + state.exp_avg + state.exp_avg_sq, P + M + V):
        assert_same_bits(a, b)
    if aux is not None:
        for a, b in zip(state.aux, aux):
            assert (a is None) == (b is None)
            if a is not None:
                assert_same_bits(a, b)


DTYPES = [ml_dtypes.bfloat16, np.float32, ml_dtypes.bfloat16, np.float16, ml_dtypes.bfloat16]


@pytest.mark.parametrize("state_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_adamw_native_leaves(rounding, state_dtype, monkeypatch):
    """The native step leaf by leaf, every leaf's start a runtime scalar, the leaves up to 40
    elements in one loop (``_leaves._small_leaves_call``), the others in runs of random lanes of
    at most 64 bytes (32 positions with one stream, 4 with three; ``_leaves._lane_chunks``; 130
    elements: a run of its own): the bits of ``srround.adamw_step``."""
    monkeypatch.setattr(_leaves, "_SMALL_LEAF", 40)
    monkeypatch.setattr(_leaves, "_LANE_BYTES", 64)
    params = normal_params(SHAPES, DTYPES)
    got, state = _jax_run(params, 2, impl="native", rounding=rounding, state_dtype=state_dtype)
    _check_against_numpy(
        got, state, _numpy_run(params, 2, rounding=rounding, state_dtype=state_dtype)
    )


@pytest.mark.parametrize("state_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rounding", ["stochastic", "kahan", "master"])
def test_host_step_joins_small_leaves(rounding, state_dtype, monkeypatch):
    """The default step on one CPU device (the host call) takes the small leaves of the same
    dtypes joined, one operand per buffer, not per leaf, each leaf at its own place in the
    random stream (two bf16 leaves apart, with other leaves between): XLA's compile time grew
    faster than the call's operands (500 small AdamW leaves, 2,000 operands: 31 s; 6.6 s
    joined, optax.adamw 6.2 s, 2-core VM). The bits of ``srround.adamw_step``."""
    monkeypatch.setattr(_leaves, "_SMALL_LEAF", 40)  # (130,) a leaf of its own, the rest small
    params = normal_params(SHAPES, DTYPES)
    tx = sj.adamw(1e-2, seed=SEED, rounding=rounding, state_dtype=state_dtype)
    text = jax.jit(tx.step).lower(params, tx.init(params), params).as_text()
    (call,) = [line for line in text.splitlines() if "custom_call @srround_host_call" in line]
    operands = call.split(" : (")[-1].split(") -> ")[0].split(", ")
    # the bf16 leaves of 33 and 12 elements as one buffer per column: params, grads, moments
    # and (kahan, master) aux; neither leaf on its own
    joined = [o for o in operands if o.startswith("tensor<45x")]
    assert len(joined) == 4 + (rounding != "stochastic"), operands
    assert not [o for o in operands if o.startswith(("tensor<33x", "tensor<2x2x3x"))], operands
    got, state = _jax_run(params, 2, impl=None, rounding=rounding, state_dtype=state_dtype)
    _check_against_numpy(
        got, state, _numpy_run(params, 2, rounding=rounding, state_dtype=state_dtype)
    )


def _as_on_a_gpu(monkeypatch):
    """Trace the native path as for a GPU, to run it on the CPU: ``lax.platform_dependent``
    takes the CUDA branch (else the default one) in ``_lax`` and ``optim``, and every leaf
    computes its own random bits (``_leaves._on_one_cpu``)."""
    from srround.adapters.jax import optim

    def platform_dependent(*args, default, cuda=None, **_):
        return (cuda or default)(*args)

    gpu_lax = SimpleNamespace(**{n: getattr(lax, n) for n in dir(lax) if not n.startswith("_")})
    gpu_lax.platform_dependent = platform_dependent
    monkeypatch.setattr(_lax, "lax", gpu_lax)
    monkeypatch.setattr(optim, "lax", gpu_lax)
    monkeypatch.setattr(_leaves, "_on_one_cpu", lambda leaves: False)


@pytest.mark.parametrize("kw", [{}, {"nesterov": True}, {"eps_root": 1e-8}])
@pytest.mark.parametrize("state_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_adamw_gpu_arithmetic_on_the_cpu(rounding, state_dtype, kw, monkeypatch):
    """The native step as lowered for a GPU, run on the CPU: each leaf computes its own random
    bits from its global indices (``_leaves._leaf_call``), and the GPU branches divide and take
    square roots in float64 and round float64 results to float32 in integer ops. The
    bits of ``srround.adamw_step`` (nesterov and eps_root: of the CPU's native step), on inputs
    whose float32 values stay normal, where the CPU's flushing of subnormals does not reach.
    With nesterov the CPU's step was not the GPU's: XLA had rewritten its divisions by the
    bias corrections (scalars) into products with their rounded reciprocals (``_lax.div``).
    What XLA's GPU backend then does with these ops is checked on a GPU by the rest of the
    suite."""
    params = normal_params(SHAPES, DTYPES, seed=4)
    if kw:  # outside the kernels' math: the CPU's own native step is the reference
        cpu, _ = _jax_run(
            params, 3, impl="native", rounding=rounding, state_dtype=state_dtype, **kw
        )
    _as_on_a_gpu(monkeypatch)
    got, state = _jax_run(
        params, 3, impl="native", rounding=rounding, state_dtype=state_dtype, **kw
    )
    if kw:
        for a, b in zip(got, cpu):
            assert_same_bits(a, b)
    else:
        expected = _numpy_run(params, 3, rounding=rounding, state_dtype=state_dtype)
        _check_against_numpy(got, state, expected)


@pytest.mark.parametrize("step", [None, 4])
def test_apply_updates_gpu_arithmetic_on_the_cpu(step, monkeypatch):
    """``apply_updates`` as lowered for a GPU (one float32 add for the sum, each leaf's own
    random bits), run on the CPU: the bits of ``stochastic_add``, on normal values."""
    params = normal_params(SHAPES, MIXED)
    updates = [u * np.float32(1e-2) for u in _grads(0)]
    expected = [jnp.asarray(p) for p in params]
    expected = sj.apply_updates(expected, updates, 7, step=step, impl="callback")
    _as_on_a_gpu(monkeypatch)
    got = jax.jit(lambda p, u: sj.apply_updates(p, u, 7, step=step, impl="native"))(
        [jnp.asarray(p) for p in params], updates
    )
    for a, b in zip(got, expected, strict=True):
        assert_same_bits(a, b)


@pytest.mark.parametrize("rounding", ["kahan", "master", "remainder"])
def test_adamw_float32_tree_in_every_mode(rounding):
    """A tree of float32 parameters only (no aux buffers) in the aux modes: the default step
    (the host call on the CPU) gives the native step's bits. The host call failed at run time
    (``srround.adamw_step`` wanted an aux list for float32 parameters)."""
    params = [p.astype(np.float32) for p in normal_params(SHAPES, DTYPES, seed=5)]
    runs = [
        _jax_run(params, 2, impl=impl, rounding=rounding, state_dtype=jnp.bfloat16)
        for impl in (None, "native")
    ]
    for a, b in zip(*(jax.tree.leaves(r) for r in runs), strict=True):
        assert_same_bits(a, b)


@pytest.mark.parametrize("impl", IMPLS)
def test_adamw_schedule_key_seed_and_hyperparameters(impl):
    optax = pytest.importorskip("optax")
    # learning rates that are products of constants: the reference below evaluates the
    # schedule eagerly, the step inside its jit (where XLA may fuse a multiply-add)
    schedule = optax.piecewise_constant_schedule(3e-2, {1: 0.5, 3: 0.1})
    key = jax.random.key(11)
    data = np.asarray(jax.random.key_data(key))
    seed = int(data[0]) | int(data[1]) << 32
    params = normal_params(SHAPES, DTYPES, seed=3)
    kw = dict(b1=0.8, b2=0.95, eps=1e-6, weight_decay=0.1)
    tx = sj.adamw(schedule, seed=key, impl=impl, **kw)
    ps = [jnp.asarray(p) for p in params]
    state = tx.init(ps)
    fn = jax.jit(tx.step)
    for t in range(4):
        ps, state = fn([jnp.asarray(g) for g in _grads(t)], state, ps)
    lrs = [float(np.float32(schedule(t))) for t in range(4)]
    P = [p.copy() for p in params]
    M = [np.zeros(p.shape, np.float32) for p in P]
    V = [np.zeros(p.shape, np.float32) for p in P]
    for t in range(4):
        srround.adamw_step(
            P,
            _grads(t),
            M,
            V,
            lr=lrs[t],
            betas=(0.8, 0.95),
            eps=1e-6,
            weight_decay=0.1,
            step=t + 1,
            seed=seed,
        )
    for a, b in zip(ps + state.exp_avg + state.exp_avg_sq, P + M + V):
        assert_same_bits(a, b)


@pytest.mark.parametrize("t", [1, 2, 3, 10, 1000, 12345, 2**20 + 7, 2**26 - 1])
def test_native_coefs_are_prepare_coefs(t):
    from srround.adapters.jax.optim import _coefs

    for lr in (1e-3, 0.3):
        expected = _optim.prepare_coefs(_optim.ADAMW, t, lr, 0.9, 0.999, 1e-8, 0.01)[:3]
        got = jax.jit(lambda s: _coefs(s, lr, 0.9, 0.999, 0.01))(jnp.int32(t))
        for a, b in zip(got, expected):
            assert_same_bits(np.float32(a), np.float32(b))
        traced = jax.jit(lambda s, r: _coefs(s, r, 0.9, 0.999, 0.01))(jnp.int32(t), jnp.float32(lr))
        lr32 = float(np.float32(lr))
        expected = _optim.prepare_coefs(_optim.ADAMW, t, lr32, 0.9, 0.999, 1e-8, 0.01)[:3]
        for a, b in zip(traced, expected):
            assert_same_bits(np.float32(a), np.float32(b))


@pytest.mark.parametrize("impl", IMPLS)
def test_found_inf_skips_bit_identically(impl):
    params = normal_params(SHAPES, DTYPES)
    tx = sj.adamw(1e-2, weight_decay=1e-2, seed=SEED, rounding="kahan", impl=impl)
    ps = [jnp.asarray(p) for p in params]
    state = tx.init(ps)
    fn = jax.jit(lambda g, s, p, f: tx.step(g, s, p, found_inf=f))
    ps, state = fn([jnp.asarray(g) for g in _grads(0)], state, ps, jnp.float32(0.0))
    assert int(state.count) == 1
    before = jax.tree_util.tree_leaves((ps, state))
    bad = [jnp.asarray(g) for g in _grads(1)]
    for flag in (jnp.float32(1.0), jnp.float32(np.inf), jnp.bool_(True)):
        ps2, state2 = fn(bad, state, ps, flag)
        for a, b in zip(jax.tree_util.tree_leaves((ps2, state2)), before):
            assert_same_bits(a, b)
    # a clean step after the skip is the step 2 of the NumPy path
    ps, state = fn([jnp.asarray(g) for g in _grads(1)], state, ps, jnp.bool_(False))
    _check_against_numpy(
        ps, state, _numpy_run(params, 2, rounding="kahan", state_dtype=jnp.float32)
    )


def test_donated_jit_and_optax_update_path():
    optax = pytest.importorskip("optax")
    params = normal_params(SHAPES, DTYPES)
    tx = sj.adamw(1e-2, weight_decay=1e-2, seed=SEED)
    assert isinstance(tx, optax.GradientTransformation)
    ps = [jnp.asarray(p) for p in params]
    state = tx.init(ps)
    grads = [jnp.asarray(g) for g in _grads(0)]
    ref_p, ref_s = jax.jit(tx.step)(grads, state, ps)
    updates, s2 = jax.jit(tx.update)(grads, state, ps)
    assert all(u.dtype == jnp.float32 for u in updates)
    for a, b in zip(optax.apply_updates(ps, updates), ref_p):
        if b.dtype != jnp.float32:
            assert_same_bits(a, b)  # bf16/fp16: exact (SR included)
        else:  # exact unless no float32 u has p + u == new (weights crossing 0 here): 1 ulp
            a, b = np.asarray(a), np.asarray(b)
            assert np.all(np.abs(a - b) <= np.spacing(np.abs(b)))
            assert np.mean(a == b) > 0.9
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "some donated buffers were not usable" on some CPUs
        donated = jax.jit(tx.step, donate_argnums=(1, 2))
        copies = jax.tree_util.tree_map(jnp.copy, (state, ps))
        p3, s3 = donated(grads, *copies)
    for a, b in zip(
        jax.tree_util.tree_leaves((p3, s3, s2)), jax.tree_util.tree_leaves((ref_p, ref_s, ref_s))
    ):
        assert_same_bits(a, b)


def test_native_fma_is_exact():
    """The optimizer's float64 fma (and its sum, ``fma(1, u, w)``) against Numba's ``fma32``
    (llvm.fma.f32) and the adapter's integer ``_fma_bits`` on hard cases: cancellation, exact
    ties, tiny addends, subnormal operands and results, overflow, specials."""
    from srround.adapters.jax.optim import _add, _fma

    def as_f32(v):
        return jnp.asarray(v.view(np.float32))

    fma = jax.jit(lambda x, y, z: _fma(x, y, z))
    loose = jax.jit(lambda x, y, z: _fma(x, y, z, exact=(True, False, True)))
    for i, (x, y, z) in enumerate(fma_hard_cases(7)):
        got = bits(fma(as_f32(x), as_f32(y), as_f32(z)))
        assert_same_fma_bits(i, x, y, z, fma32_bits(x, y, z), got)
        ones = np.full(y.size, 0x3F800000, np.uint32)
        assert_same_fma_bits(
            i, ones, y, z, fma32_bits(ones, y, z), bits(jax.jit(_add)(as_f32(y), as_f32(z)))
        )
        old = np.asarray(jax.jit(_lax._fma_bits)(jnp.asarray(x), jnp.asarray(y), jnp.asarray(z)))
        nan_g = (got & 0x7FFFFFFF) > 0x7F800000
        np.testing.assert_array_equal(
            np.where(nan_g, got >> 31, got), np.where(nan_g, old >> 31, old)
        )  # the integer fma's bits (NaN: its sign)
        normal_b = (y & 0x7F800000) != 0  # b not subnormal: the plain widening is exact
        np.testing.assert_array_equal(
            bits(loose(as_f32(x), as_f32(y), as_f32(z)))[normal_b], got[normal_b]
        )


def test_master_tracks_optax_adamw_fp32():
    optax = pytest.importorskip("optax")
    rng = np.random.default_rng(5)
    shapes = [(256,), (16, 16)]
    params = [rng.standard_normal(s).astype(ml_dtypes.bfloat16) for s in shapes]
    ref = [jnp.asarray(p.astype(np.float32)) for p in params]
    kw = dict(b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.05)
    otx = optax.adamw(1e-3, **kw)
    tx = sj.adamw(1e-3, rounding="master", **kw)
    ps = [jnp.asarray(p) for p in params]
    ostate, state = otx.init(ref), tx.init(ps)

    @jax.jit
    def both(g, ostate, ref, state, ps):
        upd, ostate = otx.update(g, ostate, ref)
        ps, state = tx.step(g, state, ps)
        return ostate, optax.apply_updates(ref, upd), state, ps

    for t in range(50):
        g = [jnp.asarray(rng.standard_normal(s).astype(np.float32)) for s in shapes]
        ostate, ref, state, ps = both(g, ostate, ref, state, ps)
    for master, r, p in zip(state.aux, ref, ps):
        master, r = np.asarray(master), np.asarray(r)
        # the same math in another float32 order: after 50 steps of lr 1e-3 both are within
        # a few ulp of |p| ~ 1 of the float64 recursion (weights near 0 have tiny ulps, so the
        # bound is in units of the weights' scale, not of each element's own ulp)
        scale_ulp = np.spacing(np.float32(max(1.0, np.max(np.abs(r)))))
        assert np.max(np.abs(master - r)) <= 16 * scale_ulp
        assert np.max(np.abs(master - r)) <= 1e-2 * 1e-3  # 1% of one step's move (lr)
        assert_same_bits(p, master.astype(ml_dtypes.bfloat16))  # the param is RNE(master)


def test_errors():
    with pytest.raises(ValueError, match="rounding"):
        sj.adamw(1e-3, rounding="floor")
    with pytest.raises(TypeError, match="state_dtype"):
        sj.adamw(1e-3, state_dtype=jnp.float16)
    with pytest.raises(TypeError, match="remainder"):
        sj.adamw(1e-3, rounding="remainder").init([jnp.zeros(3, jnp.float16)])
    with pytest.raises(ValueError, match="impl"):
        sj.apply_updates([jnp.zeros(2, jnp.bfloat16)], [jnp.zeros(2)], 0, impl="gpu")
    with pytest.raises(TypeError, match="JAX"):
        srround.adamw_step(
            [jnp.zeros(2)], [jnp.zeros(2)], [jnp.zeros(2)], [jnp.zeros(2)], lr=1e-3, step=1
        )


def _subnormal_inputs(dtypes):
    """Params with every third value subnormal (fp16: in fp16's subnormal range) and per step
    gradients whose every other value squares to a subnormal, every fourth subnormal itself:
    moments, products and quotients at and below float32's normal range."""
    rng = np.random.default_rng(8)
    shapes = [(64,), (8, 8), (40,)]
    params = []
    for s, dtype in zip(shapes, dtypes):
        x = rng.standard_normal(s).astype(np.float32).reshape(-1)
        x[::3] *= np.float32(2.0**-128) if dtype != np.float16 else np.float32(2.0**-20)
        params.append(x.reshape(s).astype(dtype))

    def grads(t):
        r = np.random.default_rng(10 + t)
        out = []
        for s in shapes:
            g = r.standard_normal(s).astype(np.float32).reshape(-1)
            g[::2] *= np.float32(1e-20)
            g[1::4] *= np.float32(2.0**-135)
            out.append(g.reshape(s))
        return out

    return params, grads


def _skip_where_xla_flushes(impl):
    """The native step on a backend that flushes float32 subnormals (XLA's CPU backend, TPU)
    computes as XLA does there: a subnormal weight, moment, gradient or intermediate is zero
    (README, "optax conventions"). The kernels (the default on the CPU) and the GPU keep
    them."""
    flushed = float(jax.jit(lambda x: x * 0.5)(jnp.float32(2.0**-140))) == 0.0
    if impl == "native" and flushed:
        pytest.skip("this backend flushes float32 subnormals: the native step does too")


@pytest.mark.parametrize("impl", [None, "native"])
@pytest.mark.parametrize("state_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rounding", ["stochastic", "kahan", "master", "remainder"])
def test_fused_step_keeps_subnormals(rounding, state_dtype, impl):
    """Subnormal weights, gradients (times ``inv_scale``), moments and intermediates: the bits
    of ``srround.adamw_step``, which keeps them (the default step on the CPU runs those
    kernels; the native step where the backend keeps subnormals: on a GPU)."""
    _skip_where_xla_flushes(impl)
    dtypes = [np.float32, ml_dtypes.bfloat16]
    dtypes.append(ml_dtypes.bfloat16 if rounding == "remainder" else np.float16)
    params, grads = _subnormal_inputs(dtypes)
    kw = dict(rounding=rounding, state_dtype=state_dtype, grads=grads, weight_decay=0.5)
    got, state = _jax_run(params, 3, impl=impl, inv_scale=0.5, **kw)
    _check_against_numpy(got, state, _numpy_run(params, 3, inv_scale=0.5, **kw))


@pytest.mark.parametrize("impl", [None, "native"])
@pytest.mark.parametrize("momentum", ["fp32", "bf16", "nesterov"])
def test_sgd_keeps_subnormals(momentum, impl):
    """``test_fused_step_keeps_subnormals`` for SGD: the bits of ``srround.sgd_step``."""
    _skip_where_xla_flushes(impl)
    params, grads = _subnormal_inputs([np.float32, ml_dtypes.bfloat16, np.float16])
    acc = jnp.bfloat16 if momentum == "bf16" else None
    tx = sj.sgd(1e-1, 0.9, momentum == "nesterov", acc, seed=SEED, impl=impl)
    ps = [jnp.asarray(p) for p in params]
    state = tx.init(ps)
    step = jax.jit(tx.step)
    P = [p.copy() for p in params]
    B = [np.zeros(p.shape, ml_dtypes.bfloat16 if acc else np.float32) for p in P]
    for t in range(3):
        ps, state = step([jnp.asarray(g) for g in grads(t)], state, ps)
        srround.sgd_step(
            P,
            grads(t),
            B,
            lr=1e-1,
            momentum=0.9,
            nesterov=momentum == "nesterov",
            step=t + 1,
            seed=SEED,
        )
    for a, b in zip(list(ps) + list(state.momentum_buffer), P + B):
        assert_same_bits(a, b)


def test_native_mask_shares_the_lane_runs(monkeypatch):
    """optax's ``mask`` on the native step: the leaves inside and outside it (different weight
    decay coefficients) share one sequence of random-lane runs on one CPU device, so XLA keeps
    one lanes buffer, as without a mask (each group its own sequence doubled the temporaries:
    32 MB and 8,300 page faults a step on 24.6M parameters). Compiled only; the bits are
    checked by ``test_fused_step_default_is_the_host_step_on_the_cpu_only``."""
    if jax.default_backend() != "cpu":
        pytest.skip("checks the CPU backend's buffers")
    monkeypatch.setattr(_leaves, "_SMALL_LEAF", 10)
    monkeypatch.setattr(_leaves, "_LANE_BYTES", 2 * 8192)  # two leaves a run
    params = [jnp.full((64, 64), 0.5, jnp.bfloat16) for _ in range(6)]

    def temp(mask):
        tx = sj.adamw(1e-3, seed=SEED, mask=mask, impl="native")
        step = jax.jit(lambda p, s, g: tx.step(g, s, p))
        compiled = step.lower(params, tx.init(params), params).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert temp([i % 2 == 0 for i in range(6)]) == temp(None)


def _leaf_kernel_outputs(device, seed, shape=(512, 1024), leaves=8) -> list[int]:
    """The native AdamW step over ``leaves`` bf16 leaves of ``shape`` compiled for ``device``:
    per kernel of the program that writes arrays of ``shape``, how many it writes."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    params = [jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=sharding)] * leaves
    grads = [jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)] * leaves
    tx = sj.adamw(1e-4, weight_decay=1e-2, seed=seed, impl="native")
    state = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
        jax.eval_shape(tx.init, params),
    )
    hlo = jax.jit(tx.step).trace(grads, state, params).lower().compile().as_text()
    entry = hlo[hlo.index("\nENTRY") :]
    dims = "[" + ",".join(map(str, shape)) + "]"
    kernels = [line.split(" fusion(")[0] for line in entry.splitlines() if " fusion(" in line]
    return [k.count(dims) for k in kernels if dims in k]


def _gpu_to_compile_for():
    """A GPU device to compile for: the first GPU; without one, a compile-only device described
    by the ``GpuTargetConfigProto`` text file named by ``SRROUND_XLA_GPU_TARGET``
    (``benchmarks/h100_sxm.txtpb``), which takes the jax-cuda12 plugin installed and
    ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1``. Skips the test with neither."""
    import os

    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        pass
    path = os.environ.get("SRROUND_XLA_GPU_TARGET")
    if not path:
        pytest.skip("XLA's GPU compiler: needs a GPU or SRROUND_XLA_GPU_TARGET")
    from jax.experimental import topologies

    with open(path) as f:
        config = f.read()
    topology = topologies.get_topology_desc(platform="cuda", topology="1x1x1", target_config=config)
    return topology.devices[0]


def test_bias_correction_powers_are_the_kernels_for_every_int32_step():
    """``_power64`` (the bias corrections' ``beta ** t``), unrolled over the exponent's bits,
    gives the bits of the kernels' repeated squaring (``_optim._power``) for any step count an
    int32 holds, the largest included."""
    from srround.adapters.jax.optim import _power64

    steps = [0, 1, 2, 3, 7, 1000, 12345, 2**26 - 1, 2**26, 2**26 + 1, 2**30 + 5, 2**31 - 1]
    for base in (0.9, 0.999, 0.95, 0.5, 1.0 - 2.0**-20):
        with jax.enable_x64(True):
            got = jax.jit(lambda t, b=base: _power64(b, t))(jnp.asarray(steps, jnp.int32))
        expected = [_optim._power(base, t) for t in steps]
        np.testing.assert_array_equal(
            np.asarray(got).view(np.uint64), np.asarray(expected, np.float64).view(np.uint64)
        )


def test_native_step_runs_no_loop_or_conditional_on_a_gpu(monkeypatch):
    """Finding: the native AdamW step on a GPU ran two ``while`` loops (the bias corrections'
    powers) and a conditional (the leaf starts hidden from constant folding) before its
    leaves' kernels. On XLA's GPU backend each loop iteration is a kernel launch and a read
    of its condition back to the host, and a conditional reads its predicate back: serial
    host round trips in every step. Now the powers are unrolled and the starts pass through an
    optimization barrier: the step's program is kernels only."""
    device = _gpu_to_compile_for()
    monkeypatch.setattr(_leaves, "_on_one_cpu", lambda leaves: False)
    sharding = jax.sharding.SingleDeviceSharding(device)

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    params = [spec((64, 128), jnp.bfloat16), spec((128,), jnp.bfloat16)]
    grads = [spec(p.shape, jnp.float32) for p in params]
    for state_dtype in (jnp.float32, jnp.bfloat16):
        tx = sj.adamw(1e-4, seed=1, impl="native", state_dtype=state_dtype)
        state = jax.tree_util.tree_map(
            lambda a: spec(a.shape, a.dtype), jax.eval_shape(tx.init, params)
        )
        hlo = jax.jit(tx.step).trace(grads, state, params).lower().compile().as_text()
        entry = hlo[hlo.index("\nENTRY") :]
        assert " while(" not in entry and " conditional(" not in entry


def test_narrowed_values_stay_narrowed_on_a_gpu():
    """A float32 rounding (``_lax.narrow``) widened again survives XLA's GPU compiler, which
    drops a bare float64 -> float32 -> float64 conversion pair (excess precision: the float32
    rounding would vanish, as it did for the plain conversion: no conversion left at all)."""
    device = _gpu_to_compile_for()
    sharding = jax.sharding.SingleDeviceSharding(device)

    def f(x, y, z):
        return _lax.narrow(x * y).astype(jnp.float64) / z

    with jax.enable_x64(True):
        arg = jax.ShapeDtypeStruct((1024,), jnp.float64, sharding=sharding)
        hlo = jax.jit(f).trace(arg, arg, arg).lower().compile().as_text()
    assert "f32[1024]{0} convert(" in hlo and "f64[1024]{0} convert(" in hlo


def test_native_step_is_a_kernel_per_leaf_on_a_gpu(monkeypatch):
    """On a GPU each leaf of the native step is a kernel of its own. XLA's GPU backend merges
    loops that share an operand into one kernel (sibling multi-output fusion), and leaves of
    one shape shared the row offsets of their element indices: 8 AdamW leaves of 512 x 1024
    became one kernel writing 24 arrays (at 8.4M elements a leaf, compiled for sm_90: 152
    registers a thread, against 48 for a leaf's own kernel). Whether XLA merges depends on its
    cost model, which sees the key (seed 0 merged, others not): several seeds."""
    device = _gpu_to_compile_for()
    # the GPU's program, also where JAX's default backend is the CPU (a compile-only device);
    # XLA's kernels, not the Pallas ones (tests/test_jax_pallas.py)
    monkeypatch.setattr(_leaves, "_on_one_cpu", lambda leaves: False)
    monkeypatch.setattr(_pallas, "MODE", "off")
    jax.clear_caches()
    for seed in (0, 1, SEED):
        assert _leaf_kernel_outputs(device, seed) == [3] * 8  # params, exp_avg, exp_avg_sq


@pytest.mark.parametrize(
    "shape, origin, global_shape",
    [
        ((5,), None, None),
        ((4, 8), None, None),  # a power-of-two last dimension: the column is or-ed in
        ((3, 12), None, None),
        ((2, 3, 16), (None, None, None), None),
        ((2, 4), (1, None), (6, 4)),
        ((2, 4), (3, 4), (5, 8)),  # a block inside shard_map: both origins
        ((2, 3), (1, 2), (4, 6)),
        ((), None, None),
    ],
)
def test_element_index_is_the_row_major_index(shape, origin, global_shape):
    """``_element_index``: the row-major index in the global array of every element of a block
    at ``origin`` (a ``None`` origin is 0), whichever way the column enters (or-ed in where
    the global last dimension is a power of two, added otherwise), also with traced origins."""
    full = shape if global_shape is None else global_shape
    start = [0 if o is None else o for o in (origin or (None,) * len(shape))]
    grids = np.meshgrid(*[np.arange(s) + o for s, o in zip(shape, start)], indexing="ij")
    expected = np.ravel_multi_index(grids, full) if shape else np.zeros(())

    def index(*offsets):
        traced = (
            None
            if origin is None
            else tuple(None if o is None else t for o, t in zip(origin, offsets))
        )
        return _lax._element_index(shape, traced, global_shape)

    offsets = [jnp.uint32(o) for o in start]
    for fn in (index, jax.jit(index)):
        got = np.asarray(fn(*offsets))
        assert got.dtype == np.uint32 and got.shape == shape
        np.testing.assert_array_equal(got, expected)


NATIVE_STEP_PTX = """
import sys
import jax, jax.numpy as jnp
from jax.experimental import topologies
from srround.adapters import jax as sj
from srround.adapters.jax import _leaves

_leaves._on_one_cpu = lambda leaves: False  # the GPU's program on a compile-only device too
state_dtype, target = sys.argv[1], sys.argv[2]
try:
    device = jax.devices("gpu")[0]
except RuntimeError:
    config = open(target).read()
    device = topologies.get_topology_desc(
        platform="cuda", topology="1x1x1", target_config=config
    ).devices[0]
sharding = jax.sharding.SingleDeviceSharding(device)
params = [jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16, sharding=sharding)]
grads = [jax.ShapeDtypeStruct((512, 1024), jnp.float32, sharding=sharding)]
if state_dtype == "round":  # stochastic_round of a float32 matrix
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=sharding)
    jax.jit(lambda x, k: sj.stochastic_round(x, seed=k)).trace(grads[0], key).lower().compile()
    sys.exit()
tx = sj.adamw(1e-4, seed=1, impl="native", state_dtype=getattr(jnp, state_dtype))
state = jax.tree_util.tree_map(
    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
    jax.eval_shape(tx.init, params),
)
jax.jit(tx.step).trace(grads, state, params).lower().compile()
"""


@pytest.mark.parametrize("state_dtype, streams", [("float32", 1), ("bfloat16", 3), ("round", 1)])
def test_native_leaf_kernel_draws_a_threefry_block_per_four_elements_on_a_gpu(
    tmp_path, state_dtype, streams
):
    """XLA's GPU kernel of a leaf gives a thread four consecutive elements, which share their
    Threefry block (per random stream: the weights', and with bf16 states each state's; and
    ``stochastic_round`` of a matrix, state_dtype "round": 384 -> 168 instructions). With
    the column or-ed into the element index (a power-of-two last dimension, ``_element_index``)
    and the leaf's first lane a constant, LLVM computes the block once for the four: 20
    rotations (``shf.l.wrap.b32``) a stream and four elements in the kernel's PTX (XLA's
    vectorization read from its loads), where a sum of the row and column terms and a traced
    first lane gave 80 (fp32 states: 1216 -> 984 SASS instructions on sm_90). The PTX is read
    from XLA's dump of a compile in a subprocess."""
    import os
    import pathlib

    from .reference import run_python

    _gpu_to_compile_for()  # skips without a GPU or a compile-only one
    root = pathlib.Path(__file__).resolve().parent.parent
    env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={tmp_path}", PYTHONPATH=str(root))
    env["SRROUND_JAX_PALLAS"] = "off"  # XLA's kernels, not the Pallas ones
    target = os.environ.get("SRROUND_XLA_GPU_TARGET", "")
    run_python(["-c", NATIVE_STEP_PTX, state_dtype, target], env=env, cwd=tmp_path)
    kernels = [p.read_text() for p in tmp_path.rglob("*.ptx")]
    if not kernels:  # seen with JAX 0.11.2 on an H200: HLO and MLIR in the dump, no LLVM or PTX
        pytest.skip("XLA's GPU compiler wrote no PTX to its dump (JAX 0.11 on a real GPU)")
    stores = [k for k in kernels if "st.global" in k]
    assert stores, sorted(p.name for p in tmp_path.rglob("*"))[:50]
    leaf = max(stores, key=lambda k: k.count("shf.l.wrap.b32"))
    # elements a thread computes: its widest vector load (the float32 input's; 4 on sm_90)
    per_thread = max([int(w) for w in re.findall(r"ld\.global(?:\.nc)?\.v(\d)\.", leaf)] or [1])
    blocks = -(-per_thread // 4)  # consecutive elements, lane 0 first: a block per four
    # 20 rotations a block and stream (LLVM may make one a byte permute); 4x where not shared
    rotations = leaf.count("shf.l.wrap.b32")
    assert 19 * streams * blocks <= rotations <= 20 * streams * blocks, (rotations, per_thread)


def test_fused_step_vmapped_over_an_ensemble():
    """``jax.vmap`` of the fused step (an ensemble of models, the default path: a host call per
    member on the CPU) gives each member's own step, and the native path's bits."""
    p = jnp.linspace(-1, 1, 3 * 40).reshape(3, 40).astype(jnp.bfloat16)
    g = jnp.full((3, 40), 0.1, jnp.bfloat16)
    tx, native = sj.adamw(1e-2, seed=3), sj.adamw(1e-2, seed=3, impl="native")
    state = jax.vmap(tx.init)(p)
    out, new_state = jax.vmap(lambda g, s, p: tx.step(g, s, p))(g, state, p)
    for i in range(3):
        one, one_state = tx.step(g[i], tx.init(p[i]), p[i])
        assert_same_bits(np.asarray(out[i]), np.asarray(one))
        assert_same_bits(np.asarray(new_state.exp_avg[i]), np.asarray(one_state.exp_avg))
    lax_out, _ = jax.vmap(lambda g, s, p: native.step(g, s, p))(g, state, p)
    assert_same_bits(np.asarray(out), np.asarray(lax_out))


def test_fused_step_export():
    """``jax.export``: the default step exports for CUDA (native) and, with ``impl="native"``,
    for the CPU; the CPU host call is process-local, so exporting it is JAX's clear error."""
    from jax import export

    p = [jnp.ones(40, jnp.bfloat16)]
    tx = sj.adamw(1e-2, seed=3)
    state = tx.init(p)

    def step_of(opt):
        return jax.jit(lambda g, s, p: opt.step(g, s, p))

    assert export.export(step_of(tx), platforms=("cuda",))(p, state, p).platforms == ("cuda",)
    native = sj.adamw(1e-2, seed=3, impl="native")
    assert export.export(step_of(native), platforms=("cpu",))(p, state, p).platforms == ("cpu",)
    with pytest.raises(ValueError, match="srround_host_call"):
        export.export(step_of(tx), platforms=("cpu",))(p, state, p)


def test_apply_updates_vmapped_default_equals_native(monkeypatch):
    """Under ``vmap`` (an ensemble, one key per member or one for all) the default's host
    lanes - one call per member, in runs - give the native path's bits."""
    monkeypatch.setattr(_leaves, "_SMALL_LEAF", 10)
    monkeypatch.setattr(_leaves, "_LANE_BYTES", 64)  # runs of 32 positions
    rng = np.random.default_rng(2)
    p = [jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in ((3, 50), (3, 7))]
    u = [jnp.asarray(rng.standard_normal(x.shape) * 1e-2, jnp.float32) for x in p]
    keys = jax.random.split(jax.random.key(3), 3)
    for per_member in (False, True):
        got = []
        for impl in (None, "native"):
            if per_member:
                fn = jax.vmap(lambda p, u, k, impl=impl: sj.apply_updates(p, u, k, impl=impl))
                got.append(jax.jit(fn)(p, u, keys))
            else:
                fn = jax.vmap(lambda p, u, impl=impl: sj.apply_updates(p, u, 7, step=2, impl=impl))
                got.append(jax.jit(fn)(p, u))
        for a, b in zip(*got):
            assert_same_bits(a, b)


def test_apply_updates_export():
    """``apply_updates``' default takes its random lanes from a host call only where the
    program is lowered for the CPU: traced on this CPU machine and exported for CUDA it has
    none (the ``jax.lax`` lanes, the same bits); ``impl="native"`` exports for the CPU."""
    from jax import export

    p = [jnp.ones(40_000, jnp.bfloat16), jnp.ones(30, jnp.bfloat16)]
    u = [jnp.full(40_000, 1e-3, jnp.float32), jnp.full(30, 1e-3, jnp.float32)]

    def apply(impl):
        return jax.jit(lambda p, u: sj.apply_updates(p, u, SEED, step=3, impl=impl))

    on_one_cpu = jax.default_backend() == "cpu"  # else the lanes are the leaves' own
    assert ("srround_host_call" in apply(None).lower(p, u).as_text()) == on_one_cpu
    for_cuda = export.export(apply(None), platforms=("cuda",))(p, u)
    assert "srround_host_call" not in for_cuda.mlir_module()
    assert export.export(apply("native"), platforms=("cpu",))(p, u).platforms == ("cpu",)
    if on_one_cpu:
        with pytest.raises(ValueError, match="srround_host_call"):
            export.export(apply(None), platforms=("cpu",))(p, u)


def test_fused_step_in_a_scanned_training_loop():
    """Five default steps in ``lax.scan`` (the host step in a loop body, with ``found_inf``)
    give the native path's params and states, bit for bit."""
    p = [jnp.linspace(-1, 1, 300).astype(jnp.bfloat16).reshape(3, 100), jnp.ones(7, jnp.float32)]
    g = [jnp.full((3, 100), 0.01, jnp.bfloat16), jnp.full(7, 0.1, jnp.float32)]

    def run(tx):
        def body(carry, _):
            params, state = carry
            return tx.step(g, state, params, found_inf=jnp.float32(0)), None

        out, _ = jax.jit(lambda p: jax.lax.scan(body, (p, tx.init(p)), None, length=5))(p)
        return jax.tree.leaves(out)

    for got, want in zip(run(sj.adamw(1e-2, seed=1)), run(sj.adamw(1e-2, seed=1, impl="native"))):
        assert_same_bits(np.atleast_1d(np.asarray(got)), np.atleast_1d(np.asarray(want)))


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_schedule_giving_an_unusable_lr_skips_the_step(opt):
    """A learning rate known only at run time (a schedule's, an injected one) that is negative,
    NaN or inf skips the step, on every impl, as an unusable ``inv_scale`` does. Before, the
    host step (the CPU default) failed inside its host call and the native step wrote NaN
    weights or stepped uphill."""
    p = {"w": jnp.linspace(-1, 1, 8).astype(jnp.bfloat16), "b": jnp.ones(3, jnp.float32)}
    g = jax.tree.map(lambda x: jnp.full(x.shape, 0.01, x.dtype), p)
    for impl in [None, *IMPLS]:
        for bad in (np.nan, -1e-3, np.inf):
            schedule = lambda count, bad=bad: jnp.where(count == 0, 0.1, bad)  # noqa: E731
            tx = getattr(sj, opt)(schedule, seed=1, impl=impl)
            state = tx.init(p)
            p1, state = tx.step(g, state, p)
            assert int(state.count) == 1
            p2, state2 = tx.step(g, state, p1)
            for a, b in zip(jax.tree.leaves((p2, state2)), jax.tree.leaves((p1, state))):
                assert_same_bits(a, b)


def test_schedule_whose_lr_overflows_the_adamw_coefficients_skips_the_step():
    """Finding (11-28): a schedule's learning rate for which ``lr / (1 - b1)`` or
    ``1 - lr * weight_decay`` is beyond float32 (the rule a number learning rate is checked
    by when ``adamw`` is made) failed the CPU default's host call with an INTERNAL error, and
    the native step wrote NaN where a moment or a weight was 0. Now it skips the step, as a
    NaN or negative one does, on every impl; the largest that fits steps, with no NaN."""
    p = {"w": jnp.array([0.0, 1.0, -1.0, 0.5], jnp.bfloat16), "b": jnp.zeros(3, jnp.float32)}
    g = jax.tree.map(jnp.zeros_like, p)
    f32_max = float(np.finfo(np.float32).max)
    for impl in [None, *IMPLS]:
        for lr, kw in (
            (f32_max, {"b1": 0.5, "weight_decay": 0.0}),  # the step size overflows
            (1e30, {"b1": 0.0, "weight_decay": 1e10}),  # the decay factor overflows
        ):
            tx = sj.adamw(
                lambda count, lr=lr: jnp.where(count == 0, 1e-3, lr), seed=1, impl=impl, **kw
            )
            p1, state = tx.step(g, tx.init(p), p)
            p2, state2 = tx.step(g, state, p1)
            for a, b in zip(jax.tree.leaves((p2, state2)), jax.tree.leaves((p1, state))):
                assert_same_bits(a, b)
        tx = sj.adamw(lambda count: 1.7e38, b1=0.5, weight_decay=0.0, seed=1, impl=impl)
        p1, state = tx.step(g, tx.init(p), p)
        assert int(state.count) == 1
        assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in jax.tree.leaves(p1))


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_fused_step_under_grad_is_a_clear_error(opt):
    """The fused step writes rounded bits and has no derivative: ``jax.grad`` through
    ``tx.step`` / ``tx.update`` is a ``TypeError`` that says what to use instead, on every
    impl. Before, the native step gave a gradient of 0 silently and the host step raised
    JAX's NotImplementedError for custom_partitioning."""
    p = {"w": jnp.linspace(-1, 1, 8).astype(jnp.bfloat16), "b": jnp.ones(3, jnp.float32)}
    g = jax.tree.map(lambda x: jnp.full(x.shape, 0.01, jnp.float32), p)
    for impl in [None, *IMPLS]:
        tx = getattr(sj, opt)(1e-2, seed=1, impl=impl)

        def loss(p, tx=tx):
            return jnp.sum(tx.step(g, tx.init(p), p)[0]["b"])

        with pytest.raises(TypeError, match="not differentiable.*apply_updates"):
            jax.grad(loss)(p)
        with pytest.raises(TypeError, match="not differentiable"):
            jax.grad(lambda g, tx=tx: jnp.sum(tx.update(g, tx.init(p), p)[0]["b"]))(g)


def test_host_step_plans_once_while_xla_keeps_the_buffers(monkeypatch):
    """The default CPU step with donated params and states: XLA hands the host call the same
    buffers every step, so the step's table is planned at the first step only (before: every
    step, about 3 ms of a 196-leaf step's 35 ms), with the bits of a fresh plan. Leaves above
    ``_leaves._SMALL_LEAF`` only: joined small leaves are XLA's temporaries, whose addresses
    move, and their few runs are planned again when they do (``test_host_step_joins_small_leaves``
    checks their bits)."""
    from srround import _plan

    monkeypatch.setattr(_leaves, "_SMALL_LEAF", 0)
    planned = []
    plan_step = _plan.plan_step
    monkeypatch.setattr(_plan, "plan_step", lambda *a, **k: planned.append(1) or plan_step(*a, **k))
    rng = np.random.default_rng(3)
    params = [jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in SHAPES]
    grads = [jnp.asarray(rng.standard_normal(s) * 1e-2, jnp.bfloat16) for s in SHAPES]
    tx = sj.adamw(1e-3, seed=SEED)
    step = jax.jit(lambda p, s, g: tx.step(g, s, p), donate_argnums=(0, 1))
    p, s = [x.copy() for x in params], tx.init(params)
    for _ in range(3):
        p, s = step(p, s, grads)
    jax.block_until_ready(p)
    assert len(planned) == 1
    plain = jax.jit(lambda p, s, g: tx.step(g, s, p))  # no donation: fresh buffers each step
    q, r = params, tx.init(params)
    for _ in range(3):
        q, r = plain(q, r, grads)
    for a, b in zip(p, q):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))


def test_apply_updates_needs_a_key():
    """``seed=None`` is refused (the README: apply_updates needs a key): a seed drawn when the
    function runs is drawn at trace time under jit, a constant of the program - the same
    noise every step (before: taken)."""
    params, updates = {"w": jnp.zeros(4, jnp.bfloat16)}, {"w": jnp.full(4, 1e-3, jnp.float32)}
    with pytest.raises(TypeError, match=r"^seed: apply_updates needs a JAX PRNG key or an int"):
        sj.apply_updates(params, updates, None, step=1)
    with pytest.raises(TypeError, match=r"^seed: stochastic_write_back needs a JAX PRNG key"):
        sj.stochastic_write_back(None)
