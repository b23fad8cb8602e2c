"""JAX adapter: stochastic rounding on ``jax.Array`` s, inside ``jit`` and ``vmap``, any backend.

JAX arrays are immutable and may live on an accelerator, so this adapter does not hand buffer
views to the Numba kernels like the other adapters do. It provides the functional API itself,
and ``srround.stochastic_round(jax_array)`` (and ``round_nearest``, ``to_float32``,
``stochastic_add``) delegate here (see ``srround.adapters``):

* ``stochastic_round(x, *, dtype="bfloat16", seed=None, offset=0, overflow="inf", impl=None)``
* ``round_nearest(x, *, dtype="bfloat16", overflow="inf", impl=None)``
* ``to_float32(y, *, dtype=None, impl=None)``
* ``stochastic_add(w, u, *, alpha=1.0, seed=None, offset=0, dtype=None, overflow="inf",
  impl=None)`` - returns the new ``w`` (``SR(w + alpha * u)``); ``w`` itself is unchanged.

Results are ``jnp.bfloat16`` / ``jnp.float16`` / ``jnp.float32`` arrays, bit for bit those of
srround's NumPy path for the same input bits, seed and offset (the contract of ``_rng.py`` and
``_scalar.py``), under either implementation:

* ``impl="native"``: ``jax.lax``/``jnp`` integer ops only, so it jit-compiles on every backend
  (CPU, GPU, TPU) and needs no x64. The rounding rule of ``_scalar.py`` is written on ``uint32``
  bit patterns; the 64-bit stream counter is a pair of ``uint32`` words with carry; the Threefry
  rounds are unrolled ``uint32`` ops (``_threefry2x32``, the function of ``_rng.threefry2x32``
  and ``jax.extend.random.threefry_2x32``). One Threefry block feeds four consecutive elements,
  as in the Numba kernels; each element computes its block, so the random bits fuse into the
  rounding (one loop, nothing materialized). ``stochastic_add`` needs ``fma(alpha, u, w)`` in float32 with one rounding;
  ``jax.lax`` has no fma, XLA may or may not contract ``alpha * u + w``, and XLA's CPU backend
  flushes float32 subnormals to zero (so float error-free transformations are not exact there,
  nor on TPU), so the fma is computed exactly in integers (``_fma_bits``: 24x24-bit product,
  alignment with a sticky bit, round to nearest even incl. subnormals and overflow).
* ``impl="callback"``: ``jax.pure_callback`` into srround's NumPy/Numba path on the host
  (``vmap_method="sequential"``: a vmapped call equals the per-example calls). The data is
  copied to the host and back, so it is only sensible on CPU. The host work runs on a helper
  thread: XLA runs callbacks with flush-to-zero/denormals-are-zero set, which would make the
  Numba fma of ``stochastic_add`` treat subnormal operands as zero.

Default implementation (``impl=None``): ``"native"`` everywhere. On GPU/TPU it is the only
sensible choice (the callback copies device -> host -> device). On CPU it is also the faster
one except for ``stochastic_add`` calls of ~2^20 elements and more. Measured with
``benchmarks/bench_adapters.py`` (2-core x86 VM, jax 0.10.2 CPU, ``jit`` with the key as an
argument, ``block_until_ready``, median per call; the NumPy path is
``srround.stochastic_round(np_array, out=...)`` / ``srround.stochastic_add`` on the same data;
one run)::

                        1024 elements   2^20        2^22
    stochastic_round (fp32 -> bf16)
      NumPy path          10 us        0.32 ms     1.7 ms
      jax native          80 us        1.1 ms      4.2 ms
      jax callback       449 us        1.6 ms      8.3 ms
    stochastic_add (bf16 w, fp32 u, alpha=0.1)
      NumPy path          11 us        0.52 ms     2.5 ms
      jax native          97 us        2.8 ms     11.0 ms
      jax callback       585 us        2.6 ms      9.5 ms

The callback pays ~0.5 ms per call (pure_callback hand-over, a thread hop, Numba's parallel
launch) and a copy of the result; native runs as one fused XLA loop, the Threefry rounds in it
(its stochastic_add does the exact integer fma, ~4x the NumPy path's time). At 1024 elements
XLA already splits that loop over both threads and waking the second one dominates (~18 us on
one core). Native also fuses with surrounding ops, keeps Python out of the compiled program and
works under every transformation and on accelerators; pass ``impl="callback"`` to run the Numba
kernels themselves.

Seeds (``seed=``):

* ``None``: a seed drawn from srround's library generator (``srround.manual_seed``) when the
  function runs in Python. Under ``jax.jit`` that is at *trace* time: the seed is baked into the
  compiled function and every call of it reuses the same random bits. Pass a key under ``jit``.
* an ``int`` in [0, 2**64): key words ``(seed & 0xFFFFFFFF, seed >> 32)`` (``_rng.split_seed``).
* a JAX PRNG key, new style (``jax.random.key(...)``, threefry implementation) or legacy
  (``jax.random.PRNGKey(...)``: a ``uint32[2]`` array): its key data words ``(w0, w1)`` are the
  Threefry key ``(k0, k1)``, so it equals the int seed ``w0 | (w1 << 32)``. Keys may be traced
  (``jit`` arguments, ``vmap`` ped). Note ``jax.random.key(s)`` for a small int ``s`` has data
  ``(0, s)``, i.e. it equals the int seed ``s << 32``, not ``s``.

``offset`` is a Python int, as in the NumPy path (only ``offset % 4`` is static under ``jit``:
calls at new offsets with the same ``offset % 4`` reuse the compiled program); ``alpha`` may be a
Python float or a (traced) scalar.

Known difference from the Numba CPU path: when an fma operand pair produces a NaN from two NaN
inputs of different signs, which NaN's sign survives is up to the hardware/compiler on both
paths (a single NaN input keeps its sign on both; ``inf * 0`` and ``inf - inf`` give the
platform's default NaN on both).
"""

