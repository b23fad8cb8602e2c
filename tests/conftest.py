"""Test configuration: backends as a parameter, the CUDA simulator where there is no GPU, and
persistent compilation caches.

Without an NVIDIA device node the CUDA tests run under Numba's simulator
(``NUMBA_ENABLE_CUDASIM=1``, set here before anything imports ``numba.cuda``), so the same suite
covers the CUDA kernels' logic on CPU-only CI; on a GPU machine they run for real.

Backends: one ``Backend`` enum (array-api-extra style). Each member knows how to put a NumPy
array on it (``put``), bring one back (``get``) and which srround functions to call (``call``:
the top-level API, or a framework adapter's own functions with its ``impl``). Fixtures pick the
members a test needs and skip the unavailable ones themselves:

- ``backend``: read-only inputs (numpy, numpy_readonly, numba_cuda);
- ``writable_backend``: in-place updates (numpy, numba_cuda);
- ``any_backend``: every way of holding arrays, frameworks included;
- ``optim_backend``: every optimizer front end (functional NumPy and CUDA, torch, JAX native
  and callback), for the optimizer contract (``tests/test_optim_contract.py``).

A new test file plugs in by taking one of these fixtures, or by parametrizing over ``Backend``
members and calling ``member.ready(request)``.
"""

from __future__ import annotations

import enum
import os

if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

import srround  # noqa: E402

settings.register_profile("srround", deadline=None, max_examples=200)
settings.load_profile("srround")

SIMULATED = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


# The longest files of a cold run on 2 cores (0.3-6 minutes each on 11-29), longest first: the
# tests run as whole files (`--dist loadfile`), and a long file handed out last runs on one
# worker while the other has nothing left to do
_LONG_FILES = (
    "test_jax_optim.py",
    "test_jax_sharding.py",
    "test_reliability.py",
    "test_optim_contract.py",
    "test_benchmarks_optim.py",
    "test_lowbit.py",
    "test_jax_pallas.py",
    "test_torch_dist.py",
    "test_jax_optax.py",
    "test_audit.py",
    "test_torch_compile.py",
    "test_jax_adapter.py",
    "test_packaging.py",
    "test_torch_optim.py",
)


