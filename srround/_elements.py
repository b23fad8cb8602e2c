"""One-element bodies of every operation, written once and compiled for both backends.

The CPU loops (``_cpu.py``, ``prange``) and the CUDA kernels (``_cuda.py``, grid-stride) call
these ``@njit`` functions on scalars: buffer addresses, bit patterns, float32 values. Formats
are ``BufferCode`` values (``_formats.py``); a code's field widths and element width come from
the tables there, so a new format needs no code here.

Optimizer tables, constants and element math are defined here; their contract (update order,
weight modes, noise offsets) is in ``docs/contracts.md``.
"""

from __future__ import annotations

import enum
import math

import numpy as np
from numba import njit

from ._formats import CODE_EXPONENT_BITS, CODE_MANTISSA_BITS, CODE_WIDTH, BufferCode
from ._rng import lane_bits16, random_block
from ._scalar import (
    bits_to_f32,
    decode,
    encode_nearest,
    encode_stochastic,
    f32_to_bits,
    fma32,
    result_bits,
)
from ._tensor_list import load_bits, store_bits

# buffer codes as plain ints: Numba folds them as constants
F32 = int(BufferCode.FLOAT32)
BF16 = int(BufferCode.BFLOAT16)
F16 = int(BufferCode.FLOAT16)
_MANTISSA = CODE_MANTISSA_BITS
_EXPONENT = CODE_EXPONENT_BITS
_WIDTH = CODE_WIDTH
_ONE_F32 = 0x3F800000


# -- buffers by code -------------------------------------------------------------------------


@njit(cache=True)
def widen(bits, code):
    """fp32 pattern (an int64) of a pattern of float buffer code ``code`` (exact)."""
    if code == F32:
        return np.int64(bits)
    if _EXPONENT[code] == 8:  # fp32's exponent range: the fp32 pattern's high bits
        return np.int64(bits) << (23 - _MANTISSA[code])
    return np.int64(decode(bits, _MANTISSA[code], _EXPONENT[code]))


@njit(cache=True)
def narrow_nearest(u, code):
    """fp32 pattern ``u`` rounded to nearest, ties to even, in format ``code`` (fp32: itself)."""
    if code == F32:
        return u
    return encode_nearest(u, _MANTISSA[code], _EXPONENT[code], False)


@njit(cache=True)
def narrow_stochastic(u, bits16, code):
    """fp32 pattern ``u`` stochastically rounded to format ``code`` with 16 random bits."""
    if code == F32:
        return u
    return encode_stochastic(u, bits16, _MANTISSA[code], _EXPONENT[code], False)


@njit(cache=True)
def load(address, j, code):
    """Element ``j`` of the buffer at ``address`` holding ``code`` elements, as an int64."""
    width = _WIDTH[code]
    if width == 4:
        return load_bits(address, j, 32)
    if width == 2:
        return load_bits(address, j, 16)
    return load_bits(address, j, 8)


@njit(cache=True)
def store(address, j, value, code):
    """Store the pattern ``value`` as element ``j`` of the buffer at ``address`` (``code``)."""
    width = _WIDTH[code]
    if width == 4:
        store_bits(address, j, value, 32)
    elif width == 2:
        store_bits(address, j, value, 16)
    else:
        store_bits(address, j, value, 8)


@njit(forceinline=True, cache=True)
def noise_bits16(k0, k1, offset):
    """The 16 random bits of counter ``offset`` of the stream of key ``(k0, k1)``: lane
    ``offset & 3`` of Threefry block ``offset >> 2``."""
    x0, x1 = random_block(k0, k1, offset >> 2)
    return lane_bits16(x0, x1, offset & 3)


# -- loss scaling ----------------------------------------------------------------------------


@njit(forceinline=True, cache=True)
def unscale_bits(bits, code, inv_scale):
    """``(new_bits, finite)`` for one gradient element of format ``code``: times float32
    ``inv_scale``, rounded back to nearest in the gradient's format (as ``grad.mul_`` in
    torch); ``finite``: whether the *result* - the unscaled gradient the optimizer reads - is
    finite, so a NaN or inf ``inv_scale``, or an fp16 product past 65504, is flagged too.
    ``inv_scale == 1`` keeps the bits; otherwise a NaN product is the canonical +qNaN."""
    wide = widen(bits, code)
    scaled = narrow_nearest(result_bits(bits_to_f32(wide) * inv_scale), code)
    # x * 1 is x: with a scale of 1, ``scaled`` is ``bits`` up to a NaN's payload
    finite = (widen(scaled, code) & 0x7F800000) != 0x7F800000
    return (bits if inv_scale == 1.0 else scaled), finite


