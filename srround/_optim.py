"""Fused optimizer steps (AdamW, SGD) over many tensors: scalar bodies and the CPU kernel.

One step reads every parameter, gradient and state element once and writes each once, for all
tensors of an optimizer in O(1) launches (a prepare pass over the tensors, then one pass over
all elements), through a pointer table (``_tensor_list.py``) of one row per tensor:

    table int64[N, 9]: param address, param format, grad address, grad format,
                       state-1 address, state-2 address, aux address, group index,
                       noise start (the tensor's element 0 in the random stream)
    starts int64[N+1]: prefix sums of the tensor sizes (the global element range)
    hyper float64[G, 5]: per param group - AdamW: lr, beta1, beta2, eps, weight_decay;
                         SGD: lr, momentum, dampening, weight_decay, nesterov (0/1)
    steps int32[N]:     steps taken per tensor (incremented by the step unless skipped)
    coefs float32[N, 4]: per-tensor scalars the prepare pass derives for this step

Formats: 0 fp32, 1 bf16, 2 fp16 (``_tensor_list.FORMAT_*``); states are fp32 or bf16 (one
format for the whole table). Math in fp32, in torch.optim's order:

    g = grad * inv_scale
    AdamW: p = p * (1 - lr*wd);  m = m + (1-b1)(g - m);  v = v*b2 + (1-b2) g*g
           p = p - lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)
    SGD:   g = g + wd*p;  buf = g (first step) or buf*momentum + (1-dampening) g
           g = g + momentum*buf (nesterov) or buf;  p = p - lr*g

Every multiply-add is an explicit ``fma32`` so CPU and CUDA give the same bits; bias corrections
are computed in float64 by repeated squaring (correctly rounded operations only).

Weight modes (how the fp32 result is written back to a bf16/fp16 parameter; fp32 parameters are
always written exactly):

    stochastic  p <- SR(p')                              (no extra memory)
    nearest     p <- RNE(p')                             (the baseline that stalls)
    kahan       aux: compensation in p's format; s = c + (p' - p), p <- RNE(p + s),
                c <- RNE(s - (p_new - p))                (2 extra bytes per parameter)
    master      aux: fp32 master weight, the value the math uses; p <- RNE(master)
    remainder   bf16 only; aux int16: fp32 bits = (p << 16) + aux exactly, p is the fp32 value
                rounded half away from zero on its bit pattern (RNE except on exact ties);
                fp32-exact updates for 2 extra bytes per parameter.

Random bits (stochastic weights, bf16 states), one stream per step, per buffer, per element:
element j of tensor k at step t (after the increment) rounds with the ``_rng.py`` stream of the
optimizer's seed at counter

    offset = t * 2**36 + stream * 2**34 + noise[k] + j      stream: 0 weight, 1 m, 2 v

where ``noise[k]`` is the table's noise-start column (``starts[k]`` unless the caller keys the
noise otherwise, e.g. to an element's place in an unsharded tensor); so the weight write-back
is exactly ``srround.stochastic_round(p', seed=seed, offset=t * 2**36 + noise[k])``; t < 2**26
and noise[k] + size[k] <= 2**34.

A set ``found_inf`` flag (float32 bits, nonzero) turns the step into a no-op: no buffer and no
step count changes, with no host synchronisation.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ._cpu import _fill_bits, run
from ._rng import lane_bits16, random_block
from ._scalar import (
    bits_to_f32,
    decode,
    encode_nearest,
    encode_stochastic,
    f32_to_bits,
    fma32,
)
from ._tensor_list import find_tensor, load_bits, store_bits

ADAMW, SGD = 0, 1
MODES = {"stochastic": 0, "nearest": 1, "kahan": 2, "master": 3, "remainder": 4}
STOCHASTIC, NEAREST, KAHAN, MASTER, REMAINDER = range(5)
# table columns
P_ADDR, P_FMT, G_ADDR, G_FMT, S1_ADDR, S2_ADDR, AUX_ADDR, GROUP, NOISE = range(9)
TABLE_COLUMNS = 9
HYPER_COLUMNS = 5
STEP_SHIFT, STREAM_SHIFT = 36, 34
MAX_STEPS = 1 << 26
MAX_ELEMENTS = 1 << 34
_CHUNK = 4096  # elements per CPU work item


# -- scalar bodies (CPU and CUDA) ------------------------------------------------------------


@njit(cache=True)
def widen(bits, fmt):
    """fp32 pattern of a ``fmt``-coded pattern (0 fp32, 1 bf16, 2 fp16)."""
    if fmt == 0:
        return bits
    if fmt == 1:
        return bits << 16
    return decode(bits, 10, 5)


@njit(cache=True)
def narrow_nearest(u, fmt):
    """fp32 pattern ``u`` rounded to nearest in format ``fmt`` (identity for fp32)."""
    if fmt == 0:
        return u
    if fmt == 1:
        return encode_nearest(u, 7, 8, False)
    return encode_nearest(u, 10, 5, False)


@njit(cache=True)
def narrow_stochastic(u, bits16, fmt):
    """fp32 pattern ``u`` stochastically rounded to ``fmt`` with 16 random bits."""
    if fmt == 0:
        return u
    if fmt == 1:
        return encode_stochastic(u, bits16, 7, 8, False)
    return encode_stochastic(u, bits16, 10, 5, False)


@njit(cache=True)
def weight_value(mode, fmt, p_bits, aux_bits):
    """The fp32 pattern the update starts from: the parameter, or the mode's exact value."""
    if fmt == 0:
        return p_bits
    if mode == MASTER:
        return aux_bits
    if mode == REMAINDER:
        low = aux_bits - ((aux_bits & 0x8000) << 1)  # int16 from its uint16 pattern
        return ((p_bits << 16) + low) & 0xFFFFFFFF
    return widen(p_bits, fmt)


