"""Numba CUDA device-array adapter (real GPU and ``NUMBA_ENABLE_CUDASIM=1``).

Numba has no bf16 type: bf16 device arrays carry the ``ml_dtypes.bfloat16`` dtype (results are
allocated so) or are ``uint16`` bit patterns with ``dtype=`` given. Kernels launch on the
stream given as ``stream=`` to the adapter functions, else Numba's default stream.
"""

from __future__ import annotations

import numpy as np

from srround._dispatch import View
from srround._formats import Format
from srround._numba_cuda_compat import import_numba_cuda
from srround._tensor_list import address

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
_FIX = "a contiguous copy (numba.cuda.device_array + copy_to_device)"


# (device ordinal, stream handle) -> Numba stream object, shared by the torch and CuPy adapters
_STREAMS: dict = {}
_MAX_STREAMS = 64


def external_stream(device_id: int, handle: int):
    """The Numba stream object for a framework's CUDA stream ``handle`` on ``device_id``,
    cached (every call of an adapter needs one)."""
    key = (device_id, handle)
    stream = _STREAMS.get(key)
    if stream is None:
        if len(_STREAMS) >= _MAX_STREAMS:  # many short-lived streams: drop the stale handles
            _STREAMS.clear()
        stream = _STREAMS[key] = import_numba_cuda().external_stream(handle)
    return stream


def _device_id() -> int:
    cuda = import_numba_cuda()
    return getattr(cuda.get_current_device(), "id", 0)  # the simulator's device has no id


def _view(a, bits_dtype) -> View:
    flat = a.reshape(a.size) if a.ndim != 1 else a
    return View(
        bits=flat.view(bits_dtype),
        device="cuda",
        shape=tuple(a.shape),
        result=a,
        stream=0,
        device_id=_device_id(),
    )


def _contiguous(a) -> bool:
    return a.is_c_contiguous()


def source(
    x, name: str, fmt: Format | None = None, *, narrow: bool = False
) -> tuple[View, Format | None]:
    """A read-only input's buffer view and format (``None``: float32), checked as ``name``."""
    fmt, bits = check_source(x.dtype, _contiguous(x), name, fmt, narrow, _FIX)
    return _view(x, bits), fmt


def target(out, name: str, like: View, fmt: Format | None) -> View:
    """The output buffer view (a new device array for ``None``), shaped like ``like``."""
    dtype = np.dtype(np.float32) if fmt is None else fmt.numpy_dtype
    if out is None:
        cuda = import_numba_cuda()
        out = cuda.device_array(like.shape, dtype=dtype)
    check_target(out.dtype, out.shape, _contiguous(out), name, like.shape, fmt, _FIX)
    return _view(out, bits_of(fmt))


def inplace(w, name: str, fmt: Format | None) -> tuple[View, Format]:
    """A low-precision array updated in place: its buffer view and format."""
    view, narrow_fmt = source(w, name, fmt, narrow=True)
    assert narrow_fmt is not None  # narrow=True always yields a format (or raises)
    return view, narrow_fmt


def counter(c, name: str, like: View) -> View:
    """An int32 device counter array of ``like``'s shape (a new zeroed one for ``None``)."""
    if c is None:
        c = import_numba_cuda().to_device(np.zeros(like.shape, np.int32))
    check_counter(c.dtype, c.shape, _contiguous(c), name, like.shape, _FIX)
    return _view(c, np.uint32)


def buffer_table(arrays, name: str, writes: bool = True):
    """``(addresses, sizes, format codes, place)`` of arrays a tensor-list kernel reads (and
    updates in place: ``writes``; device arrays are always writable) (``_common.buffer_table``).
    A list has hundreds of arrays: each is only checked (dtype, contiguity) and its data
    pointer read; the place is the current device's, looked up once."""
    place = f"cuda:{_device_id()}"

    def buffer_info(a, name: str, writes: bool) -> tuple[int, int, int, str]:
        code = buffer_code(a.dtype, name)
        check_contiguous(_contiguous(a), name, _FIX)
        return address(a), a.size, code, place

    return _buffer_table(arrays, name, buffer_info, writes)
