"""Checkpoint audits: will low-precision updates stall, and do the weights fit fp16?

Two questions about a set of weights, answered with exact arithmetic on the format's spacing:

* ``stagnation``: each weight is stored in the target format (bf16 or fp16, round-to-nearest);
  an update ``u`` to a stored weight ``q`` is lost when round-to-nearest of ``q + u`` gives
  ``q`` back: when ``|u|`` is below half the spacing toward which it moves (at exactly half it
  is lost when ``q``'s last bit is even: ties go to even). Toward zero from the first value of a
  binade the spacing is half as wide, so a scalar ``lr`` (an update of unknown sign, as Adam's
  is) is tried in both directions and each direction counts one half: a weight's verdict does
  not depend on its sign. An update array carries its own signs; zero and non-finite updates
  are counted apart, never as lost.
* ``fp16_range``: values cast to fp16 overflow at or above 65520 (65504 plus half a spacing),
  lose precision in fp16's subnormal range (below 2**-14) and flush to zero at or below
  2**-25; one power-of-two rescale fits a tensor when its max/min-nonzero ratio is at most
  65504 / 2**-14.

Both take any array srround accepts (NumPy, torch, JAX, ...) in fp32, fp64, bf16 or fp16; the
statistics are counted in one pass of a Numba kernel (no float64 copy), so
``audit_checkpoint`` streams a checkpoint of any size tensor by tensor.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from . import _audit_kernels as _k
from . import _config, _cpu
from ._formats import Format, get_format

FP16 = get_format("float16")
_FP16_MIN_NORMAL = 2.0**-14
_SIXTEEN_BIT = {"bfloat16", "float16"}
_FP8 = ("float8_e4m3fn", "float8_e5m2")
_HALF_OFFSET = 200  # log2(half spacing) + _HALF_OFFSET indexes ``_Counts.half_hist``
_DEFAULT_LR = 1e-5
_PARALLEL_FROM = 1 << 20  # smaller tensors are counted on the calling thread


def spacing(w: np.ndarray, fmt: Format) -> np.ndarray:
    """Distance between adjacent values of ``fmt`` at each ``w`` (float64): the format's ulp,
    ``2**(max(floor(log2|w|), emin) - mantissa_bits)``; exact (frexp, powers of two)."""
    w = np.abs(np.asarray(w, np.float64))
    _, e = np.frexp(w)  # w = m * 2**e with m in [0.5, 1): floor(log2 w) = e - 1
    exponent = np.where(w > 0, e - 1, 1 - fmt.bias)
    return np.ldexp(1.0, np.maximum(exponent, 1 - fmt.bias) - fmt.mantissa_bits)


_TABLES: dict = {}


def _table(kind: str) -> np.ndarray:
    """float64 values of the 65536 patterns of a 16-bit format."""
    if kind not in _TABLES:
        patterns = np.arange(1 << 16, dtype=np.uint16)
        with np.errstate(invalid="ignore"):  # the NaN patterns
            _TABLES[kind] = patterns.view(get_format(kind).numpy_dtype).astype(np.float64)
    return _TABLES[kind]


def _flat(x, argument: str):
    """``(flat read-only NumPy array, stored format name)``: 16-bit formats as their ``uint16``
    patterns, fp8 widened to float32, fp32/fp64 as they are; no copy for contiguous host
    arrays."""
    root = type(x).__module__.split(".", 1)[0]
    if root == "torch":  # bf16 and fp8 as ml_dtypes' arrays over the same bytes
        from ._checkpoint import torch_numpy

        x = torch_numpy(x)
    elif root == "numba":
        x = x.copy_to_host()
    elif root == "cupy":
        x = x.get()
    a = np.asarray(x)
    # read-only views, as the API passes inputs: one compiled kernel for either kind of array
    for kind in _SIXTEEN_BIT:
        if a.dtype == get_format(kind).numpy_dtype:
            return _cpu.read_only(a.reshape(-1).view(np.uint16)), kind
    for kind in _FP8:  # widened exactly (a float32 copy)
        if a.dtype == get_format(kind).numpy_dtype:
            return _cpu.read_only(a.reshape(-1).astype(np.float32)), kind
    if a.dtype in (np.float32, np.float64):
        return _cpu.read_only(a.reshape(-1)), a.dtype.name
    raise TypeError(
        f"{argument}: expected a float32, float64, bfloat16, float16, float8_e4m3fn or"
        f" float8_e5m2 array, got {a.dtype}"
    )


def _check_lr(lr) -> float:
    if isinstance(lr, bool) or not isinstance(lr, (int, float, np.floating, np.integer)):
        raise TypeError(f"lr: expected a number, got {type(lr).__name__}")
    if not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr: expected a finite update magnitude > 0, got {lr!r}")
    return float(lr)


def range_format(fmt: Format) -> Format:
    """The format whose range is audited: fp8 targets their own, every other one fp16."""
    return fmt if fmt.bits == 8 else FP16


def _target(dtype, stored: str) -> Format:
    """The audited format: ``dtype`` (16-bit or fp8), or the stored one (bfloat16 for
    fp32/fp64 storage)."""
    if dtype is None or dtype == "auto":
        return get_format(stored if stored in _SIXTEEN_BIT or stored in _FP8 else "bfloat16")
    fmt = get_format(dtype)
    if fmt.name not in _SIXTEEN_BIT and fmt.name not in _FP8:
        raise ValueError(
            f"dtype: the audit takes bfloat16, float16, float8_e4m3fn or float8_e5m2, got"
            f" {fmt.name!r}"
        )
    return fmt


@dataclasses.dataclass
class _Counts:
    """The reduced kernel statistics of one tensor or of several (``+``)."""

    stats: np.ndarray
    half_hist: np.ndarray  # finite weights per log2(half spacing) + _HALF_OFFSET
    # per-weight updates: half spacing / |u|, the kernel's bins from ``ratio_first`` on (the
    # occupied part of the 262144 bins: a few binades, cheap to add and to rank)
    ratio_hist: np.ndarray | None
    lr: float | None
    range_dtype: str = "float16"  # the format of the range statistics (``range_format``)
    ratio_first: int = 0

    def __add__(self, other: _Counts) -> _Counts:
        stats = self.stats + other.stats
        stats[_k.STAT_AMAX] = max(self.stats[_k.STAT_AMAX], other.stats[_k.STAT_AMAX])
        stats[_k.STAT_AMIN] = min(self.stats[_k.STAT_AMIN], other.stats[_k.STAT_AMIN])
        parts = [(c.ratio_hist, c.ratio_first) for c in (self, other) if c.ratio_hist is not None]
        ratio, first = parts[0] if parts else (None, 0)
        if len(parts) == 2:
            first = min(at for _, at in parts)
            ratio = np.zeros(max(at + h.size for h, at in parts) - first)
            for h, at in parts:
                ratio[at - first : at - first + h.size] += h
        lr = self.lr if self.lr == other.lr else None
        half = self.half_hist + other.half_hist
        return _Counts(stats, half, ratio, lr, self.range_dtype, first)

    def __getitem__(self, stat: int) -> float:
        return float(self.stats[stat])


def _run(kernel, rows: int, *args) -> None:
    """``kernel(*args)`` through ``_cpu.run`` (behind the launch lock where the threading
    layer needs one); with one row of counts, on the calling thread alone."""
    _cpu.run(kernel, _config.CPU_SERIAL_BELOW if rows > 1 else 0, *args)


def _rows_sum(rows: np.ndarray) -> np.ndarray:
    """The sum of a kernel's per-thread rows (the row itself when there is one)."""
    return rows[0] if rows.shape[0] == 1 else rows.sum(0)