@njit(cache=True)
def weight_write(mode, fmt, old_bits, new_bits, aux_bits, bits16):
    """``(param pattern, aux pattern)`` storing the fp32 result ``new_bits`` of a parameter
    whose value was ``old_bits`` (``weight_value``), per weight mode (module docstring)."""
    if fmt == 0:
        return new_bits, aux_bits
    if mode == STOCHASTIC:
        return narrow_stochastic(new_bits, bits16, fmt), aux_bits
    if mode == NEAREST:
        return narrow_nearest(new_bits, fmt), aux_bits
    if mode == MASTER:
        return narrow_nearest(new_bits, fmt), new_bits
    if mode == KAHAN:
        old = bits_to_f32(old_bits)
        compensated = bits_to_f32(widen(aux_bits, fmt)) + (bits_to_f32(new_bits) - old)
        written = narrow_nearest(f32_to_bits(old + compensated), fmt)
        moved = bits_to_f32(widen(written, fmt)) - old
        return written, narrow_nearest(f32_to_bits(compensated - moved), fmt)
    # REMAINDER (bf16): high half rounded on the bit pattern, exact signed low half
    if (new_bits & 0x7FFFFFFF) > 0x7F800000:  # NaN: the canonical quiet NaN, no remainder
        return ((new_bits >> 16) & 0x8000) | 0x7FC0, 0
    high = ((new_bits + 0x8000) >> 16) & 0xFFFF
    return high, (new_bits - (high << 16)) & 0xFFFF


@njit(cache=True)
def _power(base, exponent):
    """``base ** exponent`` (float64, int exponent >= 0) by repeated squaring: only correctly
    rounded multiplies, so every backend gets the same bits."""
    result = 1.0
    while exponent > 0:
        if exponent & 1:
            result *= base
        base *= base
        exponent >>= 1
    return result


