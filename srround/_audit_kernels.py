"""Numba kernels of ``srround.audit``: one pass over a flat tensor, counts per thread.

Two kernels:

* ``pattern_histogram(bits, hist)``: how often each of the 65536 patterns of a 16-bit tensor
  (bf16 or fp16 viewed as ``uint16``) occurs. Every statistic of a 16-bit tensor is a function
  of its patterns, so the audit runs ``value_stats`` over the 65536 decoded patterns weighted by
  this histogram: exact, and the pass over the tensor is a plain byte count.
* ``value_stats(...)``: the statistics of float values (fp32/fp64 arrays, a 16-bit tensor
  through a decode table, or weighted patterns), optionally with a per-weight update array.

Statistics (``STAT_*`` columns of the ``stats`` row of each thread, summed / max / min over
threads by the caller):

* counts of values: all, NaN, inf, zero;
* fp16 range of the values as stored: overflow (``|x| >= 65520``, becomes inf), subnormal
  (``2**-25 < |x| < 2**-14``), flushed to zero (``0 < |x| <= 2**-25``);
* largest finite magnitude, smallest nonzero finite magnitude;
* stagnation in the target format (``mantissa_bits``, ``exponent_bits``): each finite value is
  first rounded to nearest-even in the target, then an update ``u`` is lost when
  round-to-nearest of ``q + u`` gives ``q`` back. With a scalar ``lr`` (sign unknown) both
  directions are tried and ``STAT_LOST`` counts lost directions (0, 1 or 2 per weight); with an
  update array the update's own sign is used, zero and non-finite updates are counted apart;
* ``exp_hist``: how many finite values have each target exponent (their spacing), and with an
  update array ``ratio_hist``: ``half spacing / |u|`` in ``RATIO_STEPS`` bins per binade
  (``ratio_value`` gives a bin's midpoint, within ``2**-11`` relative of every value in it).
"""

from __future__ import annotations

import math

import numpy as np
from numba import get_num_threads, njit, prange, types
from numba.extending import overload

STAT_COUNT = 0
STAT_NAN = 1
STAT_INF = 2
STAT_ZERO = 3
STAT_F16_OVERFLOW = 4
STAT_F16_SUBNORMAL = 5
STAT_F16_FLUSH = 6
STAT_AMAX = 7
STAT_AMIN = 8
STAT_LOST = 9
STAT_UPDATES = 10
STAT_U_ZERO = 11
STAT_U_NONFINITE = 12
N_STATS = 13

RATIO_BITS = 10
RATIO_STEPS = 1 << RATIO_BITS  # bins per binade of ``ratio_hist``
RATIO_BINADES = 256  # ratios 2**-128 .. 2**128 (beyond: counted in the first / last bin)

_F32_INF = 0x7F800000
_F32_F16_OVERFLOW = 0x477FF000  # float32 patterns of 65520, 2**-25 and 2**-14
_F32_F16_FLUSH = 0x33000000
_F32_F16_MIN_NORMAL = 0x38800000
_F16_OVERFLOW = 65520.0  # 65504 + half a spacing: at or above it, round-to-nearest gives inf
_F16_MIN_NORMAL = 2.0**-14
_F16_FLUSH = 2.0**-25  # half the smallest subnormal: at or below it, round-to-nearest gives 0


def _value(a, i, table):
    """``a[i]`` as float64: through ``table`` (a 16-bit decode table) unless it is None."""


@overload(_value, forceinline=True)
def _value_impl(a, i, table):
    if isinstance(table, types.NoneType):
        return lambda a, i, table: np.float64(a[i])
    return lambda a, i, table: table[a[i]]


def _weight(counts, i):
    """The multiplicity of element ``i``: ``counts[i]``, or 1 when ``counts`` is None."""


@overload(_weight, forceinline=True)
def _weight_impl(counts, i):
    if isinstance(counts, types.NoneType):
        return lambda counts, i: 1.0
    return lambda counts, i: np.float64(counts[i])


