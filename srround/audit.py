"""Checkpoint audits: will low-precision updates stall, and do bf16 weights fit fp16?

Two questions about a set of weights, answered with exact arithmetic on the format's spacing:

* ``stagnation``: under round-to-nearest in bf16 (or fp16), an update ``u`` to a weight ``w``
  is lost when ``|u|`` is below half the spacing of the format at ``w`` (at exactly half it is
  lost when ``w``'s last bit is even: ties go to even). For each weight the smallest update it
  registers is therefore half its spacing; the learning-rate scale at which it starts to move is
  ``half_spacing / |u|``.
* ``fp16_range``: bf16-trained weights cast to fp16 overflow above 65504, lose precision in
  fp16's subnormal range (below 2**-14) and flush to zero below 2**-25; one rescale factor
  fits a tensor when its max/min-nonzero ratio is at most 65504 / 2**-14.

Both take any array srround accepts (NumPy, torch, JAX, ...; a dict of them for whole models).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ._formats import Format, get_format

FP16 = get_format("float16")
_FP16_MIN_NORMAL = 2.0**-14
_FP16_FLUSH = 2.0**-25  # half the smallest subnormal: at or below it, RNE gives 0
_FP16_OVERFLOW = 65520.0  # 65504 + half a spacing: at or above it, RNE gives inf


def to_float64(x) -> np.ndarray:
    """Any supported array (any float dtype, any device) as a float64 NumPy array (a copy)."""
    root = type(x).__module__.split(".", 1)[0]
    if root == "torch":
        x = x.detach().float().cpu().numpy()
    elif root == "numba":
        x = x.copy_to_host()
    elif root == "cupy":
        x = x.get()
    return np.asarray(x).astype(np.float64)


def spacing(w: np.ndarray, fmt: Format) -> np.ndarray:
    """Distance between adjacent values of ``fmt`` at each ``w`` (float64): the format's ulp,
    ``2**(max(floor(log2|w|), emin) - mantissa_bits)``; exact (frexp, powers of two)."""
    w = np.abs(np.asarray(w, np.float64))
    _, e = np.frexp(w)  # w = m * 2**e with m in [0.5, 1): floor(log2 w) = e - 1
    exponent = np.where(w > 0, e - 1, 1 - fmt.bias)
    return np.ldexp(1.0, np.maximum(exponent, 1 - fmt.bias) - fmt.mantissa_bits)


@dataclasses.dataclass
class Stagnation:
    """Stagnation statistics for one tensor (or all of them).

    Attributes:
        count: number of weights.
        lost_fraction: fraction whose update is lost under round-to-nearest.
        min_update_percentiles: smallest update magnitude each weight registers (half its
            spacing), at the 10th/50th/90th percentiles, as ``{10: ..., 50: ..., 90: ...}``.
        lr_scale_half, lr_scale_90: factor by which the updates must grow for half / 90 % of
            the weights to move under round-to-nearest (1.0 when they already do).
    """

    count: int
    lost_fraction: float
    min_update_percentiles: dict
    lr_scale_half: float
    lr_scale_90: float

    def recommendation(self) -> str:
        if self.lost_fraction < 0.01:
            return "ok: round-to-nearest keeps (almost) every update"
        return (
            f"{self.lost_fraction:.0%} of updates are lost under round-to-nearest: use stochastic"
            " rounding (srround), Kahan-compensated or fp32 master weights, or raise the"
            f" learning rate and batch size together (x{self.lr_scale_half:.3g} moves half the"
            " weights)"
        )


def _lost(w, u, fmt):
    """Whether round-to-nearest of ``w + u`` gives ``w`` back (``u`` signed; a magnitude-only
    update is taken as moving away from zero)."""
    step = spacing(w, fmt)
    pattern_even = np.round(np.abs(w) / step) % 2 == 0
    # toward zero from a power of two (a binade's first value) the spacing below is half
    mantissa, _ = np.frexp(np.abs(w))
    first_of_binade = (mantissa == 0.5) & (np.abs(w) >= 2.0 ** (2 - fmt.bias))
    toward_zero = (np.sign(u) * np.sign(w)) < 0
    half = np.where(toward_zero & first_of_binade, step / 4, step / 2)
    mag = np.abs(u)
    return (mag < half) | ((mag == half) & pattern_even)  # exact ties go to the even pattern


def stagnation(weights, update=None, *, lr=None, dtype="bfloat16") -> Stagnation:
    """How many weights would not move under round-to-nearest in ``dtype``.

    Args:
        weights: array of weights (any supported type and float dtype).
        update: per-weight update magnitudes of the same shape (e.g. a real optimizer step);
            or give ``lr`` for Adam-like updates of magnitude ``lr`` on every weight.
        lr: update magnitude when ``update`` is None.
        dtype: the weights' storage format, ``"bfloat16"`` or ``"float16"``.
    """
    fmt = get_format(dtype)
    w = to_float64(weights).ravel()
    if update is None:
        if lr is None:
            raise ValueError("update: give an update array or lr=")
        u = np.full_like(w, float(lr))
    else:
        u = to_float64(update).ravel()
        if u.shape != w.shape:
            raise ValueError(f"update: {u.size} values for {w.size} weights")
    if w.size == 0:
        return Stagnation(0, 0.0, {10: 0.0, 50: 0.0, 90: 0.0}, 1.0, 1.0)
    half = spacing(w, fmt) / 2
    with np.errstate(divide="ignore"):
        scale = np.where(np.abs(u) > 0, half / np.abs(u), np.inf)
    return Stagnation(
        count=int(w.size),
        lost_fraction=float(np.mean(_lost(w, u, fmt))),
        min_update_percentiles={p: float(np.percentile(half, p)) for p in (10, 50, 90)},
        lr_scale_half=float(max(1.0, np.percentile(scale, 50))),
        lr_scale_90=float(max(1.0, np.percentile(scale, 90))),
    )


@dataclasses.dataclass
class Fp16Range:
    """fp16 safety of one tensor's values.

    Attributes:
        count: number of values; max_abs: largest magnitude.
        overflow_fraction: fraction that becomes inf in fp16: above the largest finite value
            65504 by half a spacing or more (>= 65520; between, the cast gives 65504).
        subnormal_fraction: fraction of nonzero values that land in fp16's subnormal range.
        zero_fraction: fraction of nonzero values that round to zero in fp16.
        rescale: a power-of-two factor that maps the tensor into fp16's normal range, or None
            if no single factor can (max/min-nonzero ratio above 65504 / 2**-14).
    """

    count: int
    max_abs: float
    overflow_fraction: float
    subnormal_fraction: float
    zero_fraction: float
    rescale: float | None

    @property
    def safe(self) -> bool:
        return self.overflow_fraction == 0 and self.zero_fraction == 0


def fp16_range(tensor) -> Fp16Range:
    """fp16 safety of a tensor's values (see ``Fp16Range``)."""
    a = np.abs(to_float64(tensor).ravel())
    a = a[np.isfinite(a)]
    if a.size == 0:
        return Fp16Range(0, 0.0, 0.0, 0.0, 0.0, 1.0)
    nonzero = a[a > 0]
    top = float(a.max())
    rescale = 1.0
    if nonzero.size:
        low = float(nonzero.min())
        if top / low > FP16.max_finite / _FP16_MIN_NORMAL:
            rescale = None
        elif top > FP16.max_finite or low < _FP16_MIN_NORMAL:
            # the largest power of two that keeps the maximum finite
            rescale = 2.0 ** np.floor(np.log2(FP16.max_finite / top))
            if low * rescale < _FP16_MIN_NORMAL:
                rescale = 2.0 ** np.ceil(np.log2(_FP16_MIN_NORMAL / low))
    return Fp16Range(
        count=int(a.size),
        max_abs=top,
        overflow_fraction=float(np.mean(a >= _FP16_OVERFLOW)),
        subnormal_fraction=float(np.mean((a > _FP16_FLUSH) & (a < _FP16_MIN_NORMAL))),
        zero_fraction=float(np.mean((a > 0) & (a <= _FP16_FLUSH))),
        rescale=rescale,
    )
