"""The ``jax.lax`` backend: srround's rounding, Threefry stream and fma on ``uint32`` patterns.

Only ``jax.lax``/``jnp`` integer ops, so it jit-compiles on every backend (CPU, GPU, TPU) and
needs no x64; results are bit for bit those of the Numba kernels for the same input bits, seed
and offset:

* ``_encode`` / ``_decode``: the rounding rules of ``srround/_scalar.py`` (stochastic and
  nearest-even encode, exact decode with NaN payloads kept) on ``uint32`` bit patterns.
* ``_threefry2x32`` / ``_random16``: Threefry-2x32 with 20 rounds (``srround/_rng.py``, the
  function of ``jax.random``), the rounds unrolled; the 64-bit stream counter is a pair of
  ``uint32`` words with carry. One block feeds four consecutive elements, as in the kernels;
  each element computes its block, so the random bits fuse into the rounding loop (on a GPU
  the four elements of a thread share it where the index shows it, ``_element_index``).
* ``_fma_bits``: ``fma(a, b, c)`` in float32 with one rounding, computed exactly in integers:
  ``jax.lax`` has no fma, XLA may or may not contract ``a * b + c``, and XLA's CPU backend (and
  TPU) flushes float32 subnormals to zero.
* ``_native_*``: the four functional operations, jitted with the layout static (key words,
  stream position and ``alpha`` are traced arguments: a new seed or offset does not recompile).

A NaN that an fma computes is +qNaN 0x7FC00000 (``canonical_nan``), as in the kernels:
float ops give NaNs whose sign and payload depend on the device.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from srround._block_kernels import NVFP4_MIN_TENSOR_SCALE
from srround._formats import FORMATS, Format

_JNP_DTYPES = {
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
    "float8_e4m3fn": jnp.float8_e4m3fn,
    "float8_e5m2": jnp.float8_e5m2,
}


def result_dtype(fmt: Format):
    """The JAX dtype of results in ``fmt``: its own float dtype, or ``uint8`` bit patterns for
    fp4 (a one-value-per-byte bitcast to ``jnp.float4_e2m1fn`` is not defined: 4 bits)."""
    return _JNP_DTYPES.get(fmt.name, jnp.uint8)


def _specials(fmt: Format, saturate: bool):
    """``(limit, overflow, nan, inf_result)`` magnitude patterns (``_scalar._top``/``_special``):
    first pattern past the largest finite value, what a finite overflow becomes, the NaN
    pattern, what an infinite input becomes."""
    mb, eb = fmt.mantissa_bits, fmt.exponent_bits
    inf = ((1 << eb) - 1) << mb
    ones = (1 << (eb + mb)) - 1
    if fmt.specials == 0:
        return inf, (inf - 1 if saturate else inf), inf | (1 << (mb - 1)), inf
    limit, over, nan = (ones, ones, ones) if fmt.specials == 1 else (ones + 1, ones, 0)
    over = limit - 1 if saturate else over
    return limit, over, nan, over


_U32 = jnp.uint32


# -- 64-bit integers as (hi, lo) uint32 pairs -------------------------------------------------
#
# Shift amounts are kept in [0, 31] for every uint32 shift (XLA's shifts by >= 32 are defined as
# 0, but clamping keeps the code independent of that); a shift by 32 - m for m in [0, 31] is
# written (v >> 1) >> (31 - m).


def _u(x):
    if isinstance(x, (int, np.integer)):
        return np.uint32(x)  # a Python int >= 2**31 would not fit jnp's default int32
    return jnp.asarray(x).astype(_U32)


def _shl64(hi, lo, n):
    """``(hi, lo) << n`` for n in [0, 63] (int32)."""
    n = _u(n)
    big = n >= 32
    m = jnp.where(big, n - 32, n)
    hi_small = (hi << m) | ((lo >> 1) >> (31 - m))
    return jnp.where(big, lo << m, hi_small), jnp.where(big, _U32(0), lo << m)


def _shr64(hi, lo, n):
    """``(hi, lo) >> n`` for n in [0, 63] (int32)."""
    n = _u(n)
    big = n >= 32
    m = jnp.where(big, n - 32, n)
    lo_small = (lo >> m) | ((hi << 1) << (31 - m))
    return jnp.where(big, _U32(0), hi >> m), jnp.where(big, hi >> m, lo_small)


def _low_mask64(n):
    """``2**n - 1`` as a pair, n in [0, 63]."""
    n = _u(n)
    big = n >= 32
    m = jnp.where(big, n - 32, n)
    ones = (_U32(1) << m) - 1
    return jnp.where(big, ones, _U32(0)), jnp.where(big, _U32(0xFFFFFFFF), ones)


def _clz64(hi, lo):
    return jnp.where(hi != 0, lax.clz(hi), 32 + lax.clz(lo)).astype(jnp.int32)


def _add64(ah, al, bh, bl):
    lo = al + bl
    return ah + bh + (lo < al).astype(_U32), lo


def _sub64(ah, al, bh, bl):
    return ah - bh - (al < bl).astype(_U32), al - bl


def _gt64(ah, al, bh, bl):
    return (ah > bh) | ((ah == bh) & (al > bl))


# -- the scalar rules of _scalar.py, on uint32 patterns ----------------------------------------


def _encode(u, fmt: Format, saturate: bool, bits16=None):
    """fp32 patterns ``u`` -> narrow patterns (uint32): stochastic with ``bits16``, else nearest
    (ties to even). The same integer steps as ``_scalar.encode_stochastic/encode_nearest``;
    bfloat16, the top half of fp32, takes the short form of those steps (16 bits dropped from
    every finite value, subnormals included)."""
    mb, eb = fmt.mantissa_bits, fmt.exponent_bits
    if (eb, mb) == (8, 7):
        a = u & 0x7FFFFFFF
        if bits16 is not None and not saturate:
            # the low half plus 0xFFFF - bits16 carries into the kept bits exactly when
            # bits16 < low (the rule below); finite values and infinities keep their sign.
            # Half the integer ops of the rule's steps, which bound a GPU's time
            # (docs/performance.md, "On a GPU (one H200, 2026-11-28)")
            rounded = (u + (bits16 ^ 0xFFFF)) >> 16
            return jnp.where(a > 0x7F800000, ((u >> 16) & 0x8000) | 0x7FC0, rounded)
        low = a & 0xFFFF
        if bits16 is not None:
            up = bits16 < low
        else:
            up = (low > 0x8000) | ((low == 0x8000) & ((a & 0x10000) != 0))
        magnitude = (a >> 16) + up.astype(_U32)  # a carry into the exponent is exact
        if saturate:
            magnitude = jnp.minimum(magnitude, _U32(0x7F7F))
        special = jnp.where(a == 0x7F800000, _U32(0x7F80), _U32(0x7FC0))
        return ((u >> 31) << 15) | jnp.where(a >= 0x7F800000, special, magnitude)
    bias = fmt.bias
    a = u & 0x7FFFFFFF
    biased = (a >> 23).astype(jnp.int32)
    frac = a & 0x7FFFFF
    m = jnp.where(biased == 0, frac, frac | 0x800000)
    e = jnp.where(biased == 0, -126, biased - 127)
    e_eff = jnp.maximum(e, 1 - bias)
    s = jnp.minimum(23 - mb + (e_eff - e), 40)  # >= 23 - mb
    s31 = _u(jnp.minimum(s, 31))  # m < 2**24: shifting by 31 already drops everything
    q = m >> s31
    r = m & ((_U32(1) << s31) - 1)
    if bits16 is not None:
        # threshold = (r << 16) >> s without leaving 32 bits (r < 2**min(s, 24))
        down = _u(jnp.clip(s - 16, 0, 31))
        up_shift = _u(jnp.clip(16 - s, 0, 31))
        threshold = jnp.where(s >= 16, r >> down, r << up_shift)
        up = (bits16 < threshold).astype(_U32)
    else:
        half = _U32(1) << _u(jnp.minimum(s, 25) - 1)  # s > 25: half > r, never up
        up = ((r > half) | ((r == half) & ((q & 1) == 1))).astype(_U32)
    base = _u(e_eff + (bias - 1)) << mb
    magnitude = base + q + up
    limit, overflow, nan, inf_result = _specials(fmt, saturate)
    magnitude = jnp.where(magnitude >= limit, _U32(overflow), magnitude)
    sign = (u >> 31) << (eb + mb)
    special = sign | jnp.where(a == 0x7F800000, _U32(inf_result), _U32(nan))
    return jnp.where(a >= 0x7F800000, special, sign | magnitude)


_KERNEL_OPS = contextvars.ContextVar("srround_kernel_ops", default=None)


@contextlib.contextmanager
def kernel_ops(ops):
    """Within: ``ops`` (``fma``, ``div``, ``sqrt`` of float32 arrays, each rounded once, as
    the kernels, and ``clz`` of uint32 arrays) replace the XLA path's ops (``div``, ``sqrt``,
    ``_clz`` here, ``optim._fma``): set while a Pallas kernel's body is traced (``_pallas``);
    ``None`` keeps the XLA path's."""
    token = _KERNEL_OPS.set(ops)
    try:
        yield
    finally:
        _KERNEL_OPS.reset(token)