_UPDATE_TABLES: dict = {}
_NO_TABLE = np.zeros((1, 4))  # the table argument when there is no update array
_VALUE_STATS = slice(_k.STAT_COUNT, _k.STAT_AMIN + 1)  # columns of the stored values
_UPDATE_STATS = slice(_k.STAT_LOST, _k.N_STATS)  # columns of the update array


def _update_table(fmt: Format) -> np.ndarray:
    if fmt.name not in _UPDATE_TABLES:
        _UPDATE_TABLES[fmt.name] = _k.update_table(
            _table(fmt.name), fmt.mantissa_bits, fmt.exponent_bits
        )
    return _UPDATE_TABLES[fmt.name]


def _pattern_stats(counts, kind: str, fmt: Format, lr: float, limits):
    """``value_stats`` over the 16-bit patterns of format ``kind`` that occur (``counts``: how
    often each of the 65536 does), each weighted by its count: ``(stats, exp_hist)`` of every
    element they stand for."""
    present = np.flatnonzero(counts).astype(np.uint16)
    stats, exp_hist, ratio_hist = _k.new_buffers(fmt.exponent_bits, False, 1)
    args = (fmt.mantissa_bits, fmt.exponent_bits, limits, stats, exp_hist, ratio_hist)
    _run(_k.value_stats, 1, present, _table(kind), counts[present], None, None, lr, *args)
    return stats[0], exp_hist[0]


