"""CUDA kernels of the block-scaled formats (``_blocks.py``): one thread per block, the scalar
bodies of ``_blocks.py`` in grid-stride loops. Imported on first CUDA use only."""

from __future__ import annotations

from . import _config
from ._block_kernels import (
    block_element,
    element_value,
    mx_scale,
    mx_scale_value,
    nv_block_scale,
    nv_scale_value,
    nv_tensor_scale,
)
from ._numba_cuda_compat import import_numba_cuda
from ._rng import lane_bits16, random_block

cuda = import_numba_cuda()
_F32_ABS = 0x7FFFFFFF


@cuda.jit(cache=True)
def _amax(x, result):
    """result[0] = max of x & 0x7FFFFFFF (atomic; NaN bits exceed every number's)."""
    start, stride = cuda.grid(1), cuda.gridsize(1)
    best = 0
    for j in range(start, x.size, stride):
        a = x[j] & _F32_ABS
        if a > best:
            best = a
    cuda.atomic.max(result, 0, best)


@cuda.jit(cache=True)
def _tensor_scale(tensor):
    """tensor[0]: the amax bits -> the fp32 bits of NVFP4's tensor scale (one thread)."""
    if cuda.grid(1) == 0:
        tensor[0] = nv_tensor_scale(tensor[0])


@cuda.jit(cache=True)
def _quantize(x, data, scales, tensor, n, inner, block, k0, k1, offset, params, flags):
    m, e, kind, two_level, emax, max_mantissa, max_bits, packed = params
    stochastic, ceil = flags
    ts = tensor[0] if two_level else 0
    start, stride = cuda.grid(1), cuda.gridsize(1)
    nb = n // block
    for t in range(start, scales.size, stride):
        i = t % inner
        blk = (t // inner) % nb
        o = t // (inner * nb)
        base = (o * n + blk * block) * inner + i
        amax = 0
        for k in range(block):
            a = x[base + k * inner] & _F32_ABS
            if a > amax:
                amax = a
        if two_level:
            code, multiplier = nv_block_scale(amax, ts, ceil)
        else:
            code, multiplier = mx_scale(amax, emax, max_mantissa, ceil)
        scales[t] = code
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
            h = block_element(x[idx], multiplier, max_bits, bits16, stochastic, m, e, kind)
            if packed:
                if k & 1 == 0:
                    low = h
                else:
                    data[(o * (n >> 1) + ((blk * block + k) >> 1)) * inner + i] = low | (h << 4)
            else:
                data[idx] = h


@cuda.jit(cache=True)
def _dequantize(data, scales, tensor, out, n, inner, block, params):
    m, e, kind, two_level, packed = params
    nb = n // block
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for t in range(start, scales.size, stride):
        i = t % inner
        blk = (t // inner) % nb
        o = t // (inner * nb)
        base = (o * n + blk * block) * inner + i
        if two_level:
            scale = nv_scale_value(scales[t], tensor[0])
        else:
            scale = mx_scale_value(scales[t])
        for k in range(block):
            idx = base + k * inner
            if packed:
                byte = data[(o * (n >> 1) + ((blk * block + k) >> 1)) * inner + i]
                h = (byte >> (4 * (k & 1))) & 0xF
            else:
                h = data[idx]
            out[idx] = element_value(h, scale, m, e, kind)


def _grid(work: int) -> tuple[int, int]:
    threads = _config.CUDA_THREADS_PER_BLOCK
    return max(1, min(_config.CUDA_MAX_BLOCKS, -(-work // threads))), threads


def quantize(x, data, scales, tensor, n, inner, block, k0, k1, offset, params, *, stream):
    """Launch the block quantization; NVFP4 (``params[3]``) first reduces the tensor amax into
    ``tensor[0]`` and turns it into the tensor scale there, all on ``stream`` (no host sync)."""
    *element, stochastic, ceil = params
    if element[3]:
        tensor[:1].copy_to_device(_zero_word(tensor), stream=stream)
        grid = _grid(x.size)
        _amax[grid[0], grid[1], stream](x, tensor)
        _tensor_scale[1, 1, stream](tensor)
    grid = _grid(scales.size)
    _quantize[grid[0], grid[1], stream](
        x,
        data,
        scales,
        tensor,
        n,
        inner,
        block,
        k0,
        k1,
        offset,
        tuple(element),
        (stochastic, ceil),
    )


def dequantize(data, scales, tensor, out, n, inner, block, params, *, stream):
    if tensor is None:
        tensor = out[:1]  # unread (MX)
    grid = _grid(scales.size)
    _dequantize[grid[0], grid[1], stream](data, scales, tensor, out, n, inner, block, params)


def _zero_word(like):
    import numpy as np

    return np.zeros(1, like.dtype)
