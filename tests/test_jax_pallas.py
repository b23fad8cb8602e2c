"""The Pallas kernels on CUDA of the fused step and ``stochastic_round``
(``adapters/jax/_pallas.py``): the XLA path's bits, checked without a GPU through Pallas'
interpreter (the kernel's indexing, masks, scalar words and random bits; the exact ops are then
the XLA path's), compiled for a GPU (the inline PTX and every update's ops lower to Triton), and
on a GPU against the XLA path."""

from __future__ import annotations

import functools

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("jax.experimental.pallas.triton")
import jax.numpy as jnp
from jax import lax

from srround.adapters import jax as sj
from srround.adapters.jax import _leaves, _pallas
from srround.adapters.jax._api import _adding_update, _rounding_update

from .test_jax_optim import _gpu_to_compile_for

# a partial last block (592 rows of four, 256 per program) at lane 0, then sizes that are not a
# multiple of four (the XLA path), which move the later leaves' first elements to lanes 1 and 2
# of their Threefry blocks: one partial block, a 3-d leaf
SHAPES = [(37, 64), (13,), (1000,), (5,), (3, 5, 8)]
KERNEL_LEAVES = 3

# (optimizer, options, param dtype, grad dtype): in the interpreter (CASES) both state dtypes,
# fp16 and bf16 params, bf16 grads, nesterov and eps_root, optax's mask, the kahan weight mode
# and SGD; on a GPU (GPU_CASES) also every other weight mode, fp32 params, SGD without momentum
CASES = {
    "adamw_bf16_states_nesterov": (
        "adamw",
        {"state_dtype": jnp.bfloat16, "nesterov": True, "eps_root": 1e-12},
        jnp.bfloat16,
        jnp.bfloat16,
    ),
    "adamw_fp16_kahan_mask": (
        "adamw",
        {"rounding": "kahan", "mask": lambda p: [True, False, True, False, False]},
        jnp.float16,
        jnp.float32,
    ),
    "sgd_nesterov_bf16_momentum": (
        "sgd",
        {"momentum": 0.9, "nesterov": True, "accumulator_dtype": jnp.bfloat16},
        jnp.bfloat16,
        jnp.float32,
    ),
}
GPU_CASES = {
    **CASES,
    **{
        f"adamw_{mode}": ("adamw", {"rounding": mode}, jnp.bfloat16, jnp.float32)
        for mode in ("stochastic", "nearest", "master", "kahan", "remainder")
    },
    "adamw_fp16_stochastic": ("adamw", {}, jnp.float16, jnp.float32),
    "adamw_fp32": ("adamw", {}, jnp.float32, jnp.float32),
    "sgd_momentum": ("sgd", {"momentum": 0.9}, jnp.float16, jnp.bfloat16),
    "sgd": ("sgd", {}, jnp.bfloat16, jnp.float32),
}


@pytest.fixture
def pallas_mode(monkeypatch):
    """``set(mode)``: ``_pallas.MODE`` for the next traces (JAX's caches cleared), the generic
    leaf path (the one of GPUs) on the CPU too."""
    monkeypatch.setattr(_leaves, "_on_one_cpu", lambda leaves: False)

    def set_mode(mode):
        monkeypatch.setattr(_pallas, "MODE", mode)
        jax.clear_caches()

    yield set_mode
    jax.clear_caches()


def _optimizer(name, options, impl="native"):
    if name == "adamw":
        return sj.adamw(1e-3, weight_decay=1e-2, seed=7, impl=impl, **options)
    return sj.sgd(1e-2, seed=7, impl=impl, **options)


def _inputs(p_dtype, g_dtype, seed=0):
    """Params and grads of ``SHAPES``: subnormal weights and gradients, infinities and a NaN."""
    rng = np.random.default_rng(seed)
    params, grads = [], []
    for shape in SHAPES:
        p = (rng.normal(size=shape) * 0.02).astype(np.float32)
        g = (rng.normal(size=shape) * 1e-3).astype(np.float32)
        p.reshape(-1)[::89] = 1e-39
        g.reshape(-1)[::97] = 3e-39
        g.reshape(-1)[5:8] = [np.inf, np.nan, -np.inf][: max(0, g.size - 5)]
        params.append(jnp.asarray(p, p_dtype))
        grads.append(jnp.asarray(g, g_dtype))
    return params, grads


