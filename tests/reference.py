"""Plain-NumPy references, independent of the kernels: float64 arithmetic and ml_dtypes casts.

Every fp32 value and every power of two involved is exact in float64, so the neighbours and the
dropped fraction below are exact.
"""

from __future__ import annotations

import numpy as np

import srround
from srround._rng import lane_bits16, random_block, split_seed


def neighbours(x, fmt):
    """``(down, up, frac)``: the format's values just toward zero / away from zero of float32
    ``x`` (as float64, signed like x), and the fraction of the step that x is past ``down``."""
    x = np.asarray(x, np.float64)
    mag = np.abs(x)
    emin = 1 - fmt.bias
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(np.where(mag > 0, mag, 1.0)))
    # log2 can be off by one right at powers of two: fix e so that 2**e <= mag < 2**(e+1)
    e = np.where(2.0**e > mag, e - 1, e)
    e = np.where(2.0 ** (e + 1) <= mag, e + 1, e)
    quantum = 2.0 ** (np.maximum(e, emin) - fmt.mantissa_bits)
    steps = mag / quantum
    down = np.floor(steps) * quantum
    frac = steps - np.floor(steps)
    sign = np.where(np.signbit(x), -1.0, 1.0)
    return sign * down, sign * (down + quantum), frac


def random16(seed, offset, n):
    """The 16 random bits of elements 0..n-1 of a call (the documented stream, _rng.py)."""
    k0, k1 = split_seed(seed)
    out = np.empty(n, np.int64)
    for i in range(n):
        ctr = offset + i
        x0, x1 = random_block(k0, k1, ctr >> 2)
        out[i] = lane_bits16(x0, x1, ctr & 3)
    return out


def stochastic_round(x, fmt, seed, offset=0):
    """Reference SR of finite float32 ``x``: up iff bits16 < floor(frac * 2**16). Returns the
    result as the format's NumPy dtype (inf past the largest finite value). Non-finite entries
    give meaningless values: compare only the finite ones."""
    x = np.where(np.isfinite(x), x, np.float32(0))
    down, up, frac = neighbours(x, fmt)
    go_up = random16(seed, offset, x.size) < np.floor(frac * 65536.0)
    value = np.where(go_up, up, down)
    value = np.where(np.abs(value) > fmt.max_finite, np.copysign(np.inf, value), value)
    # exact: every value is representable (or inf); keep the sign of zeros
    value = np.where(value == 0, np.copysign(0.0, x), value)
    with np.errstate(over="ignore"):
        return value.astype(np.float32).astype(fmt.numpy_dtype)


def bits(a):
    return np.asarray(a).view(np.uint16 if np.asarray(a).dtype.itemsize == 2 else np.uint32)


FORMAT_NAMES = list(srround.FORMATS)
