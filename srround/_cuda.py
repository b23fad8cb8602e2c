"""CUDA backend: every CUDA kernel of srround, grid-stride ``numba.cuda`` kernels around the
one-element bodies of ``_scalar.py`` and ``_elements.py``.

Imported only when a device array is seen, so ``import srround`` never initialises CUDA.
Buffers are Numba device arrays of bit patterns (unsigned words of the element width). Each
thread of a random kernel handles whole counter blocks of four elements (one Threefry call,
``_rng.py``). When a call is block-aligned (``offset % 4 == 0``, 8-byte aligned pointers, 2-byte
narrow elements) the ``vec4`` kernels move four elements per thread with 8-byte loads and stores
(``uint64`` views: two fp32 words, or four narrow words); the remainder goes through the
``general`` kernels. Results never depend on the launch configuration.

Kernels run on the stream the caller passes (the adapters pass the framework's current stream).
"""

from __future__ import annotations

import collections
import threading

import numpy as np
from numba import njit

from . import _config
from ._elements import (
    ADAMW,
    AUX_ADDR,
    G_ADDR,
    G_FMT,
    GROUP,
    NOISE,
    NOISE_RUN,
    NOISE_SKIP,
    P_ADDR,
    P_FMT,
    S1_ADDR,
    S1_SCALE,
    S2_ADDR,
    S2_SCALE,
    STATE1_ALL,
    STATE1_SOME,
    group_constants,
    prepare_coefs,
    run_noise,
    scale_usable,
    state1_presence,
    step_element,
    unscale_in_place,
    update_scale_one,
)
from ._numba_cuda_compat import import_numba_cuda
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
from ._state8 import update_block8
from ._tensor_list import address, find_tensor

cuda = import_numba_cuda()

# the simulator cannot pass device arrays into njit functions: the same body as a device function
_find_tensor = cuda.jit(device=True)(find_tensor.py_func)


@cuda.jit(device=True)
def _block_range(total):
    """``(first, end)``: the contiguous element range of this block in a tensor-list kernel
    (its threads stride through it by the block, so a thread's tensor index only moves
    forward: one binary search per thread, not one per element)."""
    chunk = (total + cuda.gridDim.x - 1) // cuda.gridDim.x
    first = cuda.blockIdx.x * chunk
    return first, min(first + chunk, total)


# the element-wise operations; each has a general and a vec4 kernel (``_make_kernels``)
_ROUND, _ADD, _NEAREST, _WIDEN = range(4)


@njit(forceinline=True, cache=True)
def _narrow_op(op, old, u, alpha, bits16, mantissa_bits, exponent_bits, saturate, kind=0):
    """The narrow result of ``op`` for fp32 pattern ``u`` (and narrow ``old``, for _ADD);
    ``kind``: the format's ``specials`` code."""
    if op == _ADD:
        return add_stochastic(old, u, alpha, bits16, mantissa_bits, exponent_bits, saturate, kind)
    if op == _ROUND:
        return encode_stochastic(u, bits16, mantissa_bits, exponent_bits, saturate, kind)
    return encode_nearest(u, mantissa_bits, exponent_bits, saturate, kind)