@njit(forceinline=True, cache=True)
def _exponent(a):
    """floor(log2(a)) of a positive float64 (-1023 for zero and float64 subnormals)."""
    return (np.float64(a).view(np.int64) >> 52) - 1023


@njit(forceinline=True, cache=True)
def _pow2(e):
    """2.0**e for -1022 <= e <= 1023."""
    return np.int64((e + 1023) << 52).view(np.float64)


@njit(forceinline=True, cache=True)
def _round_half_even(v):
    """The integer nearest to ``v >= 0`` (ties to even), as int64."""
    r = np.int64(v + 0.5)
    return r - (((r - v) == 0.5) & ((r & 1) == 1))


@njit(forceinline=True, cache=True)
def _lost(d, half, even):
    """Whether an update of magnitude ``d`` is lost where half the spacing is ``half``."""
    return (d < half) | ((d == half) & even)


@njit(forceinline=True, cache=True)
def _histogram_rows(bits, row, lo, hi):
    for i in range(lo, hi):
        row[bits[i]] += 1


@njit(parallel=True, cache=True)
def pattern_histogram(bits, hist):
    """Add the occurrences of each 16-bit pattern of ``bits`` (uint16) to ``hist``
    (int64, shape ``(rows, 65536)``): ``rows`` threads, one row each."""
    n = bits.size
    nt = hist.shape[0]
    for t in prange(nt):
        _histogram_rows(bits, hist[t], t * n // nt, (t + 1) * n // nt)


@njit(cache=True)
def pattern_histogram_serial(bits, hist):
    """``pattern_histogram`` on the calling thread only (small tensors: no thread start)."""
    _histogram_rows(bits, hist[0], 0, bits.size)


@njit(forceinline=True, cache=True)
def _fp32_rows(bits, row, s, lo, hi):
    n_all = 0.0
    n_nan = 0.0
    n_inf = 0.0
    n_zero = 0.0
    n_over = 0.0
    n_sub = 0.0
    n_flush = 0.0
    amax = np.uint32(0)
    amin = np.uint32(_F32_INF)
    for i in range(lo, hi):
        b = bits[i]
        a = b & np.uint32(0x7FFFFFFF)
        n_all += 1.0
        if a >= np.uint32(_F32_INF):
            n_nan += a > np.uint32(_F32_INF)
            n_inf += a == np.uint32(_F32_INF)
            continue
        # positive float32 patterns order like their values
        n_zero += a == 0
        n_over += a >= np.uint32(_F32_F16_OVERFLOW)
        n_flush += (a > 0) & (a <= np.uint32(_F32_F16_FLUSH))
        n_sub += (a > np.uint32(_F32_F16_FLUSH)) & (a < np.uint32(_F32_F16_MIN_NORMAL))
        amax = max(amax, a)
        amin = min(amin, a if a > 0 else np.uint32(_F32_INF))
        # round to nearest even bfloat16 (exact for subnormals too)
        row[(b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)] += 1
    s[STAT_COUNT] += n_all
    s[STAT_NAN] += n_nan
    s[STAT_INF] += n_inf
    s[STAT_ZERO] += n_zero
    s[STAT_F16_OVERFLOW] += n_over
    s[STAT_F16_SUBNORMAL] += n_sub
    s[STAT_F16_FLUSH] += n_flush
    s[STAT_AMAX] = max(s[STAT_AMAX], np.float64(np.uint32(amax).view(np.float32)))
    if amin < np.uint32(_F32_INF):
        s[STAT_AMIN] = min(s[STAT_AMIN], np.float64(np.uint32(amin).view(np.float32)))


@njit(parallel=True, cache=True)
def fp32_bf16_histogram(bits, hist, stats):
    """The value statistics of a float32 tensor (``bits``: its uint32 view) into ``stats``
    (``STAT_COUNT`` .. ``STAT_AMIN``) and the histogram of its bfloat16 round-to-nearest
    patterns (NaN/inf left out) into ``hist`` (int64, ``(rows, 65536)``): with a scalar update
    every stagnation statistic in bfloat16 is a function of that pattern."""
    n = bits.size
    nt = hist.shape[0]
    for t in prange(nt):
        _fp32_rows(bits, hist[t], stats[t], t * n // nt, (t + 1) * n // nt)


@njit(cache=True)
def fp32_bf16_histogram_serial(bits, hist, stats):
    """``fp32_bf16_histogram`` on the calling thread only."""
    _fp32_rows(bits, hist[0], stats[0], 0, bits.size)


@njit(forceinline=True, cache=True)
def _stats_rows(
    w, w_table, counts, u, u_table, lr, mantissa_bits, exponent_bits, limits, s, eh, rh, lo, hi
):
    over_at, min_normal, flush_at, top_binade = limits
    bias = (1 << (exponent_bits - 1)) - 1
    emin = 1 - bias
    emax = bias + top_binade  # fp8 e4m3fn: the all-ones exponent holds numbers
    top_k = np.int64(1) << (mantissa_bits + 1)
    first_k = np.int64(1) << mantissa_bits
    amax = 0.0
    amin = np.inf
    n_all = 0.0
    n_nan = 0.0
    n_inf = 0.0
    n_zero = 0.0
    n_over = 0.0
    n_sub = 0.0
    n_flush = 0.0
    n_lost = 0.0
    n_upd = 0.0
    n_uzero = 0.0
    n_ubad = 0.0
    for i in range(lo, hi):
        c = _weight(counts, i)
        if c == 0.0:
            continue
        x = _value(w, i, w_table)
        n_all += c
        if x != x:
            n_nan += c
            continue
        a = abs(x)
        if a == np.inf:
            n_inf += c
            continue
        # fp16 range of the value as stored (branch-free: the data decide nothing)
        n_zero += c * (a == 0.0)
        n_over += c * (a >= over_at)
        n_flush += c * ((a > 0.0) & (a <= flush_at))
        n_sub += c * ((a > flush_at) & (a < min_normal))
        amin = min(amin, a if a > 0.0 else np.inf)
        amax = max(amax, a)
        # the value stored in the target format: q = k * spacing, k an integer
        e = min(max(_exponent(a), emin), emax)
        sp = _pow2(e - mantissa_bits)
        k = _round_half_even(a * _pow2(mantissa_bits - e))
        if k >= top_k and e < emax:
            e += 1
            sp *= 2.0
            k >>= 1
        eh[e - emin] += c
        even = (k & 1) == 0
        half_up = 0.5 * sp
        # toward zero from the first value of a binade the spacing below is half as wide
        half_down = half_up * (0.5 if (k == first_k) & (e > emin) else 1.0)
        if u is None:
            n_upd += 2.0 * c
            n_lost += c * (_lost(lr, half_up, even) + _lost(lr, half_down, even))
        else:
            v = _value(u, i, u_table)
            d = abs(v)
            if d != d or d == np.inf:
                n_ubad += c
                continue
            if d == 0.0:
                n_uzero += c
                continue
            n_upd += c
            away = (k == 0) | ((v > 0.0) == (x > 0.0))
            n_lost += c * _lost(d, half_up if away else half_down, even)
            r = np.float64(half_up / d).view(np.int64)  # its binade and top fraction bits
            b = ((r >> 52) - 1022 + RATIO_BINADES // 2) * RATIO_STEPS + (
                (r >> (52 - RATIO_BITS)) & (RATIO_STEPS - 1)
            )
            rh[min(max(b, 0), RATIO_BINADES * RATIO_STEPS - 1)] += c
    s[STAT_COUNT] += n_all
    s[STAT_NAN] += n_nan
    s[STAT_INF] += n_inf
    s[STAT_ZERO] += n_zero
    s[STAT_F16_OVERFLOW] += n_over
    s[STAT_F16_SUBNORMAL] += n_sub
    s[STAT_F16_FLUSH] += n_flush
    s[STAT_LOST] += n_lost
    s[STAT_UPDATES] += n_upd
    s[STAT_U_ZERO] += n_uzero
    s[STAT_U_NONFINITE] += n_ubad
    s[STAT_AMAX] = max(s[STAT_AMAX], amax)
    s[STAT_AMIN] = min(s[STAT_AMIN], amin)


@njit(parallel=True, cache=True)
def value_stats(
    w,
    w_table,
    counts,
    u,
    u_table,
    lr,
    mantissa_bits,
    exponent_bits,
    limits,
    stats,
    exp_hist,
    ratio_hist,
):
    """Accumulate the statistics of ``w`` into ``stats`` / ``exp_hist`` / ``ratio_hist`` (one
    row per thread, float64; the caller zeroes them and reduces over rows).

    Args:
        w: flat values (float32/float64), or 16-bit patterns (uint16) with ``w_table``.
        w_table: float64 decode table of the 65536 patterns, or None.
        counts: multiplicity of each element of ``w`` (int64), or None for 1 each.
        u: per-weight updates like ``w`` (same length), or None to use ``lr``.
        u_table: decode table of ``u``, or None.
        lr: update magnitude (> 0) when ``u`` is None; both directions are counted.
        mantissa_bits, exponent_bits: the target format.
        limits: ``range_limits`` of the range format: (overflow threshold, smallest normal,
            flush threshold, 1 if the all-ones exponent holds numbers else 0).
    """
    n = w.size
    nt = stats.shape[0]
    for t in prange(nt):
        _stats_rows(
            w,
            w_table,
            counts,
            u,
            u_table,
            lr,
            mantissa_bits,
            exponent_bits,
            limits,
            stats[t],
            exp_hist[t],
            ratio_hist[t],
            t * n // nt,
            (t + 1) * n // nt,
        )


@njit(cache=True)
def value_stats_serial(
    w,
    w_table,
    counts,
    u,
    u_table,
    lr,
    mantissa_bits,
    exponent_bits,
    limits,
    stats,
    exp_hist,
    ratio_hist,
):
    """``value_stats`` on the calling thread only, into row 0 (small tensors)."""
    _stats_rows(
        w,
        w_table,
        counts,
        u,
        u_table,
        lr,
        mantissa_bits,
        exponent_bits,
        limits,
        stats[0],
        exp_hist[0],
        ratio_hist[0],
        0,
        w.size,
    )


def threads() -> int:
    """Rows for a parallel kernel: Numba's current thread count."""
    return get_num_threads()


def range_limits(fmt) -> tuple:
    """``limits`` of ``value_stats`` for the range statistics in ``fmt``: magnitudes at or above
    the first become inf/NaN under round-to-nearest (the largest finite value plus half a
    spacing; just above it when that tie rounds down to an even largest value, as e4m3fn's
    464), below the second are subnormal, at or below the third round to zero."""
    top = fmt.max_finite
    half = math.ldexp(1.0, math.frexp(top)[1] - 1 - fmt.mantissa_bits - 1)
    over = top + half
    mantissa_even = round(top / math.ldexp(1.0, math.frexp(top)[1] - 1 - fmt.mantissa_bits)) % 2
    if mantissa_even == 0:  # the tie rounds to the (even) largest value
        over = float(np.nextafter(over, np.inf))
    min_normal = math.ldexp(1.0, 1 - fmt.bias)
    flush = fmt.smallest_subnormal / 2
    return over, min_normal, flush, 0 if fmt.specials == 0 else 1


def new_buffers(exponent_bits: int, with_ratio: bool, rows: int):
    """Zeroed ``(stats, exp_hist, ratio_hist)`` for ``value_stats`` with ``rows`` rows."""
    stats = np.zeros((rows, N_STATS))
    stats[:, STAT_AMIN] = np.inf
    exp_hist = np.zeros((rows, (1 << exponent_bits) - 1))
    ratio_hist = np.zeros((rows, RATIO_BINADES * RATIO_STEPS if with_ratio else 1))
    return stats, exp_hist, ratio_hist


def ratio_value(index):
    """The midpoint of ``ratio_hist`` bin ``index``."""
    binade, step = divmod(int(index), RATIO_STEPS)
    return math.ldexp(0.5 + (step + 0.5) / (2 * RATIO_STEPS), binade - RATIO_BINADES // 2)
