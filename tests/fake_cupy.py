"""A stand-in for CuPy on machines without a GPU, for the CUDA simulator.

``ndarray`` is a NumPy array that reports ``cupy`` as its module (so ``srround.adapters``
dispatches it to the CuPy adapter), with CuPy's ``device.id`` and ``data.ptr``; the module
offers the few CuPy functions the adapter and the tests call. ``install`` points the adapter's
two GPU-only hooks at the simulator: device arrays wrap the NumPy memory without a copy (as
``__cuda_array_interface__`` wraps CuPy memory on a GPU), and stream lookups are recorded (the
simulator has no external streams). This checks the adapter's own logic in CI; CuPy itself is
checked only on a GPU, where the same tests take the real module.
"""

from __future__ import annotations

import sys
import types

import ml_dtypes
import numpy as np


class ndarray(np.ndarray):  # noqa: N801  (CuPy's name)
    """A NumPy array posing as a ``cupy.ndarray`` on ``module.current_device``."""

    @property
    def device(self):
        return types.SimpleNamespace(id=getattr(self, "_device", 0))

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])

    def __array_finalize__(self, obj):
        self._device = getattr(obj, "_device", 0)


ndarray.__module__ = "cupy"


def _module():
    cp = types.ModuleType("cupy")
    cp.ndarray = ndarray
    cp.bfloat16_supported = True  # CuPy >= 14 with ml_dtypes; False: an older CuPy
    cp.current_device = 0
    cp.stream_handle = 0

    def empty(shape, dtype=np.float32):
        if np.dtype(dtype) == ml_dtypes.bfloat16 and not cp.bfloat16_supported:
            raise TypeError("Unsupported dtype bfloat16")
        return np.empty(shape, dtype).view(ndarray)

    cp.empty = empty
    cp.zeros = lambda shape, dtype=np.float32: np.zeros(shape, dtype).view(ndarray)
    cp.asarray = lambda a: np.array(a).view(ndarray)
    cp.asnumpy = lambda a: np.array(a.view(np.ndarray))
    cp.ascontiguousarray = lambda a: np.ascontiguousarray(a).view(ndarray)
    cp.cuda = types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDevice=lambda: cp.current_device),
        get_current_stream=lambda: types.SimpleNamespace(ptr=cp.stream_handle),
    )
    return cp


MODULE = _module()


def install(monkeypatch):
    """Make ``import cupy`` give the stand-in and point the CuPy adapter at the simulator.
    Returns the stand-in module; ``module.streams_asked`` lists ``(device, handle)`` lookups."""
    from numba import cuda
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    monkeypatch.setitem(sys.modules, "cupy", MODULE)
    from srround.adapters import cupy as adapter

    assert adapter.cupy is MODULE, "srround.adapters.cupy was imported with the real CuPy"
    MODULE.bfloat16_supported, MODULE.current_device, MODULE.stream_handle = True, 0, 0
    MODULE.streams_asked = []
    adapter._result_dtype.cache_clear()
    monkeypatch.setattr(adapter, "_as_numba", lambda a: FakeCUDAArray(a.view(np.ndarray)))

    def external_stream(device, handle):
        MODULE.streams_asked.append((device, handle))
        return cuda.default_stream()

    monkeypatch.setattr(adapter, "external_stream", external_stream)
    return MODULE