def exact_ops():
    """The exact ops of the kernel being traced (``kernel_ops``), or ``None``."""
    return _KERNEL_OPS.get()


def _clz(x):
    """Leading zeros of uint32 ``x`` (``lax.clz``; inside a Pallas kernel its ``clz``: Triton
    has none of its own)."""
    if (ops := exact_ops()) is not None:
        return ops.clz(x)
    return lax.clz(x)


def _decode(h, fmt: Format):
    """Narrow patterns (uint32) -> exact fp32 patterns, NaN payloads kept (``_scalar.decode``)."""
    mb, eb = fmt.mantissa_bits, fmt.exponent_bits
    bias = fmt.bias
    sign = ((h >> (eb + mb)) & 1) << 31
    biased = ((h >> mb) & ((1 << eb) - 1)).astype(jnp.int32)
    frac = h & ((1 << mb) - 1)
    normal = _u(biased - bias + 127) << 23 | (frac << (23 - mb))
    special = 0x7F800000 | (frac << (23 - mb))
    # subnormal: frac * 2**(1 - bias - mb); leading bit p of frac, exponent p + 1 - bias - mb
    p = 31 - _clz(frac).astype(jnp.int32)
    exponent = p + 1 - bias - mb
    lead_free = frac - (_U32(1) << _u(jnp.maximum(p, 0)))
    sub = _u(exponent + 127) << 23 | (lead_free << _u(jnp.clip(23 - p, 0, 31)))
    tiny_shift = 150 - bias - mb  # narrow subnormals that stay fp32 subnormals (bf16)
    if 0 <= tiny_shift < 32:
        sub = jnp.where(exponent >= -126, sub, frac << tiny_shift)
    sub = jnp.where(frac == 0, _U32(0), sub)
    top = biased == (1 << eb) - 1
    if fmt.specials == 1:  # fn: only the all-ones pattern is special (NaN)
        top = top & (frac == (1 << mb) - 1)
    elif fmt.specials == 2:  # no inf, no NaN
        top = jnp.zeros_like(top)
    magnitude = jnp.where(top, special, jnp.where(biased == 0, sub, normal))
    if fmt.bits == 4:  # a byte that is no fp4 code (seen under jit only, else a ValueError): NaN
        return jnp.where(h > 0xF, _U32(0x7FC00000), sign | magnitude)
    return sign | magnitude


