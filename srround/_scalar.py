"""Scalar kernel bodies: one element, written once, compiled for CPU (njit) and CUDA.

Every function here is a plain ``@njit`` function on integer bit patterns. The CPU backend calls
it from a ``prange`` loop, the CUDA backend from a grid-stride ``cuda.jit`` kernel (numba-cuda
compiles ``njit`` functions for the device). Backends differ only in the loop around a body.

Formats are passed as ``(mantissa_bits, exponent_bits)`` of the narrow format (``_formats.py``).
Rounding is exact integer arithmetic on the fp32 pattern; the rounding contract (the
decision rules, the probability of rounding up, special values, overflow) is section 2 of
``docs/contracts.md``, and this module is its reference implementation.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

_F32_ABS = 0x7FFFFFFF
_F32_INF = 0x7F800000
F32_QNAN = 0x7FC00000  # the NaN of srround's arithmetic (``result_bits``)


@njit(forceinline=True, cache=True)
def _split_f32(a):
    """Significand (with implicit bit) and unbiased exponent of a non-negative finite fp32
    pattern ``a``; fp32 subnormals report exponent -126 with no implicit bit."""
    biased = a >> 23
    if biased == 0:
        return a & 0x7FFFFF, -126
    return (a & 0x7FFFFF) | 0x800000, biased - 127


# What a format does with its top patterns (``Format.specials``): IEEE-like (all-ones exponent =
# inf and NaN: bf16, fp16, fp8 e5m2), "fn" (finite + NaN: only the all-ones pattern is NaN, no
# inf: fp8 e4m3fn) and "fn" without NaN (every pattern finite: fp4 e2m1fn).
IEEE, FN, FINITE = 0, 1, 2


@njit(forceinline=True, cache=True)
def _top(mantissa_bits, exponent_bits, kind):
    """``(limit, overflow, nan)`` magnitude patterns of a format: ``limit`` is the first one past
    the largest finite value, ``overflow`` what a finite overflow becomes without saturation,
    ``nan`` the canonical NaN (0 for a format without NaN: NaN inputs become zero)."""
    inf = ((1 << exponent_bits) - 1) << mantissa_bits
    ones = (1 << (exponent_bits + mantissa_bits)) - 1
    if kind == IEEE:
        return inf, inf, inf | (1 << (mantissa_bits - 1))
    if kind == FN:
        return ones, ones, ones
    return ones + 1, ones, 0


@njit(forceinline=True, cache=True)
def _special(u, mantissa_bits, exponent_bits, saturate=False, kind=IEEE):
    """For NaN and +-inf inputs, the narrow pattern; -1 for every other input.

    NaN -> the format's NaN (IEEE: the quiet NaN, sign | all-ones exponent | top fraction bit;
    fn: sign | all ones; no NaN: zero with the NaN's sign). inf -> inf where the format has
    inf; else the NaN (fn, ``saturate=False``) or the largest finite value."""
    a = u & _F32_ABS
    if a < _F32_INF:
        return -1
    sign = ((u >> 31) & 1) << (exponent_bits + mantissa_bits)
    limit, overflow, nan = _top(mantissa_bits, exponent_bits, kind)
    if a == _F32_INF:
        if kind == IEEE:
            return sign | limit
        return sign | (limit - 1 if saturate else overflow)
    return sign | nan


@njit(forceinline=True, cache=True)
def _quantize(u, mantissa_bits, exponent_bits):
    """``(base, q, r, s)`` of a finite fp32 pattern: the result is ``base + q + up`` (plus the
    sign), with ``r / 2**s`` the fraction of a quantum that was dropped."""
    if exponent_bits == 8:
        # fp32's exponent range (bf16): the narrow pattern is the fp32 pattern without its low
        # 23 - mantissa_bits bits, in every binade and for fp32 subnormals alike - the general
        # path below computes the same (s is constant), this skips what a compiler cannot fold
        s = 23 - mantissa_bits
        a = u & _F32_ABS
        return 0, a >> s, a & ((1 << s) - 1), s
    m, e = _split_f32(u & _F32_ABS)
    bias = (1 << (exponent_bits - 1)) - 1
    e_eff = max(e, 1 - bias)
    s = min(23 - mantissa_bits + (e_eff - e), 40)  # past 40 bits nothing of m survives
    q = m >> s
    r = m & ((1 << s) - 1)
    return (e_eff + bias - 1) << mantissa_bits, q, r, s


@njit(forceinline=True, cache=True)
def _finish(u, magnitude, mantissa_bits, exponent_bits, saturate, kind=IEEE):
    """Apply the overflow policy and the sign to a rounded magnitude pattern: past the largest
    finite value is the format's overflow pattern (inf, NaN for e4m3fn, the largest value for
    a format with neither), or the largest finite value under ``saturate``."""
    limit, overflow, _ = _top(mantissa_bits, exponent_bits, kind)
    if magnitude >= limit:
        magnitude = limit - 1 if saturate else overflow
    return (((u >> 31) & 1) << (exponent_bits + mantissa_bits)) | magnitude


# bf16 (the fp32 exponent range, 16 dropped bits) has closed forms that the general path
# computes too; written in 32-bit integer IR because Numba widens scalar integer arithmetic to
# 64 bits, which halves the CPU vector width.
#   nearest:    (a + 0x7FFF + bit 16 of a) >> 16               (ties to even)
#   stochastic: (a + 0xFFFF - bits16) >> 16, i.e. up iff bits16 < the low half of a
# with a = |u|, the sign put back, and NaN -> the canonical quiet NaN; a carry past the largest
# finite value lands on the infinity pattern, as in the general path.
_I32 = ir.IntType(32)


def _i32(value):
    return ir.Constant(_I32, value)


def _low32(builder, value):
    """The low 32 bits of an integer of any width (narrower ones zero-extended)."""
    width = value.type.width
    if width == 32:
        return value
    return builder.trunc(value, _I32) if width > 32 else builder.zext(value, _I32)


def _bf16_finish(builder, u, magnitude):
    """Sign of fp32 pattern ``u`` on the bf16 ``magnitude``; NaN inputs -> quiet NaN (i64)."""
    sign = builder.and_(builder.lshr(u, _i32(16)), _i32(0x8000))
    is_nan = builder.icmp_unsigned(">", builder.and_(u, _i32(_F32_ABS)), _i32(_F32_INF))
    result = builder.select(is_nan, _i32(0x7FC0), magnitude)
    return builder.zext(builder.or_(result, sign), ir.IntType(64))


@intrinsic
def _bf16_nearest(typingctx, u):
    """bf16 pattern of fp32 pattern ``u`` (int) rounded to nearest, ties to even."""

    def codegen(context, builder, signature, args):
        x = _low32(builder, args[0])
        a = builder.and_(x, _i32(_F32_ABS))
        odd = builder.and_(builder.lshr(a, _i32(16)), _i32(1))
        magnitude = builder.lshr(builder.add(builder.add(a, _i32(0x7FFF)), odd), _i32(16))
        return _bf16_finish(builder, x, magnitude)

    return types.int64(u), codegen


@intrinsic
def _bf16_stochastic(typingctx, u, bits16):
    """bf16 pattern of fp32 pattern ``u`` (int) rounded up with P = low half / 2**16."""

    def codegen(context, builder, signature, args):
        x = _low32(builder, args[0])
        a = builder.and_(x, _i32(_F32_ABS))
        bits = _low32(builder, args[1])
        magnitude = builder.lshr(builder.sub(builder.add(a, _i32(0xFFFF)), bits), _i32(16))
        return _bf16_finish(builder, x, magnitude)

    return types.int64(u, bits16), codegen


@intrinsic
def _encode_narrow(typingctx, u, bits16, mantissa_bits, exponent_bits, saturate, kind, stochastic):
    """The narrow pattern of fp32 pattern ``u`` for a format with fewer exponent bits than
    fp32's (fp16, fp8, fp4): ``_special``, ``_quantize``, the rounding and ``_finish`` of the
    general path in 32-bit integer IR (Numba's own arithmetic is 64-bit, which halves the CPU
    vector width). ``stochastic``: round up iff ``bits16 < floor(2**16 * dropped fraction)``,
    else to nearest, ties to even. Bit for bit the general path (``tests/test_rounding.py``)."""
    sig = types.int64(u, bits16, mantissa_bits, exponent_bits, saturate, kind, stochastic)

    def codegen(context, builder, signature, args):
        b = builder
        x, rnd, m, e = (_low32(b, v) for v in args[:4])
        sat, knd, sto = (_low32(b, v) for v in args[4:])
        one = _i32(1)

        def shl(v, n):
            return b.shl(v, n)

        def at_most(v, cap):
            return b.select(b.icmp_unsigned("<", v, _i32(cap)), v, _i32(cap))

        # _top and _special
        a = b.and_(x, _i32(_F32_ABS))
        sign = shl(b.and_(b.lshr(x, _i32(31)), one), b.add(e, m))
        inf_pattern = shl(b.sub(shl(one, e), one), m)
        ones = b.sub(shl(one, b.add(e, m)), one)
        ieee = b.icmp_unsigned("==", knd, _i32(IEEE))
        fn = b.icmp_unsigned("==", knd, _i32(FN))
        limit = b.select(ieee, inf_pattern, b.select(fn, ones, b.add(ones, one)))
        overflow = b.select(ieee, inf_pattern, ones)
        nan = b.select(
            ieee, b.or_(inf_pattern, shl(one, b.sub(m, one))), b.select(fn, ones, _i32(0))
        )
        past = b.select(b.icmp_unsigned("!=", sat, _i32(0)), b.sub(limit, one), overflow)
        is_nan = b.icmp_unsigned(">", a, _i32(_F32_INF))
        is_special = b.icmp_unsigned(">=", a, _i32(_F32_INF))
        special = b.or_(sign, b.select(is_nan, nan, b.select(ieee, limit, past)))
        # _quantize: significand, effective exponent, dropped bits (13 and up)
        biased = b.lshr(a, _i32(23))
        fraction = b.and_(a, _i32(0x7FFFFF))
        subnormal = b.icmp_unsigned("==", biased, _i32(0))
        significand = b.select(subnormal, fraction, b.or_(fraction, _i32(0x800000)))
        exponent = b.select(subnormal, _i32(-126), b.sub(biased, _i32(127)))
        bias = b.sub(shl(one, b.sub(e, one)), one)
        lowest = b.sub(one, bias)
        effective = b.select(b.icmp_signed(">", exponent, lowest), exponent, lowest)
        dropped = b.add(b.sub(_i32(23), m), b.sub(effective, exponent))
        s = at_most(dropped, 31)  # a legal shift; q = 0 and r = significand from 24 on
        q = b.lshr(significand, s)
        r = b.and_(significand, b.sub(shl(one, s), one))
        # stochastic: (r << 16) >> dropped in 32 bits (past 40, as 40: zero)
        far = at_most(dropped, 40)
        wide = b.icmp_unsigned("<=", far, _i32(16))
        threshold = b.select(
            wide,
            shl(r, b.sub(_i32(16), b.select(wide, far, _i32(16)))),
            b.lshr(r, b.sub(b.select(wide, _i32(16), far), _i32(16))),
        )
        up_stochastic = b.icmp_unsigned("<", rnd, threshold)
        # nearest: above half, or a tie on an odd q (half capped at 2**24, above every r)
        half = shl(one, b.sub(at_most(s, 25), one))
        tie_up = b.and_(
            b.icmp_unsigned("==", r, half), b.icmp_unsigned("!=", b.and_(q, one), _i32(0))
        )
        up_nearest = b.or_(b.icmp_unsigned(">", r, half), tie_up)
        up = b.select(b.icmp_unsigned("!=", sto, _i32(0)), up_stochastic, up_nearest)
        # _finish
        base = shl(b.add(effective, b.sub(bias, one)), m)
        magnitude = b.add(b.add(base, q), b.zext(up, _I32))
        magnitude = b.select(b.icmp_unsigned(">=", magnitude, limit), past, magnitude)
        result = b.select(is_special, special, b.or_(sign, magnitude))
        return b.zext(result, ir.IntType(64))

    return sig, codegen


@njit(forceinline=True, cache=True)
def encode_stochastic(u, bits16, mantissa_bits, exponent_bits, saturate, kind=IEEE):
    """Stochastically round fp32 pattern ``u`` to the narrow format using 16 random bits.

    Returns the narrow pattern (an int). P(round away from zero) = floor(2**16 * frac) / 2**16
    where frac is the dropped fraction of a quantum (``docs/contracts.md`` section 2).
    """
    if mantissa_bits == 7 and exponent_bits == 8 and not saturate:
        return _bf16_stochastic(u, bits16)
    if exponent_bits < 8:
        return _encode_narrow(u, bits16, mantissa_bits, exponent_bits, saturate, kind, True)
    special = _special(u, mantissa_bits, exponent_bits, saturate, kind)
    # Both paths are computed and one is selected (no early return): the body is branch-free,
    # so the CPU compiler can vectorize a loop over it (NaN/inf inputs harmlessly compute a
    # discarded finite result).
    base, q, r, s = _quantize(u, mantissa_bits, exponent_bits)
    threshold = (r << 16) >> s
    up = 1 if bits16 < threshold else 0
    rounded = _finish(u, base + q + up, mantissa_bits, exponent_bits, saturate, kind)
    return special if special >= 0 else rounded


@njit(forceinline=True, cache=True)
def encode_nearest(u, mantissa_bits, exponent_bits, saturate, kind=IEEE):
    """Round fp32 pattern ``u`` to the nearest narrow value, ties to even (IEEE default)."""
    if mantissa_bits == 7 and exponent_bits == 8 and not saturate:
        return _bf16_nearest(u)
    if exponent_bits < 8:
        return _encode_narrow(u, 0, mantissa_bits, exponent_bits, saturate, kind, False)
    special = _special(u, mantissa_bits, exponent_bits, saturate, kind)
    # branch-free like encode_stochastic, so loops over it vectorize
    base, q, r, s = _quantize(u, mantissa_bits, exponent_bits)
    half = 1 << (s - 1)
    up = 1 if (r > half or (r == half and (q & 1) == 1)) else 0
    rounded = _finish(u, base + q + up, mantissa_bits, exponent_bits, saturate, kind)
    return special if special >= 0 else rounded


@njit(forceinline=True, cache=True)
def decode(h, mantissa_bits, exponent_bits, kind=IEEE):
    """Widen a narrow pattern ``h`` to the exact fp32 pattern. NaN payloads are kept (shifted
    into the top of the fraction), as NumPy and torch do (e4m3fn's NaN 0x7F -> 0x7FF00000;
    ml_dtypes writes 0x7FC00000 for that one). In ``FN`` formats only the all-ones pattern is
    special, in ``FINITE`` ones none is. Branch-free, so widening loops vectorize: an 8-bit
    exponent (bf16) widens by a shift, and a subnormal of a narrower exponent is ``frac``
    times its quantum (an fp32 normal, exactly)."""
    h = np.int64(h)  # one integer type for every return (a uint would unify with int to float)
    shift = 23 - mantissa_bits
    if exponent_bits == 8:  # fp32's exponent field: every pattern, sign included, is a shift
        return h << shift
    sign = ((h >> (exponent_bits + mantissa_bits)) & 1) << 31
    biased = (h >> mantissa_bits) & ((1 << exponent_bits) - 1)
    frac = h & ((1 << mantissa_bits) - 1)
    bias = (1 << (exponent_bits - 1)) - 1
    top = biased == (1 << exponent_bits) - 1
    if kind == FN:
        top = top and frac == (1 << mantissa_bits) - 1
    elif kind == FINITE:
        top = False
    quantum = bits_to_f32((128 - bias - mantissa_bits) << 23)  # 2**(1 - bias - mantissa_bits)
    small = f32_to_bits(np.float32(frac) * quantum)  # zero or subnormal: frac * quantum
    normal = ((biased - bias + 127) << 23) | (frac << shift)
    special = _F32_INF | (frac << shift)
    return sign | (special if top else (small if biased == 0 else normal))


@intrinsic
def fma32(typingctx, a, b, c):
    """``a * b + c`` in float32 with a single rounding (llvm.fma.f32) on CPU and CUDA.

    Kernels write every multiply-add as ``fma32``: NVVM contracts ``a * b + c`` into an FMA by
    default while the CPU compiler does not, so a plain expression would round differently on the
    two targets and break bit-identity.
    """
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        return builder.fma(*args)

    return sig, codegen


@intrinsic
def bits_to_f32(typingctx, u):
    """Reinterpret the low 32 bits of integer ``u`` as a float32 (a scalar ``view``)."""

    def codegen(context, builder, signature, args):
        low = builder.trunc(args[0], ir.IntType(32))
        return builder.bitcast(low, ir.FloatType())

    return types.float32(u), codegen


@intrinsic
def f32_to_bits(typingctx, f):
    """The bit pattern of float32 ``f`` as a non-negative int64."""

    def codegen(context, builder, signature, args):
        return builder.zext(builder.bitcast(args[0], ir.IntType(32)), ir.IntType(64))

    return types.int64(types.float32), codegen


@njit(forceinline=True, cache=True)
def add_stochastic(w, update, alpha, bits16, mantissa_bits, exponent_bits, saturate, kind=IEEE):
    """``SR(w + alpha * update)`` for narrow pattern ``w``, fp32 pattern ``update`` and float32
    ``alpha``: the sum is formed in fp32 with one rounding (fma), then stochastically rounded."""
    total = add_exact_f32(w, update, alpha, mantissa_bits, exponent_bits, kind)
    return encode_stochastic(total, bits16, mantissa_bits, exponent_bits, saturate, kind)


@intrinsic
def result_bits(typingctx, f):
    """The bit pattern of float32 arithmetic result ``f`` (an int64, as ``f32_to_bits``), any
    NaN replaced by ``F32_QNAN`` (+qNaN).

    Which NaN a float op returns is the device's choice (x86: the NaN operand's, or -qNaN for an
    invalid op; CUDA: 0x7FFFFFFF; XLA on GPU: +qNaN), so every result srround computes and
    writes goes through this compare and select (``docs/contracts.md``, "Special values"). In
    32-bit IR, as the bf16 intrinsics: a 64-bit compare would halve the CPU vector width."""

    def codegen(context, builder, signature, args):
        nan = builder.fcmp_unordered("uno", args[0], args[0])
        bits = builder.select(nan, _i32(F32_QNAN), builder.bitcast(args[0], _I32))
        return builder.zext(bits, ir.IntType(64))

    return types.int64(types.float32), codegen


@njit(forceinline=True, cache=True)
def add_exact_f32(w, update, alpha, mantissa_bits, exponent_bits, kind=IEEE):
    """The fp32 pattern of ``w + alpha * update`` (one rounding, fma; a NaN is ``F32_QNAN``)
    that ``add_stochastic`` rounds; exposed so a backend may run the two steps as separate
    loops."""
    weight = bits_to_f32(decode(w, mantissa_bits, exponent_bits, kind))
    return result_bits(fma32(alpha, bits_to_f32(update), weight))


@njit(forceinline=True, cache=True)
def unpack(word, index, width):
    """Field ``index`` of ``width`` bits (16 or 32) of a 64-bit word, as a non-negative int64."""
    return (np.int64(word) >> (width * index)) & ((1 << width) - 1)


@njit(forceinline=True, cache=True)
def pack4(a, b, c, d):
    """Four 16-bit patterns as one uint64 word, ``a`` in the low bits (little-endian order)."""
    return np.uint64(a | (b << 16) | (c << 32) | (d << 48))


@njit(forceinline=True, cache=True)
def pack2(a, b):
    """Two 32-bit patterns as one uint64 word, ``a`` in the low bits."""
    return np.uint64(a | (b << 32))
