"""Numba kernels of ``srround.audit``: one pass over a flat tensor, counts per thread.

Two kernels:

* ``pattern_counts(...)``: for a bfloat16 or float16 target every statistic of a weight is a
  function of the pattern it is stored as, so the pass over the tensor counts patterns (its
  16-bit patterns, or the target's round-to-nearest patterns of float32 values, whose value
  statistics are counted on the way) and, with an update array, looks each weight's loss
  threshold up in a per-pattern table (``update_table``); the audit then runs ``value_stats``
  over the 65536 decoded patterns weighted by that histogram.
* ``value_stats(...)``: the statistics of float values (fp32/fp64 arrays, a 16-bit tensor
  through a decode table, or weighted patterns), optionally with a per-weight update array:
  every other case (fp64 weights, fp8 targets) and the pattern histograms.

Statistics (``STAT_*`` columns of the ``stats`` row of each thread, summed / max / min over
threads by the caller):

* counts of values: all, NaN, inf, zero;
* fp16 range of the values as stored: overflow (``|x| >= 65520``, becomes inf), subnormal
  (``2**-25 < |x| < 2**-14``), flushed to zero (``0 < |x| <= 2**-25``);
* largest finite magnitude, smallest nonzero finite magnitude;
* stagnation in the target format (``mantissa_bits``, ``exponent_bits``): each finite value is
  first rounded to nearest-even in the target (one that rounds past the largest binade has no
  stagnation statistics, as an inf pattern has none), then an update ``u`` is lost when
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

from ._scalar import encode_nearest

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
def _add_values(s, counts, amax, amin):
    """Add a row's value counts (``STAT_COUNT`` .. ``STAT_F16_FLUSH``, in column order) and
    its largest / smallest nonzero magnitude to the stats row ``s``."""
    for j in range(STAT_F16_FLUSH + 1):
        s[STAT_COUNT + j] += counts[j]
    s[STAT_AMAX] = max(s[STAT_AMAX], amax)
    s[STAT_AMIN] = min(s[STAT_AMIN], amin)


@njit(forceinline=True, cache=True)
def _quantum(a, mantissa_bits, emin, emax, top_k):
    """A finite magnitude ``a`` stored in the target by round-to-nearest-even: ``(e, sp, k)``
    with the stored magnitude ``k * sp``, ``sp`` the spacing of exponent ``e``."""
    e = min(max(_exponent(a), emin), emax)
    sp = _pow2(e - mantissa_bits)
    k = _round_half_even(a * _pow2(mantissa_bits - e))
    if k >= top_k and e < emax:
        e += 1
        sp *= 2.0
        k >>= 1
    return e, sp, k


@njit(forceinline=True, cache=True)
def _halves(e, sp, k, emin, first_k):
    """Half the spacing away from zero and toward zero of a stored ``k * sp``: toward zero
    from the first value of a binade the spacing below is half as wide."""
    half_up = 0.5 * sp
    return half_up, half_up * (0.5 if (k == first_k) & (e > emin) else 1.0)


@njit(forceinline=True, cache=True)
def _ratio_bin(half_up, d):
    """The ``ratio_hist`` bin of ``half_up / d``: its binade and top fraction bits."""
    r = np.float64(half_up / d).view(np.int64)
    b = ((r >> 52) - 1022 + RATIO_BINADES // 2) * RATIO_STEPS + (
        (r >> (52 - RATIO_BITS)) & (RATIO_STEPS - 1)
    )
    return min(max(b, 0), RATIO_BINADES * RATIO_STEPS - 1)


@njit(forceinline=True, cache=True)
def _stats_rows(
    w, w_table, counts, u, u_table, lr, mantissa_bits, exponent_bits, limits, s, eh, rh, lo, hi
):
    over_at, min_normal, flush_at, top_binade, target_over_at = limits
    bias = (1 << (exponent_bits - 1)) - 1
    emin = 1 - bias
    emax = bias + top_binade  # fp8 e4m3fn: the all-ones exponent holds numbers
    top_k = np.int64(1) << (mantissa_bits + 1)
    first_k = np.int64(1) << mantissa_bits
    amax = 0.0
    amin = np.inf
    n_all = n_nan = n_inf = n_zero = n_over = n_sub = n_flush = 0.0
    n_lost = n_upd = n_uzero = n_ubad = 0.0
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
        if a >= target_over_at:  # inf or NaN in the target (e4m3fn: 464 < a < 496 is NaN)
            continue
        e, sp, k = _quantum(a, mantissa_bits, emin, emax, top_k)
        eh[e - emin] += c
        even = (k & 1) == 0
        half_up, half_down = _halves(e, sp, k, emin, first_k)
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
            rh[_ratio_bin(half_up, d)] += c
    _add_values(s, (n_all, n_nan, n_inf, n_zero, n_over, n_sub, n_flush), amax, amin)
    s[STAT_LOST] += n_lost
    s[STAT_UPDATES] += n_upd
    s[STAT_U_ZERO] += n_uzero
    s[STAT_U_NONFINITE] += n_ubad


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
        limits: ``audit_limits`` of the range format and the target.
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


# -- 16-bit targets: every statistic is a function of the weight's target pattern ------------

T_LOST_IF_UP = 0  # columns of ``update_table`` (one row of a cache line's half per pattern)
T_LOST_IF_DOWN = 1
T_HALF_UP = 2


@njit(cache=True)
def update_table(values, mantissa_bits, exponent_bits):
    """Per pattern of a 16-bit target (``values``: the float64 of the 65536 patterns): an
    update ``v`` of a weight stored as that pattern is lost when ``|v|`` is below column
    ``T_LOST_IF_UP`` (``v > 0``) or ``T_LOST_IF_DOWN`` (``v < 0``): half the spacing in that
    direction, just above it when the pattern is even (ties go to even). ``T_HALF_UP``: half
    the spacing away from zero (``ratio_hist``); 0 for NaN and inf, which have no update
    statistics. The rule of ``_stats_rows``, tabulated."""
    bias = (1 << (exponent_bits - 1)) - 1
    emin = 1 - bias
    top_k = np.int64(1) << (mantissa_bits + 1)
    first_k = np.int64(1) << mantissa_bits
    table = np.zeros((values.size, 4))  # column 3: padding to 32 bytes
    for p in range(values.size):
        x = values[p]
        a = abs(x)
        if not a < np.inf:
            continue
        e, sp, k = _quantum(a, mantissa_bits, emin, bias, top_k)
        half_up, half_down = _halves(e, sp, k, emin, first_k)
        # lost: d < half, or d == half on an even pattern: d < the next float64 above half
        tie = (k & 1) == 0
        up = np.int64(np.float64(half_up).view(np.int64) + tie).view(np.float64)
        down = np.int64(np.float64(half_down).view(np.int64) + tie).view(np.float64)
        away_if_up = (k == 0) | (x > 0.0)
        away_if_down = (k == 0) | (x < 0.0)
        table[p, T_LOST_IF_UP] = up if away_if_up else down
        table[p, T_LOST_IF_DOWN] = up if away_if_down else down
        table[p, T_HALF_UP] = half_up
    return table


@njit(forceinline=True, cache=True)
def _update_counts(p, v, table, rh):
    """The update statistics of one weight of target pattern ``p`` and update ``v``: adds
    to ``rh`` and returns ``(lost, updates, zero updates, non-finite updates)``."""
    half_up = table[p, T_HALF_UP]
    d = abs(v)
    if half_up == 0.0:  # a NaN or inf weight
        return 0.0, 0.0, 0.0, 0.0
    if not d < np.inf:
        return 0.0, 0.0, 0.0, 1.0
    if d == 0.0:
        return 0.0, 0.0, 1.0, 0.0
    rh[_ratio_bin(half_up, d)] += 1.0
    lost = d < table[p, T_LOST_IF_UP if v > 0.0 else T_LOST_IF_DOWN]
    return np.float64(lost), 1.0, 0.0, 0.0


def _update_at(p, u, i, u_table, table, rh):
    """``_update_counts`` of element ``i`` of the update array ``u``; zeros when it is None."""


@overload(_update_at, forceinline=True)
def _update_at_impl(p, u, i, u_table, table, rh):
    if isinstance(u, types.NoneType):
        return lambda p, u, i, u_table, table, rh: (0.0, 0.0, 0.0, 0.0)
    return lambda p, u, i, u_table, table, rh: _update_counts(p, _value(u, i, u_table), table, rh)


@njit(forceinline=True, cache=True)
def _add_updates(s, lost, updates, zero, bad):
    s[STAT_LOST] += lost
    s[STAT_UPDATES] += updates
    s[STAT_U_ZERO] += zero
    s[STAT_U_NONFINITE] += bad


@njit(forceinline=True, cache=True)
def _u16_rows(w, mantissa_bits, u, u_table, table, row, s, rh, lo, hi):
    """Stored 16-bit patterns: counted as they are (``table`` indexed by them)."""
    lost = updates = zero = bad = 0.0
    for i in range(lo, hi):
        p = w[i]
        row[p] += 1
        dl, du, dz, db = _update_at(p, u, i, u_table, table, rh)
        lost, updates, zero, bad = lost + dl, updates + du, zero + dz, bad + db
    _add_updates(s, lost, updates, zero, bad)


@njit(forceinline=True, cache=True)
def _target_pattern(b, mantissa_bits):
    """The bfloat16 or float16 round-to-nearest-even pattern of float32 bits ``b``."""
    if mantissa_bits == 7:
        return encode_nearest(b, 7, 8, False)
    return encode_nearest(b, 10, 5, False)


@njit(forceinline=True, cache=True)
def _f32_rows(w, mantissa_bits, u, u_table, table, row, s, rh, lo, hi):
    """float32 bits: the value statistics counted on the way, then the target pattern."""
    n_all = n_nan = n_inf = n_zero = n_over = n_sub = n_flush = 0.0
    lost = updates = zero = bad = 0.0
    amax = np.uint32(0)
    amin = np.uint32(_F32_INF)
    for i in range(lo, hi):
        b = w[i]
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
        p = _target_pattern(b, mantissa_bits)
        row[p] += 1
        dl, du, dz, db = _update_at(p, u, i, u_table, table, rh)
        lost, updates, zero, bad = lost + dl, updates + du, zero + dz, bad + db
    _add_updates(s, lost, updates, zero, bad)
    counts = (n_all, n_nan, n_inf, n_zero, n_over, n_sub, n_flush)
    low = np.float64(np.uint32(amin).view(np.float32)) if amin < np.uint32(_F32_INF) else np.inf
    _add_values(s, counts, np.float64(np.uint32(amax).view(np.float32)), low)


def _rows(w, mantissa_bits, u, u_table, table, row, s, rh, lo, hi):
    """``_f32_rows`` for float32 bits (uint32), ``_u16_rows`` for 16-bit patterns."""


@overload(_rows, forceinline=True)
def _rows_impl(w, mantissa_bits, u, u_table, table, row, s, rh, lo, hi):
    body = _f32_rows if w.dtype.bitwidth == 32 else _u16_rows
    return lambda w, mantissa_bits, u, u_table, table, row, s, rh, lo, hi: body(
        w, mantissa_bits, u, u_table, table, row, s, rh, lo, hi
    )


@njit(parallel=True, cache=True)
def pattern_counts(w, mantissa_bits, u, u_table, table, hist, stats, ratio_hist):
    """The target patterns of a tensor into ``hist`` (int64, one 65536 row per thread) and,
    with an update array ``u`` (as in ``value_stats``), its statistics (``STAT_LOST`` ..
    ``STAT_U_NONFINITE``, ``ratio_hist``), one pass.

    ``w``: 16-bit patterns (uint16), counted as they are (``table``: ``update_table`` indexed
    by stored pattern), or float32 bits (uint32), counted by their bfloat16 (``mantissa_bits``
    7) or float16 (10) round-to-nearest pattern, with the value statistics of the float32
    values (``STAT_COUNT`` .. ``STAT_AMIN``; NaN/inf are left out of ``hist``)."""
    n = w.size
    nt = hist.shape[0]
    for t in prange(nt):
        lo, hi = t * n // nt, (t + 1) * n // nt
        _rows(w, mantissa_bits, u, u_table, table, hist[t], stats[t], ratio_hist[t], lo, hi)


def threads() -> int:
    """Rows for a parallel kernel: Numba's current thread count."""
    return get_num_threads()


