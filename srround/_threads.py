"""Numba's threading layer, chosen once when srround is imported, so that its CPU kernels are
safe from many threads and in forked children.

Numba runs ``prange`` loops on one of three layers, picked at the first parallel launch of the
process: ``tbb``, ``omp`` or ``workqueue``. Left to itself on Linux without TBB it takes GNU
OpenMP, which kills a process forked after any parallel call ("Terminating: fork() called from
a process already using GNU OpenMP") - a ``multiprocessing`` fork child or a torch
``DataLoader`` worker. ``workqueue`` survives fork but aborts the process when two threads
launch parallel work at once. ``tbb`` is safe for both, and nested use shares one pool of
workers instead of multiplying threads.

So, at import, unless the layer is already decided (``NUMBA_THREADING_LAYER`` set, a value in
``numba.config.THREADING_LAYER``, or Numba's threads already launched):

* ``tbb`` when Intel TBB (``TBB_INTERFACE_VERSION >= 12060``, the PyPI package ``tbb``) can be
  loaded. pip installs ``libtbb.so.12`` into ``<prefix>/lib``, outside the dynamic loader's
  search path, where Numba does not find it; it is loaded here by its full path first (also
  when the user chose a layer, so that ``tbb``, ``safe`` and ``threadsafe`` find it).
* otherwise ``workqueue``, with ``launch_lock`` held around every srround CPU launch so that
  threads take turns instead of aborting.

The threads are launched right away (``numba.get_num_threads()``), so a later change of
``NUMBA_*`` environment variables cannot switch the layer back to OpenMP.

Fork while another thread runs a parallel kernel: TBB cannot shut its workers down before the
fork ("Unable to join threads to shut down before fork()"), and the child's first parallel
launch then waits forever for workers that were not copied (seen in about one fork in six).
Every srround CPU launch is counted (``launching``); a child forked while one was running, or
within ``SETTLE_S`` after one ended (TBB's workers may still be returning to their pool; the
fork stress test hung once in CI with the count alone), runs its launches with serial twins of
the kernels (``serial_only``: compiled without ``parallel``, cached on disk apart), which never
enter the threading layer: a region of one thread on the calling thread still entered TBB,
and a child hung there once in CI (11-27).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.metadata
import math
import os
import sys
import threading
import time

_TBB_LIBRARY = {"win32": "tbb12.dll", "darwin": "libtbb.12.dylib"}.get(sys.platform, "libtbb.so.12")
_TBB_MIN_INTERFACE = 12060  # what Numba's tbb layer needs (TBB 2021.6)

# Held around CPU kernel launches when the layer cannot take concurrent launches (workqueue);
# a no-op context otherwise.
launch_lock: contextlib.AbstractContextManager = contextlib.nullcontext()

# In a child forked while another thread of the parent ran an srround CPU kernel: launch on the
# calling thread alone (the worker pool may be unusable there, see the module docstring).
serial_only = False

_active = 0  # srround CPU launches running now, in all threads
_active_lock = threading.Lock()
_busy_at_fork = False
_last_end = -math.inf  # time.monotonic() when the last launch ended
SETTLE_S = 0.1  # after a launch ends, how long a fork still counts it as running (seconds)


class _Launching:
    """``with launching:`` around one CPU launch: takes ``launch_lock`` and counts the launch."""

    def __enter__(self):
        global _active
        launch_lock.__enter__()
        with _active_lock:
            _active += 1

    def __exit__(self, *exc):
        global _active, _last_end
        with _active_lock:
            _active -= 1
            _last_end = time.monotonic()
        launch_lock.__exit__(*exc)


launching = _Launching()


def _before_fork() -> None:
    global _busy_at_fork
    # the forking thread holds the GIL: no launch starts or ends meanwhile
    _busy_at_fork = _active > 0 or time.monotonic() - _last_end < SETTLE_S


def _after_fork_in_child() -> None:
    global _active, _active_lock, serial_only
    _active, _active_lock = 0, threading.Lock()  # another thread may have held it
    serial_only = serial_only or _busy_at_fork


os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


def _load_tbb():
    """The TBB runtime library as a ``ctypes.CDLL`` (from the loader's path, or from the
    files of the ``tbb`` distribution), or ``None``."""
    with contextlib.suppress(OSError):
        return ctypes.CDLL(_TBB_LIBRARY)
    try:
        files = importlib.metadata.files("tbb") or ()
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in files:
        if file.name == _TBB_LIBRARY:
            with contextlib.suppress(OSError):
                # RTLD_GLOBAL: Numba's tbbpool extension then finds it by its soname
                return ctypes.CDLL(os.path.realpath(file.locate()), mode=ctypes.RTLD_GLOBAL)
    return None


def tbb_usable() -> bool:
    """Whether a TBB runtime recent enough for Numba's ``tbb`` layer can be loaded."""
    library = _load_tbb()
    if library is None:
        return False
    try:
        version = library.TBB_runtime_interface_version
    except AttributeError:
        return False
    version.restype = ctypes.c_int
    return version() >= _TBB_MIN_INTERFACE


def select_threading_layer() -> str:
    """Choose and start Numba's threading layer (see the module docstring); returns the layer
    in use (``numba.threading_layer()``)."""
    global launch_lock
    import numba
    from numba.np.ufunc import parallel

    started = getattr(parallel, "_is_initialized", False)
    chosen = (
        os.environ.get("NUMBA_THREADING_LAYER")
        or str(numba.config.THREADING_LAYER).lower() != "default"
    )
    # loads pip's TBB where Numba finds it, also for a user's choice that takes TBB (tbb, safe,
    # threadsafe: without it, an import error or GNU OpenMP)
    tbb = not started and tbb_usable()
    if not (started or chosen):
        numba.config.THREADING_LAYER = "tbb" if tbb else "workqueue"
    numba.get_num_threads()  # launches the layer's threads: the choice is final from here
    layer = numba.threading_layer()
    if layer == "workqueue":
        launch_lock = threading.Lock()
        # a child forked while another thread held the lock would wait for it forever
        os.register_at_fork(after_in_child=_new_lock)
    return layer


def _new_lock() -> None:
    global launch_lock
    launch_lock = threading.Lock()