def _by_pattern(w, stored: str, fmt: Format, u, u_table, lr: float, limits, rows: int):
    """A 16-bit target: ``pattern_counts`` over the tensor, then ``value_stats`` over the
    patterns (``_pattern_stats``). Returns ``(stats, exp_hist, ratio_hist)`` reduced."""
    remap = None
    if stored in _SIXTEEN_BIT and stored != fmt.name:  # stored pattern -> target pattern
        remap = _table(stored).astype(np.float32).astype(fmt.numpy_dtype).view(np.uint16)
    table = _NO_TABLE if u is None else _update_table(fmt)
    if remap is not None and u is not None:
        table = table[remap]  # indexed by the stored pattern
    hist = np.zeros((rows, 1 << 16), np.int64)
    counted, _, ratio = _k.new_buffers(fmt.exponent_bits, u is not None, rows)
    bits = w.view(np.uint32) if stored == "float32" else w
    _run(_k.pattern_counts, rows, bits, fmt.mantissa_bits, u, u_table, table, hist, counted, ratio)
    counts = _rows_sum(hist)
    target = counts if remap is None else np.bincount(remap, counts, 1 << 16).astype(np.int64)
    stats, exp_hist = _pattern_stats(target, fmt.name, fmt, lr, limits)
    if stored == "float32":  # the float32 values' own statistics, counted by the kernel
        stats[_VALUE_STATS] = counted[:, _VALUE_STATS].sum(0)
        stats[_k.STAT_AMAX] = counted[:, _k.STAT_AMAX].max()
        stats[_k.STAT_AMIN] = counted[:, _k.STAT_AMIN].min()
    elif remap is not None:  # the stored values' own statistics
        stats[_VALUE_STATS] = _pattern_stats(counts, stored, fmt, lr, limits)[0][_VALUE_STATS]
    if u is not None:
        stats[_UPDATE_STATS] = counted[:, _UPDATE_STATS].sum(0)
    return stats, exp_hist, _rows_sum(ratio)


