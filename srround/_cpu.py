"""CPU backend: every CPU loop of srround, ``prange`` loops over all cores around the
one-element bodies of ``_scalar.py`` and ``_elements.py``.

Buffers are flat, C-contiguous NumPy arrays of bit patterns: unsigned words of the element
width (fp32 as ``uint32``, bf16/fp16 as ``uint16``, fp8/fp4 as ``uint8``); tensor-list kernels
take pointer tables (``_tensor_list.py``). ``kind`` is a format's ``specials`` code
(``_scalar.IEEE``, ``FN``, ``FINITE``).

The random kernels work in chunks of counter blocks (four elements per Threefry block, see
``_rng.py``). Each chunk first fills a small buffer with its blocks' random words in a
branch-free loop that LLVM vectorizes, then rounds its elements in a second loop that reads
the 16 bits of element ``i`` at a fixed distance from ``i`` in that buffer. Element ``i`` still
gets the bits of counter ``offset + i``, so neither the chunk size nor the thread count can
change a bit.
"""

from __future__ import annotations

import sys
import types

import numpy as np
from numba import carray, get_num_threads, njit, prange, set_num_threads
from numba import types as nbtypes
from numba.extending import intrinsic

from . import _config, _threads
from ._elements import (
    ADAMW,
    AUX_ADDR,
    BF16,
    F16,
    F32,
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
    STATE1_STREAM,
    STATE2_STREAM,
    STOCHASTIC,
    WEIGHT_STREAM,
    group_constants,
    prepare_coefs,
    run_noise,
    scale_usable,
    state1_presence,
    stream_offset,
    unscale_bits,
    unscale_in_place,
    update_element,
    update_scale_one,
)
from ._formats import (
    CODE_EXPONENT_BITS,
    CODE_MANTISSA_BITS,
    CODE_SPECIALS,
    FORMATS,
    BufferCode,
)
from ._rng import MASK32, threefry2x32_i32
from ._scalar import add_exact_f32, bits_to_f32, decode, encode_nearest, encode_stochastic
from ._state8 import STATE_BLOCK, STREAM_WORDS, update_block8
from ._tensor_list import find_tensor, typed_pointer

if sys.byteorder != "little":  # the uint16 view of the random words below assumes it
    raise ImportError("srround's CPU backend needs a little-endian CPU")

_CHUNK_BLOCKS = 1024  # counter blocks per random-bit buffer fill: 4096 elements, 8 KiB
_TASK_CHUNKS = 16  # chunks per prange iteration (one buffer allocation each)

# formats given literal constants in the element loops, so LLVM folds their shifts and masks
# (other formats run the same loops with run-time constants)
_BF16 = (FORMATS["bfloat16"].mantissa_bits, FORMATS["bfloat16"].exponent_bits)
_FP16 = (FORMATS["float16"].mantissa_bits, FORMATS["float16"].exponent_bits)
_E4M3 = (FORMATS["float8_e4m3fn"].mantissa_bits, FORMATS["float8_e4m3fn"].exponent_bits)  # FN
_E5M2 = (FORMATS["float8_e5m2"].mantissa_bits, FORMATS["float8_e5m2"].exponent_bits)  # IEEE
_E2M1 = (FORMATS["float4_e2m1fn"].mantissa_bits, FORMATS["float4_e2m1fn"].exponent_bits)  # FINITE


def run(kernel, elements: int, *args):
    """``kernel(*args)`` for a ``prange`` kernel over ``elements`` elements; below
    ``_config.CPU_SERIAL_BELOW`` on the calling thread alone (the thread count is per calling
    thread in Numba, and restored after): a parallel region wakes and then waits for every
    worker thread, which on a busy machine can cost a scheduler time slice. In a child forked
    during a launch (``_threads.serial_only``), the kernel's serial twin."""
    with _threads.launching:  # counted, and locked where the layer needs it (``_threads``)
        if _threads.serial_only:
            return _serial_twin(kernel)(*args)
        if elements >= _config.CPU_SERIAL_BELOW:
            return kernel(*args)
        threads = get_num_threads()
        set_num_threads(1)
        try:
            return kernel(*args)
        finally:
            set_num_threads(threads)