@njit(cache=True)
def prepare_coefs(kind, step, h0, h1, h2, h3, h4):
    """Per-tensor float32 scalars of step ``step`` (1-based) from the group's hyperparameters:
    AdamW ``(1 - lr*wd, lr / bc1, sqrt(bc2), 0)``; SGD ``(lr, first step?, 0, 0)``."""
    if kind == ADAMW:
        lr, beta1, beta2, wd = h0, h1, h2, h4
        bc1 = 1.0 - _power(beta1, step)
        bc2 = 1.0 - _power(beta2, step)
        return (
            np.float32(1.0 - lr * wd),
            np.float32(lr / bc1),
            np.float32(math.sqrt(bc2)),
            np.float32(0.0),
        )
    return np.float32(h0), np.float32(1.0 if step == 1 else 0.0), np.float32(0.0), np.float32(0.0)


@njit(cache=True, error_model="numpy")  # no zero-division branch: the loops vectorize
def adamw_math(
    p, g, m, v, decay, step_size, bc2_sqrt, beta2, eps, one_minus_beta1, one_minus_beta2
):
    """One AdamW element in float32: returns ``(p, m, v)``."""
    p = p * decay
    m = fma32(one_minus_beta1, g - m, m)
    v = fma32(one_minus_beta2 * g, g, v * beta2)
    denom = math.sqrt(v) / bc2_sqrt + eps
    return fma32(-step_size, m / denom, p), m, v


@njit(cache=True)
def sgd_math(p, g, buf, lr, first, momentum, one_minus_dampening, wd, nesterov):
    """One SGD element in float32: returns ``(p, buf)``."""
    if wd != 0:
        g = fma32(wd, p, g)
    if momentum != 0:
        buf = g if first != 0 else fma32(one_minus_dampening, g, buf * momentum)
        g = fma32(momentum, buf, g) if nesterov != 0 else buf
    return fma32(-lr, g, p), buf


@njit(cache=True)
def group_constants(kind, h1, h2, h3, h4):
    """float32 per-group constants of the element math: AdamW ``(beta2, eps, 1-beta1,
    1-beta2)``; SGD ``(momentum, 1-dampening, wd, nesterov)``."""
    if kind == ADAMW:
        return np.float32(h2), np.float32(h3), np.float32(1.0 - h1), np.float32(1.0 - h2)
    return np.float32(h1), np.float32(1.0 - h2), np.float32(h3), np.float32(h4)


@njit(cache=True)
def stream_offset(step, stream, start):
    """Counter offset of element 0 of a tensor starting at global element ``start``."""
    return (np.int64(step) << STEP_SHIFT) + (np.int64(stream) << STREAM_SHIFT) + start


@njit(cache=True)
def _load(address, j, fmt):
    """Element ``j`` of a buffer of format code ``fmt`` (0: 32-bit words, else 16-bit)."""
    return load_bits(address, j, 32) if fmt == 0 else load_bits(address, j, 16)


@njit(cache=True)
def _store(address, j, value, fmt):
    if fmt == 0:
        store_bits(address, j, value, 32)
    else:
        store_bits(address, j, value, 16)


@njit(cache=True)
def _bits16(k0, k1, offset):
    """The 16 random bits of counter ``offset`` of the ``_rng.py`` stream."""
    x0, x1 = random_block(k0, k1, offset >> 2)
    return lane_bits16(x0, x1, offset & 3)


