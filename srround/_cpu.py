"""CPU backend: the scalar bodies of ``_scalar.py`` in ``prange`` loops over all cores.

Buffers are flat, C-contiguous NumPy arrays of bit patterns: fp32 as ``uint32``, narrow formats
as ``uint16`` (bf16, fp16) or ``uint8`` (fp8, fp4 one value per byte). ``kind`` is the format's
``specials`` code (``_scalar.IEEE``, ``FN``, ``FINITE``).

The random kernels work in chunks of counter blocks (four elements per Threefry block, see
``_rng.py``). Each chunk first fills a small buffer with its blocks' random words in a
branch-free loop that LLVM vectorizes, then rounds its elements in a second loop that reads
the 16 bits of element ``i`` at a fixed distance from ``i`` in that buffer. Element ``i`` still
gets the bits of counter ``offset + i``, so neither the chunk size nor the thread count can
change a bit.
"""

from __future__ import annotations

import sys

import numpy as np
from llvmlite import ir
from numba import get_num_threads, njit, prange, set_num_threads, types
from numba.extending import intrinsic

from . import _config
from ._rng import _KS_PARITY, MASK32
from ._scalar import add_exact_f32, decode, encode_nearest, encode_stochastic

if sys.byteorder != "little":  # the uint16 view of the random words below assumes it
    raise ImportError("srround's CPU backend needs a little-endian CPU")

_CHUNK_BLOCKS = 1024  # counter blocks per random-bit buffer fill: 4096 elements, 8 KiB
_TASK_CHUNKS = 16  # chunks per prange iteration (one buffer allocation each)

# formats given literal constants in the element loops, so LLVM folds their shifts and masks
_BF16 = (7, 8)
_FP16 = (10, 5)
_E4M3 = (3, 4)  # FN
_E5M2 = (2, 5)  # IEEE


def run(kernel, elements: int, *args):
    """``kernel(*args)`` for a ``prange`` kernel over ``elements`` elements; below
    ``_config.CPU_SERIAL_BELOW`` on the calling thread alone (the thread count is per calling
    thread in Numba, and restored after). A parallel region wakes and then waits for every
    worker thread: 5-10 us on an idle machine, but when other processes keep the cores busy
    (data-loader workers) a scheduler time slice - measured on a 2-core VM under load, one
    unscale pass over 200 small gradients: 7.4 ms median on 2 threads, 34 us on one."""
    if elements >= _config.CPU_SERIAL_BELOW:
        return kernel(*args)
    threads = get_num_threads()
    set_num_threads(1)
    try:
        return kernel(*args)
    finally:
        set_num_threads(threads)


@njit(inline="always", cache=True)
def _block_range(n, offset):
    """First counter block and number of blocks covering elements [0, n) at ``offset``."""
    if n == 0:
        return 0, 0
    first = offset >> 2
    return first, ((offset + n - 1) >> 2) - first + 1


_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))  # of even and odd groups of four rounds


@intrinsic
def _threefry2x32_i32(typingctx, k0, k1, c0, c1):
    """``_rng.threefry2x32`` emitted as LLVM ``i32`` arithmetic (low 32 bits of each argument).

    The same function as ``_rng.threefry2x32`` (the algorithm in that module's docstring, round
    for round), but Numba computes on 64-bit integers and LLVM cannot narrow them back, so the
    generic version vectorizes 4 blocks per AVX2 register with masking; this one vectorizes 8.
    Returns ``(x0, x1)`` as uint32.
    """

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        k0, k1, c0, c1 = (builder.trunc(a, i32) for a in args)
        ks = (k0, k1, builder.xor(builder.xor(k0, k1), i32(_KS_PARITY)))
        x0, x1 = builder.add(c0, ks[0]), builder.add(c1, ks[1])
        for g in range(5):
            for r in _ROTATIONS[g % 2]:
                x0 = builder.add(x0, x1)
                x1 = builder.xor(
                    builder.or_(builder.shl(x1, i32(r)), builder.lshr(x1, i32(32 - r))), x0
                )
            x0 = builder.add(x0, ks[(g + 1) % 3])
            x1 = builder.add(builder.add(x1, ks[(g + 2) % 3]), i32(g + 1))
        return context.make_tuple(builder, signature.return_type, (x0, x1))

    return types.UniTuple(types.uint32, 2)(k0, k1, c0, c1), codegen