def _split32(x):
    """Significand (implicit bit included) and exponent of finite fp32 patterns:
    |value| = m * 2**e."""
    biased = ((x >> 23) & 0xFF).astype(jnp.int32)
    frac = x & 0x7FFFFF
    m = jnp.where(biased == 0, frac, frac | 0x800000)
    return m, jnp.maximum(biased, 1) - 150


def _fma_bits(A, B, C):
    """fp32 pattern of ``fma(a, b, c)`` (a * b + c with ONE rounding, to nearest even) of fp32
    patterns ``A``, ``B``, ``C``, exactly, in integer ops (no float op can flush subnormals or
    round twice). Finite inputs:

    1. a = ma * 2**ea etc. (24-bit significands); the product P = ma * mb (48 bits, from 16-bit
       limbs) and ``c`` are placed in 64-bit words with their leading bit at bit 61.
    2. The smaller magnitude is shifted right to the larger one's exponent; bits shifted out
       become a sticky bit (round-to-odd at bit 0: exact for any rounding >= 2 bits higher,
       and cancellation can only move the leading bit by one when anything is shifted out).
    3. Add or subtract, find the leading bit, round to 24 bits (fewer below 2**-126: the fp32
       subnormal quantum is 2**-149) to nearest even; a carry out of 2**128 is inf.

    Exact cancellation gives +0; a zero product gives ``c`` (signed zeros as IEEE). NaN/inf
    operands use float ops (only specials reach them); a NaN result is +qNaN 0x7FC00000.
    """
    sa, sb, sc = A >> 31, B >> 31, C >> 31
    ma, ea = _split32(A)
    mb, eb = _split32(B)
    mc, ec = _split32(C)
    sp = sa ^ sb

    # 1. the 48-bit product from 16-bit limbs
    a1, a0 = ma >> 16, ma & 0xFFFF
    b1, b0 = mb >> 16, mb & 0xFFFF
    low = a0 * b0
    mid = a1 * b0 + a0 * b1  # < 2**25
    p_lo = low + (mid << 16)
    p_hi = a1 * b1 + (mid >> 16) + (p_lo < low).astype(_U32)
    p_zero = (ma == 0) | (mb == 0)
    c_zero = mc == 0

    shift_p = jnp.clip(_clz64(p_hi, p_lo) - 2, 0, 63)  # leading bit to bit 61
    ph, pl = _shl64(p_hi, p_lo, shift_p)
    ezp = ea + eb - shift_p
    shift_c = jnp.clip(lax.clz(mc).astype(jnp.int32) + 30, 0, 63)  # (0, mc): 32 + clz - 2
    ch, cl = _shl64(jnp.zeros_like(mc), mc, shift_c)
    ezc = jnp.where(c_zero, -4096, ec - shift_c)

    # 2. align the smaller magnitude to the larger
    p_big = (ezp > ezc) | ((ezp == ezc) & ~_gt64(ch, cl, ph, pl))
    bh, bl = jnp.where(p_big, ph, ch), jnp.where(p_big, pl, cl)
    th, tl = jnp.where(p_big, ch, ph), jnp.where(p_big, cl, pl)
    ez = jnp.where(p_big, ezp, ezc)
    big_sign = jnp.where(p_big, sp, sc)
    d = jnp.clip(jnp.abs(ezp - ezc), 0, 63)  # small < 2**62: a 63-bit shift drops all of it
    mh, ml = _low_mask64(d)
    sticky = (((th & mh) | (tl & ml)) != 0).astype(_U32)
    th, tl = _shr64(th, tl, d)

    # 3. add or subtract (the sticky bit makes the result round-to-odd at bit 0)
    sum_h, sum_l = _add64(bh, bl, th, tl)
    th2, tl2 = _add64(th, tl, jnp.zeros_like(sticky), sticky)
    dif_h, dif_l = _sub64(bh, bl, th2, tl2)
    same = sp == sc
    zh = jnp.where(same, sum_h, dif_h)
    zl = jnp.where(same, sum_l, dif_l) | sticky
    z_zero = (zh == 0) & (zl == 0)

    lead = 63 - _clz64(zh, zl)
    exponent = lead + ez  # value in [2**exponent, 2**(exponent + 1))
    s = jnp.maximum(lead - 23, -149 - ez)  # bits below the fp32 quantum
    sr = jnp.clip(s, 0, 63)
    _, ql = _shr64(zh, zl, sr)
    rh, rl = _low_mask64(sr)
    rh, rl = zh & rh, zl & rl
    hh, hl = _shl64(jnp.zeros_like(zh), jnp.ones_like(zl), jnp.maximum(sr - 1, 0))
    q = jnp.where(s < 0, zl << _u(jnp.clip(-s, 0, 31)), ql)
    tie = (rh == hh) & (rl == hl)
    up = (s >= 1) & (s <= 63) & (_gt64(rh, rl, hh, hl) | (tie & ((q & 1) == 1)))
    q = jnp.where(s > 63, _U32(0), q)
    e_eff = jnp.clip(exponent, -126, 128)
    magnitude = (_u(e_eff + 126) << 23) + q + up.astype(_U32)
    overflows = (exponent >= 128) | (magnitude >= 0x7F800000)
    magnitude = jnp.where(overflows, _U32(0x7F800000), magnitude)
    finite = jnp.where(z_zero, _U32(0), (big_sign << 31) | magnitude)
    finite = jnp.where(p_zero, jnp.where(c_zero, (sp & sc) << 31, C), finite)

    # NaN / inf operands: IEEE semantics of fma through float ops, with every finite nonzero
    # operand replaced by +-1 (only its sign matters here, and XLA's CPU backend would flush a
    # subnormal to zero, turning inf * tiny into inf * 0 = NaN)
    def stand_in(v):
        keep = ((v & 0x7F800000) == 0x7F800000) | ((v & 0x7FFFFFFF) == 0)
        return lax.bitcast_convert_type(
            jnp.where(keep, v, (v >> 31 << 31) | 0x3F800000), jnp.float32
        )

    a_f, b_f, c_f = stand_in(A), stand_in(B), stand_in(C)
    ab_finite = ((A & 0x7F800000) != 0x7F800000) & ((B & 0x7F800000) != 0x7F800000)
    c_finite = (C & 0x7F800000) != 0x7F800000
    special = jnp.where(ab_finite, c_f, a_f * b_f + c_f)
    special = canonical_nan(lax.bitcast_convert_type(special, _U32))
    return jnp.where(ab_finite & c_finite, finite, special)