@njit(inline="always", cache=True)
def update_element(
    kind,
    mode,
    state_fmt,
    p_fmt,
    g_fmt,
    has_state1,
    p_addr,
    g_addr,
    s1_addr,
    s2_addr,
    aux_addr,
    j,
    scale,
    coef0,
    coef1,
    coef2,
    const1,
    const2,
    const3,
    const4,
    w_bits16,
    m_bits16,
    v_bits16,
):
    """Element ``j`` of one tensor, in place: the body both backends run. ``has_state1``:
    whether ``s1_addr`` is a buffer (SGD without momentum has none); ``scale``: float32
    gradient multiplier; ``coef*``: the tensor's float32 coefficients (``prepare_coefs``);
    ``const*``: the group's float32 constants (``group_constants``); ``*_bits16``: the random
    bits of the weight, first-state and second-state streams (ignored where not rounded)."""
    aux_fmt = 0 if mode == MASTER else 1
    has_aux = p_fmt != 0 and mode >= KAHAN
    g = bits_to_f32(widen(_load(g_addr, j, g_fmt), g_fmt)) * scale
    p_bits = _load(p_addr, j, p_fmt)
    aux_bits = _load(aux_addr, j, aux_fmt) if has_aux else 0
    old = weight_value(mode, p_fmt, p_bits, aux_bits)
    m = np.float32(0)
    if has_state1:
        m = bits_to_f32(widen(_load(s1_addr, j, state_fmt), state_fmt))
    if kind == ADAMW:
        v = bits_to_f32(widen(_load(s2_addr, j, state_fmt), state_fmt))
        new, m, v = adamw_math(
            bits_to_f32(old), g, m, v, coef0, coef1, coef2, const1, const2, const3, const4
        )
        v_bits = f32_to_bits(v)
        if state_fmt != 0:
            v_bits = narrow_stochastic(v_bits, v_bits16, 1)
        _store(s2_addr, j, v_bits, state_fmt)
    else:
        new, m = sgd_math(bits_to_f32(old), g, m, coef0, coef1, const1, const2, const3, const4)
    if has_state1:
        m_bits = f32_to_bits(m)
        if state_fmt != 0:
            m_bits = narrow_stochastic(m_bits, m_bits16, 1)
        _store(s1_addr, j, m_bits, state_fmt)
    p_new, aux_new = weight_write(mode, p_fmt, old, f32_to_bits(new), aux_bits, w_bits16)
    _store(p_addr, j, p_new, p_fmt)
    if has_aux:
        _store(aux_addr, j, aux_new, aux_fmt)


@njit(cache=True)
def step_element(
    kind,
    mode,
    state_fmt,
    p_addr,
    p_fmt,
    g_addr,
    g_fmt,
    s1_addr,
    s2_addr,
    aux_addr,
    j,
    start,
    step,
    inv_scale_bits,
    coef0,
    coef1,
    coef2,
    h1,
    h2,
    h3,
    h4,
    k0,
    k1,
):
    """``update_element`` for the CUDA kernel (also runnable in the simulator): draws the
    element's random bits itself. ``h1..h4``: the group's float64 hyperparameters (the
    simulator passes Python floats, so every float32 is made here)."""
    const1, const2, const3, const4 = group_constants(kind, h1, h2, h3, h4)
    w_bits16 = m_bits16 = v_bits16 = 0
    if mode == STOCHASTIC and p_fmt != 0:
        w_bits16 = _bits16(k0, k1, stream_offset(step, 0, start) + j)
    if state_fmt != 0:
        if s1_addr:
            m_bits16 = _bits16(k0, k1, stream_offset(step, 1, start) + j)
        if kind == ADAMW:
            v_bits16 = _bits16(k0, k1, stream_offset(step, 2, start) + j)
    update_element(
        kind,
        mode,
        state_fmt,
        p_fmt,
        g_fmt,
        s1_addr != 0,
        p_addr,
        g_addr,
        s1_addr,
        s2_addr,
        aux_addr,
        j,
        bits_to_f32(inv_scale_bits),
        np.float32(coef0),
        np.float32(coef1),
        np.float32(coef2),
        const1,
        const2,
        const3,
        const4,
        w_bits16,
        m_bits16,
        v_bits16,
    )


# -- CPU: one kernel per configuration, chunks of one loop over update_element --------------


@njit(inline="always", cache=True)
def _random_bits(words, k0, k1, offset, n):
    """The 16-bit random words of elements [0, n) at counter ``offset`` (uint16[n], a view of
    ``words`` filled here; a slice, so loops index it from 0 and vectorize)."""
    first = offset >> 2
    _fill_bits(words, k0, k1, first, ((offset + n - 1) >> 2) - first + 1)
    b = offset - 4 * first
    return words.view(np.uint16)[b : b + n]