@njit(forceinline=True, cache=True)
def scale_usable(inv_scale_bits):
    """Whether float32 bits are a positive, finite scale: exactly the patterns in
    ``(0, 0x7F800000)`` (sign clear, not zero, exponent not all ones). A zero, negative, NaN
    or inf ``inv_scale`` sets ``found_inf`` (it would zero or poison every gradient)."""
    return 0 < inv_scale_bits < 0x7F800000


@njit(forceinline=True, cache=True)
def unscale_in_place(address, code, j, inv_scale_bits):
    """Unscale element ``j`` of the buffer at ``address`` in place by the float32 of bits
    ``inv_scale_bits``; returns whether the result is finite and the scale usable
    (``scale_usable``). A scale of exactly 1 only reads."""
    new, finite = unscale_bits(load(address, j, code), code, bits_to_f32(inv_scale_bits))
    if inv_scale_bits != _ONE_F32:
        store(address, j, new, code)
    return finite and scale_usable(inv_scale_bits)


@njit(forceinline=True, cache=True)
def update_scale_one(
    scale_bits,
    growth,
    overflows,
    found_bits,
    growth_factor,
    backoff_factor,
    growth_interval,
    hysteresis,
    min_scale,
    max_scale,
):
    """The loss-scale update rule (``docs/contracts.md``) for one float32 scale (bits) and its
    two counters; returns the new ``(scale_bits, growth, overflows)``. The factors are float64
    and each product is rounded once to float32 (torch's ``_amp_update_scale_``); ``min_scale``
    and ``max_scale`` are float32."""
    current = bits_to_f32(scale_bits)
    if (found_bits & 0x7FFFFFFF) != 0:  # any nonzero float32 flag
        growth = 0
        overflows += 1
        if overflows >= hysteresis:
            current = max(np.float32(np.float64(current) * backoff_factor), min_scale)
            overflows = 0
    else:
        overflows = 0
        growth += 1
        if growth == growth_interval:
            grown = np.float32(np.float64(current) * growth_factor)
            if math.isfinite(grown):
                current = min(grown, max_scale)
            growth = 0
    return f32_to_bits(current), growth, overflows


# -- fused optimizer steps -------------------------------------------------------------------


class Kind(enum.IntEnum):
    """Which optimizer a fused step runs."""

    ADAMW = 0
    SGD = 1


class Mode(enum.IntEnum):
    """How an fp32 result is written back to a bf16/fp16 parameter (``docs/contracts.md``)."""

    STOCHASTIC = 0
    NEAREST = 1
    KAHAN = 2
    MASTER = 3
    REMAINDER = 4


class Column(enum.IntEnum):
    """Columns of an optimizer's pointer table (int64[N, len(Column)], one row per tensor)."""

    P_ADDR = 0  # parameter
    P_FMT = 1
    G_ADDR = 2  # gradient
    G_FMT = 3
    S1_ADDR = 4  # first state (AdamW exp_avg, SGD momentum buffer; 0: none)
    S2_ADDR = 5  # second state (AdamW exp_avg_sq)
    AUX_ADDR = 6  # the weight mode's buffer (0: none)
    GROUP = 7  # row of the hyperparameter array
    NOISE = 8  # stream start of the tensor's element 0 (the planner's default: its start in
    # the table's element range; a sharded tensor's: its place in the full tensor)
    S1_SCALE = 9  # float32 block scales of an fp8 first / second state (``_state8``; 0: none)
    S2_SCALE = 10
    NOISE_RUN = 11  # a tensor whose stream is not one range (a tensor-parallel piece: rows of
    NOISE_SKIP = 12  # a column shard): elements per run of consecutive stream positions (0: one
    # range), and the positions skipped between two runs (``run_noise``)


class Hyper(enum.IntEnum):
    """Columns of the float64[G, len(Hyper)] hyperparameter array (one row per param group).

    AdamW uses the names; SGD stores ``(lr, momentum, dampening, weight_decay, nesterov)`` in
    the same five columns.
    """

    LR = 0
    BETA1 = 1
    BETA2 = 2
    EPS = 3
    WEIGHT_DECAY = 4


ADAMW, SGD = int(Kind.ADAMW), int(Kind.SGD)
STOCHASTIC, NEAREST, KAHAN, MASTER, REMAINDER = (int(m) for m in Mode)
MODES = {mode.name.lower(): int(mode) for mode in Mode}
(
    P_ADDR,
    P_FMT,
    G_ADDR,
    G_FMT,
    S1_ADDR,
    S2_ADDR,
    AUX_ADDR,
    GROUP,
    NOISE,
    S1_SCALE,
    S2_SCALE,
    NOISE_RUN,
    NOISE_SKIP,
) = (int(c) for c in Column)
TABLE_COLUMNS = len(Column)
HYPER_COLUMNS = len(Hyper)
COEF_COLUMNS = 4  # float32 per-tensor coefficients of a step (``prepare_coefs``)
STEP_SHIFT, STREAM_SHIFT = 36, 34  # noise offset = step << 36 + stream << 34 + element
MAX_STEPS = 1 << 26
MAX_ELEMENTS = 1 << 34
WEIGHT_STREAM, STATE1_STREAM, STATE2_STREAM = 0, 1, 2


