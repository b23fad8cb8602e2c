"""Host functions as an XLA FFI custom call on the CPU: the callback path's transport.

``jax.pure_callback`` names its Python function by an index into the program's own list of
host callbacks, so it cannot live in the per-shard function of ``custom_partitioning`` (that
list is lowered apart and dropped). This module registers one typed-FFI target with XLA's CPU
backend, ``srround_host_call``, whose handler (a ``ctypes`` function) finds the Python function
by an id in its first operand - an entry of this module's registry, which lives as long as the
process - and runs it on NumPy views of the operands' buffers. Anything XLA lowers, including
a per-shard function, can then call the kernels.

The handler copies the function's results into XLA's result buffers - except a result that
aliases an operand (``call(..., aliases=)``): XLA hands over that operand's data in the
result's buffer (the operand's own when it was donated), the function updates it in place and
nothing is copied; with ``call(..., into=True)`` the function writes every result's buffer
itself. An exception is reported as an XLA error (``XlaRuntimeError`` at the caller), never a
silent result. The handler runs on XLA's thread, with XLA's flush-to-zero set: ``_callback``
runs the work with IEEE subnormals (see there).
"""

from __future__ import annotations

import atexit
import ctypes
import itertools
import threading
import traceback

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

TARGET = "srround_host_call"

# XLA_FFI_DataType codes (xla/ffi/api/c_api.h) of the dtypes srround's host functions see
_DTYPES = {
    1: np.dtype(np.bool_),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.uint8),
    7: np.dtype(np.uint16),
    8: np.dtype(np.uint32),
    9: np.dtype(np.uint64),
    10: np.dtype(np.float16),
    11: np.dtype(np.float32),
    12: np.dtype(np.float64),
    16: np.dtype(ml_dtypes.bfloat16),
    19: np.dtype(ml_dtypes.float8_e5m2),
    20: np.dtype(ml_dtypes.float8_e4m3fn),
    32: np.dtype(ml_dtypes.float4_e2m1fn),
    33: np.dtype(ml_dtypes.float8_e8m0fnu),
}
_EXECUTE = 3  # XLA_FFI_ExecutionStage_EXECUTE
_METADATA = 1  # XLA_FFI_Extension_Metadata
_INTERNAL = 13  # XLA_FFI_Error_Code_INTERNAL


# -- the C structs of xla/ffi/api/c_api.h that the handler reads --------------------------------


class _Extension(ctypes.Structure):
    pass


_Extension._fields_ = [
    ("struct_size", ctypes.c_size_t),
    ("type", ctypes.c_int),
    ("next", ctypes.POINTER(_Extension)),
]


class _ApiVersion(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("major_version", ctypes.c_int),
        ("minor_version", ctypes.c_int),
    ]


class _Metadata(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("api_version", _ApiVersion),
        ("traits", ctypes.c_uint32),
    ]


class _MetadataExtension(ctypes.Structure):
    _fields_ = [("extension_base", _Extension), ("metadata", ctypes.POINTER(_Metadata))]


class _Buffer(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("dtype", ctypes.c_int),
        ("data", ctypes.c_void_p),
        ("rank", ctypes.c_int64),
        ("dims", ctypes.POINTER(ctypes.c_int64)),
    ]


class _Operands(ctypes.Structure):  # XLA_FFI_Args and XLA_FFI_Rets share this layout
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("size", ctypes.c_int64),
        ("types", ctypes.c_void_p),
        ("buffers", ctypes.POINTER(ctypes.POINTER(_Buffer))),
    ]


class _Attrs(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("size", ctypes.c_int64),
        ("types", ctypes.c_void_p),
        ("names", ctypes.c_void_p),
        ("attrs", ctypes.c_void_p),
    ]


class _CallFrame(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.POINTER(_Extension)),
        ("api", ctypes.c_void_p),
        ("ctx", ctypes.c_void_p),
        ("stage", ctypes.c_int),
        ("args", _Operands),
        ("rets", _Operands),
        ("attrs", _Attrs),
        ("future", ctypes.c_void_p),
    ]


class _ErrorCreateArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("message", ctypes.c_char_p),
        ("errc", ctypes.c_int),
    ]


_ERROR_CREATE = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_ErrorCreateArgs))
_ERROR_CREATE_OFFSET = 48  # XLA_FFI_Api: struct_size, extension_start, api_version, internal_api


# -- the registry and the handler ---------------------------------------------------------------

_FUNCTIONS: dict[int, tuple] = {}  # id -> (host function, aliases {operand: result}, into)
_IDS_OF: dict = {}  # key -> id
_IDS = itertools.count(1)
_LOCK = threading.Lock()


class _Memory:
    """Raw memory that NumPy views through the array interface (``np.asarray``)."""

    __slots__ = ("__array_interface__",)

    def __init__(self, address: int, shape: tuple, itemsize: int, writable: bool):
        self.__array_interface__ = {
            "data": (address, not writable),
            "shape": shape,
            "typestr": f"|u{itemsize}",  # the bits; viewed as the dtype after
            "version": 3,
        }