@njit(inline="always", cache=True)
def _update_run(
    kind,
    mode,
    state_fmt,
    p_fmt,
    g_fmt,
    has_state1,
    addresses,
    j0,
    scale,
    scalars,
    w_bits,
    m_bits,
    v_bits,
):
    """Elements j0 + e of one tensor, e < w_bits.size; ``addresses``: (param, grad, state 1,
    state 2, aux), ``scalars``: (coef0..2, const1..4) of ``update_element``. With every mode
    and format a constant, LLVM folds the branches of the body and vectorizes this loop."""
    p_addr, g_addr, s1_addr, s2_addr, aux_addr = addresses
    coef0, coef1, coef2, const1, const2, const3, const4 = scalars
    for e in range(w_bits.size):
        update_element(
            kind,
            mode,
            state_fmt,
            p_fmt,
            g_fmt,
            has_state1,
            p_addr,
            g_addr,
            s1_addr,
            s2_addr,
            aux_addr,
            j0 + e,
            scale,
            coef0,
            coef1,
            coef2,
            const1,
            const2,
            const3,
            const4,
            w_bits[e],
            m_bits[e],
            v_bits[e],
        )


@njit(inline="always", cache=True)
def _update_formats(
    kind,
    mode,
    state_fmt,
    bf16,
    fp32,
    other,
    p_fmt,
    g_fmt,
    has_state1,
    addresses,
    j0,
    scale,
    scalars,
    w_bits,
    m_bits,
    v_bits,
):
    """``_update_run`` with constant formats for bf16 and fp32 tensors (parameter and gradient
    alike; vectorized), generic (scalar, ~10x slower) otherwise. ``bf16, fp32, other``:
    which of the three loops the table needs (``format_cases``); only those are compiled."""
    if bf16 and p_fmt == 1 and g_fmt == 1:
        _update_run(
            kind,
            mode,
            state_fmt,
            1,
            1,
            has_state1,
            addresses,
            j0,
            scale,
            scalars,
            w_bits,
            m_bits,
            v_bits,
        )
    elif fp32 and p_fmt == 0 and g_fmt == 0:
        _update_run(
            kind,
            mode,
            state_fmt,
            0,
            0,
            has_state1,
            addresses,
            j0,
            scale,
            scalars,
            w_bits,
            m_bits,
            v_bits,
        )
    elif other:
        _update_run(
            kind,
            mode,
            state_fmt,
            p_fmt,
            g_fmt,
            has_state1,
            addresses,
            j0,
            scale,
            scalars,
            w_bits,
            m_bits,
            v_bits,
        )


