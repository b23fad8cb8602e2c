"""fp8 optimizer states: AdamW moments stored in float8 (e4m3fn or e5m2) under a float32
power-of-two scale per block of ``STATE_BLOCK`` elements of each tensor, written back with
stochastic rounding (the rules: ``docs/contracts.md``, "fp8 states").

One block is one work item on both backends (``update_block8``: a ``prange`` iteration on the
CPU, a thread on CUDA). A first pass computes the block's new moments in float32 and reads
their largest finite magnitudes, which give the new scales; a second pass writes the moments,
each once. On the CPU the first pass also writes the parameter and the weight mode's buffer and
keeps the float32 moments in a scratch buffer for the second; on CUDA the second pass computes
the same values again (the same float32 operations: the same bits) and writes everything, each
once. The second moment is stored in the square-root domain (``sqrt(v)``): its dynamic range is
that of the gradients, not their squares.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from ._block_kernels import block_element, element_value, scaled_value
from ._elements import (
    ADAMW,
    BF16,
    F32,
    KAHAN,
    MASTER,
    STATE1_STREAM,
    STATE2_STREAM,
    STOCHASTIC,
    WEIGHT_STREAM,
    adamw_math,
    group_constants,
    load,
    store,
    stream_offset,
    weight_value,
    weight_write,
    widen,
)
from ._formats import (
    CODE_EXPONENT_BITS,
    CODE_MANTISSA_BITS,
    CODE_MAX_BITS,
    CODE_SPECIALS,
    BufferCode,
)
from ._rng import lane_bits16, random_block
from ._scalar import bits_to_f32, f32_to_bits, result_bits
from ._tensor_list import load_bits, store_bits

STATE_BLOCK = 128  # elements per scale: 4 bytes of scale per 128 one-byte moments
STREAM_WORDS = 2 * (STATE_BLOCK // 4 + 1)  # uint32 random words of one stream of one block
#: State buffer codes that take block scales.
FP8_CODES = (BufferCode.FLOAT8_E4M3FN, BufferCode.FLOAT8_E5M2)
_ABS, _INF = 0x7FFFFFFF, 0x7F800000


def block_counts(sizes) -> np.ndarray:
    """Scales per tensor: ``ceil(size / STATE_BLOCK)``."""
    return -(-np.asarray(sizes, np.int64) // STATE_BLOCK)


@njit(forceinline=True, cache=True)
def state_scale(amax, max_bits):
    """``(scale, 1 / scale)`` as float32 bits: the smallest power of two ``2**k``, ``k`` in
    [-126, 127], with ``amax / 2**k`` at most the format's largest finite value (float32 bits
    ``max_bits``), so no finite element clips and both multiplies are exact."""
    k = (amax >> 23) - (max_bits >> 23)  # floor(log2 amax) - floor(log2 max)
    if (amax & 0x7FFFFF) > (max_bits & 0x7FFFFF):
        k += 1
    k = min(max(k, -126), 127)
    return (k + 127) << 23, (127 - k) << 23


@njit(forceinline=True, cache=True)
def _values8(mode, formats, buffers, j, scale, coefs, group, state_scales, lut):
    """Element ``j`` read and updated in float32, nothing written: ``(old weight bits, aux
    bits, new weight, m, sqrt(v))``; ``lut``: address of the states' 256 decoded float32
    patterns (``decode``), or 0: decoded here."""
    p_fmt, g_fmt, state_fmt = formats
    p_addr, g_addr, s1_addr, s2_addr, aux_addr = buffers
    sm, se, sk = (
        CODE_MANTISSA_BITS[state_fmt],
        CODE_EXPONENT_BITS[state_fmt],
        CODE_SPECIALS[state_fmt],
    )
    aux_fmt = F32 if mode == MASTER else BF16
    g = bits_to_f32(widen(load(g_addr, j, g_fmt), g_fmt)) * scale
    p_bits = load(p_addr, j, p_fmt)
    aux_bits = load(aux_addr, j, aux_fmt) if p_fmt != F32 and mode >= KAHAN else 0
    old = weight_value(mode, p_fmt, p_bits, aux_bits)
    m_h, s_h = load(s1_addr, j, state_fmt), load(s2_addr, j, state_fmt)
    if lut != 0:
        m = bits_to_f32(scaled_value(load_bits(lut, m_h, 32), state_scales[0]))
        s = bits_to_f32(scaled_value(load_bits(lut, s_h, 32), state_scales[1]))
    else:
        m = bits_to_f32(element_value(m_h, state_scales[0], sm, se, sk))
        s = bits_to_f32(element_value(s_h, state_scales[1], sm, se, sk))
    c0, c1, c2 = coefs
    beta2, eps, one_minus_beta1, one_minus_beta2 = group
    new, m, v = adamw_math(
        bits_to_f32(old), g, m, s * s, c0, c1, c2, beta2, eps, one_minus_beta1, one_minus_beta2
    )
    return old, aux_bits, new, m, np.float32(math.sqrt(v))


@njit(forceinline=True, cache=True)
def _amax(top, bits):
    """The larger of ``top`` and the magnitude of float32 bits ``bits``, skipping inf and NaN
    (branch-free, so CPU loops vectorize)."""
    a = bits & _ABS
    return a if a > top and a < _INF else top


@njit(forceinline=True, cache=True)
def _bits16(k0, k1, ctr, current, x0, x1):
    """16 random bits of counter ``ctr``, reusing the Threefry block ``current`` (its words
    ``x0, x1``) when ``ctr`` falls in it; returns ``(bits, current, x0, x1)``."""
    if (ctr >> 2) != current:
        current = ctr >> 2
        x0, x1 = random_block(k0, k1, current)
    return lane_bits16(x0, x1, ctr & 3), current, x0, x1


@njit(forceinline=True, cache=True)
def update_block8(mode, state_fmt, row, b, size, step, scale_bits, coefs, hyper, key, words, lut):
    """Block ``b`` of one tensor (elements ``[b * STATE_BLOCK, ...)``, ``size`` in all) of an
    AdamW step with fp8 states, in place: the body both backends run.

    Args:
        mode: the ``Mode``; state_fmt: the states' ``BufferCode`` (an fp8 code).
        row: the tensor's ``(p_addr, p_fmt, g_addr, g_fmt, s1_addr, s2_addr, aux_addr, noise,
            s1_scale_addr, s2_scale_addr)`` (``Column`` values).
        step: the tensor's step count (after the increment); scale_bits: float32 bits of the
            gradient multiplier; coefs: float32 ``(c0, c1, c2)`` (``prepare_coefs``); hyper: the
            group's hyperparameter columns 1-4; key: the Threefry key ``(k0, k1)``.
        words: address of the block's random words, ``STREAM_WORDS`` uint32 per stream
            (weight, first, second state), each from the Threefry block of the stream's
            first counter (the CPU loop fills them in a vectorized pass), then room for
            ``2 * STATE_BLOCK`` uint32 (the CPU pass keeps the block's float32 moments there
            instead of computing them twice); 0: drawn here, moments computed twice (CUDA).
        lut: address of the 256 float32 patterns ``decode`` gives the state format's bytes
            (the CPU loop fills them once), or 0: decoded in the body (CUDA).
    """
    p_addr, p_fmt, g_addr, g_fmt, s1_addr, s2_addr, aux_addr, noise, s1_scales, s2_scales = row
    k0, k1 = key
    scale = bits_to_f32(scale_bits)
    formats = (p_fmt, g_fmt, state_fmt)
    buffers = (p_addr, g_addr, s1_addr, s2_addr, aux_addr)
    coefs = (np.float32(coefs[0]), np.float32(coefs[1]), np.float32(coefs[2]))
    group = group_constants(ADAMW, hyper[0], hyper[1], hyper[2], hyper[3])
    old_scales = (load_bits(s1_scales, b, 32), load_bits(s2_scales, b, 32))
    j0 = b * STATE_BLOCK
    j1 = min(j0 + STATE_BLOCK, size)
    max_bits = CODE_MAX_BITS[state_fmt]
    sm, se, sk = (
        CODE_MANTISSA_BITS[state_fmt],
        CODE_EXPONENT_BITS[state_fmt],
        CODE_SPECIALS[state_fmt],
    )
    w_ctr = stream_offset(step, WEIGHT_STREAM, noise)
    m_ctr = stream_offset(step, STATE1_STREAM, noise)
    v_ctr = stream_offset(step, STATE2_STREAM, noise)
    aux_fmt = F32 if mode == MASTER else BF16
    firsts = (4 * ((w_ctr + j0) >> 2), 4 * ((m_ctr + j0) >> 2), 4 * ((v_ctr + j0) >> 2))
    m_max = v_max = 0
    if words != 0:  # CPU: one pass writes the weights and keeps the moments in the scratch
        scratch = words + 4 * 3 * STREAM_WORDS
        for j in range(j0, j1):
            old, aux, new, m, s = _values8(
                mode, formats, buffers, j, scale, coefs, group, old_scales, lut
            )
            w16 = 0
            if mode == STOCHASTIC and p_fmt != F32:
                w16 = load_bits(words, w_ctr + j - firsts[0], 16)
            p_new, aux_new = weight_write(mode, p_fmt, old, result_bits(new), aux, w16)
            store(p_addr, j, p_new, p_fmt)
            if p_fmt != F32 and mode >= KAHAN:
                store(aux_addr, j, aux_new, aux_fmt)
            m_bits, s_bits = result_bits(m), result_bits(s)  # _amax skips NaN either way
            m_max = _amax(m_max, m_bits)
            v_max = _amax(v_max, s_bits)
            store_bits(scratch, j - j0, m_bits, 32)
            store_bits(scratch, STATE_BLOCK + j - j0, s_bits, 32)
        m_scale, m_mult = state_scale(m_max, max_bits)
        v_scale, v_mult = state_scale(v_max, max_bits)
        for j in range(j0, j1):
            m16 = load_bits(words + 4 * STREAM_WORDS, m_ctr + j - firsts[1], 16)
            v16 = load_bits(words + 8 * STREAM_WORDS, v_ctr + j - firsts[2], 16)
            m = load_bits(scratch, j - j0, 32)
            s = load_bits(scratch, STATE_BLOCK + j - j0, 32)
            store_bits(s1_addr, j, block_element(m, m_mult, max_bits, m16, True, sm, se, sk), 8)
            store_bits(s2_addr, j, block_element(s, v_mult, max_bits, v16, True, sm, se, sk), 8)
        store_bits(s1_scales, b, m_scale, 32)
        store_bits(s2_scales, b, v_scale, 32)
        return
    for j in range(j0, j1):
        _, _, _, m, s = _values8(mode, formats, buffers, j, scale, coefs, group, old_scales, lut)
        m_max = _amax(m_max, f32_to_bits(m))
        v_max = _amax(v_max, f32_to_bits(s))
    m_scale, m_mult = state_scale(m_max, max_bits)
    v_scale, v_mult = state_scale(v_max, max_bits)
    wb = mb = vb = -1
    w0 = w1 = m0 = m1 = v0 = v1 = 0
    for j in range(j0, j1):
        old, aux, new, m, s = _values8(
            mode, formats, buffers, j, scale, coefs, group, old_scales, lut
        )
        w16 = 0
        if mode == STOCHASTIC and p_fmt != F32:
            w16, wb, w0, w1 = _bits16(k0, k1, w_ctr + j, wb, w0, w1)
        m16, mb, m0, m1 = _bits16(k0, k1, m_ctr + j, mb, m0, m1)
        v16, vb, v0, v1 = _bits16(k0, k1, v_ctr + j, vb, v0, v1)
        p_new, aux_new = weight_write(mode, p_fmt, old, result_bits(new), aux, w16)
        store(p_addr, j, p_new, p_fmt)
        if p_fmt != F32 and mode >= KAHAN:
            store(aux_addr, j, aux_new, aux_fmt)
        m_q = block_element(result_bits(m), m_mult, max_bits, m16, True, sm, se, sk)
        v_q = block_element(result_bits(s), v_mult, max_bits, v16, True, sm, se, sk)
        store_bits(s1_addr, j, m_q, 8)
        store_bits(s2_addr, j, v_q, 8)
    store_bits(s1_scales, b, m_scale, 32)
    store_bits(s2_scales, b, v_scale, 32)