def _array(buffer: _Buffer, writable: bool) -> np.ndarray:
    """A NumPy view of an XLA buffer (no copy); a fused step passes hundreds, so this is the
    array interface's couple of microseconds, not a ctypes array type's."""
    dtype = _DTYPES.get(buffer.dtype)
    if dtype is None:
        raise TypeError(f"srround's FFI handler got an unsupported XLA dtype code {buffer.dtype}")
    shape = tuple(buffer.dims[: buffer.rank])
    if not buffer.data or 0 in shape:
        return np.zeros(shape, dtype)
    bits = np.asarray(_Memory(buffer.data, shape, dtype.itemsize, writable))
    return bits if bits.dtype == dtype else bits.view(dtype)


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _run(frame: _CallFrame) -> None:
    buffers = frame.args.buffers
    outs = [_array(frame.rets.buffers[i].contents, True) for i in range(frame.rets.size)]
    fn, aliased, into = _FUNCTIONS[int(_array(buffers[0].contents, False))]
    # an aliased operand's data is in its result's (writable) buffer: no view of its own
    args = [
        outs[aliased[i]] if i in aliased else _array(buffers[i + 1].contents, False)
        for i in range(frame.args.size - 1)
    ]
    if into:  # the function writes the results' buffers itself
        fn(*args, outs=tuple(outs))
        return
    results = fn(*args)
    if len(outs) == 1:
        results = (results,)
    for out, result in zip(outs, results, strict=True):
        if result is out:
            continue  # updated in place, the view handed in
        result = np.asarray(result)
        if _address(result) == _address(out) and result.nbytes == out.nbytes:
            continue  # updated in place
        if result.dtype != out.dtype:
            result = result.view(out.dtype)
        np.copyto(out, result.reshape(out.shape))


def _error(api: int, message: str) -> int:
    create = _ERROR_CREATE(ctypes.c_void_p.from_address(api + _ERROR_CREATE_OFFSET).value)
    text = message.encode("utf-8", "replace")
    size = _ErrorCreateArgs.errc.offset + ctypes.sizeof(ctypes.c_int)  # XLA's: up to errc
    args = _ErrorCreateArgs(size, None, text, _INTERNAL)
    return create(ctypes.byref(args))


@ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_CallFrame))
def _handler(frame_pointer):
    frame = frame_pointer.contents
    if frame.extension_start:
        extension = frame.extension_start.contents
        if extension.type == _METADATA:  # XLA asks which FFI version the handler speaks
            meta = ctypes.cast(frame.extension_start, ctypes.POINTER(_MetadataExtension))
            version = meta.contents.metadata.contents.api_version
            version.major_version, version.minor_version = 0, 1
            return None
    if frame.stage != _EXECUTE:
        return None
    try:
        _run(frame)
    except BaseException:  # reported to XLA: the caller gets an XlaRuntimeError
        return _error(frame.api, "srround host call failed:\n" + traceback.format_exc())
    return None


jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(_handler), platform="cpu")


def _finish_programs() -> None:
    """At exit, before the interpreter finalizes: wait until every live array is ready, so the
    programs that compute them have run their host calls. The handler is Python (``ctypes``
    takes the GIL for it); a call that starts once finalization has begun never gets the GIL,
    and the process hung in XLA's thread-pool shutdown (a jitted ``tx.update`` left running at
    the end of a script: 8 of 8 runs). Registered at the first ``call``: after JAX's own exit
    handlers, so it runs before them."""
    for array in jax.live_arrays():
        try:
            array.block_until_ready()
        except Exception:  # noqa: BLE001 - a failed program has nothing left to run
            pass


_finish_at_exit = False  # _finish_programs registered


def call(fn, result_shape, *args, key, aliases=None, into=False):
    """``fn(*host arrays)`` on the host as an FFI custom call (CPU only): ``result_shape`` a
    ``jax.ShapeDtypeStruct`` or a tuple of them; ``fn`` returns an array or a tuple of arrays of
    those shapes (bit patterns of the same width are viewed as the result's dtype). Vmapped:
    one call per example. ``key`` (hashable) names what ``fn`` does - its static settings -
    and registers it for the life of the process (a compiled program may run at any later
    time); a key seen before reuses its function, so code traced again and again (eager
    calls in a loop) registers nothing new.

    ``aliases``: ``{operand index in args: result index}`` (same shape and dtype): ``fn`` gets
    that operand as a writable array and returns it as that result, updated in place (XLA
    copies the operand first unless it was donated, so the caller's array never changes).
    The other operands are read-only. ``into``: ``fn(*args, outs=...)`` writes the results into
    XLA's result buffers (a tuple of writable arrays) and returns nothing: no copy."""
    global _finish_at_exit
    aliases = tuple(sorted((aliases or {}).items()))
    with _LOCK:
        if not _finish_at_exit:
            atexit.register(_finish_programs)
            _finish_at_exit = True
        ident = _IDS_OF.get((key, aliases, into))
        if ident is None:
            ident = _IDS_OF[key, aliases, into] = next(_IDS)
            _FUNCTIONS[ident] = (fn, dict(aliases), into)
    ident_arg = jnp.asarray(ident, jnp.int32)
    call = jax.ffi.ffi_call(
        TARGET,
        result_shape,
        vmap_method="sequential",
        input_output_aliases={operand + 1: result for operand, result in aliases},
    )
    return call(ident_arg, *args)
