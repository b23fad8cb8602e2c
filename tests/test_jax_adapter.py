"""JAX adapter: both implementations give the NumPy path's bits, under jit and vmap, any seed
form, any offset; the exact fma of the native stochastic_add against Numba's llvm.fma."""

from __future__ import annotations

import ctypes
import re

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import srround  # noqa: E402
from srround.adapters import jax as sj  # noqa: E402
from srround.adapters.jax import _lax  # noqa: E402

from .reference import assert_same_fma_bits, fma32_bits, fma_hard_cases  # noqa: E402

IMPLS = ["native", "callback"]
FMTS = ["bfloat16", "float16"]
NP_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
JNP_DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}

SPECIAL_BITS = [
    0x7FFFFFFF,
    0xFFFFFFFF,
    0x7F800001,
    0xFF800001,
    0x7FC00000,
    0xFFC00000,
    0x7FA00000,
    0x7F800000,
    0xFF800000,
    0x00000000,
    0x80000000,
    0x7F7FFFFF,
    0xFF7FFFFF,
    0x00000001,
    0x80000001,
    0x007FFFFF,
    0x00800000,
    0x3F800000,
    0x3F808000,
    0x3F808001,
    0x3F7FFFFF,
]
SPECIAL_VALUES = [
    65504.0,
    -65504.0,
    65519.0,
    65520.0,
    65535.0,
    1e5,
    6.1e-5,
    6.0e-8,
    5.9e-8,
    3.0e-8,
    2.9e-8,
    1e-10,
    3.389e38,
    3.3895e38,
    -3.4e38,
    1.0 + 2.0**-9,
]


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint32 if a.dtype.itemsize == 4 else np.uint16)


def _inputs(n=4096, seed=0) -> np.ndarray:
    """Random normals at many scales, fp32/fp16/bf16 subnormals, and the special values."""
    rng = np.random.default_rng(seed)
    parts = [
        rng.standard_normal(n) * 10.0 ** rng.integers(-8, 6, n),
        rng.standard_normal(256) * 2.0**-130,  # fp32 subnormals
        rng.standard_normal(256) * 2.0**-20,  # fp16 subnormal range
        rng.uniform(6e4, 7e4, 64) * rng.choice([-1, 1], 64),  # fp16 overflow boundary
    ]
    x = np.concatenate(
        [
            np.concatenate(parts).astype(np.float32),
            np.array(SPECIAL_VALUES, np.float32),
            np.array(SPECIAL_BITS, np.uint32).view(np.float32),
        ]
    )
    return x


@pytest.mark.parametrize("overflow", ["inf", "saturate"])
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("impl", IMPLS)
def test_stochastic_round_matches_numpy_path(impl, fmt, overflow):
    x = _inputs()
    x = np.concatenate([x, x[: -x.size % 7]]).reshape(-1, 7)  # 2-D, odd row length
    expected = srround.stochastic_round(
        x, dtype=fmt, seed=0x1234_5678_9ABC, offset=7, overflow=overflow
    )
    fn = jax.jit(
        lambda a: sj.stochastic_round(
            a, dtype=fmt, seed=0x1234_5678_9ABC, offset=7, overflow=overflow, impl=impl
        )
    )
    got = fn(jnp.asarray(x))
    assert got.dtype == JNP_DTYPES[fmt] and got.shape == x.shape
    np.testing.assert_array_equal(_bits(got), _bits(expected))