@njit(inline="always", cache=True)
def _fill_run(words, k0, k1, low, high):
    """Blocks ``(low + j, high)`` for ``j < words.size // 2`` into ``words[2j], words[2j+1]``
    (``low + j`` must stay below 2**32); branch-free, vectorized 8 blocks wide."""
    for j in range(words.size >> 1):
        x0, x1 = _threefry2x32_i32(k0, k1, low + j, high)
        words[2 * j] = x0
        words[2 * j + 1] = x1


@njit(inline="always", cache=True)
def _fill_bits(words, k0, k1, block0, nblocks):
    """``words[2k], words[2k+1]`` = ``(x0, x1)`` of counter block ``block0 + k``, ``k < nblocks``.

    Viewed as ``uint16`` (little-endian), halfword ``4 * k + lane`` is ``lane_bits16(x0, x1,
    lane)``: the 16 bits of counter ``4 * (block0 + k) + lane``.
    """
    k = 0
    while k < nblocks:  # one run unless the block's high word changes inside the chunk
        block = block0 + k
        low = block & MASK32
        stop = min(nblocks, k + (1 << 32) - low)
        _fill_run(words[2 * k : 2 * stop], k0, k1, low, block >> 32)
        k = stop


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
def _round_loop(x, out, bits, mantissa_bits, exponent_bits, saturate, kind):
    """out[i] = encode_stochastic(x[i], bits[i]) over equal-length slices."""
    for i in range(x.size):
        out[i] = encode_stochastic(x[i], bits[i], mantissa_bits, exponent_bits, saturate, kind)


@njit(inline="always", cache=True)
def _round_span(x, out, bits, mantissa_bits, exponent_bits, saturate, kind=0):
    """``_round_loop`` with bf16, fp16 and fp8 as literal formats (same results, folded
    constants)."""
    if mantissa_bits == _BF16[0] and exponent_bits == _BF16[1]:
        _round_loop(x, out, bits, _BF16[0], _BF16[1], saturate, 0)
    elif mantissa_bits == _FP16[0] and exponent_bits == _FP16[1]:
        _round_loop(x, out, bits, _FP16[0], _FP16[1], saturate, 0)
    elif mantissa_bits == _E4M3[0] and exponent_bits == _E4M3[1] and kind == 1:
        _round_loop(x, out, bits, _E4M3[0], _E4M3[1], saturate, 1)
    elif mantissa_bits == _E5M2[0] and exponent_bits == _E5M2[1] and kind == 0:
        _round_loop(x, out, bits, _E5M2[0], _E5M2[1], saturate, 0)
    else:
        _round_loop(x, out, bits, mantissa_bits, exponent_bits, saturate, kind)


@njit(inline="always", cache=True)
def _sum_loop(w, u, alpha, total, mantissa_bits, exponent_bits, kind=0):
    """total[i] = add_exact_f32(w[i], u[i], alpha): the fp32 sums ``add_stochastic`` rounds."""
    for i in range(w.size):
        total[i] = add_exact_f32(w[i], u[i], alpha, mantissa_bits, exponent_bits, kind)


@njit(inline="always", cache=True)
def _add_span(w, u, alpha, total, bits, mantissa_bits, exponent_bits, saturate, kind=0):
    """w[i] = add_stochastic(w[i], u[i], alpha, bits[i]) over equal-length slices, as its two
    steps in two loops (each vectorizes better alone): fp32 sums into ``total``, then
    ``_round_span``. Literal bf16/fp16 formats as in ``_round_span``."""
    if mantissa_bits == _BF16[0] and exponent_bits == _BF16[1]:
        _sum_loop(w, u, alpha, total, _BF16[0], _BF16[1])
    elif mantissa_bits == _FP16[0] and exponent_bits == _FP16[1]:
        _sum_loop(w, u, alpha, total, _FP16[0], _FP16[1])
    else:
        _sum_loop(w, u, alpha, total, mantissa_bits, exponent_bits, kind)
    _round_span(total, w, bits, mantissa_bits, exponent_bits, saturate, kind)