def canonical_nan(u):
    """fp32 patterns (uint32) with every NaN replaced by +qNaN 0x7FC00000: the NaN of
    srround's arithmetic on every device (``srround._scalar.canonical_nan``)."""
    return jnp.where((u & 0x7FFFFFFF) > 0x7F800000, _U32(0x7FC00000), u)


def narrow(x):
    """float32 nearest to float64 ``x`` (ties to even), subnormals included, a NaN as +qNaN.

    XLA's GPU backend drops a float64 -> float32 -> float64 conversion pair (excess precision:
    the float32 rounding would vanish) unless an op sits between the two. On CUDA the
    conversion rounds as IEEE does, subnormals included, and the NaN select follows it
    (``_narrow_on_cuda``): the pair is kept. XLA's CPU backend flushes subnormal conversions
    (``_narrow_by_conversion``); elsewhere (ROCm, TPUs) the rounding is done in integer ops
    and the last conversion is exact (``_narrow_in_integers``). The last op takes several
    arrays (XLA writes the result once for all its readers)."""
    with jax.enable_x64(True):
        x = jnp.asarray(x, jnp.float64)
        return lax.platform_dependent(
            x, cpu=_narrow_by_conversion, cuda=_narrow_on_cuda, default=_narrow_in_integers
        )


def _narrow_on_cuda(x):
    """``narrow`` on CUDA: XLA's conversion (``cvt.rn.f32.f64``: IEEE, subnormals kept), a NaN
    as +qNaN."""
    n = x.astype(jnp.float32)
    return jnp.where(n == n, n, _f32(np.uint32(0x7FC00000)))


def _narrow_by_conversion(x):
    """``narrow`` with XLA's conversion for normal results. XLA's CPU backend flushes
    subnormal conversions: below 2**-126, ``|x| + 2**-97`` rounds ``|x|`` to the subnormal
    quantum 2**-149, and its low mantissa bits count the quanta."""
    return _narrow_with(x, x.astype(jnp.float32))


def _narrow_in_integers(x):
    """``narrow`` rounding normal results in integer ops: to nearest even at float32's last
    mantissa bit (bit 29 of float64's), then an exact conversion; inf stays inf."""
    b = lax.bitcast_convert_type(x, jnp.uint64)
    b = (b + np.uint64(0x0FFFFFFF) + ((b >> 29) & 1)) & np.uint64(0xFFFFFFFFE0000000)
    return _narrow_with(x, lax.bitcast_convert_type(b, jnp.float64).astype(jnp.float32))


def _narrow_with(x, normal):
    """``narrow`` of float64 ``x`` given its float32 rounding ``normal`` where that is
    normal: subnormal results from the quanta, NaN as +qNaN."""
    mag = jnp.abs(x)
    quanta = lax.bitcast_convert_type(mag + 2.0**-97, jnp.uint64).astype(_U32) & 0xFFFFFF
    sign = (lax.bitcast_convert_type(x, jnp.uint64) >> 63).astype(_U32) << 31
    wide = jnp.where(jnp.isnan(x), _f32(np.uint32(0x7FC00000)), normal)
    return jnp.where(mag < 2.0**-126, _f32(sign | quanta), wide)


def _wide_then_narrow(op):
    """``op`` on float32 arrays taken in float64 and rounded once to float32."""

    def run(*xs):
        with jax.enable_x64(True):
            return narrow(op(*(x.astype(jnp.float64) for x in xs)))

    return run


def div(a, b):
    """``a / b`` of float32 arrays, correctly rounded (to nearest even) on every backend, as
    the kernels divide. XLA's GPU backend divides float32 with ``div.full`` (up to 1 ulp off),
    so there the quotient is taken in float64 and rounded to float32 (double rounding is
    innocuous for a quotient or a square root: 53 >= 2 * 24 + 2 bits). CPU and TPU keep
    their float32 division (XLA's CPU backend flushes subnormals).

    XLA's algebraic simplifier rewrites quotients: ``x / c`` for a constant ``c`` into ``x``
    times the rounded ``1 / c``, ``(x / y) / z`` into ``x / (y * z)``, and others; each
    rounds differently. Where an operand is a scalar (a scalar divisor, a chain of scalar
    quotients) the quotient is taken as ``|a| / (-b if a's sign bit is set else b)``, the
    same value and sign, which no rewrite matches. Elementwise operands are left as they
    are: an elementwise divisor the simplifier cannot see through keeps the division."""
    if (ops := exact_ops()) is not None:
        return ops.div(a, b)
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    if a.ndim == 0 or b.ndim == 0:
        negative = (lax.bitcast_convert_type(a, _U32) >> 31) == 1
        a, b = jnp.abs(a), jnp.where(negative, -b, b)
    return lax.platform_dependent(
        a, b, cpu=jnp.divide, tpu=jnp.divide, default=_wide_then_narrow(jnp.divide)
    )