@pytest.mark.parametrize("offset", [0, 8, 5])
@pytest.mark.parametrize("width", [12, 16, 7])
def test_native_stochastic_round_of_matrices_matches_numpy_path(width, offset):
    """The native path's bfloat16 stochastic rounding as one add (``_lax._encode``): every high
    half of fp32 with low halves around the rounding threshold, NaNs and infinities included,
    in matrices (and 3-D arrays) whose last dimension is a multiple of 4, a power of two or odd,
    from the first lane of a Threefry block or not, gives the Numba kernels' bits, for ``stochastic_add``
    too."""
    highs = np.arange(1 << 16, dtype=np.uint32) << 16
    lows = np.array([0, 1, 0x7FFF, 0x8000, 0xFFFF, 0x1234], np.uint32)
    x = (highs[:, None] | lows[None, :]).reshape(-1)
    x = x[: x.size // width * width].view(np.float32).reshape(-1, width)
    expected = srround.stochastic_round(x, seed=11, offset=offset)
    fn = jax.jit(lambda a: sj.stochastic_round(a, seed=11, offset=offset, impl="native"))
    np.testing.assert_array_equal(_bits(fn(jnp.asarray(x))), _bits(expected))
    cube = x[: x.shape[0] // 3 * 3].reshape(-1, 3, width)  # row terms of two dimensions
    np.testing.assert_array_equal(
        _bits(fn(jnp.asarray(cube))), _bits(expected[: x.shape[0] // 3 * 3].reshape(cube.shape))
    )
    w = (x.view(np.uint32) >> 16).astype(np.uint16).view(ml_dtypes.bfloat16)
    u = np.full(x.shape, 2.0**-9, np.float32)
    expected = srround.stochastic_add(w.copy(), u, seed=11, offset=offset)
    got = jax.jit(lambda a, b: sj.stochastic_add(a, b, seed=11, offset=offset, impl="native"))
    np.testing.assert_array_equal(_bits(got(jnp.asarray(w), jnp.asarray(u))), _bits(expected))


@pytest.mark.parametrize("overflow", ["inf", "saturate"])
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("impl", IMPLS)
def test_round_nearest_matches_numpy_path(impl, fmt, overflow):
    x = _inputs(seed=1)
    expected = srround.round_nearest(x, dtype=fmt, overflow=overflow)
    got = jax.jit(lambda a: sj.round_nearest(a, dtype=fmt, overflow=overflow, impl=impl))(
        jnp.asarray(x)
    )
    assert got.dtype == JNP_DTYPES[fmt]
    np.testing.assert_array_equal(_bits(got), _bits(expected))


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("impl", IMPLS)
def test_to_float32_all_patterns(impl, fmt):
    patterns = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    expected = srround.to_float32(patterns.view(NP_DTYPES[fmt]))
    got = jax.jit(lambda a: sj.to_float32(a, impl=impl))(jnp.asarray(patterns.view(NP_DTYPES[fmt])))
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(_bits(got), _bits(expected))
    raw = sj.to_float32(jnp.asarray(patterns), dtype=fmt, impl=impl)  # uint16 patterns
    np.testing.assert_array_equal(_bits(raw), _bits(expected))


def _add_case(fmt, n=3000, seed=2):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 4, n)).astype(np.float32)
    u = (rng.standard_normal(n) * 10.0 ** rng.integers(-8, 4, n)).astype(np.float32)
    # hard cases: u ~ -w / alpha (cancellation), tiny u (sticky / ties), specials, subnormals
    u[:300] = (-w[:300] / 0.37 * (1 + rng.standard_normal(300) * 2.0**-20)).astype(np.float32)
    u[300:600] *= np.float32(2.0**-60)
    u[600 : 600 + len(SPECIAL_BITS)] = np.array(SPECIAL_BITS, np.uint32).view(np.float32)
    w[700 : 700 + len(SPECIAL_BITS)] = np.array(SPECIAL_BITS, np.uint32).view(np.float32)
    w[800:900] *= np.float32(2.0**-120)
    with np.errstate(over="ignore", invalid="ignore"):
        return w.astype(NP_DTYPES[fmt]), u


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("impl", IMPLS)
def test_stochastic_add_matches_numpy_path(impl, fmt):
    w, u = _add_case(fmt)
    fn = jax.jit(
        lambda a, b, alpha, key: sj.stochastic_add(
            a, b, alpha=alpha, seed=key, offset=11, impl=impl
        )
    )
    key = jax.random.key(99)
    seed = int(jax.random.key_data(key)[0]) | int(jax.random.key_data(key)[1]) << 32
    for alpha in [1.0, -0.37, 3.1e-4, 1.7e3, 2.0**-130, -1.0 / 3.0]:
        expected = w.copy()
        srround.stochastic_add(expected, u, alpha=alpha, seed=seed, offset=11)
        got = fn(jnp.asarray(w), jnp.asarray(u), jnp.float32(alpha), key)  # alpha traced
        assert got.dtype == JNP_DTYPES[fmt]
        np.testing.assert_array_equal(_bits(got), _bits(expected), err_msg=f"alpha={alpha}")
    # static alpha, saturating overflow, uint16 patterns with dtype=
    expected = w.copy()
    srround.stochastic_add(expected, u, alpha=0.1, seed=5, overflow="saturate")
    got = sj.stochastic_add(
        jnp.asarray(w.view(np.uint16)),
        jnp.asarray(u),
        alpha=0.1,
        seed=5,
        dtype=fmt,
        overflow="saturate",
        impl=impl,
    )
    assert got.dtype == jnp.uint16
    np.testing.assert_array_equal(_bits(got), _bits(expected))


def test_native_threefry_is_rng_threefry():
    """The unrolled ``_threefry2x32`` of the native path is ``_rng.threefry2x32``."""
    from srround._rng import threefry2x32

    rng = np.random.default_rng(8)
    k0, k1 = (int(v) for v in rng.integers(0, 2**32, 2))
    c0, c1 = rng.integers(0, 2**32, (2, 64), dtype=np.uint32)
    x0, x1 = jax.jit(lambda a, b: _lax._threefry2x32(np.uint32(k0), np.uint32(k1), a, b))(c0, c1)
    assert list(zip(np.asarray(x0).tolist(), np.asarray(x1).tolist())) == [
        threefry2x32(k0, k1, int(a), int(b)) for a, b in zip(c0, c1)
    ]


def test_native_fma_is_exact():
    """``_fma_bits`` (integer fma) against Numba's ``fma32`` (llvm.fma.f32) on hard cases:
    cancellation, exact ties, tiny addends, subnormal and overflowing results, specials."""
    fma = jax.jit(_lax._fma_bits)
    for i, (x, y, z) in enumerate(fma_hard_cases(3)):
        got = np.asarray(fma(jnp.asarray(x), jnp.asarray(y), jnp.asarray(z)))
        assert_same_fma_bits(i, x, y, z, fma32_bits(x, y, z), got)


@pytest.mark.parametrize("impl", IMPLS)
def test_jit_with_key_and_int_seed(impl):
    x = _inputs(1000, seed=4)
    key = jax.random.key(2024)
    w0, w1 = (int(v) for v in jax.random.key_data(key))
    expected = srround.stochastic_round(x, seed=w0 | w1 << 32, offset=3)
    by_key = jax.jit(lambda a, k: sj.stochastic_round(a, seed=k, offset=3, impl=impl))
    np.testing.assert_array_equal(_bits(by_key(jnp.asarray(x), key)), _bits(expected))
    legacy = jax.random.PRNGKey(2024)  # uint32[2], as a traced argument
    np.testing.assert_array_equal(
        _bits(by_key(jnp.asarray(x), legacy)),
        _bits(srround.stochastic_round(x, seed=int(legacy[0]) | int(legacy[1]) << 32, offset=3)),
    )
    by_int = jax.jit(lambda a: sj.stochastic_round(a, seed=77, offset=3, impl=impl))
    np.testing.assert_array_equal(
        _bits(by_int(jnp.asarray(x))), _bits(srround.stochastic_round(x, seed=77, offset=3))
    )


def test_key_seed_is_the_documented_int_seed():
    x = jnp.asarray(_inputs(500, seed=5))
    for key in [jax.random.key(5), jax.random.PRNGKey(5), jax.random.key(2**40 + 9)]:
        data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
        seed = int(data[0]) | int(data[1]) << 32
        np.testing.assert_array_equal(
            _bits(sj.stochastic_round(x, seed=key)), _bits(sj.stochastic_round(x, seed=seed))
        )
    # jax.random.key(5) has data (0, 5): the int seed 5 << 32, not 5
    np.testing.assert_array_equal(
        _bits(sj.stochastic_round(x, seed=jax.random.key(5))),
        _bits(sj.stochastic_round(x, seed=5 << 32)),
    )


def test_callback_errors_reach_the_caller():
    """An exception in a host function of the callback path (srround's FFI target on the CPU)
    is an XLA error at the caller naming it, not a silent result; the target works after."""
    from srround.adapters.jax import _ffi

    if jax.default_backend() != "cpu":
        pytest.skip("the FFI target is the CPU's")

    def fails(x):
        raise ValueError("bad host input")

    shape = jax.ShapeDtypeStruct((3,), jnp.float32)
    with pytest.raises(Exception, match="bad host input"):
        failing = jax.jit(lambda x: _ffi.call(fails, shape, x, key="test: fails"))
        jax.block_until_ready(failing(jnp.ones(3)))
    doubled = jax.jit(lambda x: _ffi.call(lambda h: h * 2, shape, x, key="test: doubles"))(
        jnp.ones(3)
    )
    np.testing.assert_array_equal(np.asarray(doubled), [2.0, 2.0, 2.0])


def test_callback_updates_aliased_operands_in_xla_buffers():
    """``_ffi.call(..., aliases=)``: the host function gets the aliased operand writable, in the
    result's buffer - the donated input's own buffer (no copy) - and the other operands
    read-only; a caller's array that was not donated keeps its values (XLA copies it first)."""
    from srround.adapters.jax import _ffi

    if jax.default_backend() != "cpu":
        pytest.skip("the FFI target is the CPU's")
    seen = {}

    def add(a, b):
        seen.update(address=a.__array_interface__["data"][0], writable=a.flags.writeable)
        seen["b_writable"] = b.flags.writeable
        a += b
        return a

    shape = jax.ShapeDtypeStruct((1024,), jnp.float32)

    def call(w, b):
        return _ffi.call(add, shape, w, b, key="test: adds in place", aliases={0: 0})

    b = jnp.ones(1024, jnp.float32)
    w = jnp.zeros(1024, jnp.float32)
    address = w.unsafe_buffer_pointer()
    out = jax.jit(call, donate_argnums=0)(w, b)
    assert seen == {"address": address, "writable": True, "b_writable": False}
    assert out.unsafe_buffer_pointer() == address
    np.testing.assert_array_equal(np.asarray(out), np.ones(1024, np.float32))
    kept = jnp.zeros(1024, jnp.float32)
    out = jax.jit(call)(kept, b)
    np.testing.assert_array_equal(np.asarray(kept), np.zeros(1024, np.float32))
    np.testing.assert_array_equal(np.asarray(out), np.ones(1024, np.float32))


def test_callback_views_each_buffer_once(monkeypatch):
    """Finding: the FFI handler made a NumPy view of every operand, the aliased ones too (then
    replaced by their results' views), and compared the addresses of every result with its
    output: for the fused AdamW step of 196 leaves (784 operands, 588 aliased) on 2 cores,
    56-66 ms a step, now 39 ms. A view per buffer: the function id, the other operands and
    the results; a result the function hands back as given is not compared."""
    from srround.adapters.jax import _ffi

    if jax.default_backend() != "cpu":
        pytest.skip("the FFI target is the CPU's")
    views = []
    real = _ffi._array
    monkeypatch.setattr(_ffi, "_array", lambda *a: views.append(1) or real(*a))
    compared = []
    monkeypatch.setattr(_ffi, "_address", lambda a: compared.append(1) or 0)

    def add(a, b, c):
        a += b
        c += b
        return a, c

    shape = jax.ShapeDtypeStruct((64,), jnp.float32)

    def call(w, b, v):
        return _ffi.call(add, (shape, shape), w, b, v, key="test: views", aliases={0: 0, 2: 1})

    ones = jnp.ones(64, jnp.float32)
    out = jax.jit(call, donate_argnums=(0, 2))(jnp.zeros(64), ones, jnp.zeros(64))
    np.testing.assert_array_equal(np.asarray(out[1]), np.ones(64, np.float32))
    assert (len(views), len(compared)) == (1 + 1 + 2, 0)  # id, b; two results


def test_apply_updates_callback_leaves_inputs_unchanged():
    """The callback ``stochastic_add`` writes in the result's buffer: params that were not
    donated keep their bits, donated ones give the same result."""
    p = jnp.asarray(_inputs(5000, seed=2)[:5000]).astype(jnp.bfloat16)
    u = jnp.full(5000, 2.0**-9, jnp.float32)
    before = _bits(p)
    plain = jax.jit(lambda p, u: sj.apply_updates(p, u, 7, step=3, impl="callback"))(p, u)
    np.testing.assert_array_equal(_bits(p), before)
    native = sj.apply_updates(p, u, 7, step=3, impl="native")
    np.testing.assert_array_equal(_bits(plain), _bits(native))
    donated = jax.jit(
        lambda p, u: sj.apply_updates(p, u, 7, step=3, impl="callback"), donate_argnums=0
    )(jnp.array(p), u)
    np.testing.assert_array_equal(_bits(donated), _bits(native))


def test_callback_through_pure_callback_equals_the_ffi_path(monkeypatch):
    """The callback path off the CPU is a ``jax.pure_callback`` (host copies, results made on
    the host): forced here on the CPU, every entry point gives the FFI path's bits."""
    from types import SimpleNamespace

    from srround.adapters.jax import _callback

    x = jnp.asarray(_inputs(3000, seed=4)[:3000])
    w = x.astype(jnp.bfloat16)
    params, grads = [w, x[:7]], [x * 1e-3, x[:7] * 1e-3]
    tx = sj.adamw(1e-2, seed=9, impl="callback")

    def calls():
        out = [
            sj.stochastic_round(x, seed=3, offset=5, impl="callback"),
            sj.stochastic_round(x, dtype="float4_e2m1fn", seed=3, impl="callback"),
            sj.round_nearest(x, dtype="float16", impl="callback"),
            sj.to_float32(w, impl="callback"),
            sj.stochastic_add(w, x, alpha=1e-3, seed=3, impl="callback"),
            *sj.apply_updates(params, grads, 3, step=2, impl="callback"),
            *jax.tree.leaves(tx.step(grads, tx.init(params), params)),
        ]
        q = sj.quantize_blocks(x[:2048], "nvfp4", seed=3, impl="callback")
        out += [q.data, q.scales, q.tensor_scale, sj.dequantize_blocks(q, impl="callback")]
        return [np.atleast_1d(np.asarray(o)).view(np.uint8) for o in out]

    expected = calls()
    pure_only = SimpleNamespace(
        **{n: getattr(jax.lax, n) for n in dir(jax.lax) if not n.startswith("_")}
    )
    pure_only.platform_dependent = lambda *args, default, **_: default(*args)
    monkeypatch.setattr(_callback, "lax", pure_only)
    for got, want in zip(calls(), expected, strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("where", ["in place", "host thread"])
def test_callback_host_work_sees_ieee_subnormals(where, monkeypatch, request):
    """XLA runs host calls with flush-to-zero/denormals-are-zero set: the host work runs with
    IEEE subnormals, on XLA's thread with those bits cleared for its duration (x86-64 Linux)
    or on the module's own thread elsewhere (forced here), and XLA's thread gets its own
    environment back. An addend times 2**-130 is subnormal: flushed, it would be lost."""
    import concurrent.futures

    from srround.adapters.jax import _callback

    if where == "host thread":  # started here, outside any XLA computation
        executor = concurrent.futures.ThreadPoolExecutor(1)
        executor.submit(int).result()
        monkeypatch.setattr(_callback, "_HOST", executor)
        request.addfinalizer(executor.shutdown)
    elif _callback._LIBM is None:
        pytest.skip("in place needs glibc on x86-64")
    w, u = _add_case("bfloat16")
    expected = w.copy()
    srround.stochastic_add(expected, u, alpha=2.0**-130, seed=5, offset=11)
    got = jax.jit(
        lambda a, b: sj.stochastic_add(a, b, alpha=2.0**-130, seed=5, offset=11, impl="callback")
    )(jnp.asarray(w), jnp.asarray(u))
    np.testing.assert_array_equal(_bits(got), _bits(expected))
    if _callback._LIBM is None:
        return
    seen = []  # the premise: XLA's thread flushes subnormals
    jax.jit(lambda x: jax.pure_callback(lambda h: seen.append(_mxcsr()) or h, x, x))(
        jnp.ones(3)
    ).block_until_ready()
    assert seen and seen[0] & 0x8040 == 0x8040
    own = _callback._X86Env()
    _callback._LIBM.fegetenv(ctypes.byref(own))
    flushing = _callback._X86Env.from_buffer_copy(own)
    flushing.mxcsr |= 0x8040
    _callback._LIBM.fesetenv(ctypes.byref(flushing))
    try:
        with _callback._ieee_floats():
            inside = _mxcsr()
        after = _mxcsr()
    finally:
        _callback._LIBM.fesetenv(ctypes.byref(own))
    assert inside & 0x8040 == 0 and after & 0x8040 == 0x8040


def _mxcsr() -> int:
    from srround.adapters.jax import _callback

    env = _callback._X86Env()
    _callback._LIBM.fegetenv(ctypes.byref(env))
    return env.mxcsr


def test_callback_registers_each_host_function_once():
    """Eager callback calls in a loop (each traced anew) register no new host function: one
    per distinct static setting (``_ffi.call``'s key), so a training loop does not grow."""
    from srround.adapters.jax import _ffi

    x = jnp.ones(16, jnp.float32)
    tx = sj.adamw(1e-3, seed=0, impl="callback")
    params = [x.astype(jnp.bfloat16)]
    state = tx.init(params)

    def calls(i):
        sj.stochastic_round(x, seed=jax.random.key(i), impl="callback")
        sj.apply_updates(params, [x], jax.random.key(i), step=i + 1, impl="callback")
        tx.step([x], state, params)

    calls(0)
    registered = len(_ffi._FUNCTIONS)
    for i in range(1, 6):
        calls(i)
    assert len(_ffi._FUNCTIONS) == registered


def test_callback_from_many_threads():
    """The callback path from 8 Python threads at once: no deadlock (the FFI handler reads
    XLA's buffers in place; a ``pure_callback`` copies them through XLA's own threads), and
    each call's bits."""
    import threading

    if jax.default_backend() != "cpu":
        pytest.skip("the FFI target is the CPU's")
    x = jnp.asarray(_inputs(20_000, seed=3)[:20_000])
    add = jax.jit(
        lambda x, k: sj.stochastic_add(x.astype(jnp.bfloat16), x, seed=k, impl="callback")
    )
    expected = [_bits(add(x, jax.random.key(j))) for j in range(20)]
    failures = []

    def work():
        for j in range(20):
            if not np.array_equal(_bits(add(x, jax.random.key(j))), expected[j]):
                failures.append(j)

    threads = [threading.Thread(target=work, daemon=True) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "callback calls from threads hang"
    assert not failures


@pytest.mark.parametrize("impl", IMPLS)
def test_vmap_equals_per_row_calls(impl):
    x = _inputs(1200, seed=6)[:1200].reshape(4, 300)
    key = jax.random.key(11)
    rows = jax.vmap(lambda r: sj.stochastic_round(r, seed=key, offset=5, impl=impl))(jnp.asarray(x))
    for i in range(4):
        np.testing.assert_array_equal(
            _bits(rows[i]),
            _bits(sj.stochastic_round(jnp.asarray(x[i]), seed=key, offset=5, impl=impl)),
        )
    keys = jax.random.split(key, 4)  # a batched (traced) key per row
    rows = jax.jit(jax.vmap(lambda r, k: sj.stochastic_round(r, seed=k, impl=impl)))(
        jnp.asarray(x), keys
    )
    for i in range(4):
        data = jax.random.key_data(keys[i])
        expected = srround.stochastic_round(x[i], seed=int(data[0]) | int(data[1]) << 32)
        np.testing.assert_array_equal(_bits(rows[i]), _bits(expected))
    w = x.astype(ml_dtypes.bfloat16)
    added = jax.vmap(lambda a, b: sj.stochastic_add(a, b, alpha=0.3, seed=key, impl=impl))(
        jnp.asarray(w), jnp.asarray(x * 0.01)
    )
    for i in range(4):
        np.testing.assert_array_equal(
            _bits(added[i]),
            _bits(
                sj.stochastic_add(
                    jnp.asarray(w[i]), jnp.asarray(x[i] * 0.01), alpha=0.3, seed=key, impl=impl
                )
            ),
        )


@pytest.mark.parametrize("offset", [2**33 + 3, 4 * (2**32 - 1) + 1, 2**62 - 5])
@pytest.mark.parametrize("impl", IMPLS)
def test_large_offsets_carry_into_the_high_counter_word(impl, offset):
    x = _inputs(900, seed=7)
    expected = srround.stochastic_round(x, seed=3, offset=offset)
    got = sj.stochastic_round(jnp.asarray(x), seed=3, offset=offset, impl=impl)
    np.testing.assert_array_equal(_bits(got), _bits(expected))


def test_seed_none_draws_from_the_library_generator():
    x = _inputs(500, seed=8)
    srround.manual_seed(123)
    expected = [_bits(srround.stochastic_round(x)) for _ in range(2)]
    for impl in IMPLS:
        srround.manual_seed(123)
        got = [_bits(sj.stochastic_round(jnp.asarray(x), impl=impl)) for _ in range(2)]
        np.testing.assert_array_equal(got[0], expected[0])
        np.testing.assert_array_equal(got[1], expected[1])


def test_top_level_api_dispatches_jax_arrays():
    x = _inputs(600, seed=9)
    x = x[np.isfinite(x)]  # (ml_dtypes casts of NaN warn)
    xj = jnp.asarray(x)
    y = srround.stochastic_round(xj, seed=8, offset=2, dtype="fp16")
    assert isinstance(y, jax.Array) and y.dtype == jnp.float16
    np.testing.assert_array_equal(
        _bits(y), _bits(srround.stochastic_round(x, seed=8, offset=2, dtype="fp16"))
    )
    np.testing.assert_array_equal(_bits(srround.round_nearest(xj)), _bits(srround.round_nearest(x)))
    z = srround.to_float32(srround.round_nearest(xj))
    assert z.dtype == jnp.float32
    w = jnp.asarray(x.astype(ml_dtypes.bfloat16))
    new = srround.stochastic_add(w, xj, alpha=0.5, seed=1)
    expected = x.astype(ml_dtypes.bfloat16)
    srround.stochastic_add(expected, x, alpha=0.5, seed=1)
    np.testing.assert_array_equal(_bits(new), _bits(expected))
    np.testing.assert_array_equal(_bits(w), _bits(x.astype(ml_dtypes.bfloat16)))  # unchanged
    traced = jax.jit(lambda a, k: srround.stochastic_round(a, seed=k))(xj, jax.random.key(4))
    np.testing.assert_array_equal(
        _bits(traced), _bits(sj.stochastic_round(xj, seed=jax.random.key(4)))
    )


def test_empty_and_scalar_inputs():
    for impl in IMPLS:
        empty = sj.stochastic_round(jnp.zeros((0, 3), jnp.float32), seed=0, impl=impl)
        assert empty.shape == (0, 3)
        y = sj.stochastic_round(jnp.float32(1.0), seed=0, impl=impl)
        assert y.shape == () and float(y) == 1.0
        w = jnp.zeros((0,), jnp.bfloat16)
        assert sj.stochastic_add(w, jnp.zeros((0,), jnp.float32), seed=0, impl=impl).shape == (0,)


def test_errors():
    x = jnp.ones(4, jnp.float32)
    with pytest.raises(TypeError, match=r"x: expected a float32 array, got int32"):
        sj.stochastic_round(jnp.ones(4, jnp.int32), seed=0)
    with pytest.raises(TypeError, match=r"x: expected a float32 array, got int32"):
        srround.stochastic_round(jnp.ones(4, jnp.int32), seed=0)
    with pytest.raises(ValueError, match=r"impl: expected one of 'native', 'callback'"):
        sj.stochastic_round(x, seed=0, impl="numba")
    with pytest.raises(TypeError, match=r"out: JAX arrays are immutable"):
        srround.stochastic_round(x, seed=0, out=jnp.zeros(4, jnp.bfloat16))
    with pytest.raises(TypeError, match=r"seed: expected None, an int"):
        sj.stochastic_round(x, seed=1.5)
    with pytest.raises(ValueError, match=r"seed: expected an int in \[0, 2\*\*64\)"):
        sj.stochastic_round(x, seed=-1)
    with pytest.raises(ValueError, match=r"overflow: expected one of"):
        sj.stochastic_round(x, seed=0, overflow="clip")
    with pytest.raises(ValueError, match=r"dtype: unsupported target format"):
        sj.stochastic_round(x, seed=0, dtype="int8")
    with pytest.raises(ValueError, match=r"u: shape \(3,\) does not match w's shape \(4,\)"):
        sj.stochastic_add(jnp.zeros(4, jnp.bfloat16), jnp.zeros(3, jnp.float32), seed=0)
    with pytest.raises(TypeError, match=r"w: expected a narrow float array"):
        sj.stochastic_add(jnp.zeros(4, jnp.float32), x, seed=0)
    with pytest.raises(TypeError, match=r"pass arrays of one framework per call"):
        srround.stochastic_add(jnp.zeros(4, jnp.bfloat16), np.zeros(4, np.float32), seed=0)
    with pytest.raises(TypeError, match=r"JAX arrays are immutable"):
        srround.unscale_and_check([x], 0.5)


@pytest.mark.parametrize("impl", IMPLS)
def test_grad_with_a_traced_key_inside_scan_and_checkpoint(impl):
    """The straight-through gradient where the key (or the block origin) is a tracer of an
    inner trace: a ``lax.scan`` over keys, ``jax.checkpoint``. The custom_jvp closed over the
    key words, and ``jax.grad`` leaked them (``UnexpectedTracerError``)."""
    x = jnp.array([1.0, 2.5, -3.1], jnp.float32)
    keys = jax.random.split(jax.random.key(0), 2)

    def body(c, k):
        w = sj.stochastic_add(c.astype(jnp.bfloat16), c, alpha=0.5, seed=k, impl=impl)
        return c + sj.stochastic_round(c, seed=k, impl=impl).astype(jnp.float32) + w, None

    def loss(x):
        return lax.scan(jax.checkpoint(body), x, keys)[0].sum()

    grad = jax.grad(loss)(x)
    np.testing.assert_array_equal(np.asarray(grad), np.full(3, 3.5**2, np.float32))
    checkpointed = jax.checkpoint(lambda x, k: sj.stochastic_round(x, seed=k, impl=impl))
    _, vjp = jax.vjp(checkpointed, x, keys[0])
    np.testing.assert_array_equal(np.asarray(vjp(jnp.ones(3, jnp.bfloat16))[0]), np.ones(3))


def test_stochastic_add_alpha_checks_and_non_finite_traced_alpha():
    """``alpha``: a concrete array is checked as a number is (finite), a bool or complex one is
    a ``TypeError`` (a complex alpha lost its imaginary part silently). A traced inf or NaN
    alpha (unknown until run time) gives the native path's IEEE sums (+-inf, +qNaN) on the
    callback path too, which failed inside its host call."""
    w = jnp.array([1.0, -2.0, 0.0, jnp.inf], jnp.bfloat16)
    u = jnp.array([1.0, 1.0, 0.0, -1.0], jnp.float32)
    for alpha in (jnp.float32(np.nan), np.float64(np.inf)):
        with pytest.raises(ValueError, match="alpha: expected a finite number"):
            sj.stochastic_add(w, u, alpha=alpha, seed=0)
    for alpha in (1j, jnp.complex64(1), jnp.bool_(True)):
        with pytest.raises(TypeError, match="alpha: expected a real"):
            sj.stochastic_add(w, u, alpha=alpha, seed=0)
    for alpha, overflow in ((np.inf, "inf"), (-np.inf, "saturate"), (np.nan, "inf")):
        got = [
            jax.jit(
                lambda a, i=impl: sj.stochastic_add(
                    w, u, alpha=a, seed=3, overflow=overflow, impl=i
                )
            )(jnp.float32(alpha))
            for impl in IMPLS
        ]
        assert _bits(got[0]).tolist() == _bits(got[1]).tolist()
        if alpha == np.inf:  # inf, inf, 0 * inf and inf - inf: +qNaN
            assert _bits(got[0]).tolist() == [0x7F80, 0x7F80, 0x7FC0, 0x7FC0]


@pytest.mark.parametrize("impl", IMPLS)
def test_grad_inside_shard_map(impl):
    """``jax.grad`` through the functional calls and ``apply_updates`` inside ``shard_map``
    (one device here): the callback path's results were not typed as varying over the mesh axes like their inputs,
    and the straight-through rule's tangent (varying) did not match them (TypeError)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1,), ("d",))
    x = jax.device_put(jnp.linspace(-1, 1, 8, dtype=jnp.float32), NamedSharding(mesh, P("d")))

    def local(x):
        y = sj.stochastic_round(x, seed=1, impl=impl, shard_spec=P("d"))
        w = sj.stochastic_add(y, x, seed=2, impl=impl, shard_spec=P("d"))
        z = sj.round_nearest(x, impl=impl).astype(jnp.float32)
        a = sj.apply_updates([y], [x], 3, step=1, impl=impl, shard_specs=P("d"))[0]
        return sj.to_float32(w, impl=impl) + z + a.astype(jnp.float32)

    f = jax.shard_map(local, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
    grad = jax.jit(jax.grad(lambda x: f(x).sum()))(x)
    np.testing.assert_array_equal(np.asarray(grad), np.full(8, 5.0, np.float32))


def test_eager_calls_skip_the_straight_through_custom_jvp(monkeypatch):
    """An eager call on concrete arrays is not differentiated, so it skips the ``custom_jvp``
    of the straight-through gradient, whose eager dispatch made a native ``stochastic_round``
    of 1024 elements 5x slower (51 -> 278 us on the 2-core VM)."""
    x = jnp.linspace(-1, 1, 8, dtype=jnp.float32)
    want = [sj.stochastic_round(x, seed=1), sj.stochastic_add(x.astype(jnp.bfloat16), x, seed=2)]

    def no_custom_jvp(fun, *args, **kwargs):
        raise AssertionError("an eager call made a custom_jvp")

    monkeypatch.setattr(jax, "custom_jvp", no_custom_jvp)
    got = [sj.stochastic_round(x, seed=1), sj.stochastic_add(x.astype(jnp.bfloat16), x, seed=2)]
    sj.to_float32(sj.round_nearest(x))
    for a, b in zip(got, want):
        assert _bits(a).tolist() == _bits(b).tolist()


def _compiles(call) -> int:
    """How many XLA programs ``call()`` compiled (JAX's compile-time events)."""
    names = []

    def listen(name, secs, **kwargs):
        if name == "/jax/core/compile/backend_compile_duration":
            names.append(name)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        jax.block_until_ready(call())
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    return len(names)


@pytest.mark.parametrize("impl", [None, *IMPLS])
def test_eager_calls_at_new_seeds_and_offsets_compile_nothing(impl):
    """A repeated eager call with the same settings and shapes, at another seed and offset (same
    ``offset % 4``), reuses the compiled program and registers no new host function. Before,
    every eager ``impl="callback"`` call of the elementwise functions compiled a program (its
    per-shard wrappers were made anew each call), and the host functions of new offsets piled
    up in the FFI registry."""
    from srround.adapters.jax import _ffi

    x = jnp.linspace(-3, 3, 64, dtype=jnp.float32).reshape(2, 32)
    w = x.astype(jnp.bfloat16)
    q = sj.quantize_blocks(x, "mxfp8_e4m3", seed=1, impl=impl)
    calls = {
        "stochastic_round": lambda i: sj.stochastic_round(x, seed=i, offset=4 * i, impl=impl),
        "stochastic_round_key": lambda i: sj.stochastic_round(
            x, seed=jax.random.key(i), offset=4 * i + 1, impl=impl
        ),
        "round_nearest": lambda i: sj.round_nearest(x, overflow="saturate", impl=impl),
        "to_float32": lambda i: sj.to_float32(w, impl=impl),
        "stochastic_add": lambda i: sj.stochastic_add(
            w, x, alpha=i, seed=i, offset=4 * i, impl=impl
        ),
        "stochastic_add_alpha_array": lambda i: sj.stochastic_add(
            w, x, alpha=jnp.float32(i), seed=i, offset=4 * i, impl=impl
        ),
        "quantize_blocks": lambda i: sj.quantize_blocks(
            x, "mxfp8_e4m3", seed=i, offset=32 * i, impl=impl
        ),
        "quantize_blocks_nearest": lambda i: sj.quantize_blocks(
            x, "nvfp4", rounding="nearest", impl=impl
        ),
        "dequantize_blocks": lambda i: sj.dequantize_blocks(q, impl=impl),
    }
    assert _compiles(lambda: jax.jit(lambda a: a * 3)(x)) == 1  # the events are counted
    failures = []
    for name, call in calls.items():
        jax.block_until_ready(call(1))
        registered = len(_ffi._FUNCTIONS)
        compiled = _compiles(lambda: call(2))
        if compiled or len(_ffi._FUNCTIONS) != registered:
            failures.append((name, compiled, len(_ffi._FUNCTIONS) - registered))
    assert failures == []  # (name, programs compiled, host functions registered)


def test_a_jax_older_than_the_adapter_needs_is_a_clear_import_error():
    """JAX 0.8 and older lack ``jax.enable_x64`` (an ``AttributeError`` inside the first call,
    before the check); 0.9.2 fails uneven sharded splits in its own compile. The floor is the
    ``jax`` extra's in ``pyproject.toml``."""
    import pathlib

    import tomllib

    from srround.adapters.jax import _requires

    for old in ("0.6.2", "0.9.2", "0.4.38"):
        with pytest.raises(ImportError, match=rf"needs JAX >= 0\.10, found {re.escape(old)}"):
            _requires.check(old)
    for new in ("0.10.0", "0.10.2", "0.12.0.1", "0.11.0.dev20261101", "1.0"):
        _requires.check(new)
    pyproject = pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml"
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    assert "jax>=0.10" in extras["jax"]  # the same floor


def test_float64_numpy_inputs_are_refused_without_x64_too():
    """A float64 NumPy array (or scalar) is refused as under ``jax_enable_x64``: without it
    ``jnp.asarray`` rounded it to float32 first, so the result was rounded twice, silently
    (1 + 2**-8 + 2**-30 gave bf16 1.0, not 1.0078125)."""
    x = np.float64([1 + 2**-8 + 2**-30])
    float64 = r": expected a float32 array, got float64; float64 is rejected"
    with pytest.raises(TypeError, match="^x" + float64):
        sj.round_nearest(x)
    with pytest.raises(TypeError, match="^x" + float64):
        sj.stochastic_round(x, seed=0)
    with pytest.raises(TypeError, match="^x" + float64):
        sj.stochastic_round(np.float64(0.5), seed=0)
    with pytest.raises(TypeError, match="^u" + float64):
        sj.stochastic_add(jnp.ones(1, jnp.bfloat16), x, seed=0)
    with pytest.raises(TypeError, match=r"^w: expected a narrow float array.*got float64"):
        sj.stochastic_add(x, jnp.ones(1, jnp.float32), seed=0)
    with pytest.raises(TypeError, match=r"^updates\[0\]: .* got float64"):
        sj.apply_updates({"w": jnp.ones(1, jnp.bfloat16)}, {"w": x}, 3, step=1)
    np.testing.assert_array_equal(  # float32 NumPy arrays are taken as they are
        np.asarray(sj.round_nearest(x.astype(np.float32))),
        x.astype(np.float32).astype(jnp.bfloat16),
    )
