"""CUDA kernels of the block-scaled formats (``_blocks.py``): one thread per block, the block
bodies of ``_block_kernels.py`` in grid-stride loops. Imported on first CUDA use only."""

from __future__ import annotations

from . import _config
from ._block_kernels import dequantize_block, nv_tensor_scale, quantize_block
from ._numba_cuda_compat import import_numba_cuda
from ._tensor_list import address

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
def _quantize(x, data, scales, count, tensor, n, inner, block, k0, k1, offset, params):
    ts = tensor[0] if params[3] else 0  # two_level: NVFP4's tensor scale, computed on device
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for t in range(start, count, stride):
        quantize_block(x, data, scales, t, n, inner, block, ts, k0, k1, offset, params)


@cuda.jit(cache=True)
def _dequantize(data, scales, count, tensor, out, n, inner, block, params):
    ts = tensor[0] if params[3] else 0
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for t in range(start, count, stride):
        dequantize_block(data, scales, out, t, n, inner, block, ts, params)


def _grid(work: int) -> tuple[int, int]:
    threads = _config.CUDA_THREADS_PER_BLOCK
    return max(1, min(_config.CUDA_MAX_BLOCKS, -(-work // threads))), threads


def quantize(x, data, scales, tensor, n, inner, block, k0, k1, offset, params, *, stream):
    """Launch the block quantization; NVFP4 (``params[3]``) first reduces the tensor amax into
    ``tensor[0]`` and turns it into the tensor scale there (1.0 for an empty ``x``), all on
    ``stream`` (no host sync)."""
    if params[3]:
        tensor[:1].copy_to_device(_zero_word(tensor), stream=stream)
        if x.size:
            grid = _grid(x.size)
            _amax[grid[0], grid[1], stream](x, tensor)
        _tensor_scale[1, 1, stream](tensor)
    if not scales.size:
        return
    grid = _grid(scales.size)
    _quantize[grid[0], grid[1], stream](
        address(x),
        address(data),
        address(scales),
        scales.size,
        tensor,
        n,
        inner,
        block,
        k0,
        k1,
        offset,
        params,
    )


def dequantize(data, scales, tensor, out, n, inner, block, params, *, stream):
    if tensor is None:
        tensor = out[:1]  # unread (MX)
    grid = _grid(scales.size)
    _dequantize[grid[0], grid[1], stream](
        address(data), address(scales), scales.size, tensor, address(out), n, inner, block, params
    )


def _zero_word(like):
    import numpy as np

    return np.zeros(1, like.dtype)