def sqrt(x):
    """Correctly rounded ``sqrt`` of a float32 array on every backend (as ``div``)."""
    if (ops := exact_ops()) is not None:
        return ops.sqrt(x)
    x = jnp.asarray(x, jnp.float32)
    return lax.platform_dependent(
        x, cpu=jnp.sqrt, tpu=jnp.sqrt, default=_wide_then_narrow(jnp.sqrt)
    )


def _rotl(x, r: int):
    return (x << r) | (x >> (32 - r))


def _threefry2x32(k0, k1, c0, c1):
    """``_rng.threefry2x32`` on uint32 arrays (the Random123 / ``jax.random`` function), the
    20 rounds unrolled with literal rotations: plain elementwise ops that fuse into their
    consumer (``jax.extend.random.threefry_2x32`` runs the rounds as a ``while`` loop on CPU,
    a separate pass over memory per group of four rounds)."""
    k0, k1 = _u(k0), _u(k1)
    ks = (k0, k1, k0 ^ k1 ^ 0x1BD11BDA)
    x0, x1 = c0 + k0, c1 + k1
    for g in range(5):
        for r in (13, 15, 26, 6) if g % 2 == 0 else (17, 29, 16, 24):
            x0 = x0 + x1
            x1 = _rotl(x1, r) ^ x0
        x0 = x0 + ks[(g + 1) % 3]
        x1 = x1 + ks[(g + 2) % 3] + (g + 1)
    return x0, x1


def _element_index(shape, origin=None, global_shape=None):
    """Row-major linear index (uint32, of ``shape``) of every element of a block of ``shape``
    at ``origin`` (per-dimension uint32 scalars, possibly traced; ``None``: zeros, for all
    dimensions or for one: an origin XLA knows is 0 keeps the GPU's saving below) in an array
    of ``global_shape`` (default ``shape``). Built from ``broadcasted_iota`` in the array's own
    shape - no reshape to 1-D - so it is elementwise: XLA's SPMD partitioner gives each shard
    the global indices of its elements (any mesh, any partition spec, uneven splits), and the
    random bits of an element depend only on its global index.

    Where the global last dimension is a power of two the column is or-ed into the row terms
    (their multiples: the same value as adding it). Then a GPU thread's consecutive elements
    visibly share the bits above the lowest two, and so their Threefry block, which LLVM
    computes once for the four elements XLA gives a thread: 1216 -> 984 SASS instructions in
    the fused AdamW step's kernel (sm_90, bf16 weights), 384 -> 168 in ``stochastic_round``'s.
    A sum hides it: XLA computes the row terms in a small array of their own."""
    global_shape = tuple(shape) if global_shape is None else tuple(global_shape)
    if not shape:
        return jnp.zeros((), _U32)
    last = len(shape) - 1
    origin = (None,) * len(shape) if origin is None else tuple(origin)
    column = lax.broadcasted_iota(_U32, tuple(shape), last)
    if origin[last] is not None:
        column = column + _u(origin[last])
    width = int(global_shape[last])
    power_of_two = width & (width - 1) == 0
    index, rows, stride = column, None, width
    for d in reversed(range(last)):
        i = lax.broadcasted_iota(_U32, tuple(shape), d)
        if origin[d] is not None:
            i = i + _u(origin[d])
        term = i * _U32(stride)
        if power_of_two:
            rows = term if rows is None else rows + term
        else:
            index = index + term
        stride *= int(global_shape[d])
    return index if rows is None else index | rows


def _check_count(n: int, name: str = "x") -> None:
    if n > (1 << 32) - 4:
        raise ValueError(f"{name}: {n} elements in one call, at most 2**32 - 4 are supported")


def _random16(k0, k1, first_lo, first_hi, lane0, index):
    """The 16 random bits (uint32, ``index``'s shape) of the elements at linear positions
    ``index`` of a call (``_rng.py``'s stream): element i is lane ``(lane0 + i) & 3`` of
    Threefry block ``first + (lane0 + i) >> 2`` (``first = offset >> 2`` as traced uint32
    words, so a new offset does not recompile; ``lane0 = offset & 3``). Elementwise in i, so it
    fuses into the rounding that consumes it: each element computes its block (4x the rounds
    where the compiler cannot share them - on a GPU it does for a thread's four elements when
    ``lane0`` is a constant 0 and the index shows their common bits, ``_element_index`` - but a
    materialized array of blocks would be a temporary: a pass over memory, and fresh pages
    every call on XLA's CPU backend). An int ``index`` n means ``iota(n)``."""
    if isinstance(index, int):
        _check_count(index)
        index = lax.iota(_U32, index)
    i = index + _u(lane0)
    return _lane16(*_threefry_block(k0, k1, first_lo, first_hi, i >> 2), i)


def _threefry_block(k0, k1, first_lo, first_hi, j):
    """The two output words of Threefry block ``first + j`` of a stream (``first`` as uint32
    words ``first_lo``, ``first_hi``; ``j`` uint32)."""
    c_lo = first_lo + j
    c_hi = first_hi + (c_lo < j).astype(_U32)  # carry into the high counter word
    return _threefry2x32(k0, k1, c_lo, c_hi)


def _lane16(x0, x1, lane):
    """Lane ``lane & 3`` (16 bits, uint32) of a Threefry block's output words."""
    return (jnp.where((lane & 2) == 0, x0, x1) >> ((lane & 1) << 4)) & 0xFFFF


