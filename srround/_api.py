"""The functional API: validate, view the caller's arrays (``srround.adapters``), launch the
backend kernel where the data lives, and return the caller's own type.

Every rounding call is a pure function of (input bits, seed, offset, index): see ``_rng.py``
for the stream and ``_scalar.py`` for the rounding rules.
"""

from __future__ import annotations

import numpy as np

from srround.adapters import adapter_for
from srround.adapters._view import View, check_same_place, check_shape

from . import _cpu
from ._formats import get_format
from ._rng import check_offset, check_seed, next_seed, split_seed

_OVERFLOW = {"inf": False, "saturate": True}


def _saturate(overflow: str) -> bool:
    try:
        return _OVERFLOW[overflow]
    except (KeyError, TypeError):
        raise ValueError(
            f"overflow: expected one of {sorted(_OVERFLOW)}, got {overflow!r}"
        ) from None


def _key(seed) -> tuple[int, int]:
    return split_seed(next_seed() if seed is None else check_seed(seed, "seed"))


def _launch(kernel: str, view: View, *args) -> None:
    """Run ``kernel`` of the backend where ``view`` lives (CUDA on the view's stream)."""
    if view.bits.size == 0:
        return
    if view.device == "cpu":
        getattr(_cpu, kernel)(*args)
    else:
        from . import _cuda  # compiles CUDA kernels on first use only

        getattr(_cuda, kernel)(*args, stream=view.stream)


def stochastic_round(x, *, dtype="bfloat16", seed=None, offset=0, out=None, overflow="inf"):
    """Stochastically round float32 ``x`` to bf16 or fp16.

    Each element rounds to one of its two neighbours in the target format, up with probability
    equal to the distance from the lower one in units of their spacing (16 random bits), so
    ``E[result] = x``; representable values, NaN, +-inf and +-0 come back unchanged (NaN as the
    format's quiet NaN with its sign).

    Args:
        x: float32 array (any supported framework, C-contiguous, any shape).
        dtype: target format, ``"bfloat16"`` (default) or ``"float16"``.
        seed: int in [0, 2**64) makes the call a pure function of (x, seed, offset); ``None``
            draws a seed from the library generator (see ``srround.manual_seed``).
        offset: position of ``x[0]`` in the random stream (elements); rounding ``x[k:]`` with
            ``offset=k`` gives the same bits as the matching part of one call on ``x``.
        out: optional result array (target dtype, ``x``'s shape, writable, contiguous).
        overflow: ``"inf"`` (the format's rule: past the largest finite value is inf) or
            ``"saturate"`` (clamp to the largest finite value).

    Returns:
        the rounded array, the caller's type with the target dtype (``ml_dtypes.bfloat16`` or
        ``np.float16`` for NumPy).

    Example:
        >>> y = srround.stochastic_round(np.float32([1.0 + 2**-9]), seed=0)
    """
    fmt = get_format(dtype)
    saturate = _saturate(overflow)
    k0, k1 = _key(seed)
    offset = check_offset(offset)
    adapter = adapter_for(x=x, out=out)
    src, _ = adapter.source(x, "x")
    dst = adapter.target(out, "out", src, fmt)
    check_same_place(x=src, out=dst)
    _launch(
        "stochastic_round", src, src.bits, dst.bits, k0, k1, offset,
        fmt.mantissa_bits, fmt.exponent_bits, saturate,
    )
    return dst.result


def round_nearest(x, *, dtype="bfloat16", out=None, overflow="inf"):
    """Round float32 ``x`` to the nearest bf16/fp16 value, ties to even: bit for bit the cast
    of ml_dtypes, NumPy and torch on every non-NaN input. Every NaN becomes the format's
    canonical quiet NaN with its sign (ml_dtypes' bf16 rule); NumPy's fp16 cast keeps payload
    bits, torch's CPU casts keep the top ones (fp16) or write 0xFFFF (vectorised bf16).

    Args and returns as ``stochastic_round`` (no randomness)."""
    fmt = get_format(dtype)
    saturate = _saturate(overflow)
    adapter = adapter_for(x=x, out=out)
    src, _ = adapter.source(x, "x")
    dst = adapter.target(out, "out", src, fmt)
    check_same_place(x=src, out=dst)
    _launch(
        "round_nearest", src, src.bits, dst.bits, fmt.mantissa_bits, fmt.exponent_bits, saturate
    )
    return dst.result


def to_float32(y, *, dtype=None, out=None):
    """Widen a bf16/fp16 array to float32 exactly (NaN payloads kept).

    Args:
        y: bf16 or fp16 array; a raw ``uint16`` bit-pattern array needs ``dtype=``.
        dtype: the format of ``y`` when its dtype does not say it.
        out: optional float32 result array of ``y``'s shape.
    """
    fmt = None if dtype is None else get_format(dtype)
    adapter = adapter_for(y=y, out=out)
    src, fmt = adapter.source(y, "y", fmt, narrow=True)
    dst = adapter.target(out, "out", src, None)
    check_same_place(y=src, out=dst)
    _launch("to_float32", src, src.bits, dst.bits, fmt.mantissa_bits, fmt.exponent_bits)
    return dst.result


def stochastic_add(w, u, *, alpha=1.0, seed=None, offset=0, dtype=None, overflow="inf"):
    """In place ``w <- SR(w + alpha * u)``: the primitive a custom low-precision optimizer needs.

    The sum is formed in float32 with a single rounding (``fma(alpha, u, w)``), then rounded
    stochastically to ``w``'s format with the stream of ``(seed, offset)``.

    Args:
        w: bf16/fp16 array updated in place (writable, contiguous; ``uint16`` needs ``dtype=``).
        u: float32 update of ``w``'s shape, same framework and device.
        alpha: scale of ``u`` (rounded to float32).
        seed, offset, overflow: as ``stochastic_round``.
        dtype: the format of ``w`` when its dtype does not say it.

    Returns:
        ``w`` (updated).
    """
    fmt = None if dtype is None else get_format(dtype)
    saturate = _saturate(overflow)
    k0, k1 = _key(seed)
    offset = check_offset(offset)
    adapter = adapter_for(w=w, u=u)
    dst, fmt = adapter.inplace(w, "w", fmt)
    src, _ = adapter.source(u, "u")
    check_shape("u", src.shape, dst.shape, "w's")
    check_same_place(w=dst, u=src)
    _launch(
        "stochastic_add", dst, dst.bits, src.bits, np.float32(alpha), k0, k1, offset,
        fmt.mantissa_bits, fmt.exponent_bits, saturate,
    )
    return dst.result