def _count(
    weights, update, lr: float | None, dtype, name: str = "weights"
) -> tuple[_Counts, Format, str]:
    """One kernel pass over ``weights`` (and ``update``): the statistics, target, stored;
    ``name``: the caller's name for ``weights`` (in errors)."""
    w, stored = _flat(weights, name)
    fmt = _target(dtype, stored)
    # the range audited: an fp8 target's own when asked for (dtype=), else fp16's - for a
    # tensor stored in fp8 too, whose own range it fits by construction
    ranged = FP16 if dtype in (None, "auto") else range_format(fmt)
    u = u_table = None
    if update is not None:
        u, u_kind = _flat(update, "update")
        if u.size != w.size:
            raise ValueError(
                f"update: shape {tuple(np.shape(update))} does not match the weights'"
                f" {tuple(np.shape(weights))}"
            )
        u_table = _table(u_kind) if u_kind in _SIXTEEN_BIT else None
    rows = _k.threads() if w.size >= _PARALLEL_FROM else 1
    limits = _k.audit_limits(ranged, fmt)
    kernel_lr = 1.0 if lr is None else lr
    with np.errstate(all="ignore"):
        if fmt.name in _SIXTEEN_BIT and stored in _SIXTEEN_BIT | {"float32"}:
            total, exp_hist, ratio = _by_pattern(
                w, stored, fmt, u, u_table, kernel_lr, limits, rows
            )
        else:
            stats, exp_hists, ratio_hist = _k.new_buffers(fmt.exponent_bits, u is not None, rows)
            args = (fmt.mantissa_bits, fmt.exponent_bits, limits, stats, exp_hists, ratio_hist)
            table = _table(stored) if stored in _SIXTEEN_BIT else None
            _run(_k.value_stats, rows, w, table, None, u, u_table, kernel_lr, *args)
            total, exp_hist, ratio = stats.sum(0), exp_hists.sum(0), _rows_sum(ratio_hist)
            total[_k.STAT_AMAX] = stats[:, _k.STAT_AMAX].max()
            total[_k.STAT_AMIN] = stats[:, _k.STAT_AMIN].min()
    half_hist = np.zeros(2 * _HALF_OFFSET)
    first = (1 - fmt.bias) - fmt.mantissa_bits - 1 + _HALF_OFFSET  # log2 half spacing at emin
    half_hist[first : first + exp_hist.size] = exp_hist
    ratio_first = 0
    if update is None:
        ratio = None
    else:  # keep the occupied bins
        occupied = np.flatnonzero(ratio)
        ratio_first = int(occupied[0]) if occupied.size else 0
        ratio = ratio[ratio_first : occupied[-1] + 1 if occupied.size else 0].copy()
    lr_of = None if update is not None else lr
    counts = _Counts(total, half_hist, ratio, lr_of, ranged.name, ratio_first)
    return counts, fmt, stored


def _percentile(hist: np.ndarray, q: float) -> int:
    """The bin of the nearest-rank ``q``-th percentile of a histogram (0 when it is empty)."""
    total = hist.sum()
    if total == 0:
        return 0
    return int(np.searchsorted(np.cumsum(hist), max(1.0, math.ceil(q / 100 * total))))


@dataclasses.dataclass
class Stagnation:
    """Stagnation statistics for one tensor (or all of them).

    Attributes:
        count: number of weights (NaN and inf included).
        lost_fraction: fraction of the audited updates lost under round-to-nearest (0 when
            there are none).
        min_update_percentiles: smallest update magnitude each finite weight registers (half
            its spacing away from zero), nearest-rank 10th/50th/90th percentiles, as
            ``{10: ..., 50: ..., 90: ...}``.
        lr_scale_half, lr_scale_90: factor by which the updates must grow for half / 90 % of
            the weights to move away from zero under round-to-nearest (1.0 when they already
            do); with an update array, to within ``2**-11`` relative.
        lost_updates: number of lost updates (with ``lr``: lost directions / 2, so weights
            lost in both directions count 1 and in one direction 0.5).
        updates: number of audited updates (finite weights; with an update array only those
            with a nonzero, finite update).
        zero_updates, nonfinite_updates: updates left out as zero / NaN or inf.
        nonfinite_weights: NaN or inf weights (left out).
        dtype: the audited storage format.
        directions: ``"both"`` for a scalar ``lr`` (sign unknown), ``"signed"`` for an array.
    """

    count: int
    lost_fraction: float
    min_update_percentiles: dict
    lr_scale_half: float
    lr_scale_90: float
    lost_updates: float = 0.0
    updates: int = 0
    zero_updates: int = 0
    nonfinite_updates: int = 0
    nonfinite_weights: int = 0
    dtype: str = "bfloat16"
    directions: str = "both"

    def recommendation(self) -> str:
        """One line of advice: keep round-to-nearest, or which rounding to switch to."""
        if self.updates == 0:
            return "no nonzero, finite updates to audit: nothing can be said about stagnation"
        if self.lost_fraction < 0.01:
            return "ok: round-to-nearest keeps (almost) every update"
        return (
            f"{self.lost_fraction:.0%} of updates are lost under round-to-nearest in"
            f" {self.dtype}: use stochastic rounding (srround), Kahan-compensated or fp32 master"
            " weights, or raise the learning rate and batch size together"
            f" (x{self.lr_scale_half:.3g} moves half the weights)"
        )