def read_only(bits):
    """An input buffer as the kernels read it: a read-only view of a writable NumPy array
    (free; anything else as it is), so each kernel has one compiled version for read-only and
    writable inputs alike (Numba types the two apart: a second compile, seconds cold)."""
    if isinstance(bits, np.ndarray) and bits.flags.writeable:
        bits = bits.view()
        bits.flags.writeable = False
    return bits


_SERIAL_TWINS: dict = {}


def _serial_twin(kernel):
    """``kernel`` (a ``parallel=True`` dispatcher) compiled without ``parallel``: its ``prange``
    loops become plain loops, the same bits, and it never calls into the threading layer,
    whose worker pool may be unusable in a child forked while another thread ran a launch
    (with TBB, even a region of one thread can wait there forever). Made on first use in that
    process from a copy of the kernel's function named ``<name>__serial``, so the on-disk cache
    keeps it apart from the parallel kernel: a forked worker loads it rather than compiling it."""
    twin = _SERIAL_TWINS.get(kernel)
    if twin is None:
        func = kernel.py_func
        copy = types.FunctionType(
            func.__code__, func.__globals__, func.__name__, func.__defaults__, func.__closure__
        )
        copy.__qualname__ = func.__qualname__ + "__serial"
        copy.__module__, copy.__doc__ = func.__module__, func.__doc__
        options = {
            k: v for k, v in kernel.targetoptions.items() if k not in ("parallel", "nopython")
        }
        twin = _SERIAL_TWINS[kernel] = njit(cache=True, **options)(copy)
    return twin


@njit(forceinline=True, cache=True)
def _block_range(n, offset):
    """First counter block and number of blocks covering elements [0, n) at ``offset``."""
    if n == 0:
        return 0, 0
    first = offset >> 2
    return first, ((offset + n - 1) >> 2) - first + 1


@intrinsic
def _prefer_512_bit_vectors(typingctx):
    """Lets LLVM's loop vectorizer use 512-bit vectors in the function being compiled, where
    the CPU has AVX-512: LLVM's ``"prefer-vector-width"`` function attribute, for this
    function only (``NUMBA_CPU_FEATURES`` would change every Numba function of the process).
    On Intel server CPUs LLVM's tuning otherwise prefers 256 bits; on CPUs with narrower
    vectors the attribute changes nothing. Bits never depend on the vector width."""

    def codegen(context, builder, signature, args):
        # llvmlite's FunctionAttributes accepts LLVM's keyword attributes only; a string
        # attribute is written into the IR as given
        set.add(builder.function.attributes, '"prefer-vector-width"="512"')
        return context.get_dummy_value()

    return nbtypes.void(), codegen


@njit(forceinline=True, cache=True)
def _fill_run(words, k0, k1, low, high):
    """Blocks ``(low + j, high)`` for ``j < words.size // 2`` into ``words[2j], words[2j+1]``
    (``low + j`` must stay below 2**32); branch-free, vectorized 8 blocks wide (16 with
    AVX-512: the Threefry rounds are compute-bound). Inlined into its callers already
    vectorized, so the attribute holds there too."""
    _prefer_512_bit_vectors()
    for j in range(words.size >> 1):
        x0, x1 = threefry2x32_i32(k0, k1, low + j, high)
        words[2 * j] = x0
        words[2 * j + 1] = x1


@njit(forceinline=True, cache=True)
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


@njit(forceinline=True, cache=True)
def _chunk_span(n, offset, first, c, nblocks):
    """Blocks ``[first + c, first + c + m)`` of a chunk: returns ``(block0, m, lo, hi)`` with
    elements ``[lo, hi)`` the ones those blocks cover; element ``i`` has random halfword
    ``i - lo + (offset + lo - 4 * block0)`` of the chunk's buffer."""
    block0 = first + c
    m = min(_CHUNK_BLOCKS, nblocks - c)
    lo = max(4 * block0 - offset, 0)
    hi = min(4 * (block0 + m) - offset, n)
    return block0, m, lo, hi


