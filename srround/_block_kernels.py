"""Kernels of the block-scaled formats (``_blocks.py`` has the rules): one-element and one-block
bodies, written once and compiled for the CPU loops here (one ``prange`` iteration per block)
and the CUDA kernels of ``_blocks_cuda.py`` (one thread per block)."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._rng import lane_bits16, random_block
from ._scalar import FN, bits_to_f32, decode, encode_nearest, encode_stochastic, f32_to_bits
from ._tensor_list import load_bits, store_bits

_F32_ABS = 0x7FFFFFFF
_F32_INF = 0x7F800000
NVFP4_TENSOR_DIVISOR = 448.0 * 6.0  # float8_e4m3fn max * float4_e2m1fn max
#: fp32 bits of 2**-121, the least NVFP4 tensor scale: (1 / ts) / 2**-6 (the least block scale)
#: is then at most 2**127, finite
NVFP4_MIN_TENSOR_SCALE = 6 << 23


# -- scalar bodies (njit: compiled for the CPU loops and the CUDA kernels alike) -------------


@njit(forceinline=True, cache=True)
def pow2_bits(k):
    """fp32 bits of ``2**k`` for k in [-149, 127] (subnormal below -126)."""
    if k >= -126:
        return (k + 127) << 23
    return 1 << (k + 149)


@njit(forceinline=True, cache=True)
def mx_scale(amax, emax, max_mantissa, ceil):
    """``(biased e8m0 scale, fp32 bits of the multiplier 1/scale)`` of a block whose largest
    magnitude has fp32 bits ``amax`` (NaN bits when the block holds a NaN)."""
    if amax > _F32_INF:
        return 255, 0  # NaN scale: x / inf in torchao, i.e. x * 0 (finite -> +-0, else NaN)
    k = (amax >> 23) - 127 - emax
    if ceil and (amax >> 23) != 0 and (amax & 0x7FFFFF) > max_mantissa:
        k += 1
    k = min(max(k, -127), 128)
    return k + 127, pow2_bits(-k)


@njit(forceinline=True, cache=True)
def nv_tensor_scale(amax):
    """fp32 bits of NVFP4's tensor scale ``max(amax / 2688, 2**-121)`` (1.0 when amax is 0)."""
    if amax == 0:
        return 0x3F800000
    scale = f32_to_bits(bits_to_f32(amax) / np.float32(NVFP4_TENSOR_DIVISOR))
    return max(scale, NVFP4_MIN_TENSOR_SCALE)  # non-negative: bits order as values (NaN last)


@njit(forceinline=True, cache=True)
def nv_block_scale(amax, tensor_scale, ceil):
    """``(e4m3 block scale, fp32 bits of the element multiplier)`` of an NVFP4 block."""
    ts = bits_to_f32(tensor_scale)
    scaled = (bits_to_f32(amax) / np.float32(6.0)) / ts
    if scaled == scaled:  # torch.clamp keeps NaN
        scaled = min(max(scaled, np.float32(0.015625)), np.float32(448.0))
    u = f32_to_bits(scaled)
    code = encode_nearest(u, 3, 4, True, FN)
    if ceil and code < 0x7E and decode(code, 3, 4, FN) < u:  # positive: bits order as values
        code += 1
    s32 = bits_to_f32(decode(code, 3, 4, FN))
    return code, f32_to_bits((np.float32(1.0) / ts) / s32)


@njit(forceinline=True, cache=True)
def block_element(u, multiplier, max_bits, bits16, stochastic, m, e, kind):
    """The element pattern of fp32 bits ``u`` scaled by the fp32 ``multiplier`` (bits),
    clamped to +-max (``max_bits``: the fp32 bits of the largest element) and rounded."""
    y = f32_to_bits(bits_to_f32(u) * bits_to_f32(multiplier))
    sign = y & 0x80000000
    a = y & _F32_ABS
    if a > _F32_INF:  # NaN (a NaN ``u``, or inf * 0 in a NaN block): all ones (torch's fp8
        # casts; fp4 has no NaN: torchao's 0b0011), with the sign of ``u`` - the sign of a
        # NaN product differs between CPUs and GPUs
        return ((u >> 31) << (m + e)) | (((1 << (m + e)) - 1) if kind != 2 else 0x3)
    if a > max_bits:
        y = sign | max_bits
    if stochastic:
        return encode_stochastic(y, bits16, m, e, True, kind)
    return encode_nearest(y, m, e, True, kind)


@njit(forceinline=True, cache=True)
def element_value(h, scale_bits, m, e, kind):
    """fp32 bits of element pattern ``h`` times the fp32 scale (bits); a NaN result is the
    quiet NaN 0x7FC00000 (which NaN a product keeps differs between CPUs and GPUs)."""
    return scaled_value(decode(h, m, e, kind), scale_bits)


@njit(forceinline=True, cache=True)
def scaled_value(u, scale_bits):
    """fp32 bits of fp32 pattern ``u`` (a decoded element) times the fp32 scale (bits), a NaN
    result as in ``element_value``."""
    v = f32_to_bits(bits_to_f32(u) * bits_to_f32(scale_bits))
    return v if (v & _F32_ABS) <= _F32_INF else 0x7FC00000