@njit(cache=True)
def weight_value(mode, code, p_bits, aux_bits):
    """The fp32 pattern an update starts from: the parameter, or its mode's exact value."""
    if code == F32:
        return p_bits
    if mode == MASTER:
        return aux_bits
    if mode == REMAINDER:
        low = aux_bits - ((aux_bits & 0x8000) << 1)  # int16 from its uint16 pattern
        return ((p_bits << 16) + low) & 0xFFFFFFFF
    return widen(p_bits, code)


@njit(cache=True)
def weight_write(mode, code, old_bits, new_bits, aux_bits, bits16):
    """``(param pattern, aux pattern)`` storing the fp32 result ``new_bits`` of a parameter of
    format ``code`` whose value was ``old_bits`` (``weight_value``), per weight mode."""
    if code == F32:
        return new_bits, aux_bits
    if mode == STOCHASTIC:
        return narrow_stochastic(new_bits, bits16, code), aux_bits
    if mode == NEAREST:
        return narrow_nearest(new_bits, code), aux_bits
    if mode == MASTER:
        return narrow_nearest(new_bits, code), new_bits
    if mode == KAHAN:
        old = bits_to_f32(old_bits)
        compensated = bits_to_f32(widen(aux_bits, code)) + (bits_to_f32(new_bits) - old)
        written = narrow_nearest(result_bits(old + compensated), code)
        moved = bits_to_f32(widen(written, code)) - old
        return written, narrow_nearest(result_bits(compensated - moved), code)
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
def prepare_coefs(kind, step, lr, hyper1, hyper2, hyper3, hyper4):
    """float32 coefficients of step ``step`` (1-based) of a tensor whose group has the
    hyperparameter row ``(lr, hyper1..hyper4)`` (``Hyper``): AdamW ``(1 - lr*wd, lr / bc1,
    sqrt(bc2), 0)`` with bias corrections ``bc = 1 - beta**step``; SGD ``(lr, first step?,
    0, 0)``."""
    if kind == ADAMW:
        beta1, beta2, weight_decay = hyper1, hyper2, hyper4
        bc1 = 1.0 - _power(beta1, step)
        bc2 = 1.0 - _power(beta2, step)
        return (
            np.float32(1.0 - lr * weight_decay),
            np.float32(lr / bc1),
            np.float32(math.sqrt(bc2)),
            np.float32(0.0),
        )
    first = 1.0 if step == 1 else 0.0
    return np.float32(lr), np.float32(first), np.float32(0.0), np.float32(0.0)


@njit(cache=True)
def group_constants(kind, hyper1, hyper2, hyper3, hyper4):
    """float32 constants of a group's element math from its hyperparameter columns 1-4:
    AdamW ``(beta2, eps, 1-beta1, 1-beta2)``; SGD ``(momentum, 1-dampening, wd, nesterov)``."""
    if kind == ADAMW:
        beta1, beta2, eps = hyper1, hyper2, hyper3
        return np.float32(beta2), np.float32(eps), np.float32(1.0 - beta1), np.float32(1.0 - beta2)
    momentum, dampening, weight_decay, nesterov = hyper1, hyper2, hyper3, hyper4
    return (
        np.float32(momentum),
        np.float32(1.0 - dampening),
        np.float32(weight_decay),
        np.float32(nesterov),
    )


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
def stream_offset(step, stream, start):
    """Noise counter of element 0 of a tensor starting at global element ``start``, for
    ``stream`` (``WEIGHT_STREAM``, ``STATE1_STREAM``, ``STATE2_STREAM``) at step ``step``."""
    return (np.int64(step) << STEP_SHIFT) + (np.int64(stream) << STREAM_SHIFT) + start