def _opaque(values, probes):
    """Python ints ``values`` (< 2**32) as uint32 scalars XLA cannot constant-fold: each plus a
    zero XLA cannot evaluate (from the traced ``probes``: key words, step), out of a
    conditional (CPU) or an optimization barrier (elsewhere), so no loop fuses the sum (and its
    constant) in. A computation that takes such a value as a parameter is the same for every
    value; with the values folded in as constants, each would be a computation of its own (on
    XLA's CPU backend, a kernel of its own to compile). When every probe is a constant there is
    nothing to hide behind: constants."""
    probes = [p for p in probes if not isinstance(p, (int, np.integer))]
    if not probes:
        return tuple(np.uint32(v) for v in values)
    zero = None
    for p in probes:
        p = _u(p)
        zero = p & ~p if zero is None else zero | (p & ~p)
    words = tuple(jnp.asarray(np.uint32(v)) for v in values)
    return lax.platform_dependent(zero, *words, cpu=_in_conditional, default=_behind_barrier)


def _in_conditional(zero, *words):
    """``_opaque`` on XLA's CPU backend: the sums as a conditional's outputs (the native AdamW
    step of 196 leaves compiled in about 8 s this way, 11 s behind a barrier)."""
    return lax.cond(zero == 0, lambda: tuple(w + zero for w in words), lambda: words)


def _behind_barrier(zero, *words):
    """``_opaque`` elsewhere: XLA's GPU backend reads a conditional's predicate back to the
    host, so the sums pass an optimization barrier instead."""
    return lax.optimization_barrier(tuple(w + zero for w in words))


def _spec_axes(spec, ndim: int, name: str):
    """Per dimension the mesh axis names (a tuple, empty if not split) of a ``PartitionSpec``."""
    entries = tuple(spec) if spec is not None else ()
    if len(entries) > ndim:
        raise ValueError(
            f"{name}: partition spec {spec} has {len(entries)} entries for an array of rank {ndim}"
        )
    axes = []
    for entry in entries + (None,) * (ndim - len(entries)):
        if entry is None:
            axes.append(())
        elif isinstance(entry, str):
            axes.append((entry,))
        else:
            axes.append(tuple(entry))
    return axes


def _varying_axes(x) -> frozenset:
    """The mesh axes that ``x`` varies over inside ``shard_map`` (its type's)."""
    t = jax.typeof(x)
    manual = getattr(t, "manual_axis_type", None)
    return frozenset(manual.varying if manual is not None else getattr(t, "vma", ()))


def _check_split(x, spec, name: str, spec_name: str) -> None:
    """Inside ``shard_map`` an array whose noise follows its global elements varies over
    exactly the mesh axes its partition spec ``spec`` splits it over (``shard_map`` types it
    so, with ``check_vma``): one that varies over others would be rounded as a whole array,
    with the noise of the other blocks - a ``ValueError`` naming ``name`` and ``spec_name``."""
    split = {a for names in _spec_axes(spec, np.ndim(x), name) for a in names}
    unsplit = sorted(_varying_axes(x) - split) if isinstance(x, jax.Array) else []
    if unsplit:
        raise ValueError(
            f"{name}: inside shard_map it varies over mesh axes {unsplit}, but {spec_name}"
            f" gives it {spec}: pass its partition spec from in_specs as {spec_name} (split"
            " arrays need it; replicated ones need none)"
        )


def _shard_layout(local_shape, spec, name: str = "x"):
    """``(origin, global_shape)`` of this device's block inside ``shard_map`` for an array
    split by ``spec`` (the partition spec given in ``shard_map``'s ``in_specs``): per dimension
    ``origin = axis_index(axes) * local`` (traced) and ``global = local * axis_size(axes)``.
    ``(None, local_shape)`` when nothing is split."""
    axes = _spec_axes(spec, len(local_shape), name)
    if not any(axes):
        return None, tuple(local_shape)
    origin, global_shape = [], []
    for n, names in zip(local_shape, axes):
        if not names:
            origin.append(_U32(0))
            global_shape.append(int(n))
            continue
        try:
            size = 1
            for axis in names:
                size *= int(lax.axis_size(axis))
            index = lax.axis_index(names if len(names) > 1 else names[0])
        except NameError as exc:
            raise ValueError(
                f"{name}: shard_spec={spec} names mesh axes that are not bound here - call it"
                f" inside shard_map over those axes ({exc})"
            ) from None
        origin.append(index.astype(_U32) * _U32(n))
        global_shape.append(int(n) * size)
    return tuple(origin), tuple(global_shape)


def _to_narrow(patterns, fmt: Format, shape):
    stored = patterns.astype(jnp.dtype(fmt.bits_dtype))
    if fmt.name in _JNP_DTYPES:
        stored = lax.bitcast_convert_type(stored, _JNP_DTYPES[fmt.name])
    return stored.reshape(shape)


def _bits(x, dtype):
    """Bit patterns of ``x`` in its own shape (elementwise: partitions with ``x``)."""
    return lax.bitcast_convert_type(x, dtype)


# -- native implementations ------------------------------------------------------------------
#
# Jitted with the layout parameters static: under an outer jit they are inlined; called eagerly
# they run as one compiled program (not ~300 op-by-op dispatches), compiled once per shape.
# Key words and alpha are arguments, so a new seed does not recompile.

_static = functools.partial(
    jax.jit, static_argnames=("lane0", "fmt_name", "saturate", "global_shape")
)


def _first_block(offset: int):
    """``offset >> 2`` as two uint32 words: traced arguments, so offsets do not recompile."""
    first = offset >> 2
    return _u(first & 0xFFFFFFFF), _u(first >> 32)


@_static
def _native_stochastic_round(
    x, k0, k1, first_lo, first_hi, origin, *, lane0, fmt_name, saturate, global_shape
):
    fmt = FORMATS[fmt_name]
    index = _element_index(x.shape, origin, global_shape)
    y = _encode(_bits(x, _U32), fmt, saturate, _random16(k0, k1, first_lo, first_hi, lane0, index))
    return _to_narrow(y, fmt, x.shape)


