"""One input, one seed, every available backend: bit-identical results, special values included.

Backends are a parameter (array-api-extra style): each knows how to put a NumPy array on it, get
one back, and which srround functions to call (the top-level API, or a framework adapter's own
functions with an explicit ``impl``). Unavailable backends skip themselves.
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import pytest

import srround

from .reference import bits

BACKENDS = [
    "numpy",
    "numpy_readonly",
    "numba_cuda",
    "cupy",
    "torch_cpu",
    "torch_cuda",
    "jax_native",
    "jax_callback",
    "jax_gpu",
]


class Backend:
    def __init__(self, put, get, api=srround, **options):
        self.put, self.get, self.api, self.options = put, get, api, options

    def call(self, name, *args, **kwargs):
        return getattr(self.api, name)(*args, **kwargs, **self.options)


def _torch(device):
    torch = pytest.importorskip("torch")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA for torch")
    dtypes = {np.dtype(ml_dtypes.bfloat16): torch.bfloat16}

    def put(a):
        if a.dtype in dtypes:
            return torch.from_numpy(a.view(np.int16).copy()).view(dtypes[a.dtype]).to(device)
        return torch.from_numpy(a.copy()).to(device)

    def get(t):
        t = t.cpu()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()

    return Backend(put, get)


def _jax(impl, platform="cpu"):
    jax = pytest.importorskip("jax")
    try:
        device = jax.devices(platform)[0]
    except RuntimeError:
        pytest.skip(f"no {platform} device for JAX")
    from srround.adapters import jax as jax_adapter

    return Backend(
        functools.partial(jax.device_put, device=device), np.asarray, jax_adapter, impl=impl
    )


@pytest.fixture(params=BACKENDS)
def any_backend(request, small_cuda_launch):
    name = request.param
    if name == "numpy":
        return Backend(np.array, np.asarray)
    if name == "numpy_readonly":

        def put(a):  # float32 arrays are only read: make them read-only; narrow ones get written
            a = a.copy()
            a.flags.writeable = a.dtype != np.float32
            return a

        return Backend(put, np.asarray)
    if name == "numba_cuda":
        from numba import cuda

        if not cuda.is_available():
            pytest.skip("no CUDA")
        return Backend(cuda.to_device, lambda d: d.copy_to_host())
    if name == "cupy":  # under the simulator: the stand-in of tests/fake_cupy.py
        cp = request.getfixturevalue("cupy_module")
        return Backend(cp.asarray, cp.asnumpy)
    if name.startswith("torch"):
        return _torch(name.split("_")[1])
    if name == "jax_gpu":
        return _jax("native", "gpu")
    return _jax(name.split("_")[1])


SPECIALS = np.array(
    [
        0x7FFFFFFF,
        0xFFFFFFFF,
        0x7F800001,
        0x7FC00000,
        0xFFC00000,
        0x7F800000,
        0xFF800000,
        0,
        0x80000000,
        0x7F7FFFFF,
        0x00000001,
        0x807FFFFF,
        0x3F808000,
        0x477FF000,
        0x33000000,
    ],
    np.uint32,
).view(np.float32)


def _inputs():
    rng = np.random.default_rng(11)
    return np.concatenate(
        [
            SPECIALS,
            rng.standard_normal(97).astype(np.float32),
            (rng.standard_normal(40) * 1e-6).astype(np.float32),
        ]
    )


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_every_backend_gives_the_numpy_bits(any_backend, dtype):
    x = _inputs()
    b = any_backend
    for offset in (0, 3, 2**33 + 1):
        expected = srround.stochastic_round(x, dtype=dtype, seed=2024, offset=offset)
        got = b.get(b.call("stochastic_round", b.put(x), dtype=dtype, seed=2024, offset=offset))
        assert np.array_equal(bits(got), bits(expected)), offset
    nearest = srround.round_nearest(x, dtype=dtype)
    assert np.array_equal(
        bits(b.get(b.call("round_nearest", b.put(x), dtype=dtype))), bits(nearest)
    )
    assert np.array_equal(
        bits(b.get(b.call("to_float32", b.put(nearest)))), bits(srround.to_float32(nearest))
    )
    u = np.random.default_rng(5).standard_normal(x.size).astype(np.float32) * np.float32(1e-3)
    expected = srround.stochastic_add(nearest.copy(), u, alpha=-0.7, seed=9, offset=5)
    w = b.put(nearest)
    result = b.call("stochastic_add", w, b.put(u), alpha=-0.7, seed=9, offset=5)
    assert np.array_equal(bits(b.get(result)), bits(expected))