from __future__ import annotations

import concurrent.futures
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from srround._formats import FORMATS, Format, get_format, saturate_flag
from srround._rng import check_offset, check_seed, next_seed, split_seed

IMPLS = ("native", "callback")
_JNP_DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}
_U32 = jnp.uint32


# -- argument handling ------------------------------------------------------------------------


def _impl(impl, x) -> str:
    if impl is None:
        return "native"  # see the module docstring for why, with the CPU numbers
    if impl not in IMPLS:
        options = ", ".join(map(repr, IMPLS))
        raise ValueError(f"impl: expected one of {options} or None, got {impl!r}")
    return impl


def _no_out(out) -> None:
    if out is not None:
        raise TypeError(
            "out: JAX arrays are immutable, so out= is not supported; use the returned array"
        )


def _as_jax(x, name: str):
    if isinstance(x, jax.Array):  # includes tracers
        return x
    try:
        return jnp.asarray(x)
    except TypeError:
        raise TypeError(f"{name}: expected a JAX array, got {type(x).__name__}") from None


def _check_float32(x, name: str):
    x = _as_jax(x, name)
    if x.dtype != jnp.float32:
        extra = ""
        if x.dtype == jnp.float64:
            extra = (
                "; float64 is rejected rather than rounded through float32, which would round"
                " twice - cast with .astype(jnp.float32) if that is what you want"
            )
        raise TypeError(f"{name}: expected a float32 array, got {x.dtype}{extra}")
    return x


def _narrow(y, name: str, fmt: Format | None):
    """``(array, format)`` of a bf16/fp16 array (or uint16 patterns with ``dtype=`` given)."""
    y = _as_jax(y, name)
    for candidate_name, dtype in _JNP_DTYPES.items():
        if y.dtype == dtype:
            candidate = FORMATS[candidate_name]
            if fmt is not None and fmt is not candidate:
                raise TypeError(f"{name}: dtype {y.dtype} does not match dtype={fmt.name!r}")
            return y, candidate
    if y.dtype == jnp.uint16 and fmt is not None:
        return y, fmt
    raise TypeError(
        f"{name}: expected a narrow float array (bfloat16, float16, or uint16 bit patterns with"
        f" dtype= given), got {y.dtype}"
    )