@functools.partial(jax.jit, static_argnames=("fmt_name", "saturate"))
def _native_round_nearest(x, *, fmt_name, saturate):
    fmt = FORMATS[fmt_name]
    return _to_narrow(_encode(_bits(x, _U32), fmt, saturate), fmt, x.shape)


@functools.partial(jax.jit, static_argnames=("fmt_name",))
def _native_to_float32(y, *, fmt_name):
    fmt = FORMATS[fmt_name]
    h = _bits(y, jnp.dtype(fmt.bits_dtype)).astype(_U32)
    return lax.bitcast_convert_type(_decode(h, fmt), jnp.float32).reshape(y.shape)


@_static
def _native_stochastic_add(
    w, u, alpha, k0, k1, first_lo, first_hi, origin, *, lane0, fmt_name, saturate, global_shape
):
    index = _element_index(w.shape, origin, global_shape)
    bits16 = _random16(k0, k1, first_lo, first_hi, lane0, index)
    return stochastic_sum(w, u, alpha, FORMATS[fmt_name], saturate, bits16)


def stochastic_sum(w, u, alpha, fmt: Format, saturate: bool, bits16):
    """``SR(fma(alpha, u, w))`` in ``w``'s dtype (``fmt`` values or their patterns), ``u``
    float32, ``alpha`` a float32 scalar, rounded with ``bits16``: the exact fma in integers
    (``_fma_bits``), inside a Pallas kernel the GPU's own (``exact_ops``: the same bits, a NaN
    as +qNaN)."""
    patterns = jnp.dtype(fmt.bits_dtype)
    wide = _decode(_bits(w, patterns).astype(_U32), fmt)
    alpha = jnp.asarray(alpha, jnp.float32)
    if (ops := exact_ops()) is not None:
        total = _bits(ops.fma(alpha, u, _f32(wide)), _U32)
    else:
        total = _fma_bits(_bits(alpha, _U32), _bits(u, _U32), wide)
    out = _encode(total, fmt, saturate, bits16).astype(patterns)
    return lax.bitcast_convert_type(out, w.dtype)


# -- block-scaled formats (``srround/_block_kernels.py``, the same steps on arrays) -----------
#
# Element products go through ``_fma_bits(a, b, -0)`` (a * b rounded once, in integers): XLA's
# CPU backend flushes float32 subnormals. The scale arithmetic of NVFP4 (divisions, ``div``)
# meets none: the tensor scale is at least 2**-121 and a subnormal ``amax / 6`` is rounded in
# integers (``_sixth_over``).

_ABS32, _INF32, _NEG_ZERO = 0x7FFFFFFF, 0x7F800000, 0x80000000
_E4M3 = FORMATS["float8_e4m3fn"]


def _f32(bits):
    return lax.bitcast_convert_type(bits, jnp.float32)


def mul_bits(a, b):
    """float32 bits of ``a * b`` (bits in, bits out), one rounding, subnormals kept."""
    return _fma_bits(a, b, jnp.full(jnp.broadcast_shapes(a.shape, b.shape), _NEG_ZERO, _U32))


def _pow2_bits(k):
    """fp32 bits of ``2**k`` (int32 k in [-149, 127]; ``_block_kernels.pow2_bits``)."""
    return jnp.where(k >= -126, _u(k + 127) << 23, _U32(1) << _u(jnp.clip(k + 149, 0, 31)))


def _mx_scale(amax, bf, ceil: bool):
    """``(e8m0 code, multiplier bits)`` per block (``_block_kernels.mx_scale``)."""
    expo = (amax >> 23).astype(jnp.int32)
    k = expo - 127 - bf.emax
    if ceil:
        k = k + ((expo != 0) & ((amax & 0x7FFFFF) > bf.max_mantissa)).astype(jnp.int32)
    k = jnp.clip(k, -127, 128)
    nan = amax > _INF32
    code = jnp.where(nan, _U32(255), _u(k + 127))
    return code, jnp.where(nan, _U32(0), _pow2_bits(-k))


def _nv_tensor_scale(amax):
    """fp32 bits of NVFP4's tensor scale ``max(amax / 2688, 2**-121)`` (1.0 when amax is 0;
    ``_block_kernels.nv_tensor_scale``)."""
    scale = lax.bitcast_convert_type(div(_f32(amax), jnp.float32(448.0 * 6.0)), _U32)
    scale = jnp.maximum(scale, _U32(NVFP4_MIN_TENSOR_SCALE))
    return jnp.where(amax == 0, _U32(0x3F800000), scale)


_SIX_MIN_NORMAL = int(np.float32(6 * 2.0**-126).view(np.uint32))


def _sixth_over(amax, ts):
    """``(amax / 6) / ts`` (fp32 bits in, float32 out), each quotient rounded once, as the
    kernels compute it. XLA's CPU backend flushes float32 subnormals: where ``amax / 6`` is
    one, it is rounded in integers (units of 2**-149, ties to even) and divided by ``ts``
    with both terms times 2**24 (exact, normal)."""
    expo = amax >> 23
    n = jnp.where(expo == 0, amax, ((amax & 0x7FFFFF) | 0x800000) << (jnp.clip(expo, 1, 3) - 1))
    q, r = n // 6, n % 6  # n = amax * 2**149 below 6 * 2**-126: under 2**26
    q = q + ((r > 3) | ((r == 3) & ((q & 1) == 1))).astype(_U32)
    low = div(q.astype(jnp.float32) * jnp.float32(2.0**-125), _f32(ts) * jnp.float32(2.0**24))
    high = div(div(_f32(amax), jnp.float32(6.0)), _f32(ts))
    return jnp.where(amax < _SIX_MIN_NORMAL, low, high)