def _two_steps(tx, params, grads):
    step = jax.jit(lambda g, s, p: tx.step(g, s, p, inv_scale=0.5))
    first = step(grads, tx.init(params), params)
    return first, step(grads, first[1], first[0])


def _assert_same_bits(expected, got):
    for k, (e, g) in enumerate(zip(jax.tree.leaves(expected), jax.tree.leaves(got))):
        e, g = np.atleast_1d(np.asarray(e)), np.atleast_1d(np.asarray(g))
        assert e.dtype == g.dtype and e.shape == g.shape, k
        differ = np.flatnonzero(e.view(np.uint8) != g.view(np.uint8))
        assert differ.size == 0, f"leaf {k}: bytes {differ[:8]} of {e.nbytes} differ"


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernels_give_the_xla_paths_bits_in_the_interpreter(pallas_mode, case):
    """Two steps (with ``inv_scale``) through the kernels in Pallas' interpreter equal the XLA
    path's bits, params, states and aux buffers; three of the five leaves run as kernels."""
    name, options, p_dtype, g_dtype = CASES[case]
    tx = _optimizer(name, options)
    params, grads = _inputs(p_dtype, g_dtype)
    pallas_mode("off")
    expected = _two_steps(tx, params, grads)
    pallas_mode("interpret")
    jaxpr = str(jax.make_jaxpr(lambda g, s, p: tx.step(g, s, p))(grads, tx.init(params), params))
    assert jaxpr.count("pallas_call") == KERNEL_LEAVES
    _assert_same_bits(expected, _two_steps(tx, params, grads))


def test_only_elementwise_leaves_of_rows_of_four_take_a_kernel(monkeypatch):
    """``takes``: a leaf of an update marked elementwise, of rows of four elements, where
    Pallas' Triton backend imports; with ``MODE="auto"`` only where JAX's backend is a
    GPU."""
    from srround.adapters.jax import optim

    leaf = (jnp.zeros((8, 4)), jnp.zeros((8, 4)), None)
    monkeypatch.setattr(_pallas, "MODE", "on")
    assert _pallas.takes(optim._update, leaf)
    assert _pallas.takes(optim._sgd_update, leaf)
    assert not _pallas.takes(optim._update8, leaf)  # blocks of 32: not elementwise
    assert not _pallas.takes(optim._apply_update, leaf)  # after optax's XLA update
    assert not _pallas.takes(optim._update, (jnp.zeros(6), jnp.zeros(6), None))
    assert not _pallas.takes(optim._update, (jnp.zeros(8), jnp.zeros((2, 4)), None))
    assert _pallas.takes(_rounding_update, (jnp.zeros((3, 4)),))  # stochastic_round's
    assert _pallas.takes(_adding_update, (jnp.zeros((3, 4)), jnp.zeros((3, 4))))
    monkeypatch.setattr(_pallas, "MODE", "auto")
    assert _pallas.takes(optim._update, leaf) == (jax.default_backend() == "gpu")
    monkeypatch.setattr(_pallas, "MODE", "off")
    assert not _pallas.takes(optim._update, leaf)
    monkeypatch.setattr(_pallas, "MODE", "on")
    monkeypatch.setattr(_pallas, "_has_triton", lambda: False)  # a jaxlib without Triton
    assert not _pallas.takes(optim._update, leaf)


def test_kernels_compile_for_a_gpu(pallas_mode):
    """Every case's step compiles for a GPU (a compile-only H100 without one: see
    ``_gpu_to_compile_for``) with its three kernels: Triton takes the inline PTX and every op
    of the updates (a leading-zero count, which Triton lacks, is PTX's ``clz``)."""
    device = _gpu_to_compile_for()
    pallas_mode("on")
    sharding = jax.sharding.SingleDeviceSharding(device)

    def spec(a):
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)

    for name, options, p_dtype, g_dtype in GPU_CASES.values():
        tx = _optimizer(name, options)
        params = [jax.ShapeDtypeStruct(s, p_dtype, sharding=sharding) for s in SHAPES]
        grads = [jax.ShapeDtypeStruct(s, g_dtype, sharding=sharding) for s in SHAPES]
        state = jax.tree.map(spec, jax.eval_shape(tx.init, params))
        step = jax.jit(lambda g, s, p, tx=tx: tx.step(g, s, p))
        hlo = step.trace(grads, state, params).lower().compile().as_text()
        assert hlo.count("__gpu$xla.gpu.triton") == KERNEL_LEAVES, (name, options)