def _key_words(seed):
    """Threefry key ``(k0, k1)``: Python ints (static) or uint32 scalars (possibly traced)."""
    if seed is None:
        return split_seed(next_seed())
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, (bool, np.bool_)):
        return split_seed(check_seed(seed, "seed"))
    if isinstance(seed, (jax.Array, np.ndarray)):
        if jnp.issubdtype(seed.dtype, jax.dtypes.prng_key):
            impl = str(jax.random.key_impl(seed))
            if seed.shape != () or "threefry" not in impl:
                raise TypeError(
                    f"seed: expected a single threefry PRNG key, got shape {seed.shape} of {impl}"
                )
            data = jax.random.key_data(seed)
        else:
            data = seed
        if data.shape == (2,) and data.dtype == jnp.uint32:
            return data[0], data[1]
        raise TypeError(
            f"seed: expected a PRNG key (jax.random.key / PRNGKey: uint32[2]), got"
            f" {data.dtype}{list(data.shape)}"
        )
    raise TypeError(
        f"seed: expected None, an int in [0, 2**64) or a JAX PRNG key, got {type(seed).__name__}"
    )


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
    inf = ((1 << eb) - 1) << mb
    magnitude = jnp.where(magnitude >= inf, _U32(inf - 1 if saturate else inf), magnitude)
    sign = (u >> 31) << (eb + mb)
    special = sign | inf | jnp.where(a == 0x7F800000, _U32(0), _U32(1 << (mb - 1)))
    return jnp.where(a >= 0x7F800000, special, sign | magnitude)


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
    p = 31 - lax.clz(frac).astype(jnp.int32)
    exponent = p + 1 - bias - mb
    lead_free = frac - (_U32(1) << _u(jnp.maximum(p, 0)))
    sub = _u(exponent + 127) << 23 | (lead_free << _u(jnp.clip(23 - p, 0, 31)))
    tiny_shift = 150 - bias - mb  # narrow subnormals that stay fp32 subnormals (bf16)
    if 0 <= tiny_shift < 32:
        sub = jnp.where(exponent >= -126, sub, frac << tiny_shift)
    sub = jnp.where(frac == 0, _U32(0), sub)
    magnitude = jnp.where(biased == (1 << eb) - 1, special, jnp.where(biased == 0, sub, normal))
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
    operands use float ops (only specials reach them).
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
    qh, ql = _shr64(zh, zl, sr)
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
    special = lax.bitcast_convert_type(special, _U32)
    return jnp.where(ab_finite & c_finite, finite, special)


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


def _random16(k0, k1, first_lo, first_hi, lane0: int, n: int):
    """The 16 random bits (uint32[n]) of elements 0..n-1 of a call (``_rng.py``'s stream):
    element i is lane ``(lane0 + i) & 3`` of Threefry block ``first + (lane0 + i) >> 2``
    (``first = offset >> 2`` as traced uint32 words, so a new offset does not recompile;
    ``lane0 = offset & 3``). Elementwise in i, so it fuses into the rounding that consumes it:
    each element computes its block (4x the rounds, but a materialized array of blocks would be
    a temporary - a pass over memory, and fresh pages every call on XLA's CPU backend)."""
    if n > (1 << 32) - 4:
        raise ValueError(f"x: {n} elements in one call, at most 2**32 - 4 are supported")
    i = lax.iota(_U32, n) + _U32(lane0)
    j = i >> 2
    c_lo = first_lo + j
    c_hi = first_hi + (c_lo < j).astype(_U32)  # carry into the high counter word
    x0, x1 = _threefry2x32(k0, k1, c_lo, c_hi)
    return (jnp.where((i & 2) == 0, x0, x1) >> ((i & 1) << 4)) & 0xFFFF


def _to_narrow(patterns, fmt: Format, shape):
    narrow = lax.bitcast_convert_type(patterns.astype(jnp.uint16), _JNP_DTYPES[fmt.name])
    return narrow.reshape(shape)


def _bits(x, dtype):
    return lax.bitcast_convert_type(x, dtype).reshape(-1)


# -- native implementations ------------------------------------------------------------------
#
# Jitted with the layout parameters static: under an outer jit they are inlined; called eagerly
# they run as one compiled program (not ~300 op-by-op dispatches), compiled once per shape.
# Key words and alpha are arguments, so a new seed does not recompile.

_static = functools.partial(jax.jit, static_argnames=("lane0", "fmt_name", "saturate"))


def _first_block(offset: int):
    """``offset >> 2`` as two uint32 words: traced arguments, so offsets do not recompile."""
    first = offset >> 2
    return _u(first & 0xFFFFFFFF), _u(first >> 32)


@_static
def _native_stochastic_round(x, k0, k1, first_lo, first_hi, *, lane0, fmt_name, saturate):
    fmt = FORMATS[fmt_name]
    n = x.size
    y = _encode(_bits(x, _U32), fmt, saturate, _random16(k0, k1, first_lo, first_hi, lane0, n))
    return _to_narrow(y, fmt, x.shape)


