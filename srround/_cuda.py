"""CUDA backend: the scalar bodies of ``_scalar.py`` in grid-stride ``numba.cuda`` kernels.

Imported only when a device array is seen (``_api._launch``), so ``import srround`` never
initialises CUDA. Buffers are Numba device arrays of bit patterns (fp32 as ``uint32``, narrow
formats as ``uint16``). Each thread handles whole counter blocks of four elements (one Threefry
call, ``_rng.py``). When a call is block-aligned (``offset % 4 == 0``, 8-byte aligned pointers)
the fast kernels move four elements per thread with 8-byte loads and stores (``uint64`` views:
two fp32 words, or four narrow words); the remainder goes through the general kernels. Results
never depend on the launch configuration.

Kernels run on the stream the caller passes (the adapters pass the framework's current stream).
"""

from __future__ import annotations

from . import _config
from ._loss_scale import unscale_in_place, update_one
from ._numba_cuda_compat import import_numba_cuda
from ._optim import GROUP, prepare_coefs, step_element
from ._rng import lane_bits16, random_block
from ._scalar import (
    add_stochastic,
    decode,
    encode_nearest,
    encode_stochastic,
    pack2,
    pack4,
    unpack,
)
from ._tensor_list import address

cuda = import_numba_cuda()


@cuda.jit(cache=True)
def _stochastic_round_general(x, out, k0, k1, offset, mantissa_bits, exponent_bits, saturate):
    n = x.size
    first = offset >> 2
    nblocks = ((offset + n - 1) >> 2) - first + 1
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for b in range(start, nblocks, stride):
        block = first + b
        x0, x1 = random_block(k0, k1, block)
        for lane in range(4):
            i = block * 4 + lane - offset
            if 0 <= i < n:
                r16 = lane_bits16(x0, x1, lane)
                out[i] = encode_stochastic(x[i], r16, mantissa_bits, exponent_bits, saturate)


@cuda.jit(cache=True)
def _stochastic_round_vec4(x2, out4, k0, k1, first, mantissa_bits, exponent_bits, saturate):
    """x2: uint64[n/2] (fp32 pairs), out4: uint64[n/4] (four narrow words); block-aligned."""
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for b in range(start, out4.size, stride):
        x0, x1 = random_block(k0, k1, first + b)
        lo = x2[2 * b]
        hi = x2[2 * b + 1]
        m, e, sat = mantissa_bits, exponent_bits, saturate
        out4[b] = pack4(
            encode_stochastic(unpack(lo, 0, 32), unpack(x0, 0, 16), m, e, sat),
            encode_stochastic(unpack(lo, 1, 32), unpack(x0, 1, 16), m, e, sat),
            encode_stochastic(unpack(hi, 0, 32), unpack(x1, 0, 16), m, e, sat),
            encode_stochastic(unpack(hi, 1, 32), unpack(x1, 1, 16), m, e, sat),
        )


@cuda.jit(cache=True)
def _stochastic_add_general(w, u, alpha, k0, k1, offset, mantissa_bits, exponent_bits, saturate):
    n = w.size
    first = offset >> 2
    nblocks = ((offset + n - 1) >> 2) - first + 1
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for b in range(start, nblocks, stride):
        block = first + b
        x0, x1 = random_block(k0, k1, block)
        for lane in range(4):
            i = block * 4 + lane - offset
            if 0 <= i < n:
                r16 = lane_bits16(x0, x1, lane)
                w[i] = add_stochastic(
                    w[i], u[i], alpha, r16, mantissa_bits, exponent_bits, saturate
                )


@cuda.jit(cache=True)
def _stochastic_add_vec4(w4, u2, alpha, k0, k1, first, mantissa_bits, exponent_bits, saturate):
    """w4: uint64[n/4] (four narrow words, updated in place), u2: uint64[n/2] (fp32 pairs)."""
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for b in range(start, w4.size, stride):
        x0, x1 = random_block(k0, k1, first + b)
        old = w4[b]
        lo = u2[2 * b]
        hi = u2[2 * b + 1]
        m, e, sat = mantissa_bits, exponent_bits, saturate
        w4[b] = pack4(
            add_stochastic(
                unpack(old, 0, 16), unpack(lo, 0, 32), alpha, unpack(x0, 0, 16), m, e, sat
            ),
            add_stochastic(
                unpack(old, 1, 16), unpack(lo, 1, 32), alpha, unpack(x0, 1, 16), m, e, sat
            ),
            add_stochastic(
                unpack(old, 2, 16), unpack(hi, 0, 32), alpha, unpack(x1, 0, 16), m, e, sat
            ),
            add_stochastic(
                unpack(old, 3, 16), unpack(hi, 1, 32), alpha, unpack(x1, 1, 16), m, e, sat
            ),
        )