def range_limits(fmt) -> tuple[float, float, float]:
    """Three magnitudes of ``fmt``: at or above the first a value becomes inf/NaN under
    round-to-nearest (the largest finite value plus half a spacing; just above it when that tie
    rounds down to an even largest value, as e4m3fn's 464), below the second it is subnormal,
    at or below the third it rounds to zero."""
    top = fmt.max_finite
    half = math.ldexp(1.0, math.frexp(top)[1] - 1 - fmt.mantissa_bits - 1)
    over = top + half
    mantissa_even = round(top / math.ldexp(1.0, math.frexp(top)[1] - 1 - fmt.mantissa_bits)) % 2
    if mantissa_even == 0:  # the tie rounds to the (even) largest value
        over = float(np.nextafter(over, np.inf))
    min_normal = math.ldexp(1.0, 1 - fmt.bias)
    flush = fmt.smallest_subnormal / 2
    return over, min_normal, flush


def audit_limits(ranged, target) -> tuple:
    """``limits`` of ``value_stats``: ``range_limits(ranged)`` (the range statistics), then of
    the target: 1 if its all-ones exponent holds numbers (e4m3fn) else 0, and its overflow
    threshold (a weight at or above it rounds to inf or NaN there: no stagnation statistics)."""
    return (*range_limits(ranged), 0 if target.specials == 0 else 1, range_limits(target)[0])


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