@functools.partial(jax.jit, static_argnames=("fmt_name", "saturate"))
def _native_round_nearest(x, *, fmt_name, saturate):
    fmt = FORMATS[fmt_name]
    return _to_narrow(_encode(_bits(x, _U32), fmt, saturate), fmt, x.shape)


@functools.partial(jax.jit, static_argnames=("fmt_name",))
def _native_to_float32(y, *, fmt_name):
    h = _bits(y, jnp.uint16).astype(_U32)
    return lax.bitcast_convert_type(_decode(h, FORMATS[fmt_name]), jnp.float32).reshape(y.shape)


@_static
def _native_stochastic_add(w, u, alpha, k0, k1, first_lo, first_hi, *, lane0, fmt_name, saturate):
    fmt = FORMATS[fmt_name]
    n = w.size
    wb = _bits(w, jnp.uint16).astype(_U32)
    ub = _bits(u, _U32)
    ab = lax.bitcast_convert_type(jnp.asarray(alpha, jnp.float32), _U32)
    total = _fma_bits(ab, ub, _decode(wb, fmt))
    bits16 = _random16(k0, k1, first_lo, first_hi, lane0, n)
    out = _encode(total, fmt, saturate, bits16)
    return lax.bitcast_convert_type(out.astype(jnp.uint16), w.dtype).reshape(w.shape)


# -- callback implementations ----------------------------------------------------------------


def _seed_of(k0, k1) -> int:
    return int(k0) | (int(k1) << 32)


# XLA's CPU runtime runs computations, and the host callbacks inside them, with the thread's
# flush-to-zero / denormals-are-zero flags set: a Numba fma there treats subnormal operands as
# zero (alpha = 2**-130 times inf gave NaN instead of inf). So the host work runs on a thread of
# its own, started here, at import, with the default floating-point environment (a new thread
# inherits its creator's); Numba's worker pool, if first started from it, inherits it too.
_HOST = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="srround-jax-host")
_HOST.submit(int).result()  # start the thread now, outside any XLA computation


def _callback(fn, result_shape, *args):
    def on_host(*arrays):
        return _HOST.submit(fn, *arrays).result()

    return jax.pure_callback(on_host, result_shape, *args, vmap_method="sequential")


def _host(name: str):
    """srround's own API function ``name`` (the NumPy path, run on host arrays)."""
    import srround._api as api

    return getattr(api, name)


# -- public functions ------------------------------------------------------------------------


def stochastic_round(
    x, *, dtype="bfloat16", seed=None, offset=0, overflow="inf", impl=None, out=None
):
    """Stochastically round a float32 JAX array to bf16/fp16 (see ``srround.stochastic_round``).

    Args:
        x: float32 array (any shape; a tracer under ``jit``/``vmap``).
        dtype: ``"bfloat16"`` (default) or ``"float16"``.
        seed: ``None``, an int in [0, 2**64) or a JAX PRNG key (module docstring).
        offset: Python int, position of ``x``'s first element in the random stream.
        overflow: ``"inf"`` or ``"saturate"``.
        impl: ``"native"``, ``"callback"`` or ``None`` (default: ``"native"``).

    Returns:
        a new ``jnp.bfloat16`` / ``jnp.float16`` array of ``x``'s shape.
    """
    _no_out(out)
    fmt = get_format(dtype)
    saturate = saturate_flag(overflow)
    offset = check_offset(offset)
    x = _check_float32(x, "x")
    impl = _impl(impl, x)
    k0, k1 = _key_words(seed)
    if impl == "native":
        if x.size == 0:
            return jnp.zeros(x.shape, _JNP_DTYPES[fmt.name])
        return _native_stochastic_round(
            x,
            _u(k0),
            _u(k1),
            *_first_block(offset),
            lane0=offset & 3,
            fmt_name=fmt.name,
            saturate=saturate,
        )

    def host(xh, h0, h1):
        y = _host("stochastic_round")(
            np.asarray(xh, order="C"),
            dtype=fmt.name,
            seed=_seed_of(h0, h1),
            offset=offset,
            overflow=overflow,
        )
        return np.asarray(y).reshape(xh.shape)

    shape = jax.ShapeDtypeStruct(x.shape, _JNP_DTYPES[fmt.name])
    return _callback(host, shape, x, _u(k0), _u(k1))


