"""Array adapters and framework layers, installed as ``srround.adapters``.

* ``numpy``, ``numba``, ``cupy``, ``torch`` (``torch/_views.py``): views of the caller's arrays
  for the kernels (the ``MUTABLE`` adapters of ``srround._dispatch``).
* ``jax``: the functional API on immutable JAX arrays (a ``jax.lax`` implementation and a
  callback into the kernels), the optimizers and the loss scales.
* ``torch``: ``AdamW``, ``SGD`` and ``GradScaler``.

``srround.adapters.torch`` etc. work without an explicit import: a framework's package is
imported when it is first asked for.
"""

from __future__ import annotations

import importlib

__all__: list[str] = []

_SUBMODULES = ("numpy", "numba", "cupy", "torch", "jax")


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