@njit(forceinline=True, cache=True)
def _round_loop(x, out, bits, mantissa_bits, exponent_bits, saturate, kind):
    """out[i] = encode_stochastic(x[i], bits[i]) over equal-length slices."""
    for i in range(x.size):
        out[i] = encode_stochastic(x[i], bits[i], mantissa_bits, exponent_bits, saturate, kind)


@njit(forceinline=True, cache=True)
def _literal_format(loop, x, out, bits, mantissa_bits, exponent_bits, saturate, kind):
    """``loop(x, out, bits, mantissa_bits, exponent_bits, saturate, kind)`` with srround's
    formats (bf16, fp16, fp8, fp4) as literal constants, which LLVM folds so the loop vectorizes
    (same results); any other format with run-time fields."""
    if mantissa_bits == _BF16[0] and exponent_bits == _BF16[1]:
        loop(x, out, bits, _BF16[0], _BF16[1], saturate, 0)
    elif mantissa_bits == _FP16[0] and exponent_bits == _FP16[1]:
        loop(x, out, bits, _FP16[0], _FP16[1], saturate, 0)
    elif mantissa_bits == _E4M3[0] and exponent_bits == _E4M3[1] and kind == 1:
        loop(x, out, bits, _E4M3[0], _E4M3[1], saturate, 1)
    elif mantissa_bits == _E5M2[0] and exponent_bits == _E5M2[1] and kind == 0:
        loop(x, out, bits, _E5M2[0], _E5M2[1], saturate, 0)
    elif mantissa_bits == _E2M1[0] and exponent_bits == _E2M1[1] and kind == 2:
        loop(x, out, bits, _E2M1[0], _E2M1[1], saturate, 2)
    else:
        loop(x, out, bits, mantissa_bits, exponent_bits, saturate, kind)


@njit(forceinline=True, cache=True)
def _round_span(x, out, bits, mantissa_bits, exponent_bits, saturate, kind=0):
    """``_round_loop`` with the formats as literal constants (``_literal_format``)."""
    _literal_format(_round_loop, x, out, bits, mantissa_bits, exponent_bits, saturate, kind)


@njit(forceinline=True, cache=True)
def _sum_loop(w, u, alpha, total, mantissa_bits, exponent_bits, kind=0):
    """total[i] = add_exact_f32(w[i], u[i], alpha): the fp32 sums ``add_stochastic`` rounds."""
    for i in range(w.size):
        total[i] = add_exact_f32(w[i], u[i], alpha, mantissa_bits, exponent_bits, kind)


@njit(forceinline=True, cache=True)
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


_ROUND, _ADD = 0, 1  # operations of the random kernels