def _make_kernels(op):
    """``(general, vec4)`` kernels of one operation, both called as
    ``kernel(src, dst, alpha, k0, k1, offset, mantissa_bits, exponent_bits, saturate[, kind])``
    (``general`` takes the format's ``specials`` code ``kind``; ``vec4`` only 16-bit formats,
    IEEE-like).

    ``_ROUND``: ``dst = SR(src)``; ``_ADD``: ``dst = SR(dst + alpha * src)``; ``_NEAREST``:
    ``dst = RNE(src)`` (src fp32, dst narrow); ``_WIDEN``: ``dst = fp32(src)`` (src narrow).
    Unused arguments are ignored. ``vec4`` takes ``uint64`` views and, as its ``offset``, the
    first counter block (``offset >> 2`` of an aligned call).
    """
    random = op in (_ROUND, _ADD)

    @cuda.jit(cache=True)
    def general(src, dst, alpha, k0, k1, offset, mantissa_bits, exponent_bits, saturate, kind):
        n = src.size
        start, stride = cuda.grid(1), cuda.gridsize(1)
        if random:
            first = offset >> 2
            nblocks = ((offset + n - 1) >> 2) - first + 1
            for b in range(start, nblocks, stride):
                block = first + b
                x0, x1 = random_block(k0, k1, block)
                for lane in range(4):
                    i = block * 4 + lane - offset
                    if 0 <= i < n:
                        old = dst[i] if op == _ADD else 0
                        dst[i] = _narrow_op(
                            op,
                            old,
                            src[i],
                            alpha,
                            lane_bits16(x0, x1, lane),
                            mantissa_bits,
                            exponent_bits,
                            saturate,
                            kind,
                        )
        elif op == _WIDEN:
            for i in range(start, n, stride):
                dst[i] = decode(src[i], mantissa_bits, exponent_bits, kind)
        else:
            for i in range(start, n, stride):
                dst[i] = encode_nearest(src[i], mantissa_bits, exponent_bits, saturate, kind)

    @cuda.jit(cache=True)
    def vec4(src, dst, alpha, k0, k1, first, mantissa_bits, exponent_bits, saturate):
        m, e, sat = mantissa_bits, exponent_bits, saturate
        start, stride = cuda.grid(1), cuda.gridsize(1)
        if op == _WIDEN:  # src: four narrow words per uint64, dst: fp32 pairs
            for b in range(start, src.size, stride):
                word = src[b]
                dst[2 * b] = pack2(
                    decode(unpack(word, 0, 16), m, e), decode(unpack(word, 1, 16), m, e)
                )
                dst[2 * b + 1] = pack2(
                    decode(unpack(word, 2, 16), m, e), decode(unpack(word, 3, 16), m, e)
                )
            return
        for b in range(start, dst.size, stride):  # src: fp32 pairs, dst: four narrow words
            x0 = x1 = 0
            if random:
                x0, x1 = random_block(k0, k1, first + b)
            old = dst[b] if op == _ADD else np.uint64(0)  # only _ADD reads dst
            lo = src[2 * b]
            hi = src[2 * b + 1]
            dst[b] = pack4(
                _narrow_op(
                    op, unpack(old, 0, 16), unpack(lo, 0, 32), alpha, unpack(x0, 0, 16), m, e, sat
                ),
                _narrow_op(
                    op, unpack(old, 1, 16), unpack(lo, 1, 32), alpha, unpack(x0, 1, 16), m, e, sat
                ),
                _narrow_op(
                    op, unpack(old, 2, 16), unpack(hi, 0, 32), alpha, unpack(x1, 0, 16), m, e, sat
                ),
                _narrow_op(
                    op, unpack(old, 3, 16), unpack(hi, 1, 32), alpha, unpack(x1, 1, 16), m, e, sat
                ),
            )

    return general, vec4


_KERNELS = {op: _make_kernels(op) for op in (_ROUND, _ADD, _NEAREST, _WIDEN)}
_stochastic_round_general, _stochastic_round_vec4 = _KERNELS[_ROUND]
_stochastic_add_general, _stochastic_add_vec4 = _KERNELS[_ADD]
_round_nearest_general, _round_nearest_vec4 = _KERNELS[_NEAREST]
_to_float32_general, _to_float32_vec4 = _KERNELS[_WIDEN]


_NO_ALPHA = np.float32(0.0)  # the alpha argument of operations without one