@njit(forceinline=True, cache=True)
def update_element(kind, mode, formats, buffers, has_state1, j, scale, coefs, group, noise):
    """Element ``j`` of one tensor, updated in place: the body both backends run. Every result
    it writes is formed by ``result_bits``, so a NaN is +qNaN on every device.

    Args:
        kind, mode: ``Kind`` and ``Mode`` values.
        formats: ``(param, grad, state)`` buffer codes.
        buffers: ``(param, grad, state1, state2, aux)`` addresses (0: no buffer).
        has_state1: whether ``state1`` is a buffer (SGD without momentum has none).
        scale: float32 gradient multiplier (1 / loss scale).
        coefs: the tensor's float32 ``(c0, c1, c2)`` of this step (``prepare_coefs``).
        group: the group's float32 constants (``group_constants``).
        noise: 16 random bits of the ``(weight, state1, state2)`` streams (unused where no
            stochastic rounding happens).
    """
    p_fmt, g_fmt, state_fmt = formats
    p_addr, g_addr, s1_addr, s2_addr, aux_addr = buffers
    coef0, coef1, coef2 = coefs
    const1, const2, const3, const4 = group
    w_bits16, m_bits16, v_bits16 = noise
    aux_fmt = F32 if mode == MASTER else BF16
    has_aux = p_fmt != F32 and mode >= KAHAN
    g = bits_to_f32(widen(load(g_addr, j, g_fmt), g_fmt)) * scale
    p_bits = load(p_addr, j, p_fmt)
    aux_bits = load(aux_addr, j, aux_fmt) if has_aux else 0
    old = weight_value(mode, p_fmt, p_bits, aux_bits)
    m = np.float32(0)
    if has_state1:
        m = bits_to_f32(widen(load(s1_addr, j, state_fmt), state_fmt))
    if kind == ADAMW:
        v = bits_to_f32(widen(load(s2_addr, j, state_fmt), state_fmt))
        new, m, v = adamw_math(
            bits_to_f32(old), g, m, v, coef0, coef1, coef2, const1, const2, const3, const4
        )
        v_bits = result_bits(v)
        if state_fmt != F32:
            v_bits = narrow_stochastic(v_bits, v_bits16, state_fmt)
        store(s2_addr, j, v_bits, state_fmt)
    else:
        new, m = sgd_math(bits_to_f32(old), g, m, coef0, coef1, const1, const2, const3, const4)
    if has_state1:
        m_bits = result_bits(m)
        if state_fmt != F32:
            m_bits = narrow_stochastic(m_bits, m_bits16, state_fmt)
        store(s1_addr, j, m_bits, state_fmt)
    p_new, aux_new = weight_write(mode, p_fmt, old, result_bits(new), aux_bits, w_bits16)
    store(p_addr, j, p_new, p_fmt)
    if has_aux:
        store(aux_addr, j, aux_new, aux_fmt)


STATE1_NONE, STATE1_ALL, STATE1_SOME = range(3)


def state1_presence(table) -> int:
    """Whether no, every or some tensor of ``table`` has a first state (an SGD momentum buffer;
    AdamW: every one): a constant of the compiled steps, where a mix tests per tensor."""
    present = np.asarray(table)[:, S1_ADDR] != 0
    return STATE1_ALL if present.all() else STATE1_SOME if present.any() else STATE1_NONE


@njit(forceinline=True, cache=True)
def run_noise(noise, run, skip, j):
    """The stream start to pair with element ``j`` of a tensor whose table row has ``NOISE``,
    ``NOISE_RUN``, ``NOISE_SKIP`` = ``noise, run, skip``: its stream position is
    ``run_noise(...) + j``, that is ``noise + j`` plus ``skip`` for each whole run before it."""
    if run == 0:
        return noise
    return noise + (j // run) * skip


@njit(cache=True)
def step_element(
    kind, mode, formats, buffers, has_state1, j, start, step, scale_bits, coefs, group, key
):
    """``update_element`` for a kernel that has no random-bit buffer (CUDA): draws element
    ``j``'s noise itself, one Threefry block per element and stream (a thread per element, so
    that a warp's loads are consecutive; docs/performance.md, "On a GPU": sharing a block
    among a thread's four consecutive elements was slower).

    Args:
        formats, buffers, has_state1, coefs, group: as ``update_element``'s.
        start: the tensor's first global element; step: its step count (after the increment).
        scale_bits: float32 bits of the gradient multiplier.
        key: the Threefry key ``(k0, k1)``.
    """
    p_fmt, _g_fmt, state_fmt = formats
    k0, k1 = key
    # float32 again: in the simulator these come from Python, where a float32 is a float
    coefs = (np.float32(coefs[0]), np.float32(coefs[1]), np.float32(coefs[2]))
    c1, c2, c3, c4 = group
    group = (np.float32(c1), np.float32(c2), np.float32(c3), np.float32(c4))
    w_bits16 = m_bits16 = v_bits16 = 0
    if mode == STOCHASTIC and p_fmt != F32:
        w_bits16 = noise_bits16(k0, k1, stream_offset(step, WEIGHT_STREAM, start) + j)
    if state_fmt != F32:
        if has_state1:
            m_bits16 = noise_bits16(k0, k1, stream_offset(step, STATE1_STREAM, start) + j)
        if kind == ADAMW:
            v_bits16 = noise_bits16(k0, k1, stream_offset(step, STATE2_STREAM, start) + j)
    update_element(
        kind,
        mode,
        formats,
        buffers,
        has_state1,
        j,
        bits_to_f32(scale_bits),
        coefs,
        group,
        (w_bits16, m_bits16, v_bits16),
    )