def _make_random_kernel(op):
    """The ``prange`` kernel of a random operation (``_ROUND`` or ``_ADD``):
    ``kernel(src, dst, alpha, k0, k1, offset, mantissa_bits, exponent_bits, saturate)`` over
    ``src.size`` elements, chunk by chunk (module docstring).

    ``_ROUND``: ``dst[i] = SR(src[i])``, ``alpha`` unused. ``_ADD``: ``dst[i] = SR(dst[i] +
    alpha * src[i])`` in place. ``src``: fp32 patterns (uint32), ``dst``: narrow patterns.
    """

    @njit(parallel=True, cache=True)
    def kernel(src, dst, alpha, k0, k1, offset, mantissa_bits, exponent_bits, saturate, kind=0):
        n = src.size
        first, nblocks = _block_range(n, offset)
        task = _CHUNK_BLOCKS * _TASK_CHUNKS
        for t in prange((nblocks + task - 1) // task):
            words = np.empty(2 * _CHUNK_BLOCKS, np.uint32)
            bits = words.view(np.uint16)
            total = np.empty(4 * _CHUNK_BLOCKS if op == _ADD else 0, np.uint32)
            for c in range(t * task, min(t * task + task, nblocks), _CHUNK_BLOCKS):
                block0, m, lo, hi = _chunk_span(n, offset, first, c, nblocks)
                _fill_bits(words, k0, k1, block0, m)
                b = offset + lo - 4 * block0
                noise = bits[b : b + hi - lo]
                if op == _ADD:
                    _add_span(
                        dst[lo:hi],
                        src[lo:hi],
                        alpha,
                        total[: hi - lo],
                        noise,
                        mantissa_bits,
                        exponent_bits,
                        saturate,
                        kind,
                    )
                else:
                    _round_span(
                        src[lo:hi], dst[lo:hi], noise, mantissa_bits, exponent_bits, saturate, kind
                    )

    return kernel


@njit(parallel=True, cache=True)
def random_lanes(out, k0, k1, positions, targets, lengths):
    """The 16 random bits of stream positions, as the other kernels draw them: for each piece
    ``j``, ``out[targets[j] + i]`` (uint16, ``out.size`` even) = the bits of position
    ``positions[j] + i`` (lane ``p & 3`` of counter block ``p >> 2``), ``i < lengths[j]``.
    Pieces run in parallel; a piece whose position and target are multiples of 4 is filled
    in place, block by block, others through a buffer."""
    words = out.view(np.uint32)
    for j in prange(positions.size):
        p, t, n = positions[j], targets[j], lengths[j]
        whole = n >> 2 if (p & 3) == 0 and (t & 3) == 0 else 0
        if whole > 0:
            _fill_bits(words[t >> 1 : (t >> 1) + 2 * whole], k0, k1, p >> 2, whole)
            p, t, n = p + 4 * whole, t + 4 * whole, n - 4 * whole
        buffer = np.empty(2 * _CHUNK_BLOCKS, np.uint32)
        step = 4 * _CHUNK_BLOCKS - 4
        for i in range(0, n, step):
            m = min(step, n - i)
            first, blocks = _block_range(m, p + i)
            _fill_bits(buffer, k0, k1, first, blocks)
            b = p + i - 4 * first
            out[t + i : t + i + m] = buffer.view(np.uint16)[b : b + m]


#: ``stochastic_round(x, out, alpha, k0, k1, offset, mantissa_bits, exponent_bits, saturate)``:
#: ``out[i] = SR(x[i])``; x: uint32[n] (fp32 bits), out: narrow patterns; ``alpha`` unused.
stochastic_round = _make_random_kernel(_ROUND)
#: ``stochastic_add(u, w, alpha, k0, k1, offset, mantissa_bits, exponent_bits, saturate)``:
#: ``w[i] = SR(w[i] + alpha * u[i])`` in place; u: uint32[n] (fp32 bits), alpha: float32.
stochastic_add = _make_random_kernel(_ADD)


@njit(forceinline=True, cache=True)
def _nearest_loop(x, out, _bits, mantissa_bits, exponent_bits, saturate, kind):
    """out[i] = RNE(x[i]) over equal-length slices (``_bits``: unused, as ``_round_loop``'s)."""
    for i in range(x.size):
        out[i] = encode_nearest(x[i], mantissa_bits, exponent_bits, saturate, kind)


@njit(parallel=True, cache=True)
def round_nearest(x, out, mantissa_bits, exponent_bits, saturate, kind=0):
    """out[i] = RNE(x[i]); x: uint32[n] (fp32 bits), out: uint16[n]. Chunks of 4096 elements
    per task, the formats with literal constants (``_literal_format``)."""
    n = x.size
    chunk = 4 * _CHUNK_BLOCKS
    for t in prange((n + chunk - 1) // chunk):
        lo, hi = t * chunk, min(t * chunk + chunk, n)
        _literal_format(
            _nearest_loop, x[lo:hi], out[lo:hi], None, mantissa_bits, exponent_bits, saturate, kind
        )


@njit(parallel=True, cache=True)
def to_float32(h, out, mantissa_bits, exponent_bits, kind=0):
    """out[i] = fp32 bits of narrow pattern h[i]; h: uint16[n], out: uint32[n]."""
    for i in prange(h.size):
        out[i] = decode(h[i], mantissa_bits, exponent_bits, kind)


# -- loss scaling (tensor lists through a pointer table, see _tensor_list.py) ----------------

_ONE_F32 = 0x3F800000


@njit(forceinline=True, cache=True)
def _unscale_array(a, code, inv_scale):
    """``unscale_bits`` over a whole array in place; True if every element was finite."""
    finite = True
    for j in range(a.size):
        new, ok = unscale_bits(a[j], code, inv_scale)
        a[j] = new
        finite &= ok
    return finite


@njit(forceinline=True, cache=True)
def _all_finite(a, code):
    """True if every element of ``a`` (format ``code``) is finite; reads only."""
    finite = True
    for j in range(a.size):
        finite &= unscale_bits(a[j], code, np.float32(1.0))[1]
    return finite


@njit(forceinline=True, cache=True)
def _unscale_buffer(a, code, inv_scale_bits):
    """One typed buffer slice: the check alone for a scale of 1, else unscale in place."""
    if inv_scale_bits == _ONE_F32:
        return _all_finite(a, code)
    finite = _unscale_array(a, code, bits_to_f32(inv_scale_bits))
    return finite and scale_usable(inv_scale_bits)


@njit(forceinline=True, cache=True)
def _unscale_run(address, code, j0, j1, inv_scale_bits):
    """Elements [j0, j1) of one buffer; True if all were finite. float32, bf16 and fp16 run
    as typed arrays with a literal format (LLVM vectorizes each loop); other formats one
    element at a time through ``unscale_in_place``."""
    if code == F32:
        return _unscale_buffer(carray(typed_pointer(address, 32), j1)[j0:], F32, inv_scale_bits)
    if code == BF16:
        return _unscale_buffer(carray(typed_pointer(address, 16), j1)[j0:], BF16, inv_scale_bits)
    if code == F16:
        return _unscale_buffer(carray(typed_pointer(address, 16), j1)[j0:], F16, inv_scale_bits)
    finite = True
    for j in range(j0, j1):
        finite &= unscale_in_place(address, code, j, inv_scale_bits)
    return finite


@njit(parallel=True, cache=True)
def unscale_and_check(addresses, formats, starts, inv_scales, found, per_tensor):
    """Unscale and check every element of a tensor list (``addresses``, ``formats``,
    ``starts``); ``inv_scales``/``found``: uint32 float32 patterns, 1 or one per tensor (with
    ``per_tensor``: one flag per tensor, and one scale per tensor or one for all). Work
    is split into equal chunks of the global element range; a chunk walks the runs of the
    tensors it covers."""
    total = starts[-1]
    chunk = 1 << 16
    for c in prange((total + chunk - 1) // chunk):
        i = c * chunk
        hi = min(i + chunk, total)
        k = find_tensor(starts, i)
        while i < hi:
            end = min(hi, starts[k + 1])
            slot = k if per_tensor else 0
            scale = inv_scales[slot if inv_scales.size > 1 else 0]  # one scale: shared
            if not _unscale_run(addresses[k], formats[k], i - starts[k], end - starts[k], scale):
                found[slot] = _ONE_F32
            i = end
            k += 1


@njit(cache=True)
def update_scale(scale, growth_tracker, overflow_tracker, found, factors):
    """``update_scale_one`` for every scale of ``scale`` (float32 patterns) in place;
    ``factors``: its last six arguments, as a tuple."""
    for k in range(scale.size):
        scale[k], growth_tracker[k], overflow_tracker[k] = update_scale_one(
            scale[k], growth_tracker[k], overflow_tracker[k], found[k], *factors
        )


# -- fused optimizer steps: one kernel per configuration, chunks of one loop ------------------

_CHUNK = 4096  # elements per optimizer work item


@njit(forceinline=True, cache=True)
def _random_bits(words, k0, k1, offset, n):
    """The 16-bit random words of elements [0, n) at counter ``offset`` (uint16[n], a view of
    ``words`` filled here; a slice, so loops index it from 0 and vectorize)."""
    first = offset >> 2
    _fill_bits(words, k0, k1, first, ((offset + n - 1) >> 2) - first + 1)
    b = offset - 4 * first
    return words.view(np.uint16)[b : b + n]


@njit(forceinline=True, cache=True)
def _update_run(kind, mode, formats, buffers, has_state1, j0, scale, coefs, group, noise):
    """Elements ``j0 + e`` of one tensor, ``e < noise[0].size`` (``update_element``'s
    arguments, ``noise`` as three uint16 arrays). With every mode and format a constant, LLVM
    folds the branches of the body and vectorizes this loop."""
    w_bits, m_bits, v_bits = noise
    for e in range(w_bits.size):
        update_element(
            kind,
            mode,
            formats,
            buffers,
            has_state1,
            j0 + e,
            scale,
            coefs,
            group,
            (w_bits[e], m_bits[e], v_bits[e]),
        )


@njit(forceinline=True, cache=True)
def _update_formats(
    kind, mode, state_fmt, cases, p_fmt, g_fmt, buffers, has_state1, j0, scale, coefs, group, noise
):
    """``_update_run`` with constant formats for the pairs of ``CONSTANT_FORMATS`` (parameter,
    gradient: vectorized), run-time formats (scalar, not vectorized: several times slower)
    otherwise. ``cases``: which of these loops the table needs (``format_cases``); only those
    are compiled."""
    bf16, fp16, fp32, bf16_fp32, fp16_fp32, other = cases
    rest = (buffers, has_state1, j0, scale, coefs, group, noise)
    if bf16 and p_fmt == BF16 and g_fmt == BF16:
        _update_run(kind, mode, (BF16, BF16, state_fmt), *rest)
    elif fp16 and p_fmt == F16 and g_fmt == F16:
        _update_run(kind, mode, (F16, F16, state_fmt), *rest)
    elif fp32 and p_fmt == F32 and g_fmt == F32:
        _update_run(kind, mode, (F32, F32, state_fmt), *rest)
    elif bf16_fp32 and p_fmt == BF16 and g_fmt == F32:
        _update_run(kind, mode, (BF16, F32, state_fmt), *rest)
    elif fp16_fp32 and p_fmt == F16 and g_fmt == F32:
        _update_run(kind, mode, (F16, F32, state_fmt), *rest)
    elif other:
        _update_run(kind, mode, (p_fmt, g_fmt, state_fmt), *rest)


@njit(forceinline=True, cache=True)
def _step_chunk(config, table, starts, hyper, steps, coefs, scale, k0, k1, lo, hi):
    """Global elements [lo, hi) of one CPU step: per tensor run, its random bits into scratch,
    then one loop over ``update_element`` (``_update_formats``). ``config``: the kernel's
    constants ``(kind, mode, state_fmt, state1, cases)``."""
    kind, mode, state_fmt, state1, cases = config
    words = np.empty((3, _CHUNK // 2 + 4), np.uint32)
    i = lo
    k = find_tensor(starts, i)
    while i < hi:
        row = table[k]
        end, j0, run = min(hi, starts[k + 1]), i - starts[k], row[NOISE_RUN]
        if run:  # a piece of runs (tensor parallel): one pass per run, each its own noise
            end = min(end, i + run - j0 % run)
        n = end - i
        p_fmt, g_fmt = row[P_FMT], row[G_FMT]
        h = hyper[row[GROUP]]
        group = group_constants(kind, h[1], h[2], h[3], h[4])
        w_bits = words[0].view(np.uint16)[:n]
        m_bits = words[1].view(np.uint16)[:n]
        v_bits = words[2].view(np.uint16)[:n]
        step, noise = steps[k], run_noise(row[NOISE], run, row[NOISE_SKIP], j0)
        if mode == STOCHASTIC and p_fmt != F32:
            offset = stream_offset(step, WEIGHT_STREAM, noise) + j0
            w_bits = _random_bits(words[0], k0, k1, offset, n)
        has_state1 = row[S1_ADDR] != 0 if state1 == STATE1_SOME else state1 == STATE1_ALL
        if state_fmt != F32:  # the streams this tensor's states round with (SGD: one, or none)
            if has_state1:
                offset = stream_offset(step, STATE1_STREAM, noise) + j0
                m_bits = _random_bits(words[1], k0, k1, offset, n)
            if kind == ADAMW:
                offset = stream_offset(step, STATE2_STREAM, noise) + j0
                v_bits = _random_bits(words[2], k0, k1, offset, n)
        buffers = (row[P_ADDR], row[G_ADDR], row[S1_ADDR], row[S2_ADDR], row[AUX_ADDR])
        _update_formats(
            kind,
            mode,
            state_fmt,
            cases,
            p_fmt,
            g_fmt,
            buffers,
            has_state1,
            j0,
            scale,
            (coefs[k, 0], coefs[k, 1], coefs[k, 2]),
            group,
            (w_bits, m_bits, v_bits),
        )
        if end == starts[k + 1]:
            k += 1
        i = end


def _make_step(kind, mode, state_fmt, state1, cases):
    """The CPU step of one configuration: kind, weight mode, state format, which tensors have
    a first state (``state1_presence``) and which format loops are needed (``format_cases``)
    are constants of the compiled loops (closure variables), so each configuration compiles
    on first use, alone, and is cached."""
    config = (kind, mode, state_fmt, state1, cases)

    @njit(parallel=True, cache=True, error_model="numpy")
    def step(table, starts, hyper, steps, coefs, inv_scale, found, k0, k1):
        """One fused step over every tensor of ``table`` (``_elements.Column``); ``inv_scale``
        and ``found``: uint32[1] float32 patterns; a nonzero ``found`` skips the step."""
        if found[0] & 0x7FFFFFFF:
            return
        for k in range(table.shape[0]):
            steps[k] += 1
            if k > 0 and steps[k] == steps[k - 1] and table[k, GROUP] == table[k - 1, GROUP]:
                # the common case: the same step of the same group. Element by element: a
                # row copy compiles Numba's shape-mismatch error message into each kernel
                for c in range(coefs.shape[1]):
                    coefs[k, c] = coefs[k - 1, c]
                continue
            h = hyper[table[k, GROUP]]
            coefs[k, 0], coefs[k, 1], coefs[k, 2], coefs[k, 3] = prepare_coefs(
                kind, steps[k], h[0], h[1], h[2], h[3], h[4]
            )
        scale = bits_to_f32(inv_scale[0])
        total = starts[-1]
        for c in prange((total + _CHUNK - 1) // _CHUNK):
            lo = c * _CHUNK
            _step_chunk(
                config,
                table,
                starts,
                hyper,
                steps,
                coefs,
                scale,
                k0,
                k1,
                lo,
                min(lo + _CHUNK, total),
            )

    return step


# (parameter, gradient) formats whose step loops are compiled with constant formats: the same
# dtype, and 16-bit parameters with float32 gradients (JAX gradients of a float32 loss scale,
# mixed-precision recipes); other pairs run a scalar loop
CONSTANT_FORMATS = ((BF16, BF16), (F16, F16), (F32, F32), (BF16, F32), (F16, F32))


def format_cases(table) -> tuple:
    """Per pair of ``CONSTANT_FORMATS`` whether ``table`` has tensors of it, then whether it
    has any other pair."""
    p_fmt, g_fmt = np.asarray(table)[:, P_FMT], np.asarray(table)[:, G_FMT]
    pairs = [(p_fmt == p) & (g_fmt == g) for p, g in CONSTANT_FORMATS]
    other = ~np.logical_or.reduce(pairs)
    return (*(bool(c.any()) for c in pairs), bool(other.any()))


_STEPS = {}


def optim_step_kernel(kind, mode, state_fmt, table):
    """The compiled CPU step for ``table``'s configuration, built once per process."""
    key = (int(kind), int(mode), int(state_fmt), state1_presence(table), format_cases(table))
    if key not in _STEPS:
        _STEPS[key] = _make_step(*key)
    return _STEPS[key]


# -- fused AdamW steps with fp8 states (``_state8``) ------------------------------------------

FLOAT8_E4M3FN = int(BufferCode.FLOAT8_E4M3FN)


@njit(parallel=True, cache=True)
def optim_step8(table, starts, bstarts, hyper, steps, coefs, inv_scale, found, k0, k1, mode, fmt):
    """One AdamW step with fp8 states (``_state8``) over every tensor of ``table``
    (``_elements.Column``): the prepare pass, then one ``prange`` iteration per block
    (``bstarts``: prefix sums of ``block_counts``), which first fills the block's random words
    of the three streams in a vectorized pass (the states' bytes decode through a table built
    once); ``inv_scale``, ``found``: uint32[1] float32 patterns; a nonzero ``found`` skips the
    step. ``mode`` and ``fmt`` are run-time values (one compiled kernel), with one branch of
    constant formats for the common case: bf16 parameters, bf16 or float32 gradients, e4m3fn
    states, stochastic rounding."""
    if found[0] & 0x7FFFFFFF:
        return
    for k in range(table.shape[0]):
        steps[k] += 1
        h = hyper[table[k, GROUP]]
        coefs[k, 0], coefs[k, 1], coefs[k, 2], coefs[k, 3] = prepare_coefs(
            ADAMW, steps[k], h[0], h[1], h[2], h[3], h[4]
        )
    fast = mode == STOCHASTIC and fmt == FLOAT8_E4M3FN
    lut = np.empty(256, np.uint32)
    for code in range(256):  # the states' bytes decoded once (the body reads them by address)
        lut[code] = decode(
            code, CODE_MANTISSA_BITS[fmt], CODE_EXPONENT_BITS[fmt], CODE_SPECIALS[fmt]
        )
    table_address = np.int64(lut.ctypes.data)
    for t in prange(bstarts[-1]):
        k = find_tensor(bstarts, t)
        r = table[k]
        h = hyper[r[GROUP]]
        b, size, scale = t - bstarts[k], starts[k + 1] - starts[k], inv_scale[0]
        j0 = b * STATE_BLOCK
        n = min(STATE_BLOCK, size - j0)
        words = np.empty(3 * STREAM_WORDS + 2 * STATE_BLOCK, np.uint32)
        for stream in range(3):
            first, nblocks = _block_range(n, stream_offset(steps[k], stream, r[NOISE]) + j0)
            _fill_bits(words[stream * STREAM_WORDS :], k0, k1, first, nblocks)
        address = np.int64(words.ctypes.data)
        c, g, key = (coefs[k, 0], coefs[k, 1], coefs[k, 2]), (h[1], h[2], h[3], h[4]), (k0, k1)
        row = (
            r[P_ADDR],
            r[P_FMT],
            r[G_ADDR],
            r[G_FMT],
            r[S1_ADDR],
            r[S2_ADDR],
            r[AUX_ADDR],
            r[NOISE],
            r[S1_SCALE],
            r[S2_SCALE],
        )
        rest = (b, size, steps[k], scale, c, g, key, address, table_address)
        # constant formats, folded by LLVM (about 4x faster): bf16 parameters with bf16 or
        # float32 gradients (as CONSTANT_FORMATS)
        if fast and r[P_FMT] == BF16 and r[G_FMT] == BF16:
            update_block8(STOCHASTIC, FLOAT8_E4M3FN, (row[0], BF16, row[2], BF16) + row[4:], *rest)
        elif fast and r[P_FMT] == BF16 and r[G_FMT] == F32:
            update_block8(STOCHASTIC, FLOAT8_E4M3FN, (row[0], BF16, row[2], F32) + row[4:], *rest)
        else:
            update_block8(mode, fmt, row, *rest)
        words[0] = 0  # keeps the buffer alive until here (the body reads it by address)
    lut[0] = 0  # decode(0): keeps the table alive until here (read by address)
