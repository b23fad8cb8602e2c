"""Array adapters: any supported array in, a flat zero-copy bit-pattern view out, and back.

``srround.adapters`` recognises an array by the module its type comes from, so it never imports
a framework the caller did not import. Each adapter module turns one framework's arrays into
``View`` objects (``_view.py``): a flat, contiguous ``uint32`` (fp32) or ``uint16`` (narrow)
buffer the kernels can take - a NumPy array on the CPU, a Numba device array on CUDA - plus what
is needed to hand the result back as the caller's own type and dtype.

Adapters of immutable arrays (JAX: ``jax.Array`` and tracers) cannot hand out writable views.
Such an adapter module defines the functional API itself - module-level functions named
``stochastic_round``, ``round_nearest``, ``to_float32``, ``stochastic_add`` - and
``srround._api`` delegates a call to the adapter's function of the same name, with the same
keyword arguments, before any View is made. An adapter of mutable arrays must not define
functions with these names.
"""

from __future__ import annotations

import importlib
import sys

from ._view import View

__all__ = ["View", "adapter_for"]

# first component of type(x).__module__  ->  adapter module in this package
_ADAPTERS = {
    "numpy": "numpy",
    "cupy": "cupy",
    "ml_dtypes": "numpy",
    "numba": "numba",
    "numba_cuda": "numba",
    "torch": "torch",
    "jax": "jax",  # tracers (jax._src...)
    "jaxlib": "jax",  # jax.Array (jaxlib._jax.ArrayImpl)
}


# array type -> adapter name, filled on first sight of a type (a dict hit per argument)
_BY_TYPE: dict = {}


def _adapter_name(array, name: str) -> str:
    kind = type(array)
    key = _BY_TYPE.get(kind)
    if key is None:
        key = _ADAPTERS.get(kind.__module__.split(".", 1)[0])
        if key is None:
            supported = (
                "NumPy arrays, CuPy arrays, Numba CUDA device arrays, torch tensors and JAX arrays"
            )
            raise TypeError(
                f"{name}: unsupported array type {kind.__module__}.{kind.__name__};"
                f" expected one of: {supported}"
            )
        _BY_TYPE[kind] = key
    return key


def adapter_for(**arrays):
    """The adapter module shared by every given array (``name=array``; ``None`` is skipped).

    Raises ``TypeError`` naming the argument for an unsupported type, and for arrays of
    different frameworks in one call (no silent conversion between frameworks).
    """
    found = None
    for name, array in arrays.items():
        if array is None:
            continue
        key = _adapter_name(array, name)
        if found is None:
            found = (name, key)
        elif found[1] != key:
            raise TypeError(
                f"{name}: is a {key} array but {found[0]} is a {found[1]} array; pass arrays of"
                " one framework per call"
            )
    if found is None:
        raise TypeError("no array given")
    module = sys.modules.get(f"{__name__}.{found[1]}")
    return module if module is not None else importlib.import_module(f"{__name__}.{found[1]}")


def __getattr__(name):
    """``srround.adapters.torch`` etc. without an explicit import: the framework is imported
    only when its adapter is first asked for."""
    if name in set(_ADAPTERS.values()):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