def _grid(work_items: int) -> tuple[int, int]:
    threads = _config.CUDA_THREADS_PER_BLOCK
    blocks = max(1, min(_config.CUDA_MAX_BLOCKS, -(-work_items // threads)))
    return blocks, threads


def _vec4_head(n: int, offset: int, narrow, *arrays) -> int:
    """Number of leading elements the vec4 kernels can take (a multiple of 4), 0 if none:
    block-aligned calls on 8-byte aligned buffers whose narrow elements are 2 bytes."""
    if offset % 4 or narrow.dtype.itemsize != 2 or any(address(a) % 8 for a in arrays):
        return 0
    return n - n % 4


def _run(
    op,
    src,
    dst,
    narrow,
    alpha,
    k0,
    k1,
    offset,
    mantissa_bits,
    exponent_bits,
    saturate,
    kind,
    stream,
):
    """Launch ``op`` over ``src.size`` elements: vec4 on the aligned head, general on the rest."""
    general, vec4 = _KERNELS[op]
    n = src.size
    head = _vec4_head(n, offset, narrow, src, dst)
    fields = (mantissa_bits, exponent_bits, saturate)
    if head:
        grid = _grid(head // 4)
        whole = head == n  # the usual case: no slices (a device-array slice costs host time)
        vec4[grid[0], grid[1], stream](
            (src if whole else src[:head]).view("uint64"),
            (dst if whole else dst[:head]).view("uint64"),
            alpha,
            k0,
            k1,
            offset >> 2,
            *fields,
        )
    if head < n:
        grid = _grid((n - head) // 4 + 2 if op in (_ROUND, _ADD) else n - head)
        general[grid[0], grid[1], stream](
            src[head:], dst[head:], alpha, k0, k1, offset + head, *fields, kind
        )


def stochastic_round(
    x, out, alpha, k0, k1, offset, mantissa_bits, exponent_bits, saturate, kind=0, *, stream
):
    """``out = SR(x)`` (fp32 patterns to narrow ones); ``alpha`` unused (the CPU signature)."""
    fields = (mantissa_bits, exponent_bits, saturate, kind)
    _run(_ROUND, x, out, out, alpha, k0, k1, offset, *fields, stream)


def stochastic_add(
    u, w, alpha, k0, k1, offset, mantissa_bits, exponent_bits, saturate, kind=0, *, stream
):
    """``w = SR(w + alpha * u)`` in place (``u`` fp32 patterns, ``w`` narrow ones)."""
    _run(_ADD, u, w, w, alpha, k0, k1, offset, mantissa_bits, exponent_bits, saturate, kind, stream)


def round_nearest(x, out, mantissa_bits, exponent_bits, saturate, kind=0, *, stream):
    """``out = RNE(x)`` (fp32 patterns to narrow ones)."""
    fields = (mantissa_bits, exponent_bits, saturate, kind)
    _run(_NEAREST, x, out, out, _NO_ALPHA, 0, 0, 0, *fields, stream)


def to_float32(h, out, mantissa_bits, exponent_bits, kind=0, *, stream):
    """``out = fp32(h)`` (narrow patterns to fp32 ones, exact)."""
    _run(_WIDEN, h, out, h, _NO_ALPHA, 0, 0, 0, mantissa_bits, exponent_bits, False, kind, stream)


@cuda.jit(cache=True)
def _max_byte(h, result):
    """result[0] = the largest of the bytes ``h`` (atomic)."""
    start, stride = cuda.grid(1), cuda.gridsize(1)
    best = np.uint32(0)
    for j in range(start, h.size, stride):
        best = max(best, np.uint32(h[j]))
    cuda.atomic.max(result, 0, best)


def max_byte(h, *, stream) -> int:
    """The largest of the bytes ``h`` (a device array), read back to the host (a sync)."""
    result = cuda.to_device(np.zeros(1, np.uint32), stream=stream)
    grid = _grid(h.size)
    _max_byte[grid[0], grid[1], stream](h, result)
    return int(result.copy_to_host(stream=stream)[0])


# -- loss scaling (tensor lists through a pointer table, see _tensor_list.py) -----------------


def _make_unscale(fixed_code):
    """The unscale-and-check kernel, the gradients' format a constant where every tensor of
    the list has the same (``fixed_code``; -1: per tensor, from the table). A thread reads a
    tensor's entries once, not per element (its stores through raw addresses would make the
    compiler read them again)."""

    @cuda.jit(cache=True)
    def unscale(addresses, formats, starts, inv_scales, found, per_tensor):
        first, end = _block_range(starts[starts.size - 1])
        lead = first + cuda.threadIdx.x
        if lead >= end:
            return
        shared = inv_scales.size == 1  # one scale for every tensor
        k = _find_tensor(starts, lead)
        address, code, start, stop = addresses[k], formats[k], starts[k], starts[k + 1]
        slot = k if per_tensor else 0
        scale = inv_scales[0 if shared else slot]
        for i in range(lead, end, cuda.blockDim.x):
            if i >= stop:
                while i >= starts[k + 1]:
                    k += 1
                address, code, start, stop = addresses[k], formats[k], starts[k], starts[k + 1]
                slot = k if per_tensor else 0
                scale = inv_scales[0 if shared else slot]
            fmt = fixed_code if fixed_code >= 0 else code
            if not unscale_in_place(address, fmt, i - start, scale):
                found[slot] = 0x3F800000  # 1.0f

    return unscale


_UNSCALES: dict = {}


def _unscale_kernel(formats):
    """``_make_unscale``'s kernel for the host array ``formats``, built once per process."""
    fixed = int(formats[0]) if len(formats) and (formats == formats[0]).all() else -1
    if fixed not in _UNSCALES:
        _UNSCALES[fixed] = _make_unscale(fixed)
    return _UNSCALES[fixed]


@cuda.jit(cache=True)
def _update_scale(scale, growth_tracker, overflow_tracker, found, factors):
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for k in range(start, scale.size, stride):
        scale[k], growth_tracker[k], overflow_tracker[k] = update_scale_one(
            scale[k], growth_tracker[k], overflow_tracker[k], found[k], *factors
        )


_TABLES: collections.OrderedDict = collections.OrderedDict()  # see _device_table
_TABLES_LOCK = threading.Lock()


def _device_table(arrays):
    """Device copies of a tensor list's host table (int64 arrays), of the last
    ``_config.CUDA_TABLES_KEPT`` tables: a training loop passes the same table every step, and
    each copy costs an allocation and a transfer. A new table is copied and synchronized once,
    so that any stream may read it. ``arrays``: NumPy arrays (a device array has no bytes to
    key the cache with: on a GPU an AttributeError, in the simulator a silent host read)."""
    if not all(isinstance(a, np.ndarray) for a in arrays):
        raise TypeError("_device_table: the host table's NumPy arrays, not device arrays")
    device = getattr(cuda.get_current_device(), "id", 0)  # (the simulator's has none)
    key = (device, *(a.tobytes() for a in arrays))
    with _TABLES_LOCK:
        table = _TABLES.get(key)
        if table is not None:
            _TABLES.move_to_end(key)
            return table
    table = [cuda.to_device(a) for a in arrays]
    cuda.synchronize()
    with _TABLES_LOCK:
        _TABLES[key] = table
        while len(_TABLES) > _config.CUDA_TABLES_KEPT:
            _TABLES.popitem(last=False)
    return table


def unscale_and_check(
    addresses, formats, starts, inv_scales, found, per_tensor, *, total, stream, device_table=None
):
    """``total``: elements over all tensors; ``addresses``, ``formats``, ``starts``: the host
    table, copied over (cached, ``_device_table``) unless ``device_table`` holds the device
    copies the caller keeps."""
    table = (
        device_table if device_table is not None else _device_table((addresses, formats, starts))
    )
    grid = _grid(total)
    kernel = _unscale_kernel(formats)
    kernel[grid[0], grid[1], stream](*table, inv_scales, found, per_tensor)


def update_scale(scale, growth_tracker, overflow_tracker, found, factors, *, stream):
    grid = _grid(scale.size)
    _update_scale[grid[0], grid[1], stream](scale, growth_tracker, overflow_tracker, found, factors)


# -- fused optimizer steps (tables of _elements.Column) ---------------------------------------


@cuda.jit(cache=True)
def _optim_prepare(kind, table, hyper, steps, coefs, inv_scale, sign, found):
    k = cuda.grid(1)
    if k >= steps.size:
        return
    if not scale_usable(inv_scale[0] ^ sign):  # every thread reads the same verdict
        found[0] = 0x3F800000  # 1.0f: ``_optim_step`` then skips
    elif (found[0] & 0x7FFFFFFF) == 0:
        steps[k] += 1
        g = table[k, GROUP]
        coefs[k, 0], coefs[k, 1], coefs[k, 2], coefs[k, 3] = prepare_coefs(
            kind, steps[k], hyper[g, 0], hyper[g, 1], hyper[g, 2], hyper[g, 3], hyper[g, 4]
        )


@cuda.jit(device=True)
def _buffers(table, k):
    """Row ``k``'s buffers: parameter, gradient, state and aux addresses and the two formats,
    in ``Column`` order (the first seven columns)."""
    return (
        table[k, P_ADDR],
        table[k, P_FMT],
        table[k, G_ADDR],
        table[k, G_FMT],
        table[k, S1_ADDR],
        table[k, S2_ADDR],
        table[k, AUX_ADDR],
    )


@cuda.jit(device=True)
def _tensor_constants(table, starts, hyper, steps, coefs, k, kind):
    """What the elements of tensor ``k`` share, read once per tensor a thread reaches (its
    element loop stores through raw addresses, which could alias these arrays: read inside
    that loop, every one would be read again per element): ``(buffers, formats, state1,
    noise (``NOISE``, ``NOISE_RUN``, ``NOISE_SKIP``), start, end, step, coefs, group)``."""
    g = table[k, GROUP]
    buffers = (
        table[k, P_ADDR],
        table[k, G_ADDR],
        table[k, S1_ADDR],
        table[k, S2_ADDR],
        table[k, AUX_ADDR],
    )
    c = (coefs[k, 0], coefs[k, 1], coefs[k, 2])
    group = group_constants(kind, hyper[g, 1], hyper[g, 2], hyper[g, 3], hyper[g, 4])
    return (
        buffers,
        (table[k, P_FMT], table[k, G_FMT]),
        table[k, S1_ADDR] != 0,
        (table[k, NOISE], table[k, NOISE_RUN], table[k, NOISE_SKIP]),
        starts[k],
        starts[k + 1],
        steps[k],
        c,
        group,
    )


def _make_step(kind, mode, state_fmt, state1, formats):
    """The CUDA step kernel of one configuration: kind, weight mode, state format, which
    tensors have a first state (``state1_presence``) and the parameter and gradient formats
    (``(-1, -1)``: per tensor, from the table) are constants the compiler folds (closure
    variables), as in the CPU's steps: the generic kernel carried every branch of every
    configuration. Each block takes a contiguous range of elements, its threads one element at
    a time (a warp's loads consecutive), and a thread reads a tensor's row once."""
    fixed_p, fixed_g = formats

    @cuda.jit(cache=True)
    def step(table, starts, hyper, steps, coefs, inv_scale, found, k0, k1):
        if found[0] & 0x7FFFFFFF:
            return
        first, end = _block_range(starts[starts.size - 1])
        lead = first + cuda.threadIdx.x
        if lead >= end:
            return
        k = _find_tensor(starts, lead)
        buffers, fmts, some1, noise, start, stop, count, c, group = _tensor_constants(
            table, starts, hyper, steps, coefs, k, kind
        )
        scale_bits = inv_scale[0]
        for i in range(lead, end, cuda.blockDim.x):
            if i >= stop:
                while i >= starts[k + 1]:
                    k += 1
                buffers, fmts, some1, noise, start, stop, count, c, group = _tensor_constants(
                    table, starts, hyper, steps, coefs, k, kind
                )
            p_fmt = fixed_p if fixed_p >= 0 else fmts[0]
            g_fmt = fixed_g if fixed_g >= 0 else fmts[1]
            has_state1 = some1 if state1 == STATE1_SOME else state1 == STATE1_ALL
            step_element(
                kind,
                mode,
                (p_fmt, g_fmt, state_fmt),
                buffers,
                has_state1,
                i - start,
                run_noise(noise[0], noise[1], noise[2], i - start),
                count,
                scale_bits,
                c,
                group,
                (k0, k1),
            )

    return step


_STEPS: dict = {}


def optim_step_kernel(kind, mode, state_fmt, table):
    """The compiled CUDA step for the host ``table``'s configuration, built once per process
    (and kept in Numba's cache)."""
    p_fmt, g_fmt = np.asarray(table)[:, P_FMT], np.asarray(table)[:, G_FMT]
    uniform = len(p_fmt) and (p_fmt == p_fmt[0]).all() and (g_fmt == g_fmt[0]).all()
    formats = (int(p_fmt[0]), int(g_fmt[0])) if uniform else (-1, -1)
    key = (int(kind), int(mode), int(state_fmt), state1_presence(table), formats)
    if key not in _STEPS:
        _STEPS[key] = _make_step(*key)
    return _STEPS[key]


def optim_step(
    kernel,
    kind,
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
    sign,
    total,
    stream,
):
    """Both passes of one fused step over ``total`` elements; every array on the device;
    ``kernel``: ``optim_step_kernel``'s for this table. ``sign``: the sign bit an
    ``inv_scale`` must have (0, or 0x80000000 for a negated one), else ``found`` is set to 1.0
    and nothing changes."""
    grid = _grid(steps.size)
    _optim_prepare[grid[0], grid[1], stream](
        kind, table, hyper, steps, coefs, inv_scale, sign, found
    )
    grid = _grid(total)
    kernel[grid[0], grid[1], stream](table, starts, hyper, steps, coefs, inv_scale, found, k0, k1)


@cuda.jit(cache=True)
def _optim_step8(
    mode, state_fmt, table, starts, bstarts, hyper, steps, coefs, inv_scale, found, k0, k1
):
    if found[0] & 0x7FFFFFFF:
        return
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for t in range(start, bstarts[bstarts.size - 1], stride):
        k = _find_tensor(bstarts, t)
        g = table[k, GROUP]
        update_block8(
            mode,
            state_fmt,
            # the row, in _state8's order
            _buffers(table, k) + (table[k, NOISE], table[k, S1_SCALE], table[k, S2_SCALE]),
            t - bstarts[k],
            starts[k + 1] - starts[k],
            steps[k],
            inv_scale[0],
            (coefs[k, 0], coefs[k, 1], coefs[k, 2]),
            (hyper[g, 1], hyper[g, 2], hyper[g, 3], hyper[g, 4]),
            (k0, k1),
            0,  # no random words: drawn in the body
            0,  # no decode table: decoded in the body
        )


def optim_step8(mode, state_fmt, table, starts, bstarts, *args, sign, blocks, stream):
    """An AdamW step with fp8 states (``_state8``): the prepare pass (``sign`` as in
    ``optim_step``), then one thread per block of ``_state8.STATE_BLOCK`` elements (``blocks``
    in all); every array on the device; ``args``: ``(hyper, steps, coefs, inv_scale, found,
    k0, k1)``."""
    hyper, steps, coefs, inv_scale, found = args[:5]
    grid = _grid(steps.size)
    _optim_prepare[grid[0], grid[1], stream](
        ADAMW, table, hyper, steps, coefs, inv_scale, sign, found
    )
    grid = _grid(blocks)
    _optim_step8[grid[0], grid[1], stream](mode, state_fmt, table, starts, bstarts, *args)
