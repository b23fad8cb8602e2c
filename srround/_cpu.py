"""CPU backend: the scalar bodies of ``_scalar.py`` in ``prange`` loops over all cores.

Buffers are flat, C-contiguous NumPy arrays of bit patterns: fp32 as ``uint32``, narrow formats
as ``uint16``.

The random kernels work in chunks of counter blocks (four elements per Threefry block, see
``_rng.py``). Each chunk first fills a small buffer with its blocks' random words in a
branch-free loop that LLVM vectorizes, then rounds its elements in a second loop that reads
the 16 bits of element ``i`` at a fixed distance from ``i`` in that buffer. Element ``i`` still
gets the bits of counter ``offset + i``, so neither the chunk size nor the thread count can
change a bit.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._rng import random_block
from ._scalar import add_stochastic, decode, encode_nearest, encode_stochastic

_CHUNK_BLOCKS = 1024  # counter blocks per random-bit buffer fill: 4096 elements, 8 KiB
_TASK_CHUNKS = 16  # chunks per prange iteration (one buffer allocation each)

# formats given literal constants in the element loops, so LLVM folds their shifts and masks
_BF16 = (7, 8)
_FP16 = (10, 5)


@njit(inline="always", cache=True)
def _block_range(n, offset):
    """First counter block and number of blocks covering elements [0, n) at ``offset``."""
    if n == 0:
        return 0, 0
    first = offset >> 2
    return first, ((offset + n - 1) >> 2) - first + 1


@njit(inline="always", cache=True)
def _fill_bits(buf, k0, k1, block0, nblocks):
    """``buf[k]`` = the 64 random bits of counter block ``block0 + k`` (``x0`` in the low half)
    for ``k < nblocks``. Viewed as ``uint16`` (little-endian), halfword ``4 * k + lane`` is
    ``lane_bits16(x0, x1, lane)``: the bits of counter ``4 * (block0 + k) + lane``."""
    for k in range(nblocks):
        x0, x1 = random_block(k0, k1, block0 + k)
        buf[k] = x0 | (x1 << 32)


@njit(inline="always", cache=True)
def _chunk_span(n, offset, first, c, nblocks):
    """Blocks ``[first + c, first + c + m)`` of a chunk: returns ``(block0, m, lo, hi)`` with
    elements ``[lo, hi)`` the ones those blocks cover; element ``i`` has random halfword
    ``i - lo + (offset + lo - 4 * block0)`` of the chunk's buffer."""
    block0 = first + c
    m = min(_CHUNK_BLOCKS, nblocks - c)
    lo = max(4 * block0 - offset, 0)
    hi = min(4 * (block0 + m) - offset, n)
    return block0, m, lo, hi


@njit(inline="always", cache=True)
def _round_loop(x, out, bits, mantissa_bits, exponent_bits, saturate):
    """out[i] = encode_stochastic(x[i], bits[i]) over equal-length slices."""
    for i in range(x.size):
        out[i] = encode_stochastic(x[i], bits[i], mantissa_bits, exponent_bits, saturate)


@njit(inline="always", cache=True)
def _round_span(x, out, bits, mantissa_bits, exponent_bits, saturate):
    """``_round_loop`` with bf16 and fp16 as literal formats (same results, folded constants)."""
    if mantissa_bits == _BF16[0] and exponent_bits == _BF16[1]:
        _round_loop(x, out, bits, _BF16[0], _BF16[1], saturate)
    elif mantissa_bits == _FP16[0] and exponent_bits == _FP16[1]:
        _round_loop(x, out, bits, _FP16[0], _FP16[1], saturate)
    else:
        _round_loop(x, out, bits, mantissa_bits, exponent_bits, saturate)


@njit(inline="always", cache=True)
def _add_loop(w, u, alpha, bits, mantissa_bits, exponent_bits, saturate):
    """w[i] = add_stochastic(w[i], u[i], alpha, bits[i]) over equal-length slices."""
    for i in range(w.size):
        w[i] = add_stochastic(w[i], u[i], alpha, bits[i], mantissa_bits, exponent_bits, saturate)


@njit(inline="always", cache=True)
def _add_span(w, u, alpha, bits, mantissa_bits, exponent_bits, saturate):
    """``_add_loop`` with bf16 and fp16 as literal formats (same results, folded constants)."""
    if mantissa_bits == _BF16[0] and exponent_bits == _BF16[1]:
        _add_loop(w, u, alpha, bits, _BF16[0], _BF16[1], saturate)
    elif mantissa_bits == _FP16[0] and exponent_bits == _FP16[1]:
        _add_loop(w, u, alpha, bits, _FP16[0], _FP16[1], saturate)
    else:
        _add_loop(w, u, alpha, bits, mantissa_bits, exponent_bits, saturate)


@njit(parallel=True, cache=True)
def stochastic_round(x, out, k0, k1, offset, mantissa_bits, exponent_bits, saturate):
    """out[i] = SR(x[i]); x: uint32[n] (fp32 bits), out: uint16[n]."""
    n = x.size
    first, nblocks = _block_range(n, offset)
    task = _CHUNK_BLOCKS * _TASK_CHUNKS
    for t in prange((nblocks + task - 1) // task):
        buf = np.empty(_CHUNK_BLOCKS, np.uint64)
        bits = buf.view(np.uint16)
        for c in range(t * task, min(t * task + task, nblocks), _CHUNK_BLOCKS):
            block0, m, lo, hi = _chunk_span(n, offset, first, c, nblocks)
            _fill_bits(buf, k0, k1, block0, m)
            b = offset + lo - 4 * block0
            _round_span(
                x[lo:hi], out[lo:hi], bits[b:b + hi - lo], mantissa_bits, exponent_bits, saturate
            )


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
    """w[i] = SR(w[i] + alpha * u[i]) in place; w: uint16[n], u: uint32[n] (fp32 bits), alpha:
    float32."""
    n = w.size
    first, nblocks = _block_range(n, offset)
    task = _CHUNK_BLOCKS * _TASK_CHUNKS
    for t in prange((nblocks + task - 1) // task):
        buf = np.empty(_CHUNK_BLOCKS, np.uint64)
        bits = buf.view(np.uint16)
        for c in range(t * task, min(t * task + task, nblocks), _CHUNK_BLOCKS):
            block0, m, lo, hi = _chunk_span(n, offset, first, c, nblocks)
            _fill_bits(buf, k0, k1, block0, m)
            b = offset + lo - 4 * block0
            _add_span(
                w[lo:hi], u[lo:hi], alpha, bits[b:b + hi - lo], mantissa_bits, exponent_bits,
                saturate,
            )
