"""NumPy adapter: CPU arrays. bf16 is ``ml_dtypes.bfloat16`` (the dtype JAX uses), fp16 is
``np.float16``; fp32 data must be ``np.float32``. Read-only arrays work as inputs and are
refused as outputs or in-place targets; NumPy scalars work as single inputs only."""

from __future__ import annotations

import numpy as np

from srround._dispatch import View
from srround._formats import Format

from ._common import (
    bits_of,
    buffer_code,
    check_contiguous,
    check_counter,
    check_source,
    check_target,
)
from ._common import buffer_table as _buffer_table

MUTABLE = True  # the adapter protocol of srround._dispatch: views of the caller's memory
_FIX = "np.ascontiguousarray(...)"


def _as_array(x, name, *, held=False):
    """``x`` as an ndarray: a NumPy scalar becomes a 0-d copy, so it is taken only as a read
    input whose view holds that copy (not ``held``: written, or listed by address)."""
    if isinstance(x, np.generic):
        if held:
            raise TypeError(
                f"{name}: a NumPy scalar ({x.dtype}) is immutable and has no memory of its own"
                f" for this call; pass an array (e.g. np.array({name}))"
            )
        return np.asarray(x)
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name}: expected a NumPy array, got {type(x).__name__}")
    return x


def _view(a, bits_dtype) -> View:
    return View(bits=a.reshape(-1).view(bits_dtype), device="cpu", shape=a.shape, result=a)


def source(
    x, name: str, fmt: Format | None = None, *, narrow: bool = False
) -> tuple[View, Format | None]:
    """A read view of ``x``: float32 data (``narrow=False``) or narrow data (``narrow=True``,
    format from the dtype or ``fmt``). Returns ``(view, format)``."""
    a = _as_array(x, name)
    fmt, bits = check_source(a.dtype, a.flags.c_contiguous, name, fmt, narrow, _FIX)
    return _view(a, bits), fmt


def _check_writable(a, name):
    if not a.flags.writeable:
        raise ValueError(
            f"{name}: is read-only and this call writes to it; pass a writable array"
            " (e.g. a copy: np.array(x))"
        )


def target(out, name: str, like: View, fmt: Format | None) -> View:
    """A write view for the result: ``out`` validated, or a new array shaped like ``like``.
    ``fmt=None`` means float32."""
    dtype = np.dtype(np.float32) if fmt is None else fmt.numpy_dtype
    if out is None:
        return _view(np.empty(like.shape, dtype), bits_of(fmt))
    a = _as_array(out, name, held=True)
    check_target(a.dtype, a.shape, a.flags.c_contiguous, name, like.shape, fmt, _FIX)
    _check_writable(a, name)
    return _view(a, bits_of(fmt))


def inplace(w, name: str, fmt: Format | None) -> tuple[View, Format]:
    """A read-write view of a narrow array updated in place."""
    _as_array(w, name, held=True)
    view, narrow_fmt = source(w, name, fmt, narrow=True)
    assert narrow_fmt is not None  # narrow=True always yields a format (or raises)
    _check_writable(view.result, name)
    return view, narrow_fmt


def counter(c, name: str, like: View) -> View:
    """An int32 counter array of ``like``'s shape updated in place (a new zeroed one for
    ``None``), as a ``uint32`` view."""
    if c is None:
        c = np.zeros(like.shape, np.int32)
    a = _as_array(c, name, held=True)
    check_counter(a.dtype, a.shape, a.flags.c_contiguous, name, like.shape, _FIX)
    _check_writable(a, name)
    return _view(a, np.uint32)


def buffer_table(arrays, name: str, writes: bool = True):
    """``(addresses, sizes, format codes, place)`` of arrays a tensor-list kernel reads (and
    updates in place: ``writes``; else read-only arrays are taken) (``_common.buffer_table``)."""
    return _buffer_table(arrays, name, _buffer_info, writes)


def _buffer_info(a, name: str, writes: bool) -> tuple[int, int, int, str]:
    """``(address, size, format code, place)`` of an array a tensor-list kernel reads (and
    writes: ``writes``): the cheap per-array path for lists of hundreds of arrays."""
    a = _as_array(a, name, held=True)
    code = buffer_code(a.dtype, name)
    check_contiguous(a.flags.c_contiguous, name, _FIX)
    if writes:
        _check_writable(a, name)
    return a.__array_interface__["data"][0], a.size, code, "cpu"
