"""Block-scaled quantization: MXFP8 (e4m3, e5m2), MXFP4 and NVFP4, as data plus scalar bodies.

A block is ``block`` consecutive elements along one axis of a C-contiguous float32 array viewed
as ``(outer, n, inner)`` (``n`` the axis length). One pass per block finds the block's absolute
maximum, computes its scale and rounds its elements; nothing else is read or written twice.

MX (OCP Microscaling v1.0), blocks of 32, one ``float8_e8m0fnu`` scale per block (a biased
power-of-two exponent, 0xFF = NaN)::

    e      = biased exponent field of amax - 127                 # floor(log2(amax)), amax normal
    k      = clamp(e - emax_elem, -127, 128)        # emax_elem: 8 e4m3, 15 e5m2, 2 e2m1
    k     += 1 if scale == "ceil" and amax's significand > max_elem's   (the scale never clips)
    scale  = k + 127 (uint8); 0xFF when amax is NaN
    q_i    = round(clamp(x_i / 2**k, -max_elem, max_elem))    # saturating

``scale="floor"`` with ``rounding="nearest"`` is torchao's ``to_mx`` (ScaleCalculationMode.FLOOR)
bit for bit, except on blocks of scale 2**-127, which torchao divides by 2**-126 (so that its
dequantized values are half the inputs there). Under FLOOR the block maximum divided by the
scale lies in ``[2**emax, 2**(emax+1))`` while the largest element is ``1.75 * 2**emax`` (e4m3,
e5m2) or ``1.5 * 2**emax`` (e2m1): a block maximum above that is clipped to the largest
element. ``"ceil"`` differs from ``"floor"`` exactly on those blocks, where it takes the next
power of two (one bit less resolution for that block), so no element clips.

NVFP4, blocks of 16, an fp32 scale per tensor and a ``float8_e4m3fn`` scale per block; torchao's
``nvfp4_quantize(x, 16, per_tensor_scale=per_tensor_amax_to_scale(amax))`` step for step, in
float32 (each operation rounded once), except that the tensor scale is floored at 2**-121, so
that the multiplier ``(1 / tensor_scale) / s_b`` stays finite (torchao's overflows to inf
there, and a zero element becomes NaN)::

    tensor_scale = max(amax(|x|) / (448 * 6), 2**-121)            # 1.0 for an all-zero tensor
    s_b   = e4m3(clamp((amax_b / 6) / tensor_scale, 2**-6, 448))  # nearest ("floor") or up ("ceil")
    q_i   = round(clamp(x_i * ((1 / tensor_scale) / s_b), -6, 6))

Rounding an element: ``"nearest"`` (ties to even) or ``"stochastic"`` (``_scalar.py``, 16 random
bits of stream position ``offset + i``, ``i`` the element's row-major index in ``x``): unbiased
for every element that the scale does not clip. fp4 elements are packed two per byte along the
axis, element ``2j`` in the low nibble, as torchao's ``pack_uint4``.
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import importlib.util
import sys
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from . import _cpu
from ._block_kernels import (
    amax_bits_cpu,
    dequantize_blocks_cpu,
    nv_tensor_scale,
    quantize_blocks_cpu,
)
from ._formats import FORMATS, Format, check_float32_dtype
from ._rng import check_offset, check_seed, next_seed, split_seed
from ._tensor_list import address


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    """A block-scaled format.

    Attributes:
        name: ``"mxfp8_e4m3"``, ``"mxfp8_e5m2"``, ``"mxfp4"`` or ``"nvfp4"``.
        element: the element ``Format``.
        block: elements per block along the axis.
        two_level: NVFP4's e4m3 block scales under an fp32 tensor scale (else MX e8m0 scales).
        emax: exponent of the element format's largest power of two (MX scale rule).
    """

    name: str
    element: Format
    block: int
    two_level: bool
    emax: int

    @property
    def packed(self) -> bool:
        """Two elements per byte (fp4)."""
        return self.element.bits == 4

    @property
    def max_mantissa(self) -> int:
        """The fp32 fraction field of the largest element over ``2**emax`` (1.75 -> 0x600000)."""
        ratio = self.element.max_finite / 2.0**self.emax
        return int(round((ratio - 1.0) * 2**23))

    @property
    def scale_dtype(self) -> str:
        return "float8_e4m3fn" if self.two_level else "float8_e8m0fnu"


BLOCK_FORMATS = {
    "mxfp8_e4m3": BlockFormat("mxfp8_e4m3", FORMATS["float8_e4m3fn"], 32, False, 8),
    "mxfp8_e5m2": BlockFormat("mxfp8_e5m2", FORMATS["float8_e5m2"], 32, False, 15),
    "mxfp4": BlockFormat("mxfp4", FORMATS["float4_e2m1fn"], 32, False, 2),
    "nvfp4": BlockFormat("nvfp4", FORMATS["float4_e2m1fn"], 16, True, 2),
}
SCALE_MODES = ("floor", "ceil")


def get_block_format(name) -> BlockFormat:
    if isinstance(name, str) and name.lower() in BLOCK_FORMATS:
        return BLOCK_FORMATS[name.lower()]
    raise ValueError(f"format: expected one of {sorted(BLOCK_FORMATS)}, got {name!r}")


# -- the functional API -----------------------------------------------------------------------

# storage-only formats of block results (never rounded to: they only name a dtype and a width)
E8M0 = Format("float8_e8m0fnu", 7, 0, np.dtype(ml_dtypes.float8_e8m0fnu))
PACKED_FP4 = Format("uint8", 4, 3, np.dtype(np.uint8))


class QuantizedBlocks(NamedTuple):
    """The result of ``quantize_blocks``.

    Attributes:
        data: the elements: ``x``'s shape in the element dtype (``float8_e4m3fn`` /
            ``float8_e5m2``); fp4 formats as ``uint8`` with the axis halved, two elements per
            byte (element ``2j`` along the axis in the low nibble).
        scales: one per block, ``x``'s shape with the axis length divided by the block size:
            ``float8_e8m0fnu`` (MX) or ``float8_e4m3fn`` (NVFP4).
        tensor_scale: NVFP4's float32 tensor scale, an array of one value; ``None`` for MX.
        format: the block format's name.
        axis: the (non-negative) axis the blocks run along.
    """

    data: Any
    scales: Any
    tensor_scale: Any
    format: str
    axis: int


def _register_pytree(jax) -> None:
    """``QuantizedBlocks`` as a pytree of the imported ``jax`` module: its arrays are leaves,
    ``format`` and ``axis`` static (so it passes through ``jit`` and ``device_put``)."""
    jax.tree_util.register_pytree_node(
        QuantizedBlocks,
        lambda q: ((q.data, q.scales, q.tensor_scale), (q.format, q.axis)),
        lambda aux, children: QuantizedBlocks(*children, *aux),
    )


class _AfterJaxImport(importlib.abc.MetaPathFinder):
    """Registers the pytree once ``import jax`` has run, whenever that is: the core imports no
    framework, and the pytree must not wait for ``srround.adapters.jax``. It stays in
    ``sys.meta_path`` until JAX's module has run (a ``find_spec`` probe imports nothing)."""

    finding = False

    def find_spec(self, name, path, target=None):
        if name != "jax" or self.finding:
            return None
        self.finding = True
        try:
            spec = importlib.util.find_spec(name)  # the other finders' spec
        finally:
            self.finding = False
        if spec is not None and spec.loader is not None:
            exec_module = spec.loader.exec_module

            def exec_then_register(module):
                exec_module(module)
                _register_pytree(module)
                if self in sys.meta_path:
                    sys.meta_path.remove(self)

            spec.loader.exec_module = exec_then_register  # type: ignore[method-assign]
        return spec