def _stagnation(c: _Counts, dtype: str) -> Stagnation:
    halves = {
        p: math.ldexp(1.0, _percentile(c.half_hist, p) - _HALF_OFFSET) if c.half_hist.any() else 0.0
        for p in (10, 50, 90)
    }
    if c.ratio_hist is not None:
        if c.ratio_hist.any():
            scale = {
                p: _k.ratio_value(c.ratio_first + _percentile(c.ratio_hist, p)) for p in (50, 90)
            }
        else:
            scale = {50: 1.0, 90: 1.0}
        updates = c[_k.STAT_UPDATES]
        directions = "signed"
    else:
        lr = c.lr if c.lr is not None else _DEFAULT_LR
        scale = {p: halves[p] / lr for p in (50, 90)}
        updates = c[_k.STAT_UPDATES] / 2
        directions = "both"
    lost = c[_k.STAT_LOST] / (2 if directions == "both" else 1)
    return Stagnation(
        count=int(c[_k.STAT_COUNT]),
        lost_fraction=lost / updates if updates else 0.0,
        min_update_percentiles=halves,
        lr_scale_half=max(1.0, scale[50]),
        lr_scale_90=max(1.0, scale[90]),
        lost_updates=lost,
        updates=int(updates),
        zero_updates=int(c[_k.STAT_U_ZERO]),
        nonfinite_updates=int(c[_k.STAT_U_NONFINITE]),
        nonfinite_weights=int(c[_k.STAT_NAN] + c[_k.STAT_INF]),
        dtype=dtype,
        directions=directions,
    )


def stagnation(weights, update=None, *, lr=None, dtype=None) -> Stagnation:
    """How many updates to ``weights`` would be lost under round-to-nearest in ``dtype``.

    Args:
        weights: array of weights (any supported type; fp32, fp64, bf16, fp16 or fp8).
        update: per-weight signed updates of the same size (e.g. a real optimizer step).
        lr: update magnitude of unknown sign on every weight (Adam-like), tried in both
            directions; give either ``update`` or ``lr``.
        dtype: the format the weights are stored in during training, ``"bfloat16"`` or
            ``"float16"``; default: the weights' own 16-bit or fp8 format, else bfloat16.

    Raises:
        ValueError: both or neither of ``update`` and ``lr``; ``lr`` not finite and > 0;
            ``update`` of another size; an unknown ``dtype``.
        TypeError: an integer array, or a non-numeric ``lr``.
    """
    if update is None and lr is None:
        raise ValueError("update: give an update array or lr=")
    if update is not None and lr is not None:
        raise ValueError("lr: give either an update array or lr=, not both")
    lr = None if lr is None else _check_lr(lr)
    counts, fmt, _ = _count(weights, update, lr, dtype)
    counts.lr = lr
    return _stagnation(counts, fmt.name)