def test_kernels_give_the_xla_paths_bits_on_a_gpu(pallas_mode):
    """On a GPU, every case: the kernels (the GPU's own fma, division, square root) give the
    XLA path's bits (float64 emulation of them), two steps."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    for case, (name, options, p_dtype, g_dtype) in sorted(GPU_CASES.items()):
        tx = _optimizer(name, options)
        params, grads = _inputs(p_dtype, g_dtype)
        pallas_mode("off")
        expected = _two_steps(tx, params, grads)
        pallas_mode("on")
        try:
            _assert_same_bits(expected, _two_steps(tx, params, grads))
        except AssertionError as exc:
            raise AssertionError(f"{case}: {exc}") from None


# stochastic_round's and stochastic_add's kernels: a partial last block, a 3-d array, rows of 20
# columns (not a power of two, as 11008), offsets from lane 0, lane 1 and a stream position
# past 2**34 (the counters' high word 1)
ROUND_SHAPES = [(37, 64), (3, 5, 8), (7, 20)]
ROUND_OFFSETS = [0, 5, 2**34 + 6]


def _round_input(shape, seed=0):
    """float32 values of every magnitude, bf16/fp16 overflows, subnormals, infinities, a NaN."""
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=shape) * 10.0 ** rng.integers(-44, 38, shape)).astype(np.float32)
    x.reshape(-1)[:6] = [np.inf, np.nan, -0.0, 3e38, -1e-42, 65520.0]
    return jnp.asarray(x)


def _rounded(x, dtype, offset):
    return jax.jit(lambda v: sj.stochastic_round(v, dtype=dtype, seed=3, offset=offset))(x)


def _added(w, u, offset, alpha=0.75):
    """``stochastic_add`` with a Python alpha and with a traced one."""
    fn = jax.jit(
        lambda a, b, al: (
            sj.stochastic_add(a, b, alpha=alpha, seed=3, offset=offset),
            sj.stochastic_add(a, b, alpha=al, seed=4, offset=offset),
        )
    )
    return fn(w, u, jnp.float32(-3.0))


def _add_inputs(shape, dtype):
    """Weights of ``dtype`` (subnormals, infinities, a NaN among them) and float32 updates
    that move some weights by less than an ulp, overflow others, and cancel one exactly."""
    w = _round_input(shape).astype(dtype)
    u = _round_input(shape, seed=1) * np.float32(1e-3)
    u = u.at[(0,) * len(shape)].set(-w.reshape(-1)[0].astype(jnp.float32) / 0.75)
    return w, u


def _rounded_rows(x, keys, dtype):
    """Each row of ``x`` rounded with its key (``vmap``), and the straight-through gradient."""
    rows = jax.jit(jax.vmap(lambda r, k: sj.stochastic_round(r, dtype=dtype, seed=k, offset=1)))
    grad = jax.grad(lambda v: sj.stochastic_round(v, dtype=dtype, seed=3).astype(jnp.float32).sum())
    return rows(x, keys), jax.jit(grad)(x)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_stochastic_round_kernels_give_the_xla_paths_bits_in_the_interpreter(pallas_mode, dtype):
    """``stochastic_round`` through a Pallas kernel (the interpreter) equals the XLA path's
    bits, under ``vmap`` with a key a row and its gradient too; fp8 and arrays not of rows of
    four keep the XLA path."""
    for shape in ROUND_SHAPES:
        x = _round_input(shape)
        for offset in ROUND_OFFSETS:
            pallas_mode("off")
            expected = _rounded(x, dtype, offset)
            pallas_mode("interpret")
            fn = functools.partial(sj.stochastic_round, dtype=dtype, seed=3, offset=offset)
            assert str(jax.make_jaxpr(fn)(x)).count("pallas_call") == 1
            _assert_same_bits(expected, _rounded(x, dtype, offset))
    rows, keys = _round_input((3, 40)), jax.random.split(jax.random.key(1), 3)
    pallas_mode("off")
    expected = _rounded_rows(rows, keys, dtype)
    pallas_mode("interpret")
    _assert_same_bits(expected, _rounded_rows(rows, keys, dtype))
    for x, dtype in [(_round_input((8,)), "float8_e4m3fn"), (_round_input((7,)), "bfloat16")]:
        assert "pallas_call" not in str(
            jax.make_jaxpr(lambda v: sj.stochastic_round(v, dtype=dtype, seed=3))(x)
        )


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_stochastic_add_kernels_give_the_xla_paths_bits_in_the_interpreter(pallas_mode, dtype):
    """``stochastic_add`` through a Pallas kernel (the interpreter) equals the XLA path's bits,
    with a Python alpha and a traced one; uint16 patterns keep the XLA path. Each shape and
    each stream position once: the kernel's rows, lanes and blocks are ``stochastic_round``'s
    (``_pallas.leaf_call``), whose test above takes every pair."""
    for shape, offset in zip(ROUND_SHAPES, ROUND_OFFSETS, strict=True):
        w, u = _add_inputs(shape, dtype)
        pallas_mode("off")
        expected = _added(w, u, offset)
        pallas_mode("interpret")
        jaxpr = str(jax.make_jaxpr(lambda a, b: sj.stochastic_add(a, b, seed=3))(w, u))
        assert jaxpr.count("pallas_call") == 1
        _assert_same_bits(expected, _added(w, u, offset))
    patterns = lax.bitcast_convert_type(w, jnp.uint16)
    fn = functools.partial(sj.stochastic_add, seed=3, dtype=dtype)
    assert "pallas_call" not in str(jax.make_jaxpr(fn)(patterns, u))


def test_round_and_add_kernels_compile_for_a_gpu(pallas_mode):
    """``stochastic_round``'s and ``stochastic_add``'s kernels compile for a GPU (a compile-only
    H100 without one; the latter's fma is PTX's), bf16 and fp16, from lane 0 and from lane 1."""
    device = _gpu_to_compile_for()
    pallas_mode("on")
    sharding = jax.sharding.SingleDeviceSharding(device)
    x = jax.ShapeDtypeStruct((64, 11008), jnp.float32, sharding=sharding)
    for dtype in ("bfloat16", "float16"):
        for offset in (0, 5):
            fn = jax.jit(
                lambda v, d=dtype, o=offset: sj.stochastic_round(v, dtype=d, seed=3, offset=o)
            )
            hlo = fn.trace(x).lower().compile().as_text()
            assert hlo.count("__gpu$xla.gpu.triton") == 1, (dtype, offset)
            w = jax.ShapeDtypeStruct(x.shape, jnp.dtype(dtype), sharding=sharding)
            add = jax.jit(
                lambda a, b, o=offset: sj.stochastic_add(a, b, alpha=0.5, seed=3, offset=o)
            )
            hlo = add.trace(w, x).lower().compile().as_text()
            assert hlo.count("__gpu$xla.gpu.triton") == 1, ("add", dtype, offset)


def test_round_and_add_kernels_give_the_xla_paths_bits_on_a_gpu(pallas_mode):
    """On a GPU: ``stochastic_round``'s and ``stochastic_add``'s kernels equal the XLA path's
    bits (and so the Numba kernels', ``test_jax_adapter.py``), 11008 columns among the shapes,
    ``vmap`` and the gradient of ``stochastic_round`` too."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    rows, keys = _round_input((3, 40)), jax.random.split(jax.random.key(1), 3)
    for dtype in ("bfloat16", "float16"):
        for shape in [*ROUND_SHAPES, (33, 11008)]:
            x = _round_input(shape)
            w, u = _add_inputs(shape, dtype)
            for offset in ROUND_OFFSETS:
                pallas_mode("off")
                expected = _rounded(x, dtype, offset), _added(w, u, offset)
                pallas_mode("on")
                _assert_same_bits(expected, (_rounded(x, dtype, offset), _added(w, u, offset)))
        pallas_mode("off")
        expected = _rounded_rows(rows, keys, dtype)
        pallas_mode("on")
        _assert_same_bits(expected, _rounded_rows(rows, keys, dtype))