if "jax" in sys.modules:
    _register_pytree(sys.modules["jax"])
else:
    sys.meta_path.insert(0, _AfterJaxImport())


def check_axis(axis, ndim, name="axis") -> int:
    """``axis`` of an ``ndim``-dimensional array as a non-negative int, else a ValueError
    naming ``name``."""
    if (
        isinstance(axis, bool)
        or not isinstance(axis, (int, np.integer))
        or not -ndim <= axis < ndim
    ):
        raise ValueError(f"{name}: expected an int in [{-ndim}, {ndim}), got {axis!r}")
    return int(axis) % ndim


def check_tensor_scale(size) -> None:
    """An NVFP4 tensor scale is one value (any shape: torchao's is 0-d, srround's ``(1,)``)."""
    if size != 1:
        raise ValueError(f"q.tensor_scale: expected one float32 value, got {size}")


def _layout(shape, axis, block, name="x"):
    """``(axis, outer, n, inner)`` of blocks along ``axis`` of a C-contiguous ``shape``."""
    ndim = len(shape)
    if ndim == 0:
        raise ValueError(f"{name}: expected an array with at least one dimension, got a scalar")
    axis = check_axis(axis, ndim)
    n = shape[axis]
    if n % block:
        raise ValueError(
            f"{name}: the length {n} of axis {axis} is not a multiple of the block size {block};"
            f" pad it (e.g. with zeros, which leave every block scale unchanged) to a multiple"
            f" of {block}"
        )
    outer = int(np.prod(shape[:axis], dtype=np.int64))
    inner = int(np.prod(shape[axis + 1 :], dtype=np.int64))
    return axis, outer, n, inner