def _nv_block_scale(amax, ts, ceil: bool):
    """``(e4m3 code, multiplier bits)`` per NVFP4 block (``_block_kernels.nv_block_scale``)."""
    scaled = _sixth_over(amax, ts)
    scaled = jnp.where(scaled == scaled, jnp.clip(scaled, 0.015625, 448.0), scaled)
    u = lax.bitcast_convert_type(scaled.astype(jnp.float32), _U32)
    code = _encode(u, _E4M3, True)
    if ceil:
        code = jnp.where((code < 0x7E) & (_decode(code, _E4M3) < u), code + 1, code)
    multiplier = div(div(jnp.float32(1.0), _f32(ts)), _f32(_decode(code, _E4M3)))
    return code, lax.bitcast_convert_type(multiplier, _U32)


def element_value(h, scale, el: Format):
    """fp32 patterns of element patterns ``h`` (format ``el``) times the fp32 ``scale``
    patterns, NaN as 0x7FC00000 (``_block_kernels.element_value``)."""
    out = mul_bits(_decode(h, el), scale)
    return jnp.where((out & _ABS32) > _INF32, _U32(0x7FC00000), out)


def block_element(u, multiplier, el: Format, bits16):
    """Element patterns of format ``el`` (``_block_kernels.block_element``): ``u *
    multiplier`` clamped to +-max and rounded (saturating); NaN as the kernels write it."""
    max_bits = int(np.float32(el.max_finite).view(np.uint32))
    y = mul_bits(u, multiplier)
    sign, a = y & _U32(0x80000000), y & _ABS32
    width = el.mantissa_bits + el.exponent_bits
    nan = ((u >> 31) << width) | _U32((1 << width) - 1 if el.specials != 2 else 0x3)
    y = jnp.where(a > max_bits, sign | max_bits, y)
    return jnp.where(a > _INF32, nan, _encode(y, el, True, bits16))


@functools.partial(jax.jit, static_argnames=("fmt_name", "axis", "stochastic", "ceil", "lane0"))
def native_quantize_blocks(
    x, k0, k1, first_lo, first_hi, *, fmt_name, axis, stochastic, ceil, lane0
):
    """``(data, scales, tensor_scale)`` of ``srround.quantize_blocks`` on ``jax.lax``: the
    bits of the kernels (``_block_kernels.quantize_block``), blocks along ``axis``."""
    from srround._blocks import BLOCK_FORMATS

    bf = BLOCK_FORMATS[fmt_name]
    shape = x.shape
    outer = int(np.prod(shape[:axis], dtype=np.int64))
    inner = int(np.prod(shape[axis + 1 :], dtype=np.int64))
    n = shape[axis]
    blocked = (outer, n // bf.block, bf.block, inner)
    u = _bits(x, _U32).reshape(blocked)
    amax = jnp.max(u & _ABS32, axis=2, keepdims=True)
    ts = _U32(0)
    if bf.two_level:
        ts = _nv_tensor_scale(jnp.max(u & _ABS32))
        code, multiplier = _nv_block_scale(amax, ts, ceil)
    else:
        code, multiplier = _mx_scale(amax, bf, ceil)
    bits16 = None
    if stochastic:
        index = _element_index(shape).reshape(blocked)
        bits16 = _random16(k0, k1, first_lo, first_hi, lane0, index)
    h = block_element(u, multiplier, bf.element, bits16)
    scale_shape = shape[:axis] + (n // bf.block,) + shape[axis + 1 :]
    scales = code.astype(jnp.uint8).reshape(scale_shape)
    scales = lax.bitcast_convert_type(
        scales, jnp.float8_e4m3fn if bf.two_level else jnp.float8_e8m0fnu
    )
    if bf.packed:  # element 2j in the low nibble, along the axis
        pairs = h.reshape(outer, n // 2, 2, inner)
        data = (pairs[:, :, 0, :] | (pairs[:, :, 1, :] << 4)).astype(jnp.uint8)
        data = data.reshape(shape[:axis] + (n // 2,) + shape[axis + 1 :])
    else:
        data = _to_narrow(h, bf.element, shape)
    tensor = jnp.reshape(_f32(ts) if bf.two_level else jnp.float32(1.0), (1,))
    return data, scales, tensor


@functools.partial(jax.jit, static_argnames=("fmt_name", "axis"))
def native_dequantize_blocks(data, scales, tensor, *, fmt_name, axis):
    """float32 values of block-scaled data (``_block_kernels.dequantize_block``) on
    ``jax.lax``."""
    from srround._blocks import BLOCK_FORMATS

    bf = BLOCK_FORMATS[fmt_name]
    shape = list(data.shape)
    if bf.packed:
        shape[axis] *= 2
    shape = tuple(shape)
    outer = int(np.prod(shape[:axis], dtype=np.int64))
    inner = int(np.prod(shape[axis + 1 :], dtype=np.int64))
    n = shape[axis]
    raw = _bits(data, jnp.uint8).astype(_U32)
    if bf.packed:
        raw = raw.reshape(outer, n // 2, 1, inner)
        h = jnp.concatenate([raw & 0xF, raw >> 4], axis=2)
    else:
        h = raw.reshape(outer, n, 1, inner)
    h = h.reshape(outer, n // bf.block, bf.block, inner)
    code = _bits(scales, jnp.uint8).astype(_U32).reshape(outer, n // bf.block, 1, inner)
    if bf.two_level:
        ts = jnp.broadcast_to(_bits(tensor.reshape(()), _U32), code.shape)
        scale = mul_bits(_decode(code, _E4M3), ts)
    else:
        scale = jnp.where(code == 255, _U32(0x7FC00000), _pow2_bits(code.astype(jnp.int32) - 127))
    out = element_value(h, jnp.broadcast_to(scale, h.shape), bf.element)
    return lax.bitcast_convert_type(out, jnp.float32).reshape(shape)
