"""Import ``numba.cuda`` safely under NumPy 2.5.

numba-cuda 0.30.4 (the newest release) registers an overload for ``np.row_stack`` while
building its array lowering; NumPy 2.5 removed that alias (deprecated since 2.0 in favour of
``np.vstack``), so the first kernel compile fails with ``AttributeError``. A fresh
``pip install srround`` resolves to exactly that pair. The shim below restores the alias *only*
when it is missing, as ``np.vstack`` (its definition in every NumPy that had it), before
numba-cuda is imported. Remove it once numba-cuda stops referencing ``np.row_stack``.
"""

from __future__ import annotations

import functools

import numpy as np


@functools.cache
def import_numba_cuda():
    """Return the ``numba.cuda`` module, with the NumPy 2.5 shim applied first and srround's
    cache locator installed (once per process: every CUDA call asks for the module, and
    installing the locator builds a class)."""
    if not hasattr(np, "row_stack"):
        np.row_stack = np.vstack
    from numba import cuda

    from . import _cache

    _cache.install_cuda()
    return cuda
