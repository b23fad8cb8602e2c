"""CPU backend: the scalar bodies of ``_scalar.py`` in ``prange`` loops over all cores.

Buffers are flat, C-contiguous NumPy arrays of bit patterns: fp32 as ``uint32``, narrow formats
as ``uint16``. Work is split into counter blocks of four elements (one Threefry call each, see
``_rng.py``); ``prange`` hands whole blocks to threads, so no thread count changes a bit.
"""

from __future__ import annotations

from numba import njit, prange

from ._rng import lane_bits16, random_block
from ._scalar import add_stochastic, decode, encode_nearest, encode_stochastic


@njit(inline="always", cache=True)
def _block_range(n, offset):
    """First counter block and number of blocks covering elements [0, n) at ``offset``."""
    if n == 0:
        return 0, 0
    first = offset >> 2
    return first, ((offset + n - 1) >> 2) - first + 1


@njit(parallel=True, cache=True)
def stochastic_round(x, out, k0, k1, offset, mantissa_bits, exponent_bits, saturate):
    """out[i] = SR(x[i]); x: uint32[n] (fp32 bits), out: uint16[n]."""
    n = x.size
    first, nblocks = _block_range(n, offset)
    for b in prange(nblocks):
        block = first + b
        x0, x1 = random_block(k0, k1, block)
        for lane in range(4):
            i = block * 4 + lane - offset
            if 0 <= i < n:
                r16 = lane_bits16(x0, x1, lane)
                out[i] = encode_stochastic(x[i], r16, mantissa_bits, exponent_bits, saturate)


@njit(parallel=True, cache=True)
def round_nearest(x, out, mantissa_bits, exponent_bits, saturate):
    """out[i] = RNE(x[i]); x: uint32[n] (fp32 bits), out: uint16[n]."""
    for i in prange(x.size):
        out[i] = encode_nearest(x[i], mantissa_bits, exponent_bits, saturate)


@njit(parallel=True, cache=True)
def to_float32(h, out, mantissa_bits, exponent_bits):
    """out[i] = fp32 bits of narrow pattern h[i]; h: uint16[n], out: uint32[n]."""
    for i in prange(h.size):
        out[i] = decode(h[i], mantissa_bits, exponent_bits)


@njit(parallel=True, cache=True)
def stochastic_add(w, u, alpha, k0, k1, offset, mantissa_bits, exponent_bits, saturate):
    """w[i] = SR(w[i] + alpha * u[i]) in place; w: uint16[n], u: float32[n], alpha: float32."""
    n = w.size
    first, nblocks = _block_range(n, offset)
    for b in prange(nblocks):
        block = first + b
        x0, x1 = random_block(k0, k1, block)
        for lane in range(4):
            i = block * 4 + lane - offset
            if 0 <= i < n:
                r16 = lane_bits16(x0, x1, lane)
                w[i] = add_stochastic(w[i], u[i], alpha, r16, mantissa_bits, exponent_bits, saturate)
