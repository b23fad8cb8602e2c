"""Test configuration: backends as a parameter, and the CUDA simulator where there is no GPU.

Without an NVIDIA device node the CUDA tests run under Numba's simulator
(``NUMBA_ENABLE_CUDASIM=1``, set here before anything imports ``numba.cuda``), so the same suite
covers the CUDA kernels' logic on CPU-only CI; on a GPU machine they run for real.
"""

from __future__ import annotations

import os

if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("srround", deadline=None, max_examples=200)
settings.load_profile("srround")

SIMULATED = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


@pytest.fixture
def small_cuda_launch(monkeypatch):
    """Tiny launch configuration so the simulator covers multi-block grid-stride loops fast."""
    from srround import _config

    monkeypatch.setattr(_config, "CUDA_THREADS_PER_BLOCK", 8)
    monkeypatch.setattr(_config, "CUDA_MAX_BLOCKS", 3)


class Backend:
    """One way of holding arrays: ``put`` moves a NumPy array there, ``get`` brings it back."""

    def __init__(self, name, put, get):
        self.name, self.put, self.get = name, put, get

    def __repr__(self):
        return self.name


def _numpy_readonly(a):
    a = a.copy()
    a.flags.writeable = False
    return a


def _cuda_backend():
    from numba import cuda

    if not cuda.is_available():
        pytest.skip("no CUDA device and not simulated")
    return Backend("cuda", cuda.to_device, lambda d: d.copy_to_host())


@pytest.fixture(params=["numpy", "numpy_readonly", "cuda"])
def backend(request):
    """Backends for read-only inputs (rounding results are always fresh arrays)."""
    if request.param == "numpy":
        return Backend("numpy", np.array, np.asarray)
    if request.param == "numpy_readonly":
        return Backend("numpy_readonly", _numpy_readonly, np.asarray)
    request.getfixturevalue("small_cuda_launch")
    return _cuda_backend()


@pytest.fixture(params=["numpy", "cuda"])
def writable_backend(request):
    """Backends for in-place updates."""
    if request.param == "numpy":
        return Backend("numpy", np.array, np.asarray)
    request.getfixturevalue("small_cuda_launch")
    return _cuda_backend()


@pytest.fixture
def cupy_module(monkeypatch, small_cuda_launch):
    """CuPy on a GPU; under the simulator, the stand-in of ``tests/fake_cupy.py``."""
    if SIMULATED:
        from . import fake_cupy

        return fake_cupy.install(monkeypatch)
    cupy = pytest.importorskip("cupy")
    if not cupy.cuda.is_available():
        pytest.skip("CuPy has no CUDA device")
    return cupy
