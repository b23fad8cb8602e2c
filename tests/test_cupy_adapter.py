"""The CuPy adapter: real CuPy on a GPU; without one, the stand-in of ``tests/fake_cupy.py``
under Numba's CUDA simulator (the adapter's own logic; CuPy itself needs the GPU run).

Bit identity with the NumPy path for the rounding functions is in test_cross_backend.py."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import srround

from .reference import bits

pytestmark = pytest.mark.cuda

BF16 = np.dtype(ml_dtypes.bfloat16)


def _x(n=50, seed=0):
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def test_results_are_cupy_arrays_of_the_native_dtype(cupy_module):
    cp = cupy_module
    x = cp.asarray(_x().reshape(5, 10))
    y = srround.stochastic_round(x, seed=1)
    assert isinstance(y, cp.ndarray) and y.dtype == BF16 and y.shape == (5, 10)
    half = srround.round_nearest(x, dtype="float16")
    assert isinstance(half, cp.ndarray) and half.dtype == np.float16
    back = srround.to_float32(y)
    assert isinstance(back, cp.ndarray) and back.dtype == np.float32
    assert np.array_equal(
        bits(cp.asnumpy(back)),
        bits(srround.to_float32(srround.stochastic_round(_x().reshape(5, 10), seed=1))),
    )


def test_out_and_inplace_write_the_callers_array(cupy_module):
    cp = cupy_module
    x = _x()
    out = cp.empty(x.shape, BF16)
    assert srround.round_nearest(cp.asarray(x), out=out) is out
    assert np.array_equal(bits(cp.asnumpy(out)), bits(x.astype(BF16)))
    w = cp.asarray(x.astype(BF16))
    u = _x(seed=1) * np.float32(1e-3)
    assert srround.stochastic_add(w, cp.asarray(u), seed=4) is w
    expected = srround.stochastic_add(x.astype(BF16), u, seed=4)
    assert np.array_equal(bits(cp.asnumpy(w)), bits(expected))


def test_bf16_as_uint16_bit_patterns_without_cupy_bf16(cupy_module):
    """An older CuPy has no bf16 dtype: bf16 goes in and comes out as uint16 bit patterns."""
    cp = cupy_module
    if not hasattr(cp, "bfloat16_supported"):
        pytest.skip("only the stand-in can pretend to be an older CuPy")
    from srround.adapters import cupy as adapter

    cp.bfloat16_supported = False
    adapter._result_dtype.cache_clear()
    x = _x()
    y = srround.stochastic_round(cp.asarray(x), seed=3)
    assert y.dtype == np.uint16
    expected = srround.stochastic_round(x, seed=3)
    assert np.array_equal(cp.asnumpy(y), bits(expected))
    back = srround.to_float32(y, dtype="bfloat16")
    assert np.array_equal(bits(cp.asnumpy(back)), bits(srround.to_float32(expected)))
    with pytest.raises(TypeError, match=r"y: .*uint16 / uint8 bit patterns with dtype= given"):
        srround.to_float32(y)


def test_kernels_run_on_the_current_cupy_stream(cupy_module):
    cp = cupy_module
    x = _x()
    if hasattr(cp, "streams_asked"):  # the stand-in records which stream was looked up
        cp.stream_handle = 0xABC
        srround.stochastic_round(cp.asarray(x), seed=5)
        assert set(cp.streams_asked) == {(0, 0xABC)}
        return
    with cp.cuda.Stream(non_blocking=True) as stream:
        y = srround.stochastic_round(cp.asarray(x), seed=5)
        got = cp.asnumpy(y, stream=stream)
        stream.synchronize()
    assert np.array_equal(bits(got), bits(srround.stochastic_round(x, seed=5)))


def test_errors_name_the_argument(cupy_module):
    cp = cupy_module
    x = cp.asarray(_x(64).reshape(8, 8))
    with pytest.raises(ValueError, match=r"x: must be C-contiguous.*cupy.ascontiguousarray"):
        srround.stochastic_round(x[:, ::2])
    with pytest.raises(TypeError, match="x: expected a float32 array, got float64"):
        srround.stochastic_round(cp.asarray(_x().astype(np.float64)))
    with pytest.raises(TypeError, match="out: is a numpy array but x is a cupy array"):
        srround.round_nearest(x, out=np.empty((8, 8), BF16))
    with pytest.raises(ValueError, match=r"out: shape \(4,\) does not match"):
        srround.round_nearest(x, out=cp.empty(4, BF16))
    with pytest.raises(TypeError, match="w: expected a narrow float array"):
        srround.stochastic_add(x, x)
    if hasattr(cp, "current_device"):  # the stand-in can pretend another device is current
        cp.current_device = 1
        with pytest.raises(ValueError, match=r"x: is on cuda:0 but the current CuPy device is"):
            srround.stochastic_round(x)


def test_unscale_and_check_on_a_list_of_cupy_arrays(cupy_module):
    cp = cupy_module
    rng = np.random.default_rng(2)
    host = [
        rng.standard_normal(n).astype(dtype)
        for n, dtype in ((33, np.float32), (7, BF16), (20, np.float16))
    ]
    host[1][3] = np.inf
    grads = [cp.asarray(g) for g in host]
    found = srround.unscale_and_check(grads, 0.25)
    expected = srround.unscale_and_check(host, 0.25)
    assert isinstance(found, cp.ndarray) and cp.asnumpy(found)[0] == expected[0] == 1.0
    for g, h in zip(grads, host):
        assert np.array_equal(bits(cp.asnumpy(g)), bits(h))


def test_adamw_step_on_cupy_arrays_matches_numpy(cupy_module):
    cp = cupy_module
    rng = np.random.default_rng(7)
    sizes = (40, 9)
    host = {
        "params": [rng.standard_normal(n).astype(BF16) for n in sizes],
        "grads": [rng.standard_normal(n).astype(BF16) for n in sizes],
        "exp_avgs": [np.zeros(n, np.float32) for n in sizes],
        "exp_avg_sqs": [np.zeros(n, np.float32) for n in sizes],
    }
    device = {k: [cp.asarray(a) for a in v] for k, v in host.items()}
    steps = cp.zeros(len(sizes), np.int32)
    for t in range(2):
        srround.adamw_step(**device, lr=1e-2, step=steps, seed=11)
        srround.adamw_step(**host, lr=1e-2, step=t + 1, seed=11)
    assert np.array_equal(cp.asnumpy(steps), [2, 2])
    for name in host:
        for d, h in zip(device[name], host[name]):
            assert np.array_equal(bits(cp.asnumpy(d)), bits(h)), name
