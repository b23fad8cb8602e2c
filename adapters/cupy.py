"""CuPy adapter: device arrays, zero-copy, on the current CuPy stream.

Arrays reach the kernels as Numba device arrays through ``__cuda_array_interface__`` (no copy,
no synchronisation), viewed as raw bits first: fp32 as ``uint32``, bf16/fp16 as ``uint16``.
Kernels launch on ``cupy.cuda.get_current_stream()``, so they are ordered with the caller's
CuPy work. An array must live on the current CuPy device (``with cupy.cuda.Device(i):``).

Dtypes: fp32 is ``cupy.float32``, fp16 ``cupy.float16``. bf16 is ``ml_dtypes.bfloat16``, which
CuPy supports from version 14 (with ml_dtypes installed); results are allocated with it there.
With an older CuPy, pass bf16 data as a ``uint16`` bit-pattern array with ``dtype="bfloat16"``
given; bf16 results then come back as ``uint16`` arrays of bit patterns (view them with
``.view(ml_dtypes.bfloat16)`` after upgrading, or hand them to torch/JAX via DLPack).
CuPy arrays are always writable: in-place calls update them where they are.
"""

from __future__ import annotations

import functools

import cupy
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
from .numba import external_stream

MUTABLE = True  # the adapter protocol of srround._dispatch: views of the caller's memory
_FIX = "cupy.ascontiguousarray(...)"


def _as_numba(a):
    """A Numba device array over ``a``'s memory (``__cuda_array_interface__``; no sync: the
    kernel runs on the stream that ``a``'s producer used)."""
    from srround._numba_cuda_compat import import_numba_cuda

    return import_numba_cuda().as_cuda_array(a, sync=False)


@functools.cache
def _result_dtype(fmt: Format):
    """The dtype of new narrow results: the format's own where this CuPy supports it, else
    bit patterns of its width (``uint16`` for bf16 before CuPy 14, ``uint8`` for fp8/fp4)."""
    dtype = fmt.numpy_dtype
    try:
        cupy.empty(0, dtype)
    except (TypeError, ValueError, NotImplementedError):
        return fmt.bits_dtype
    return dtype


def _as_array(x, name: str):
    if not isinstance(x, cupy.ndarray):
        raise TypeError(f"{name}: expected a cupy.ndarray, got {type(x).__name__}")
    return x


def _device_id(a, name: str) -> int:
    device, current = a.device.id, cupy.cuda.runtime.getDevice()
    if device != current:
        raise ValueError(
            f"{name}: is on cuda:{device} but the current CuPy device is cuda:{current}; call"
            f" inside `with cupy.cuda.Device({device}):` (kernels launch on the current device)"
        )
    return device


def _view(a, bits_dtype, name: str) -> View:
    """Zero-copy flat bit view of contiguous ``a`` as a Numba device array."""
    device = _device_id(a, name)
    flat = a.reshape(a.size).view(bits_dtype)  # a view: a is C-contiguous
    # empty: nothing launches (the API returns first); don't ask the driver about a null pointer
    bits = np.empty(0, bits_dtype) if a.size == 0 else _as_numba(flat)
    stream = external_stream(device, cupy.cuda.get_current_stream().ptr)
    return View(
        bits=bits, device="cuda", shape=tuple(a.shape), result=a, stream=stream, device_id=device
    )


def source(
    x, name: str, fmt: Format | None = None, *, narrow: bool = False
) -> tuple[View, Format | None]:
    """A read view of ``x``: float32 data (``narrow=False``) or narrow data (``narrow=True``,
    format from the dtype or ``fmt``). Returns ``(view, format)``."""
    a = _as_array(x, name)
    fmt, bits = check_source(a.dtype, a.flags.c_contiguous, name, fmt, narrow, _FIX)
    return _view(a, bits, name), fmt


def target(out, name: str, like: View, fmt: Format | None) -> View:
    """A write view for the result: ``out`` validated, or a new array shaped like ``like`` on
    the current device. ``fmt=None`` means float32."""
    if out is None:
        dtype = np.dtype(np.float32) if fmt is None else _result_dtype(fmt)
        out = cupy.empty(like.shape, dtype)
    else:
        a = _as_array(out, name)
        check_target(a.dtype, a.shape, a.flags.c_contiguous, name, like.shape, fmt, _FIX)
    return _view(out, bits_of(fmt), name)


def inplace(w, name: str, fmt: Format | None) -> tuple[View, Format]:
    """A read-write view of a narrow array updated in place."""
    view, narrow_fmt = source(w, name, fmt, narrow=True)
    assert narrow_fmt is not None  # narrow=True always yields a format (or raises)
    return view, narrow_fmt


def counter(c, name: str, like: View) -> View:
    """An int32 counter array of ``like``'s shape updated in place (a new zeroed one for
    ``None``), as a ``uint32`` view."""
    if c is None:
        c = cupy.zeros(like.shape, np.int32)
    a = _as_array(c, name)
    check_counter(a.dtype, a.shape, a.flags.c_contiguous, name, like.shape, _FIX)
    return _view(a, np.uint32, name)


def buffer_table(arrays, name: str, writes: bool = True):
    """``(addresses, sizes, format codes, place)`` of arrays a tensor-list kernel reads (and
    updates in place: ``writes``) (``_common.buffer_table``)."""
    return _buffer_table(arrays, name, _buffer_info, writes)


def _buffer_info(a, name: str, writes: bool) -> tuple[int, int, int, str]:
    """``(address, size, format code, place)`` of one array of a tensor list: the cheap path
    for lists of hundreds of arrays (no Numba array is built)."""
    a = _as_array(a, name)
    code = buffer_code(a.dtype, name)
    check_contiguous(a.flags.c_contiguous, name, _FIX)
    return a.data.ptr, a.size, code, f"cuda:{_device_id(a, name)}"