@cuda.jit(cache=True)
def _round_nearest_general(x, out, mantissa_bits, exponent_bits, saturate):
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, x.size, stride):
        out[i] = encode_nearest(x[i], mantissa_bits, exponent_bits, saturate)


@cuda.jit(cache=True)
def _round_nearest_vec4(x2, out4, mantissa_bits, exponent_bits, saturate):
    """x2: uint64[n/2] (fp32 pairs), out4: uint64[n/4] (four narrow words)."""
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for b in range(start, out4.size, stride):
        lo = x2[2 * b]
        hi = x2[2 * b + 1]
        m, e, sat = mantissa_bits, exponent_bits, saturate
        out4[b] = pack4(
            encode_nearest(unpack(lo, 0, 32), m, e, sat),
            encode_nearest(unpack(lo, 1, 32), m, e, sat),
            encode_nearest(unpack(hi, 0, 32), m, e, sat),
            encode_nearest(unpack(hi, 1, 32), m, e, sat),
        )


@cuda.jit(cache=True)
def _to_float32_general(h, out, mantissa_bits, exponent_bits):
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, h.size, stride):
        out[i] = decode(h[i], mantissa_bits, exponent_bits)


@cuda.jit(cache=True)
def _to_float32_vec4(h4, out2, mantissa_bits, exponent_bits):
    """h4: uint64[n/4] (four narrow words), out2: uint64[n/2] (fp32 pairs)."""
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for b in range(start, h4.size, stride):
        word = h4[b]
        out2[2 * b] = pack2(
            decode(unpack(word, 0, 16), mantissa_bits, exponent_bits),
            decode(unpack(word, 1, 16), mantissa_bits, exponent_bits),
        )
        out2[2 * b + 1] = pack2(
            decode(unpack(word, 2, 16), mantissa_bits, exponent_bits),
            decode(unpack(word, 3, 16), mantissa_bits, exponent_bits),
        )