def round_nearest(x, *, dtype="bfloat16", overflow="inf", impl=None, out=None):
    """Round a float32 JAX array to the nearest bf16/fp16 value, ties to even (see
    ``srround.round_nearest``; every NaN becomes the format's quiet NaN with its sign)."""
    _no_out(out)
    fmt = get_format(dtype)
    saturate = saturate_flag(overflow)
    x = _check_float32(x, "x")
    if _impl(impl, x) == "native":
        if x.size == 0:
            return jnp.zeros(x.shape, _JNP_DTYPES[fmt.name])
        return _native_round_nearest(x, fmt_name=fmt.name, saturate=saturate)

    def host(xh):
        return np.asarray(
            _host("round_nearest")(np.asarray(xh, order="C"), dtype=fmt.name, overflow=overflow)
        ).reshape(xh.shape)

    return _callback(host, jax.ShapeDtypeStruct(x.shape, _JNP_DTYPES[fmt.name]), x)


def to_float32(y, *, dtype=None, impl=None, out=None):
    """Widen a bf16/fp16 JAX array (or uint16 patterns with ``dtype=``) to float32 exactly
    (NaN payloads kept)."""
    _no_out(out)
    y, fmt = _narrow(y, "y", None if dtype is None else get_format(dtype))
    if _impl(impl, y) == "native":
        if y.size == 0:
            return jnp.zeros(y.shape, jnp.float32)
        return _native_to_float32(y, fmt_name=fmt.name)

    def host(yh):
        widened = _host("to_float32")(np.asarray(yh, order="C"), dtype=fmt.name)
        return np.asarray(widened).reshape(yh.shape)

    return _callback(host, jax.ShapeDtypeStruct(y.shape, jnp.float32), y)


def stochastic_add(w, u, *, alpha=1.0, seed=None, offset=0, dtype=None, overflow="inf", impl=None):
    """``SR(w + alpha * u)`` for a bf16/fp16 JAX array ``w`` and a float32 ``u`` of its shape:
    the sum in float32 with one rounding (``fma(alpha, u, w)``), then stochastically rounded to
    ``w``'s format. Returns the new ``w`` (same dtype); JAX arrays are immutable, so unlike the
    NumPy path nothing is updated in place.

    Args:
        w: bf16/fp16 array (or uint16 patterns with ``dtype=``).
        u: float32 array of ``w``'s shape.
        alpha: float32 scale of ``u`` (a Python number or a scalar array, may be traced).
        seed, offset, overflow, impl: as ``stochastic_round``.
        dtype: the format of ``w`` when its dtype does not say it.
    """
    w, fmt = _narrow(w, "w", None if dtype is None else get_format(dtype))
    u = _check_float32(u, "u")
    if tuple(u.shape) != tuple(w.shape):
        raise ValueError(f"u: shape {tuple(u.shape)} does not match w's shape {tuple(w.shape)}")
    saturate = saturate_flag(overflow)
    offset = check_offset(offset)
    impl = _impl(impl, w)
    k0, k1 = _key_words(seed)
    if isinstance(alpha, (int, float, np.number)):
        alpha = np.float32(alpha)
    else:
        alpha = _as_jax(alpha, "alpha")
        if alpha.shape != ():
            raise ValueError(f"alpha: expected a scalar, got shape {alpha.shape}")
        alpha = alpha.astype(jnp.float32)
    if impl == "native":
        if w.size == 0:
            return w
        return _native_stochastic_add(
            w,
            u,
            alpha,
            _u(k0),
            _u(k1),
            *_first_block(offset),
            lane0=offset & 3,
            fmt_name=fmt.name,
            saturate=saturate,
        )

    def host(wh, uh, ah, h0, h1):
        target = np.array(wh)  # a writable copy: the callback's input is read-only
        _host("stochastic_add")(
            target,
            np.asarray(uh, order="C"),
            alpha=np.float32(ah),
            seed=_seed_of(h0, h1),
            offset=offset,
            dtype=fmt.name,
            overflow=overflow,
        )
        return target

    shape = jax.ShapeDtypeStruct(w.shape, w.dtype)
    return _callback(host, shape, w, u, jnp.asarray(alpha, jnp.float32), _u(k0), _u(k1))


# -- the View protocol of the other adapters: not for immutable arrays ------------------------


def _unsupported(*args, **kwargs):
    raise TypeError(
        "JAX arrays are immutable: srround's in-place and out= operations do not take them; use"
        " srround.adapters.jax (stochastic_round, round_nearest, to_float32, stochastic_add)"
    )


source = target = inplace = counter = buffer_table = _unsupported
