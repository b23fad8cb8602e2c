"""Dispatch: which adapter takes an array, and the ``View`` it hands to the kernels.

An array is recognised by its type: an instance (subclasses included) of the array type of a
framework that is already imported - ``sys.modules`` is looked at, nothing is imported to find
out, so a framework the caller did not import is never loaded. The answer is cached per type.
Array-likes that the kernels cannot take (``numpy.ma.MaskedArray``, ``numpy.matrix``, lists,
...) raise a ``TypeError`` naming the argument.

The adapter module of a framework is imported by name, on first use, with
``importlib.import_module`` (``srround.adapters.<name>``: the core never imports an adapter
statically). An adapter module declares ``MUTABLE``:

* ``MUTABLE = True`` (NumPy, Numba, CuPy, torch): the kernels write into the caller's memory
  through ``View`` s that the module makes - ``source``, ``target``, ``inplace``, ``counter``
  and ``buffer_table(arrays, name, writes=True)`` (``writes=False``: read-only arrays are
  taken); optionally ``reduce_flags(arrays, flags)``, which combines overflow flags across
  processes for sharded arrays (torch: DTensors).
* ``MUTABLE = False`` (JAX): arrays are immutable, so the module implements the functional API
  itself - ``stochastic_round``, ``round_nearest``, ``to_float32`` and ``stochastic_add``, with
  the keyword arguments of ``srround``'s functions - and operations that update arrays in place
  reject its arrays (``mutable_adapter_for``).
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from types import ModuleType
from typing import Any

__all__ = [
    "View",
    "adapter_for",
    "mutable_adapter_for",
    "check_same_place",
    "check_shape",
    "describe_dtype",
]


@dataclasses.dataclass
class View:
    """A zero-copy view of one array argument.

    Attributes:
        bits: flat C-contiguous bit-pattern buffer the kernels take: ``uint32`` for fp32 data,
            ``uint16`` for bf16/fp16; a NumPy array (``device == "cpu"``) or a Numba device
            array (``device == "cuda"``).
        device: ``"cpu"`` or ``"cuda"``; on CUDA ``device_id`` names the GPU.
        shape: the caller's shape.
        result: what to hand back to the caller (the caller's type and dtype).
        stream: the CUDA stream to launch on (``None`` on the CPU).
        device_id: CUDA device ordinal, ``None`` on the CPU.
        offset: stream position of ``bits[0]`` relative to the caller's ``offset=``: 0, or for
            a local piece of a sharded array its first element's flat index in the full array
            (so noise follows the global element); an exception when the piece has no such
            single position (raised by ``stream_offset`` only where noise is drawn); ``None``
            in a view describing another buffer (shape, device) rather than this array.
        sharded: the local piece of a sharded array (a torch DTensor), ``result`` the whole.
        runs: ``(run, skip)``: a piece that is evenly spaced runs of its full array (a
            tensor-parallel ``Shard(1)`` piece: its rows): element ``j`` is at stream position
            ``offset + j + (j // run) * skip``; ``(0, 0)``: one range.
    """

    bits: Any
    device: str
    shape: tuple
    result: Any
    stream: Any = None
    device_id: int | None = None
    offset: Any = 0
    sharded: bool = False
    runs: tuple = (0, 0)

    def stream_offset(self) -> int:
        """``offset`` (raising the exception it holds, if any)."""
        if isinstance(self.offset, Exception):
            raise self.offset
        return self.offset

    @property
    def where(self) -> str:
        """``"cpu"`` or ``"cuda:<device_id>"``."""
        return self.device if self.device_id is None else f"{self.device}:{self.device_id}"


def check_same_place(**views: View) -> None:
    """Raise ``ValueError`` if the views are on different devices (no silent transfers)."""
    items = [(name, v) for name, v in views.items() if v is not None]
    first_name, first = items[0]
    for name, view in items[1:]:
        if view.where != first.where:
            raise ValueError(
                f"{name}: is on {view.where} but {first_name} is on {first.where}; move both to"
                " one device first"
            )


def check_shape(name: str, shape: tuple, expected: tuple, expected_from: str) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``shape == expected``."""
    if tuple(shape) != tuple(expected):
        raise ValueError(
            f"{name}: shape {tuple(shape)} does not match {expected_from} shape {tuple(expected)}"
        )


def describe_dtype(expected) -> str:
    """``"a or b"`` for a tuple of dtypes, else the dtype's name."""
    return " or ".join(str(e) for e in expected) if isinstance(expected, tuple) else str(expected)


# (module defining the array types, their names, adapter module in srround.adapters), in the
# order they are tried: CuPy before NumPy (a CPU stand-in for CuPy subclasses ndarray)
_FRAMEWORKS = (
    ("cupy", ("ndarray",), "cupy"),
    ("torch", ("Tensor",), "torch._views"),
    ("jax", ("Array",), "jax._api"),  # tracers included (an isinstance check)
    ("numba.cuda.cudadrv.devicearray", ("DeviceNDArrayBase",), "numba"),
    ("numba.cuda.simulator.cudadrv.devicearray", ("FakeCUDAArray",), "numba"),
    ("numpy", ("ndarray", "generic"), "numpy"),  # NumPy and ml_dtypes scalars are generic
)

# subclasses of an accepted type that the kernels cannot take: (module, type, what to do)
_REJECTED = (
    ("numpy.ma", "MaskedArray", "its mask would be ignored; pass {name}.filled(...)"),
    ("numpy", "matrix", "pass np.asarray({name})"),
)

_SUPPORTED = "NumPy arrays, CuPy arrays, Numba CUDA device arrays, torch tensors and JAX arrays"

_BY_TYPE: dict[type, str] = {}  # array type -> adapter module name, on first sight of a type
_MODULES: dict[str, ModuleType] = {}  # adapter module name -> the module, once imported


def _types(module_name: str, names: tuple) -> tuple:
    module = sys.modules.get(module_name)
    return tuple(getattr(module, n) for n in names if hasattr(module, n)) if module else ()


def _detect(array, name: str) -> str:
    kind = type(array)
    for module_name, type_name, fix in _REJECTED:
        rejected = _types(module_name, (type_name,))
        if rejected and issubclass(kind, rejected):
            raise TypeError(
                f"{name}: {module_name}.{type_name} is not supported; " + fix.format(name=name)
            )
    for module_name, names, adapter in _FRAMEWORKS:
        types = _types(module_name, names)
        if types and isinstance(array, types):
            return adapter
    raise TypeError(
        f"{name}: unsupported array type {kind.__module__}.{kind.__qualname__}; expected one of:"
        f" {_SUPPORTED}"
    )


def _adapter_name(array, name: str) -> str:
    key = _BY_TYPE.get(type(array))
    if key is None:
        key = _BY_TYPE[type(array)] = _detect(array, name)
    return key


def _module(key: str) -> ModuleType:
    """The adapter module ``srround.adapters.<key>``, imported on first use. ``import_module``
    waits for a module that another thread is still importing (the import lock), so no caller
    gets a half-initialised module."""
    module = _MODULES.get(key)
    if module is None:
        module = _MODULES[key] = importlib.import_module(f"srround.adapters.{key}")
    return module


def adapter_for(**arrays) -> ModuleType:
    """The adapter module shared by every given array (``name=array``; ``None`` is skipped).

    Raises:
        TypeError: naming the argument, for an unsupported type, and for arrays of different
            frameworks in one call (no silent conversion between frameworks); naming the
            first argument when every one is ``None``.
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
                f"{name}: is a {_framework(key)} array but {found[0]} is a"
                f" {_framework(found[1])} array; pass arrays of one framework per call"
            )
    if found is None:
        raise TypeError(f"{next(iter(arrays), 'arrays')}: expected an array, got None")
    return _module(found[1])


def mutable_adapter_for(**arrays) -> ModuleType:
    """``adapter_for``, for operations that update the arrays in place.

    Raises:
        TypeError: as ``adapter_for``, and for immutable arrays (JAX), naming the first one.
    """
    adapter = adapter_for(**arrays)
    if not adapter.MUTABLE:
        name = next(n for n, a in arrays.items() if a is not None)
        package = adapter.__name__.rsplit(".", 1)[0]
        raise TypeError(
            f"{name}: {_DISPLAY.get(adapter.__name__, package)} arrays are immutable, and this"
            f" operation updates arrays in place; use the functional API of {package}"
        )
    return adapter


_DISPLAY = {"srround.adapters.jax._api": "JAX"}


def _framework(key: str) -> str:
    return key.split(".", 1)[0]