@dataclasses.dataclass
class Fp16Range:
    """fp16 safety of one tensor's values (fractions are of the finite values). With an fp8
    target (``dtype="float8_e4m3fn"`` / ``"float8_e5m2"``) the same for that format instead:
    ``dtype`` names it, and its thresholds replace fp16's (e4m3fn: overflow above 464, to NaN;
    subnormal below 2**-6; zero at or below 2**-10).

    Attributes:
        count: number of finite values; max_abs: largest finite magnitude.
        overflow_fraction: fraction that becomes inf in fp16: above the largest finite value
            65504 by half a spacing or more (>= 65520; between, the cast gives 65504).
        subnormal_fraction: fraction of nonzero values that land in fp16's subnormal range.
        zero_fraction: fraction of nonzero values that round to zero in fp16.
        rescale: a power-of-two factor that maps the tensor into fp16's normal range, or None
            if no single factor can (max/min-nonzero ratio above 65504 / 2**-14).
        overflow, subnormal, flushed: the same as counts.
        min_nonzero: smallest nonzero finite magnitude (0 when there is none).
        nan, inf: non-finite values (left out of everything else).
    """

    count: int
    max_abs: float
    overflow_fraction: float
    subnormal_fraction: float
    zero_fraction: float
    rescale: float | None
    overflow: int = 0
    subnormal: int = 0
    flushed: int = 0
    min_nonzero: float = 0.0
    nan: int = 0
    inf: int = 0
    dtype: str = "float16"

    @property
    def safe(self) -> bool:
        """No value overflows or flushes to zero (NaN/inf aside)."""
        return self.overflow == 0 and self.flushed == 0


def _fp16(c: _Counts) -> Fp16Range:
    fmt = get_format(c.range_dtype)
    top_value, min_normal = fmt.max_finite, 2.0 ** (1 - fmt.bias)
    finite = int(c[_k.STAT_COUNT] - c[_k.STAT_NAN] - c[_k.STAT_INF])
    top = c[_k.STAT_AMAX]
    low = c[_k.STAT_AMIN] if math.isfinite(c[_k.STAT_AMIN]) else 0.0
    rescale: float | None = 1.0
    if low > 0:
        if top / low > top_value / min_normal:
            rescale = None
        elif top > top_value or low < min_normal:
            # the largest power of two that keeps the maximum finite
            rescale = 2.0 ** math.floor(math.log2(top_value / top))
            if low * rescale < min_normal:
                rescale = 2.0 ** math.ceil(math.log2(min_normal / low))
    over, sub, flushed = (
        int(c[s]) for s in (_k.STAT_F16_OVERFLOW, _k.STAT_F16_SUBNORMAL, _k.STAT_F16_FLUSH)
    )
    return Fp16Range(
        count=finite,
        max_abs=top,
        overflow_fraction=over / finite if finite else 0.0,
        subnormal_fraction=sub / finite if finite else 0.0,
        zero_fraction=flushed / finite if finite else 0.0,
        rescale=rescale,
        overflow=over,
        subnormal=sub,
        flushed=flushed,
        min_nonzero=low,
        nan=int(c[_k.STAT_NAN]),
        inf=int(c[_k.STAT_INF]),
        dtype=fmt.name,
    )


def fp16_range(tensor) -> Fp16Range:
    """fp16 safety of a tensor's values (see ``Fp16Range``)."""
    counts, _, _ = _count(tensor, None, _DEFAULT_LR, None, "tensor")
    return _fp16(counts)


@dataclasses.dataclass
class TensorAudit:
    """Both audits of one tensor (or of several, by ``+``) from one kernel pass.

    Attributes:
        stagnation, fp16: the results as ``stagnation`` and ``fp16_range`` return them.
        stored: the tensor's storage format (``"mixed"`` for a sum of tensors).
    """

    stagnation: Stagnation
    fp16: Fp16Range
    stored: str
    _counts: _Counts = dataclasses.field(repr=False)

    def __add__(self, other: TensorAudit) -> TensorAudit:
        counts = self._counts + other._counts
        dtype = self.stagnation.dtype
        if other.stagnation.dtype != dtype:
            dtype = "mixed"
        stored = self.stored if self.stored == other.stored else "mixed"
        return TensorAudit(_stagnation(counts, dtype), _fp16(counts), stored, counts)