@njit(forceinline=True, cache=True)
def nv_scale_value(code, tensor_scale):
    """fp32 bits of an NVFP4 block's scale: e4m3 ``code`` times the tensor scale (bits)."""
    return f32_to_bits(bits_to_f32(decode(code, 3, 4, FN)) * bits_to_f32(tensor_scale))


@njit(forceinline=True, cache=True)
def mx_scale_value(code):
    """fp32 bits of an e8m0 scale (NaN for 0xFF)."""
    if code == 255:
        return 0x7FC00000
    return pow2_bits(code - 127)


# -- CPU kernels ------------------------------------------------------------------------------


@njit(cache=True)
def _amax_bits_range(x, start, stop):
    """The largest of ``x[j] & 0x7FFFFFFF`` for ``start <= j < stop`` (0 for none)."""
    m = np.uint32(0)
    for j in range(start, stop):
        a = x[j] & np.uint32(_F32_ABS)
        if a > m:
            m = a
    return m


@njit(parallel=True, cache=True)
def amax_bits_cpu(x):
    """The largest of ``x & 0x7FFFFFFF`` over fp32 bits ``x`` (NaN bits exceed every number's,
    so a NaN anywhere gives a NaN). The per-chunk loop is its own function: written inline in
    the ``prange`` body, Numba's reduction analysis fails on Python 3.12's bytecode
    ("unexpected cycle in lookup()")."""
    n = x.size
    chunk = 1 << 16
    parts = max((n + chunk - 1) // chunk, 1)
    results = np.zeros(parts, np.uint32)
    for p in prange(parts):
        results[p] = _amax_bits_range(x, p * chunk, min(n, p * chunk + chunk))
    return results.max()


@njit(forceinline=True, cache=True)
def quantize_block(x, data, scales, t, n, inner, block, tensor_scale, k0, k1, offset, params):
    """Block ``t`` (row-major over ``(outer, n // block, inner)``) of the fp32 patterns at
    address ``x``: its scale into the bytes at ``scales`` (element ``t``), its elements into
    the bytes at ``data``. ``params``: (m, e, kind, two_level, emax, max_mantissa, max_bits,
    packed, stochastic, ceil). Addresses, not arrays: the CUDA simulator cannot pass its
    arrays to an ``njit`` body."""
    m, e, kind, two_level, emax, max_mantissa, max_bits, packed, stochastic, ceil = params
    nb = n // block
    i = t % inner
    blk = (t // inner) % nb
    o = t // (inner * nb)
    base = (o * n + blk * block) * inner + i
    amax = 0
    for k in range(block):
        a = load_bits(x, base + k * inner, 32) & _F32_ABS
        if a > amax:
            amax = a
    if two_level:
        code, multiplier = nv_block_scale(amax, tensor_scale, ceil)
    else:
        code, multiplier = mx_scale(amax, emax, max_mantissa, ceil)
    store_bits(scales, t, code, 8)
    current = -1
    x0 = x1 = 0
    low = 0
    for k in range(block):
        idx = base + k * inner
        bits16 = 0
        if stochastic:
            ctr = offset + idx
            if (ctr >> 2) != current:
                current = ctr >> 2
                x0, x1 = random_block(k0, k1, current)
            bits16 = lane_bits16(x0, x1, ctr & 3)
        u = load_bits(x, idx, 32)
        h = block_element(u, multiplier, max_bits, bits16, stochastic, m, e, kind)
        if packed:
            if k & 1 == 0:
                low = h
            else:
                j = (o * (n >> 1) + ((blk * block + k) >> 1)) * inner + i
                store_bits(data, j, low | (h << 4), 8)
        else:
            store_bits(data, idx, h, 8)


@njit(parallel=True, cache=True)
def quantize_blocks_cpu(
    x, data, scales, count, n, inner, block, tensor_scale, k0, k1, offset, params
):
    """Every one of the ``count`` blocks (see ``quantize_block``)."""
    for t in prange(count):
        quantize_block(x, data, scales, t, n, inner, block, tensor_scale, k0, k1, offset, params)


@njit(forceinline=True, cache=True)
def dequantize_block(data, scales, out, t, n, inner, block, tensor_scale, params):
    """Block ``t`` (as in ``quantize_block``, addresses): out (fp32 patterns) = element *
    scale (NVFP4: scale = e4m3 block scale * tensor scale). ``params``: (m, e, kind,
    two_level, packed)."""
    m, e, kind, two_level, packed = params
    nb = n // block
    i = t % inner
    blk = (t // inner) % nb
    o = t // (inner * nb)
    base = (o * n + blk * block) * inner + i
    if two_level:
        scale = nv_scale_value(load_bits(scales, t, 8), tensor_scale)
    else:
        scale = mx_scale_value(load_bits(scales, t, 8))
    for k in range(block):
        idx = base + k * inner
        if packed:
            byte = load_bits(data, (o * (n >> 1) + ((blk * block + k) >> 1)) * inner + i, 8)
            h = (byte >> (4 * (k & 1))) & 0xF
        else:
            h = load_bits(data, idx, 8)
        store_bits(out, idx, element_value(h, scale, m, e, kind), 32)


@njit(parallel=True, cache=True)
def dequantize_blocks_cpu(data, scales, out, count, n, inner, block, tensor_scale, params):
    """Every one of the ``count`` blocks (see ``dequantize_block``)."""
    for t in prange(count):
        dequantize_block(data, scales, out, t, n, inner, block, tensor_scale, params)