def pytest_collection_modifyitems(items):
    """Collect ``_LONG_FILES`` first; every file keeps the order of its tests."""
    rank = {name: i for i, name in enumerate(_LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_configure(config):
    """Two settings made before any test runs.

    - xdist hands out files in collection order (``_LONG_FILES`` first), not by their number
      of tests (its default since 3.5; ``--no-loadscope-reorder`` from 3.8 on, set here even
      over a ``--loadscope-reorder`` on the command line).
    - JAX's persistent compilation cache lives under pytest's cache folder (set before JAX
      loads).
    """
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    cache = getattr(config, "cache", None)
    if cache is not None and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = str(cache.mkdir("jax-compilation-cache"))
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def pytest_runtest_logreport(report):
    """With ``SRROUND_FAILURE_LOG`` set (``benchmarks/gpu_session.sh``), each failure's report is
    appended to that file as it comes in, so a run stopped at its time limit still keeps its
    tracebacks (pytest prints them at the end). Written once: by xdist's controller, or by the
    only process."""
    path = os.environ.get("SRROUND_FAILURE_LOG")
    if path and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:
        with open(path, "a") as log:
            log.write(f"== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


@pytest.fixture
def small_cuda_launch(monkeypatch):
    """Tiny launch configuration so the simulator covers multi-block grid-stride loops fast."""
    from srround import _config

    monkeypatch.setattr(_config, "CUDA_THREADS_PER_BLOCK", 8)
    monkeypatch.setattr(_config, "CUDA_MAX_BLOCKS", 3)


# --------------------------------------------------------------------------------------------
# backends
# --------------------------------------------------------------------------------------------


def _numpy_readonly(a):
    """float32 arrays are only ever read: make them read-only; narrow ones may be written."""
    a = a.copy()
    a.flags.writeable = a.dtype != np.float32
    return a


def _torch_put(device):
    import torch

    def put(a):
        a = np.asarray(a)
        if a.dtype == np.dtype(ml_dtypes.bfloat16):
            t = torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
        else:
            t = torch.from_numpy(a.copy())
        return t.to(device)

    return put


def _torch_get(t):
    import torch

    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


class Backend(enum.Enum):
    """One way of holding arrays and calling srround on them."""

    NUMPY = "numpy"
    NUMPY_READONLY = "numpy_readonly"
    NUMBA_CUDA = "numba_cuda"
    CUPY = "cupy"
    TORCH_CPU = "torch_cpu"
    TORCH_CUDA = "torch_cuda"
    JAX_NATIVE = "jax_native"
    JAX_CALLBACK = "jax_callback"
    JAX_GPU = "jax_gpu"

    def __repr__(self):
        return self.value

    __str__ = __repr__

    @property
    def framework(self) -> str:
        """``numpy`` (NumPy and Numba device arrays), ``cupy``, ``torch`` or ``jax``."""
        head = self.value.split("_")[0]
        return "numpy" if head == "numba" else head

    @property
    def device(self) -> str:
        """``cpu`` or ``cuda`` (simulated CUDA included)."""
        return (
            "cuda"
            if self in (Backend.NUMBA_CUDA, Backend.CUPY, Backend.TORCH_CUDA, Backend.JAX_GPU)
            else "cpu"
        )

    @property
    def impl(self) -> str | None:
        """The JAX implementation (``native``/``callback``), None elsewhere."""
        if self.framework != "jax":
            return None
        return "callback" if self is Backend.JAX_CALLBACK else "native"

    def ready(self, request) -> Backend:
        """Skip the test when this backend is unavailable here; set it up otherwise."""
        if self is Backend.NUMBA_CUDA:
            from numba import cuda

            if not cuda.is_available():
                pytest.skip("no CUDA device and not simulated")
            request.getfixturevalue("small_cuda_launch")
        elif self is Backend.CUPY:
            self._state["cupy"] = request.getfixturevalue("cupy_module")
        elif self.framework == "torch":
            torch = pytest.importorskip("torch")
            if self.device == "cuda" and not torch.cuda.is_available():
                pytest.skip("no CUDA for torch (torch has no simulator)")
        elif self.framework == "jax":
            jax = pytest.importorskip("jax")
            platform = "gpu" if self is Backend.JAX_GPU else "cpu"
            try:
                self._state["jax_device"] = jax.devices(platform)[0]
            except RuntimeError:
                pytest.skip(f"no {platform} device for JAX")
        return self

    @property
    def _state(self) -> dict:
        return _STATE.setdefault(self.value, {})

    def put(self, a):
        """A NumPy array on this backend."""
        if self is Backend.NUMPY:
            return np.array(a)
        if self is Backend.NUMPY_READONLY:
            return _numpy_readonly(np.asarray(a))
        if self is Backend.NUMBA_CUDA:
            from .reference import to_cuda

            return to_cuda(a)
        if self is Backend.CUPY:
            return self._state["cupy"].asarray(a)
        if self.framework == "torch":
            return _torch_put(self.device)(a)
        import jax

        return jax.device_put(np.asarray(a), self._state["jax_device"])

    def get(self, a):
        """This backend's array as NumPy."""
        if self is Backend.NUMBA_CUDA:
            return a.copy_to_host()
        if self is Backend.CUPY:
            return self._state["cupy"].asnumpy(a)
        if self.framework == "torch":
            return _torch_get(a)
        return np.asarray(a)

    def call(self, name, *args, **kwargs):
        """``srround.<name>`` (or the JAX adapter's, with this backend's ``impl``)."""
        if self.framework == "jax":
            from srround.adapters import jax as jax_adapter

            return getattr(jax_adapter, name)(*args, impl=self.impl, **kwargs)
        return getattr(srround, name)(*args, **kwargs)


_STATE: dict = {}

READ_BACKENDS = [Backend.NUMPY, Backend.NUMPY_READONLY, Backend.NUMBA_CUDA]
WRITE_BACKENDS = [Backend.NUMPY, Backend.NUMBA_CUDA]
OPTIM_BACKENDS = [
    Backend.NUMPY,
    Backend.NUMBA_CUDA,
    Backend.TORCH_CPU,
    Backend.TORCH_CUDA,
    Backend.JAX_NATIVE,
    Backend.JAX_CALLBACK,
]


@pytest.fixture(params=READ_BACKENDS, ids=str)
def backend(request):
    """Backends for read-only inputs (rounding results are always fresh arrays)."""
    return request.param.ready(request)


@pytest.fixture(params=WRITE_BACKENDS, ids=str)
def writable_backend(request):
    """Backends for in-place updates."""
    return request.param.ready(request)


@pytest.fixture(params=list(Backend), ids=str)
def any_backend(request):
    """Every backend, frameworks included."""
    return request.param.ready(request)


@pytest.fixture(params=OPTIM_BACKENDS, ids=str)
def optim_backend(request):
    """Every optimizer front end: NumPy and CUDA buffers (functional), torch, JAX."""
    return request.param.ready(request)


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