def audit_tensor(weights, update=None, *, lr=None, dtype=None) -> TensorAudit:
    """``stagnation`` and ``fp16_range`` of one tensor in one pass (arguments as for
    ``stagnation``; without ``update`` and ``lr``, ``lr`` is 1e-5)."""
    if update is not None and lr is not None:
        raise ValueError("lr: give either an update array or lr=, not both")
    if update is None:
        lr = _DEFAULT_LR if lr is None else _check_lr(lr)
    counts, fmt, stored = _count(weights, update, lr, dtype)
    return TensorAudit(_stagnation(counts, fmt.name), _fp16(counts), stored, counts)


def _row(name, shape, result: TensorAudit | None, fp16: Fp16Range, stored, dtype) -> dict:
    return {
        "name": name,
        "shape": list(shape),
        "stored": stored,
        "dtype": dtype,
        "stagnation": None if result is None else dataclasses.asdict(result.stagnation),
        "fp16": dataclasses.asdict(fp16),
    }


def audit_checkpoint(path: str, *, lr=None, update: str | None = None, dtype=None) -> dict:
    """Audit every weight of a checkpoint file, one tensor at a time.

    Weights are the floating-point tensors that are not optimizer state or normalization
    buffers (judged by name: ``exp_avg``, ``optimizer.*``, ``running_mean``, ...); those,
    non-float tensors and tensors without values to read (meta, sparse) are listed under
    ``"not_audited"`` with the reason.

    Args:
        path: a ``.safetensors``, ``.pt``/``.pth``/``.bin`` (torch), ``.npz`` or ``.npy`` file
            (a string or a path-like object).
        lr: update magnitude of unknown sign (default 1e-5 when ``update`` is not given).
        update: a checkpoint of per-weight signed updates with the same names and shapes.
            Weights it lacks are audited for fp16 range only and listed under
            ``"missing_updates"``; its names that are no weight are listed under
            ``"unused_updates"``.
        dtype: the training storage format, ``"bfloat16"``, ``"float16"``,
            ``"float8_e4m3fn"`` or ``"float8_e5m2"`` (fp8: the range audit is of that format
            instead of fp16); default: each tensor's own 16-bit or fp8 format, bfloat16 for
            fp32/fp64 (the range audit then fp16's for every tensor).

    Returns:
        A JSON-ready dict: ``"tensors"`` (one row per weight, most lost first, with
        ``stagnation`` and ``fp16`` as the ``Stagnation`` / ``Fp16Range`` fields),
        ``"overall"``, ``"nonfinite"`` (weights holding NaN or inf), ``"not_audited"``,
        ``"missing_updates"``, ``"unused_updates"``, ``"weights"`` and ``"seconds"``.

    Raises:
        srround._checkpoint.CheckpointError: an unreadable file.
        ValueError: ``lr`` with ``update``, a bad ``lr`` or ``dtype``, an update whose shape
            differs from its weight's (the message names the tensor), no weights at all.
    """
    import os
    import time

    from ._checkpoint import CheckpointError, classify, open_checkpoint

    start = time.perf_counter()
    path, update = os.fspath(path), None if update is None else os.fspath(update)  # (JSON)
    if update is not None and lr is not None:
        raise ValueError("lr: give either an update checkpoint or lr, not both")
    lr = None if update is not None else (_DEFAULT_LR if lr is None else _check_lr(lr))
    if dtype not in (None, "auto"):
        dtype = get_format(dtype).name
    entries = open_checkpoint(path)
    weights, not_audited = [], []
    for e in entries:
        reason = e.unreadable or classify(e.name, e.dtype)
        if reason is None:
            weights.append(e)
        else:
            not_audited.append(
                {"name": e.name, "shape": list(e.shape), "dtype": e.dtype, "reason": reason}
            )
    if not weights:
        raise ValueError(f"{path}: no floating-point weights")
    updates, missing, unused = {}, [], []
    if update is not None:
        updates = {e.name: e for e in open_checkpoint(update)}
        names = {e.name for e in weights}
        unused = [n for n in updates if n not in names]
        for e in weights:
            other = updates.get(e.name)
            if other is None:
                missing.append(e.name)
            elif other.shape != e.shape:
                raise ValueError(
                    f"update: {e.name} has shape {list(other.shape)} ({other.dtype}) in"
                    f" {update}, the weight has {list(e.shape)}"
                )
            elif other.dtype not in ("float64", "float32", "bfloat16", "float16"):
                raise ValueError(
                    f"update: {e.name} is {other.dtype} in {update}; updates are float64,"
                    " float32, bfloat16 or float16"
                )
    rows, nonfinite, targets = [], [], set()
    stag_total = all_total = None
    for e in weights:
        try:
            w = e.read()
            u = updates[e.name].read() if e.name in updates else None
        except Exception as error:  # a member or mapping the reader could not produce
            raise CheckpointError(f"{path}: {e.name}: cannot be read ({error})") from error
        if update is not None and u is None:
            result = audit_tensor(w, dtype=dtype)  # fp16 range only
            stag = None
        else:
            result = audit_tensor(w, u, lr=lr if u is None else None, dtype=dtype)
            stag = result
            stag_total = result._counts if stag_total is None else stag_total + result._counts
            targets.add(result.stagnation.dtype)
        all_total = result._counts if all_total is None else all_total + result._counts
        del w, u  # unmaps a memory-mapped tensor
        e.release()
        if e.name in updates:
            updates[e.name].release()
        rows.append(
            _row(e.name, e.shape, stag, result.fp16, result.stored, result.stagnation.dtype)
        )
        if result.fp16.nan or result.fp16.inf:
            nonfinite.append({"name": e.name, "nan": result.fp16.nan, "inf": result.fp16.inf})
    rows.sort(
        key=lambda r: (
            -(r["stagnation"]["lost_fraction"] if r["stagnation"] else -1.0),
            -int(np.prod(r["shape"])),
        )
    )
    overall_stag = None
    if stag_total is not None:
        overall_stag = _stagnation(stag_total, targets.pop() if len(targets) == 1 else "mixed")
    assert all_total is not None  # weights is not empty (checked above)
    overall_fp16 = _fp16(all_total)
    count = sum(int(np.prod(r["shape"])) for r in rows)
    seconds = time.perf_counter() - start
    return {
        "checkpoint": path,
        "update": update,
        "lr": lr,
        "dtype": dtype or "auto",
        "weights": count,
        "seconds": seconds,
        "overall": {
            "stagnation": None if overall_stag is None else dataclasses.asdict(overall_stag),
            "fp16": dataclasses.asdict(overall_fp16),
            "recommendation": (
                overall_stag.recommendation()
                if overall_stag is not None
                else "no weight has an update in the update file: no stagnation audit"
            ),
            "fp16_verdict": fp16_verdict(overall_fp16),
        },
        "nonfinite": nonfinite,
        "tensors": rows,
        "not_audited": not_audited,
        "missing_updates": missing,
        "unused_updates": unused,
    }


def fp16_verdict(r: Fp16Range) -> str:
    """One line on fp16 (or the fp8 target's) safety, with the counts it rests on."""
    name = {"float16": "fp16"}.get(r.dtype, r.dtype)
    over = "inf" if r.dtype != "float8_e4m3fn" else "NaN"
    if r.count == 0:
        return f"{name}: no finite weights"
    parts = []
    if r.overflow:
        parts.append(f"{r.overflow:,} overflow to {over}")
    if r.flushed:
        parts.append(f"{r.flushed:,} flush to zero")
    sub = (
        f"; {r.subnormal:,} land in {name}'s subnormal range (less precision)"
        if r.subnormal
        else ""
    )
    if not parts:
        return f"{name}: all {r.count:,} finite weights fit {name} as they are{sub}"
    fix = (
        "no single power-of-two rescale fits every weight"
        if r.rescale is None
        else f"a rescale by {r.rescale:g} fits every weight"
    )
    return f"{name}: not safe as is: {' and '.join(parts)} of {r.count:,} weights{sub}; {fix}"