@njit(parallel=True, cache=True)
def stochastic_round(x, out, k0, k1, offset, mantissa_bits, exponent_bits, saturate, kind=0):
    """out[i] = SR(x[i]); x: uint32[n] (fp32 bits), out: uint16[n] or uint8[n]."""
    n = x.size
    first, nblocks = _block_range(n, offset)
    task = _CHUNK_BLOCKS * _TASK_CHUNKS
    for t in prange((nblocks + task - 1) // task):
        words = np.empty(2 * _CHUNK_BLOCKS, np.uint32)
        bits = words.view(np.uint16)
        for c in range(t * task, min(t * task + task, nblocks), _CHUNK_BLOCKS):
            block0, m, lo, hi = _chunk_span(n, offset, first, c, nblocks)
            _fill_bits(words, k0, k1, block0, m)
            b = offset + lo - 4 * block0
            _round_span(
                x[lo:hi],
                out[lo:hi],
                bits[b : b + hi - lo],
                mantissa_bits,
                exponent_bits,
                saturate,
                kind,
            )


@njit(inline="always", cache=True)
def _nearest_loop(x, out, mantissa_bits, exponent_bits, saturate, kind=0):
    for i in range(x.size):
        out[i] = encode_nearest(x[i], mantissa_bits, exponent_bits, saturate, kind)


@njit(parallel=True, cache=True)
def round_nearest(x, out, mantissa_bits, exponent_bits, saturate, kind=0):
    """out[i] = RNE(x[i]); x: uint32[n] (fp32 bits), out: uint16[n] or uint8[n]. Chunks of 4096
    elements per task, bf16 and fp16 with literal constants (as ``_round_span``)."""
    n = x.size
    chunk = 4 * _CHUNK_BLOCKS
    for t in prange((n + chunk - 1) // chunk):
        lo, hi = t * chunk, min(t * chunk + chunk, n)
        if mantissa_bits == _BF16[0] and exponent_bits == _BF16[1]:
            _nearest_loop(x[lo:hi], out[lo:hi], _BF16[0], _BF16[1], saturate)
        elif mantissa_bits == _FP16[0] and exponent_bits == _FP16[1]:
            _nearest_loop(x[lo:hi], out[lo:hi], _FP16[0], _FP16[1], saturate)
        else:
            _nearest_loop(x[lo:hi], out[lo:hi], mantissa_bits, exponent_bits, saturate, kind)


@njit(parallel=True, cache=True)
def to_float32(h, out, mantissa_bits, exponent_bits, kind=0):
    """out[i] = fp32 bits of narrow pattern h[i]; h: uint16[n] or uint8[n], out: uint32[n]."""
    for i in prange(h.size):
        out[i] = decode(h[i], mantissa_bits, exponent_bits, kind)


@njit(parallel=True, cache=True)
def stochastic_add(w, u, alpha, k0, k1, offset, mantissa_bits, exponent_bits, saturate, kind=0):
    """w[i] = SR(w[i] + alpha * u[i]) in place; w: uint16[n] or uint8[n], u: uint32[n] (fp32
    bits), alpha: float32."""
    n = w.size
    first, nblocks = _block_range(n, offset)
    task = _CHUNK_BLOCKS * _TASK_CHUNKS
    for t in prange((nblocks + task - 1) // task):
        words = np.empty(2 * _CHUNK_BLOCKS, np.uint32)
        bits = words.view(np.uint16)
        total = np.empty(4 * _CHUNK_BLOCKS, np.uint32)
        for c in range(t * task, min(t * task + task, nblocks), _CHUNK_BLOCKS):
            block0, m, lo, hi = _chunk_span(n, offset, first, c, nblocks)
            _fill_bits(words, k0, k1, block0, m)
            b = offset + lo - 4 * block0
            _add_span(
                w[lo:hi],
                u[lo:hi],
                alpha,
                total[: hi - lo],
                bits[b : b + hi - lo],
                mantissa_bits,
                exponent_bits,
                saturate,
                kind,
            )
