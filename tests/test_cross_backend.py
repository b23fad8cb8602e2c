"""One input, one seed, every available backend: bit-identical results, special values included.

Backends are a parameter (``any_backend``, tests/conftest.py): each knows how to put a NumPy
array on it, get one back, and which srround functions to call (the top-level API, or a
framework adapter's own functions with an explicit ``impl``). Unavailable backends skip
themselves.
"""

from __future__ import annotations

import numpy as np
import pytest

import srround

from .reference import SPECIAL_BITS, bits

SPECIALS = np.array(
    [*SPECIAL_BITS, 0x807FFFFF, 0x3F808000, 0x477FF000, 0x33000000], np.uint32
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


# the canonical +qNaN of each 16-bit format: what any NaN that srround's arithmetic computes
# is written as (docs/contracts.md, "Special values"); x86 would keep a NaN operand's sign and
# give -qNaN for inf - inf, CUDA 0x7FFFFFFF, XLA on GPU +qNaN
QNAN16 = {"bfloat16": 0x7FC0, "float16": 0x7E00}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_stochastic_add_nan_is_the_positive_quiet_nan(any_backend, dtype):
    """NaN weights of both signs, NaN updates of both signs (payloads too) and inf + (-inf)
    give exactly the format's +qNaN on every backend; finite sums are untouched."""
    b = any_backend
    w32 = np.array(
        [0xFFC00000, 0x7FC00000, 0xFFFFE000, 0x7F800000, 0xFF800000, 0x3F800000, 0xBF800000],
        np.uint32,
    ).view(np.float32)
    u = np.array(
        [0x3F800000, 0xBF800000, 0, 0xFF800000, 0x7F800000, 0xFFC00001, 0x7FA00000], np.uint32
    ).view(np.float32)
    w = srround.round_nearest(w32, dtype=dtype)
    assert (bits(w)[:3] >> 15).tolist() == [1, 0, 1]  # the inputs keep their NaN signs
    result = b.get(b.call("stochastic_add", b.put(w), b.put(u), alpha=0.5, seed=3, offset=1))
    assert [hex(v) for v in bits(result)] == [hex(QNAN16[dtype])] * len(u)
    finite = srround.round_nearest(np.float32([1.0, -2.0]), dtype=dtype)
    result = b.get(b.call("stochastic_add", b.put(finite), b.put(u[:2]), alpha=0.5, seed=3))
    assert np.array_equal(
        bits(result), bits(srround.round_nearest(np.float32([1.5, -2.5]), dtype=dtype))
    )