@njit(inline="always", cache=True)
def _step_chunk(
    kind,
    mode,
    state_fmt,
    state1,
    bf16,
    fp32,
    other,
    table,
    starts,
    hyper,
    steps,
    coefs,
    scale,
    k0,
    k1,
    lo,
    hi,
):
    """Global elements [lo, hi) of one CPU step: per tensor run, its random bits into scratch,
    then one loop over ``update_element`` (``_update_formats``)."""
    words = np.empty((3, _CHUNK // 2 + 4), np.uint32)
    i = lo
    k = find_tensor(starts, i)
    while i < hi:
        end = min(hi, starts[k + 1])
        j0, n = i - starts[k], end - i
        row = table[k]
        p_fmt, g_fmt = row[P_FMT], row[G_FMT]
        h = hyper[row[GROUP]]
        c1, c2, c3, c4 = group_constants(kind, h[1], h[2], h[3], h[4])
        w_bits = words[0].view(np.uint16)[:n]
        m_bits = words[1].view(np.uint16)[:n]
        v_bits = words[2].view(np.uint16)[:n]
        step, noise = steps[k], row[NOISE]
        if mode == STOCHASTIC and p_fmt != 0:
            w_bits = _random_bits(words[0], k0, k1, stream_offset(step, 0, noise) + j0, n)
        if state_fmt != 0:
            m_bits = _random_bits(words[1], k0, k1, stream_offset(step, 1, noise) + j0, n)
            v_bits = _random_bits(words[2], k0, k1, stream_offset(step, 2, noise) + j0, n)
        addresses = (row[P_ADDR], row[G_ADDR], row[S1_ADDR], row[S2_ADDR], row[AUX_ADDR])
        scalars = (coefs[k, 0], coefs[k, 1], coefs[k, 2], c1, c2, c3, c4)
        has_state1 = row[S1_ADDR] != 0 if state1 == STATE1_SOME else state1 == STATE1_ALL
        _update_formats(
            kind,
            mode,
            state_fmt,
            bf16,
            fp32,
            other,
            p_fmt,
            g_fmt,
            has_state1,
            addresses,
            j0,
            scale,
            scalars,
            w_bits,
            m_bits,
            v_bits,
        )
        i = end
        k += 1


def _make_step_cpu(kind, mode, state_fmt, state1, formats):
    """The CPU step of one configuration: kind, weight mode, state format, which tensors have
    a first state (``state1_presence``) and which format loops are needed (``format_cases``)
    are constants of the compiled loops (closure variables), so each configuration compiles on
    first use (3-8 s), alone, and is cached."""
    bf16, fp32, other = formats

    @njit(parallel=True, cache=True, error_model="numpy")
    def step_cpu(table, starts, hyper, steps, coefs, inv_scale, found, k0, k1):
        """One fused step over every tensor of ``table`` (module docstring); ``inv_scale``
        and ``found``: uint32[1] float32 patterns."""
        if found[0] & 0x7FFFFFFF:
            return
        for k in range(table.shape[0]):
            steps[k] += 1
            if k > 0 and steps[k] == steps[k - 1] and table[k, GROUP] == table[k - 1, GROUP]:
                coefs[k] = coefs[k - 1]  # the common case: the same step of the same group
                continue
            h = hyper[table[k, GROUP]]
            coefs[k, 0], coefs[k, 1], coefs[k, 2], coefs[k, 3] = prepare_coefs(
                kind, steps[k], h[0], h[1], h[2], h[3], h[4]
            )
        scale = bits_to_f32(inv_scale[0])
        total = starts[-1]
        for c in prange((total + _CHUNK - 1) // _CHUNK):
            _step_chunk(
                kind,
                mode,
                state_fmt,
                state1,
                bf16,
                fp32,
                other,
                table,
                starts,
                hyper,
                steps,
                coefs,
                scale,
                k0,
                k1,
                c * _CHUNK,
                min(c * _CHUNK + _CHUNK, total),
            )

    return step_cpu


STATE1_NONE, STATE1_ALL, STATE1_SOME = range(3)


def state1_presence(table) -> int:
    """Whether no, every or some tensor of ``table`` has a first state (an SGD momentum buffer;
    AdamW: every one). Loops over a mix test per tensor and do not vectorize."""
    present = np.asarray(table)[:, S1_ADDR] != 0
    return STATE1_ALL if present.all() else STATE1_SOME if present.any() else STATE1_NONE


def format_cases(table) -> tuple:
    """``(bf16, fp32, other)``: whether ``table`` has bf16 tensors (parameter and gradient),
    fp32 ones, and any other combination (fp16, or formats that differ)."""
    p_fmt, g_fmt = np.asarray(table)[:, P_FMT], np.asarray(table)[:, G_FMT]
    bf16 = (p_fmt == 1) & (g_fmt == 1)
    fp32 = (p_fmt == 0) & (g_fmt == 0)
    return bool(bf16.any()), bool(fp32.any()), bool((~bf16 & ~fp32).any())


_STEP_CPU = {}


def step_cpu_kernel(kind, mode, state_fmt, state1, formats):
    """The compiled CPU step of a configuration (``_make_step_cpu``), built once per process."""
    key = (kind, mode, state_fmt, state1, formats)
    if key not in _STEP_CPU:
        _STEP_CPU[key] = _make_step_cpu(*key)
    return _STEP_CPU[key]


class FusedStep:
    """A fused step over a fixed set of buffers: the pointer table is built and (on CUDA)
    copied to the device once; each ``run`` is one CPU call or two CUDA launches, whatever the
    number of tensors. The caller keeps the buffers alive and in place.

    Args:
        kind: ``ADAMW`` or ``SGD``.
        mode: weight mode code (``MODES``); state_fmt: 0 (fp32) or 1 (bf16).
        table: int64[N, 8] host table (module docstring); sizes: elements per tensor.
        steps: uint32[N] bits of the int32 step counters (host or device array).
        device: ``"cpu"`` or ``"cuda"``; stream: the CUDA stream to launch on.
    """

    def __init__(self, kind, mode, state_fmt, table, sizes, steps, device, stream=None):
        self.kind, self.mode, self.state_fmt = kind, mode, state_fmt
        starts = np.concatenate([[0], np.cumsum(np.asarray(sizes, np.int64))]).astype(np.int64)
        self.total = int(starts[-1])
        if self.total >= MAX_ELEMENTS:
            raise ValueError(f"params: {self.total} elements, at most {MAX_ELEMENTS - 1} per step")
        if len(table) and int((table[:, NOISE] + np.diff(starts)).max()) > MAX_ELEMENTS:
            raise ValueError(f"params: noise starts past {MAX_ELEMENTS} elements")
        self.device, self.stream, self.steps = device, stream, steps
        coefs = np.zeros((len(table), 4), np.float32)
        self._hyper_host = None
        self._hyper = None
        self._host_table, self._grad_table = table, None  # gradient columns: check_grads
        if device == "cpu":
            self.table, self.starts, self.coefs = table, starts, coefs
            self._kernel = step_cpu_kernel(
                kind, mode, state_fmt, state1_presence(table), format_cases(table)
            )
        else:
            from ._numba_cuda_compat import import_numba_cuda

            cuda = import_numba_cuda()
            self.table, self.starts, self.coefs = (
                cuda.to_device(a, stream=stream) for a in (table, starts, coefs)
            )

    def set_hyper(self, hyper: np.ndarray) -> None:
        """Per-group hyperparameters (float64[G, 5]); copied to the device only when changed
        (a learning-rate schedule changes them every step: one small copy)."""
        if self._hyper_host is not None and np.array_equal(hyper, self._hyper_host):
            return
        self._hyper_host = hyper.copy()
        if self.device == "cpu":
            self._hyper = self._hyper_host
        elif self._hyper is not None and self._hyper.shape == hyper.shape:
            # stream-ordered: the previous step's kernels have read the old values by then
            self._hyper.copy_to_device(self._hyper_host, stream=self.stream)
        else:
            from ._numba_cuda_compat import import_numba_cuda

            self._hyper = import_numba_cuda().to_device(self._hyper_host, stream=self.stream)

    def check_grads(self, found) -> None:
        """Set ``found`` (uint32[1], float32 bits, on the table's device) to 1.0 if any gradient
        of the table is inf/NaN: the loss-scale overflow check, one pass that reads the
        gradients and writes nothing, through the cached table (no per-call table build)."""
        from ._loss_scale import unscale_and_check_cpu

        if self._grad_table is None:
            columns = [np.ascontiguousarray(self._host_table[:, c]) for c in (G_ADDR, G_FMT)]
            one = np.array([1.0], np.float32).view(np.uint32)
            if self.device == "cuda":
                from ._numba_cuda_compat import import_numba_cuda

                cuda = import_numba_cuda()
                columns = [cuda.to_device(a, stream=self.stream) for a in columns]
                one = cuda.to_device(one, stream=self.stream)
            self._grad_table = (*columns, self.starts, one)
        args = (*self._grad_table, found, False)
        if self.device == "cpu":
            run(unscale_and_check_cpu, self.total, *args)
        else:
            from . import _cuda

            _cuda.unscale_and_check(*args, total=self.total, stream=self.stream)

    def run(self, inv_scale, found, k0, k1) -> None:
        """One step; ``inv_scale``, ``found``: uint32[1] float32 bits on the table's device."""
        args = (
            self.table,
            self.starts,
            self._hyper,
            self.steps,
            self.coefs,
            inv_scale,
            found,
            k0,
            k1,
        )
        if self.device == "cpu":
            run(self._kernel, self.total, *args)
        else:
            from . import _cuda

            _cuda.optim_step(
                self.kind, self.mode, self.state_fmt, *args, total=self.total, stream=self.stream
            )