def check_whole(name, view) -> None:
    """Block formats run on whole arrays: the piece of a sharded one (a torch DTensor) is a
    TypeError naming ``name`` (its blocks, NVFP4's tensor scale and its noise would be the
    piece's, its results DTensors of the input's shape)."""
    if view is not None and view.sharded:
        raise TypeError(
            f"{name}: a DTensor; block formats run on whole tensors: pass its full_tensor() (or,"
            " for MX with blocks inside each local piece, its to_local() with offset= the"
            " piece's first element's index in the full tensor)"
        )


def dequantized_layout(bf: BlockFormat, axis, data_shape, scales_shape):
    """``(axis, shape, n, inner)`` of the float32 values of a ``QuantizedBlocks`` (``shape``:
    ``x``'s) with data and scales of these shapes; a ValueError naming the field that does not
    fit."""
    data_shape = tuple(data_shape)
    axis = check_axis(axis, len(data_shape), "q.axis")
    shape = _shape_with(data_shape, axis, data_shape[axis] * 2) if bf.packed else data_shape
    axis, _, n, inner = _layout(shape, axis, bf.block, "q.data")
    want = _shape_with(shape, axis, n // bf.block)
    if tuple(scales_shape) != want:
        raise ValueError(f"q.scales: shape {tuple(scales_shape)}, expected {want} for q.data")
    return axis, shape, n, inner


def _shape_with(shape, axis, length):
    return tuple(shape[:axis]) + (length,) + tuple(shape[axis + 1 :])


def _element_params(bf: BlockFormat):
    el = bf.element
    max_bits = int(np.float32(el.max_finite).view(np.uint32))
    return (
        el.mantissa_bits,
        el.exponent_bits,
        el.specials,
        bf.two_level,
        bf.emax,
        bf.max_mantissa,
        max_bits,
        bf.packed,
    )


def quantize_blocks(x, format, *, rounding="stochastic", seed=None, offset=0, axis=-1, scale=None):
    """Quantize float32 ``x`` to a block-scaled format, blocks along ``axis``.

    Args:
        x: float32 array (NumPy, torch, Numba CUDA; C-contiguous), any shape; the length of
            ``axis`` must be a multiple of the block size (32 MX, 16 NVFP4), else a ValueError
            (pad with zeros, which change no block's scale).
        format: ``"mxfp8_e4m3"``, ``"mxfp8_e5m2"``, ``"mxfp4"`` or ``"nvfp4"``.
        rounding: ``"stochastic"`` (default; unbiased for every element the scale does not
            clip) or ``"nearest"`` (ties to even).
        seed, offset: the random stream, as ``stochastic_round``: element ``i`` (row-major
            index in ``x``) uses stream position ``offset + i``, whatever ``axis`` is.
        axis: the axis the blocks run along.
        scale: ``"floor"`` (the OCP MX rule and torchao's bits; may clip a block's largest
            element) or ``"ceil"`` (the next scale up on exactly the blocks that would clip,
            so nothing clips). Default: ``"floor"`` for ``rounding="nearest"``, ``"ceil"`` for
            ``"stochastic"`` (whose point is an unbiased result).

    Returns:
        ``QuantizedBlocks(data, scales, tensor_scale, format, axis)`` in ``x``'s framework and
        device (see ``QuantizedBlocks``).
    """
    from ._dispatch import adapter_for

    bf = get_block_format(format)
    if not isinstance(rounding, str) or rounding not in ("stochastic", "nearest"):
        raise ValueError(f"rounding: expected 'stochastic' or 'nearest', got {rounding!r}")
    if scale is None:
        scale = "ceil" if rounding == "stochastic" else "floor"
    if not isinstance(scale, str) or scale not in SCALE_MODES:
        raise ValueError(f"scale: expected one of {list(SCALE_MODES)}, got {scale!r}")
    adapter = adapter_for(x=x)
    if not adapter.MUTABLE:  # JAX: its adapter's own implementation
        return adapter.quantize_blocks(
            x, format, rounding=rounding, seed=seed, offset=offset, axis=axis, scale=scale
        )
    stochastic = rounding == "stochastic"
    offset = check_offset(offset)
    src, _ = adapter.source(x, "x")
    check_whole("x", src)
    axis, outer, n, inner = _layout(src.shape, axis, bf.block)
    data_shape = _shape_with(src.shape, axis, n // 2) if bf.packed else src.shape
    data = adapter.target(
        None,
        "data",
        dataclasses.replace(src, shape=data_shape),
        PACKED_FP4 if bf.packed else bf.element,
    )
    scales = adapter.target(
        None,
        "scales",
        dataclasses.replace(src, shape=_shape_with(src.shape, axis, n // bf.block)),
        FORMATS["float8_e4m3fn"] if bf.two_level else E8M0,
    )
    tensor = adapter.target(None, "tensor_scale", dataclasses.replace(src, shape=(1,)), None)
    k0, k1 = (0, 0)
    if stochastic:  # after the checks: a refused call draws no seed
        k0, k1 = split_seed(next_seed() if seed is None else check_seed(seed, "seed"))
    params = (*_element_params(bf), stochastic, scale == "ceil")
    size = src.bits.size
    if src.device == "cpu":
        ts = 0
        if bf.two_level:  # an empty tensor's amax is 0: tensor scale 1.0, as an all-zero one's
            amax = int(_cpu.run(amax_bits_cpu, size, _cpu.read_only(src.bits))) if size else 0
            ts = nv_tensor_scale(amax)
        tensor.bits[0] = ts
        if size:
            _cpu.run(  # as every CPU launch: counted, locked where the threading layer needs it
                quantize_blocks_cpu,
                size,
                address(src.bits),
                address(data.bits),
                address(scales.bits),
                scales.bits.size,
                n,
                inner,
                bf.block,
                ts,
                k0,
                k1,
                offset,
                params,
            )
    else:
        from . import _blocks_cuda

        _blocks_cuda.quantize(
            src.bits,
            data.bits,
            scales.bits,
            tensor.bits,
            n,
            inner,
            bf.block,
            k0,
            k1,
            offset,
            params,
            stream=src.stream,
        )
    return QuantizedBlocks(
        data.result, scales.result, tensor.result if bf.two_level else None, bf.name, axis
    )


def dequantize_blocks(q, *, dtype="float32"):
    """float32 values of a ``QuantizedBlocks`` (``quantize_blocks``' result): element times its
    block scale (NVFP4: times ``e4m3 scale * tensor_scale``, rounded once in float32 first).

    Args:
        q: a ``QuantizedBlocks``; its arrays in one framework, on one device.
        dtype: float32 (the only one): ``"float32"``, ``np.float32`` or the framework's own
            (``torch.float32``, ``jnp.float32``).
    """
    from ._dispatch import adapter_for, check_same_place

    if not isinstance(q, QuantizedBlocks):
        raise TypeError(f"q: expected a QuantizedBlocks, got {type(q).__name__}")
    check_float32_dtype(dtype)
    bf = get_block_format(q.format)
    adapter = adapter_for(data=q.data, scales=q.scales, tensor_scale=q.tensor_scale)
    if not adapter.MUTABLE:
        return adapter.dequantize_blocks(q, dtype=dtype)
    data, _ = adapter.source(q.data, "q.data", PACKED_FP4 if bf.packed else bf.element, narrow=True)
    scales, _ = adapter.source(
        q.scales, "q.scales", FORMATS["float8_e4m3fn"] if bf.two_level else E8M0, narrow=True
    )
    check_whole("q.data", data)
    check_whole("q.scales", scales)
    axis, shape, n, inner = dequantized_layout(bf, q.axis, data.shape, scales.shape)
    tensor = None
    if bf.two_level:
        if q.tensor_scale is None:
            raise ValueError("q.tensor_scale: NVFP4 needs its float32 tensor scale")
        tensor, _ = adapter.source(q.tensor_scale, "q.tensor_scale")
        check_whole("q.tensor_scale", tensor)
        check_tensor_scale(tensor.bits.size)
    out = adapter.target(None, "out", dataclasses.replace(data, shape=shape), None)
    check_same_place(**{"q.data": data, "q.scales": scales, "out": out, "q.tensor_scale": tensor})
    el = bf.element
    params = (el.mantissa_bits, el.exponent_bits, el.specials, bf.two_level, bf.packed)
    if out.bits.size:
        if out.device == "cpu":
            ts = int(tensor.bits[0]) if tensor is not None else 0
            _cpu.run(
                dequantize_blocks_cpu,
                out.bits.size,
                address(data.bits),
                address(scales.bits),
                address(out.bits),
                scales.bits.size,
                n,
                inner,
                bf.block,
                ts,
                params,
            )
        else:
            from . import _blocks_cuda

            _blocks_cuda.dequantize(
                data.bits,
                scales.bits,
                None if tensor is None else tensor.bits,
                out.bits,
                n,
                inner,
                bf.block,
                params,
                stream=out.stream,
            )
    return out.result
