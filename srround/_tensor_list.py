"""Tensor lists for O(1)-launch kernels: many buffers, one kernel, through a pointer table.

A model has hundreds of parameter tensors, and each CUDA launch costs host time: a tensor-list
kernel covers them all in one launch. A ``TensorList`` describes N buffers by a table:

    addresses int64[N]   data pointers (host pointers on the CPU, device pointers on CUDA)
    formats   int64[N]   BufferCode of each buffer (``_formats.py``)
    starts    int64[N+1] prefix sums of the sizes: tensor k owns global elements
                         [starts[k], starts[k+1])

Kernels run over the global element range ``[0, starts[N])``, find the tensor of an element by
binary search in ``starts`` (a few cache-resident probes), and load and store through the
``load_bits`` / ``store_bits`` intrinsics below, which turn an address into a typed pointer
(LLVM ``inttoptr``): the same code compiles for the CPU and for CUDA (generic address space).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic


def address(bits) -> int:
    """Data pointer of a flat buffer: a NumPy array, a Numba device array, or a simulated one
    (which wraps host memory)."""
    pointer = getattr(bits, "device_ctypes_pointer", None)
    if pointer is not None:
        return pointer.value or 0
    return bits.__array_interface__["data"][0]


def _pointer_codegen(bits):
    def typed_pointer(builder, address, index):
        pointer = builder.inttoptr(address, ir.IntType(bits).as_pointer())
        return builder.gep(pointer, [index])

    return typed_pointer


@intrinsic
def load_bits(typingctx, address, index, width):
    """``width``-bit word (16 or 32, a literal) ``index`` of the buffer at ``address``, as int64."""
    if not isinstance(width, types.IntegerLiteral):
        return None
    bits = width.literal_value
    gep = _pointer_codegen(bits)

    def codegen(context, builder, signature, args):
        value = builder.load(gep(builder, args[0], args[1]))
        return builder.zext(value, ir.IntType(64))

    return types.int64(types.int64, types.int64, width), codegen


@intrinsic
def store_bits(typingctx, address, index, value, width):
    """Store the low ``width`` bits (16 or 32, a literal) of ``value`` at word ``index``."""
    if not isinstance(width, types.IntegerLiteral):
        return None
    bits = width.literal_value
    gep = _pointer_codegen(bits)

    def codegen(context, builder, signature, args):
        builder.store(builder.trunc(args[2], ir.IntType(bits)), gep(builder, args[0], args[1]))
        return context.get_dummy_value()

    return types.none(types.int64, types.int64, types.int64, width), codegen


@intrinsic
def typed_pointer(typingctx, address, width):
    """``address`` as a ``uint16*`` / ``uint32*`` (``width`` 16 or 32, a literal), for
    ``numba.carray`` in CPU loops (arrays vectorize better than raw loads)."""
    if not isinstance(width, types.IntegerLiteral):
        return None
    pointee = types.uint16 if width.literal_value == 16 else types.uint32

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return types.CPointer(pointee)(types.int64, width), codegen


@njit(forceinline=True, cache=True)
def find_tensor(starts, i):
    """Index k with starts[k] <= i < starts[k + 1] (binary search; empty tensors skipped)."""
    lo = 0
    hi = starts.size - 2
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if starts[mid] <= i:
            lo = mid
        else:
            hi = mid - 1
    return lo


class TensorList:
    """The pointer table of a list of buffers (see the module docstring).

    Attributes:
        addresses, formats, starts: the table as NumPy int64 arrays (host; CUDA kernels get
            cached device copies, ``_cuda._device_table``).
        sizes: elements per buffer (int64 array, ``starts``' differences).
        total: number of elements over all buffers.
        keepalive: the buffers, so their memory outlives the table.
    """

    def __init__(self, addresses, formats, sizes, keepalive):
        self.addresses = np.asarray(addresses, np.int64)
        self.formats = np.asarray(formats, np.int64)
        self.sizes = np.asarray(sizes, np.int64)
        self.starts = np.zeros(self.sizes.size + 1, np.int64)
        np.cumsum(self.sizes, out=self.starts[1:])
        self.total = int(self.starts[-1])
        self.keepalive = keepalive

    def __len__(self):
        return self.addresses.size