def _grid(work_items: int) -> tuple[int, int]:
    threads = _config.CUDA_THREADS_PER_BLOCK
    blocks = max(1, min(_config.CUDA_MAX_BLOCKS, -(-work_items // threads)))
    return blocks, threads


def _aligned(*arrays) -> bool:
    """True when every buffer starts on an 8-byte boundary (needed by the uint64 views)."""
    return all(address(a) % 8 == 0 for a in arrays)


def _split_aligned(n: int, offset: int) -> int:
    """Number of leading elements the vec4 kernels can take (a multiple of 4), 0 if none."""
    return n - n % 4 if offset % 4 == 0 else 0


def stochastic_round(x, out, k0, k1, offset, mantissa_bits, exponent_bits, saturate, stream):
    n = x.size
    head = _split_aligned(n, offset) if _aligned(x, out) else 0
    if head:
        grid = _grid(head // 4)
        _stochastic_round_vec4[grid[0], grid[1], stream](
            x[:head].view("uint64"),
            out[:head].view("uint64"),
            k0,
            k1,
            offset >> 2,
            mantissa_bits,
            exponent_bits,
            saturate,
        )
    if head < n:
        grid = _grid((n - head) // 4 + 2)
        _stochastic_round_general[grid[0], grid[1], stream](
            x[head:], out[head:], k0, k1, offset + head, mantissa_bits, exponent_bits, saturate
        )


def stochastic_add(w, u, alpha, k0, k1, offset, mantissa_bits, exponent_bits, saturate, stream):
    n = w.size
    head = _split_aligned(n, offset) if _aligned(w, u) else 0
    if head:
        grid = _grid(head // 4)
        _stochastic_add_vec4[grid[0], grid[1], stream](
            w[:head].view("uint64"),
            u[:head].view("uint64"),
            alpha,
            k0,
            k1,
            offset >> 2,
            mantissa_bits,
            exponent_bits,
            saturate,
        )
    if head < n:
        grid = _grid((n - head) // 4 + 2)
        _stochastic_add_general[grid[0], grid[1], stream](
            w[head:],
            u[head:],
            alpha,
            k0,
            k1,
            offset + head,
            mantissa_bits,
            exponent_bits,
            saturate,
        )


def round_nearest(x, out, mantissa_bits, exponent_bits, saturate, stream):
    n = x.size
    head = _split_aligned(n, 0) if _aligned(x, out) else 0
    if head:
        grid = _grid(head // 4)
        _round_nearest_vec4[grid[0], grid[1], stream](
            x[:head].view("uint64"),
            out[:head].view("uint64"),
            mantissa_bits,
            exponent_bits,
            saturate,
        )
    if head < n:
        grid = _grid(n - head)
        _round_nearest_general[grid[0], grid[1], stream](
            x[head:], out[head:], mantissa_bits, exponent_bits, saturate
        )


def to_float32(h, out, mantissa_bits, exponent_bits, stream):
    n = h.size
    head = _split_aligned(n, 0) if _aligned(h, out) else 0
    if head:
        grid = _grid(head // 4)
        _to_float32_vec4[grid[0], grid[1], stream](
            h[:head].view("uint64"), out[:head].view("uint64"), mantissa_bits, exponent_bits
        )
    if head < n:
        grid = _grid(n - head)
        _to_float32_general[grid[0], grid[1], stream](
            h[head:], out[head:], mantissa_bits, exponent_bits
        )


# -- loss scaling (tensor lists through a pointer table, see _tensor_list.py) -----------------


@cuda.jit(cache=True)
def _unscale_and_check(addresses, formats, starts, inv_scales, found, per_tensor):
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, starts[starts.size - 1], stride):
        # _tensor_list.find_tensor, written out: the simulator cannot pass device arrays into
        # njit functions, and a device function here would need a GPU to compile PTX in tests
        k, hi = 0, starts.size - 2
        while k < hi:
            mid = (k + hi + 1) >> 1
            if starts[mid] <= i:
                k = mid
            else:
                hi = mid - 1
        slot = k if per_tensor else 0
        if not unscale_in_place(addresses[k], formats[k], i - starts[k], inv_scales[slot]):
            found[slot] = 0x3F800000  # 1.0f


@cuda.jit(cache=True)
def _update_scale(
    scale,
    growth_tracker,
    overflow_tracker,
    found,
    growth_factor,
    backoff_factor,
    growth_interval,
    hysteresis,
    min_scale,
    max_scale,
):
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for k in range(start, scale.size, stride):
        scale[k], growth_tracker[k], overflow_tracker[k] = update_one(
            scale[k],
            growth_tracker[k],
            overflow_tracker[k],
            found[k],
            growth_factor,
            backoff_factor,
            growth_interval,
            hysteresis,
            min_scale,
            max_scale,
        )


def unscale_and_check(addresses, formats, starts, inv_scales, found, per_tensor, *, total, stream):
    """``total``: elements over all tensors; table arrays on the host are copied over."""
    table = [cuda.to_device(a, stream=stream) for a in (addresses, formats, starts)]
    grid = _grid(total)
    _unscale_and_check[grid[0], grid[1], stream](*table, inv_scales, found, per_tensor)


def update_scale(scale, growth_tracker, overflow_tracker, found, *factors, stream):
    grid = _grid(scale.size)
    _update_scale[grid[0], grid[1], stream](
        scale, growth_tracker, overflow_tracker, found, *factors
    )


# -- fused optimizer steps (tables of _optim.py) -----------------------------------------------


@cuda.jit(cache=True)
def _optim_prepare(kind, table, hyper, steps, coefs, found):
    k = cuda.grid(1)
    if k < steps.size and (found[0] & 0x7FFFFFFF) == 0:
        steps[k] += 1
        g = table[k, GROUP]
        coefs[k, 0], coefs[k, 1], coefs[k, 2], coefs[k, 3] = prepare_coefs(
            kind, steps[k], hyper[g, 0], hyper[g, 1], hyper[g, 2], hyper[g, 3], hyper[g, 4]
        )


@cuda.jit(cache=True)
def _optim_step(
    kind, mode, state_fmt, table, starts, hyper, steps, coefs, inv_scale, found, k0, k1
):
    if found[0] & 0x7FFFFFFF:
        return
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, starts[starts.size - 1], stride):
        k, hi = 0, starts.size - 2  # _tensor_list.find_tensor, written out (see above)
        while k < hi:
            mid = (k + hi + 1) >> 1
            if starts[mid] <= i:
                k = mid
            else:
                hi = mid - 1
        g = table[k, 7]
        step_element(
            kind,
            mode,
            state_fmt,
            table[k, 0],
            table[k, 1],
            table[k, 2],
            table[k, 3],
            table[k, 4],
            table[k, 5],
            table[k, 6],
            i - starts[k],
            table[k, 8],
            steps[k],
            inv_scale[0],
            coefs[k, 0],
            coefs[k, 1],
            coefs[k, 2],
            hyper[g, 1],
            hyper[g, 2],
            hyper[g, 3],
            hyper[g, 4],
            k0,
            k1,
        )


def optim_step(
    kind,
    mode,
    state_fmt,
    table,
    starts,
    hyper,
    steps,
    coefs,
    inv_scale,
    found,
    k0,
    k1,
    *,
    total,
    stream,
):
    """Both passes of one fused step over ``total`` elements; every array on the device."""
    grid = _grid(steps.size)
    _optim_prepare[grid[0], grid[1], stream](kind, table, hyper, steps, coefs, found)
    grid = _grid(total)
    _optim_step[grid[0], grid[1], stream](
        kind, mode, state_fmt, table, starts, hyper, steps, coefs, inv_scale, found, k0, k1
    )
