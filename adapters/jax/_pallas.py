"""The fused step's leaves, ``stochastic_round`` and ``stochastic_add`` as Pallas kernels on CUDA.

XLA's GPU backend has no fma, and divides and takes square roots of float32 approximately
(``div.full.f32``, ``sqrt.approx.f32``), so the XLA path (``_lax``, ``optim._fma``) takes
srround's correctly rounded fma, division and square root in float64 and rounds them back:
about half of the fused AdamW step's instructions on a GPU. Here a leaf's update runs as one
Pallas kernel - the same code (``optim._update``, ``optim._sgd_update``), traced inside the
kernel - in which those ops are the GPU's own correctly rounded instructions (``fma.rn.f32``,
``div.rn.f32``, ``sqrt.rn.f32``, inline PTX: what the Numba CUDA kernels run), and a row of four
elements draws one Threefry block. The bits are the XLA path's (``tests/test_jax_pallas.py``:
Pallas' interpreter on the CPU, the compiled kernels on a GPU; ``benchmarks/jax_gpu_check.py``).

``stochastic_round`` and ``stochastic_add`` to bf16 or fp16 run the same kernels, each as a
leaf update (``_api._rounding_update``, ``_api._adding_update``: on rows whose length is not a
power of two the XLA path computes a Threefry block for each element, and its exact fma is
integer work, ``docs/performance.md``).

Where (``takes``, ``leaf_call``): a leaf of an elementwise update (``elementwise``) with a
multiple of four elements, where JAX's backend is a GPU. A Pallas call does not partition, so
under ``jit`` over several devices each shard of a leaf is a kernel of its own
(``custom_partitioning``, the callback path's ``_per_shard``: nothing is gathered), as is a
block inside ``shard_map``, at its global position when its elements are one run of the leaf
(only the first dimension split); a block split otherwise takes the XLA path with its origin.
On GPUs other than NVIDIA's (``lax.platform_dependent``) the XLA path runs.

``MODE`` (the environment variable ``SRROUND_JAX_PALLAS`` at import, default ``"auto"``; to
change it later set the attribute and call ``jax.clear_caches()``):

* ``"auto"``: as above;
* ``"off"``: the XLA path everywhere (the benchmark times both);
* ``"on"``: the kernels wherever the program is lowered for CUDA, whatever JAX's default
  backend (compiling for a compile-only GPU);
* ``"interpret"``: Pallas' interpreter on any platform (under ``jit`` over several devices:
  each CPU shard), with the XLA path's exact ops (tests of the kernel's indexing, masks,
  scalar words, random bits and shards without a GPU).
"""

from __future__ import annotations

import functools
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _lax
from ._callback import _per_shard

MODES = ("auto", "off", "on", "interpret")
MODE = os.environ.get("SRROUND_JAX_PALLAS", "auto")
if MODE not in MODES:
    raise ValueError(f"SRROUND_JAX_PALLAS: expected one of {', '.join(MODES)}, got {MODE!r}")
ROWS = 256  # rows of four elements per program (1024; the tile sweep: docs/performance.md)
WARPS = 4
_QNAN = np.uint32(0x7FC00000).view(np.float32)


def elementwise(update):
    """Mark ``update`` (a ``_native_leaves`` update) as elementwise: element i of its outputs
    depends only on element i of its inputs and its random bits, so a kernel can take the
    leaf in blocks. Returns ``update``."""
    update.srround_elementwise = True
    return update


@functools.cache
def _has_triton() -> bool:
    """Whether this JAX has Pallas' Triton backend (a jaxlib built without it keeps the XLA
    path rather than failing at the first step)."""
    try:
        from jax.experimental.pallas import triton  # noqa: F401
    except ImportError:
        return False
    return True


def takes(update, arrays) -> bool:
    """Whether a leaf's update (``arrays``: its buffers, ``None`` where absent) runs as Pallas
    kernels where the program runs on CUDA (``leaf_call``)."""
    if MODE == "off" or not getattr(update, "srround_elementwise", False):
        return False
    if MODE == "auto" and jax.default_backend() != "gpu":
        return False
    if not _has_triton():
        return False
    p = arrays[0]
    return (
        p.size % 4 == 0
        and p.size > 0
        and all(x is None or (hasattr(x, "shape") and x.shape == p.shape) for x in arrays)
    )


class _Exact:
    """The exact float32 ops inside a kernel (``_lax.kernel_ops``): the GPU's own correctly
    rounded instructions, subnormals kept (no ``.ftz``), a NaN as +qNaN 0x7FC00000 (the GPU's
    is 0x7FFFFFFF)."""

    @staticmethod
    def _asm(asm, dtype, *xs):
        from jax.experimental.pallas import triton as plgpu

        xs = [jnp.asarray(x, dtype) for x in xs]
        shape = jnp.broadcast_shapes(*(x.shape for x in xs))
        reg = "f" if dtype == jnp.float32 else "r"
        (r,) = plgpu.elementwise_inline_asm(
            asm,
            args=[jnp.broadcast_to(x, shape) for x in xs],
            constraints=",".join([f"={reg}"] + [reg] * len(xs)),
            pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct(shape, dtype)],
        )
        return r

    def _ptx(self, asm, *xs):
        r = self._asm(asm, jnp.float32, *xs)
        return jnp.where(r != r, _QNAN, r)

    def clz(self, x):  # Triton's inline assembly takes signless integers: int32
        x = lax.bitcast_convert_type(jnp.asarray(x, jnp.uint32), jnp.int32)
        return self._asm("clz.b32 $0, $1;", jnp.int32, x).astype(jnp.uint32)

    def fma(self, a, b, c):
        return self._ptx("fma.rn.f32 $0, $1, $2, $3;", a, b, c)

    def div(self, a, b):
        return self._ptx("div.rn.f32 $0, $1, $2;", a, b)

    def sqrt(self, x):
        return self._ptx("sqrt.rn.f32 $0, $1;", x)


def _word_dtype(dtype):
    """``dtype`` if a scalar of it passes as one uint32 word (4 bytes, or a bool), else None."""
    dtype = jnp.dtype(dtype)
    return dtype if dtype.itemsize == 4 or dtype == jnp.bool_ else None


def _as_word(v):
    v = jnp.asarray(v).reshape(())
    if v.dtype == jnp.bool_:
        return v.astype(jnp.uint32)
    return lax.bitcast_convert_type(v, jnp.uint32)


def _width(n: int) -> int:
    """Length of the kernel's vector of ``n`` scalar words (a power of two, as Triton's)."""
    return max(2, 1 << max(n - 1, 0).bit_length())


def _from_word(w, dtype):
    return w.astype(jnp.bool_) if dtype == jnp.bool_ else lax.bitcast_convert_type(w, dtype)


@functools.partial(jax.jit, static_argnames=("xla_call", "lane0", "update", "cfg", "global_shape"))
def leaf_call(
    xla_call, arrays, k0, k1, hi, start_lo, lane0, origin, extra, *, update, cfg, global_shape
):
    """``xla_call``'s leaf update (``_leaves._leaf_call``, same arguments) as Pallas kernels
    where the program runs on CUDA, ``xla_call`` elsewhere (``MODE``). A block inside
    ``shard_map`` (``global_shape`` given) and, under ``jit`` over several devices, each
    shard of a leaf (XLA's partitioner, ``custom_partitioning``) is one kernel over its
    elements when they are one run of the leaf (only the first dimension split), at its
    global position; any other block takes the XLA path with its origin (the same bits)."""
    kw = {"update": update, "cfg": cfg}
    n_arrays = len(arrays)
    present = [i for i, x in enumerate(arrays) if x is not None]
    scalars, tree = jax.tree_util.tree_flatten((k0, k1, hi, start_lo, extra))
    dynamic = [i for i, v in enumerate(scalars) if isinstance(v, jax.Array)]
    if any(scalars[i].size != 1 or _word_dtype(scalars[i].dtype) is None for i in dynamic):
        return xla_call(
            arrays, k0, k1, hi, start_lo, lane0, origin, extra, global_shape=global_shape, **kw
        )
    n_words = len(dynamic)
    shape = tuple(arrays[0].shape if global_shape is None else global_shape)  # the leaf's
    out_shapes = jax.eval_shape(
        lambda *xs: xla_call(
            xs, k0, k1, hi, start_lo, lane0, origin, extra, global_shape=global_shape, **kw
        ),
        *arrays,
    )
    outs = [i for i, o in enumerate(out_shapes) if o is not None]
    leaf = _Leaf(
        update,
        cfg,
        tree,
        tuple(scalars),
        tuple(dynamic),
        tuple(present),
        n_arrays,
        tuple(outs),
        tuple(out_shapes[i].dtype for i in outs),
    )
    single = len(outs) == 1

    def on_xla(operands, block_origin):
        k0, k1, hi, start_lo, extra = _unpack(leaf, lambda slot: operands[slot])
        full = [None] * n_arrays
        for i, x in zip(present, operands[n_words:]):
            full[i] = x
        at = None if block_origin is None else tuple(block_origin)  # None: the whole leaf
        got = xla_call(
            tuple(full),
            k0,
            k1,
            hi,
            start_lo,
            lane0,
            at,
            extra,
            global_shape=None if at is None else shape,
            **kw,
        )
        got = tuple(got[i] for i in outs)
        return got[0] if single else got

    def on_kernel(operands, block_origin):
        local = operands[n_words:]
        block = local[0].shape
        size = int(np.prod(block))
        if block_origin is not None and (tuple(block[1:]) != shape[1:] or size % 4):
            return on_xla(operands, block_origin)  # not one run of the leaf
        row_offset = jnp.uint32(0)
        if block_origin is not None and block:
            run = int(np.prod(shape[1:]))  # a row of the leaf; the block starts at origin[0]
            row_offset = (_lax._u(block_origin[0]) * np.uint32(run)) >> 2
        words = list(operands[:n_words]) + [row_offset]
        words = jnp.stack(words + [jnp.uint32(0)] * (_width(len(words)) - len(words)))
        mat = getattr(jax.typeof(local[0]), "manual_axis_type", None)
        call = _kernel(leaf, size // 4, lane0, mat)
        got = tuple(r.reshape(block) for r in call(words, *(x.reshape(-1, 4) for x in local)))
        return got[0] if single else got

    def per_block(*operands_and_origins):
        *operands, origins = operands_and_origins
        block_origin = None if origins is None else origins[0]
        if MODE == "interpret":
            return on_kernel(operands, block_origin)
        return lax.platform_dependent(
            *operands,
            cuda=lambda *o: on_kernel(o, block_origin),
            default=lambda *o: on_xla(o, block_origin),
        )

    operands = [_as_word(scalars[i]) for i in dynamic] + [arrays[i] for i in present]
    if global_shape is not None:  # a block inside shard_map: its origin in the leaf
        got = per_block(*operands, {0: list(origin)})
    elif jax.device_count() == 1:
        got = per_block(*operands, None)
    else:  # each shard where XLA's partitioner splits the leaf
        leaf_of = [None] * n_words + [0] * len(present)
        got = _per_shard(
            per_block,
            leaf_of,
            *operands,
            result_leaves=(0,) * len(outs),
            platform="cpu" if MODE == "interpret" else "cuda",
            default=lambda *o: on_xla(o, None),
        )
    got = (got,) if single else tuple(got)
    result = [None] * len(out_shapes)
    for i, r in zip(outs, got):
        result[i] = r
    return tuple(result)


class _Leaf(NamedTuple):
    """What a leaf's kernel computes: ``update(cfg, *arrays, bits, *extra)``, the arrays
    ``present`` of ``n_arrays`` given, its outputs ``outs`` (``out_dtypes``); ``(k0, k1, hi,
    start_lo, extra)`` flattened (``tree``) into ``scalars``, those at ``dynamic`` passed to
    the kernel as uint32 words."""

    update: Any
    cfg: Any
    tree: Any
    scalars: tuple
    dynamic: tuple
    present: tuple
    n_arrays: int
    outs: tuple
    out_dtypes: tuple


def _unpack(leaf: _Leaf, word):
    """``(k0, k1, hi, start_lo, extra)`` of ``leaf``, its dynamic scalars from ``word(slot)``
    (uint32 words in ``leaf.dynamic``'s order)."""
    values = list(leaf.scalars)
    for slot, i in enumerate(leaf.dynamic):
        values[i] = _from_word(word(slot), jnp.dtype(leaf.scalars[i].dtype))
    return jax.tree_util.tree_unflatten(leaf.tree, values)


def _kernel(leaf: _Leaf, quads: int, lane0: int, mat):
    """The Pallas call over ``quads`` rows of four elements of ``leaf``: ``(words, *blocks) ->
    outputs``. ``words``: the dynamic scalars as uint32 words, then the block's first row in
    the leaf. A row's elements draw from one Threefry block where
    the leaf starts at lane ``lane0`` 0, else from two (each computes both). ``mat``: the
    blocks' manual axis type inside ``shard_map`` (the outputs vary as they do), or ``None``."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    update, cfg, _, _, dynamic, present, n_arrays, outs, out_dtypes = leaf
    interpret = MODE == "interpret"

    def body(w_ref, *refs):
        k0, k1, first_hi, first_lo, extra = _unpack(leaf, lambda slot: w_ref[slot])
        local = pl.program_id(0).astype(jnp.uint32) * np.uint32(ROWS)
        local = local + lax.broadcasted_iota(jnp.uint32, (ROWS, 1), 0)
        valid = jnp.broadcast_to(local < np.uint32(quads), (ROWS, 4))
        row = local + w_ref[len(dynamic)]  # each row of four: its first element's block
        lane = lax.broadcasted_iota(jnp.uint32, (1, 4), 1)
        inputs = [None] * n_arrays
        for ref, i in zip(refs, present):
            inputs[i] = plgpu.load(ref, mask=valid, other=0)

        def threefry(stream, j):  # the leaf's Threefry block j of the stream: two words
            return _lax._threefry_block(k0, k1, first_lo, first_hi + np.uint32(stream), j)

        def bits(stream):  # _lax._random16 of the elements 4 row + lane (after lane0)
            if lane0 == 0:  # a row is one block
                return jnp.broadcast_to(_lax._lane16(*threefry(stream, row), lane), (ROWS, 4))
            at = lane + np.uint32(lane0)  # a row's elements in blocks row and row + 1
            here = _lax._lane16(*threefry(stream, row), at)
            after = _lax._lane16(*threefry(stream, row + np.uint32(1)), at)
            return jnp.where(at >= 4, after, here)

        with _lax.kernel_ops(None if interpret else _Exact()):
            result = update(cfg, *inputs, bits, *extra)
        for ref, i in zip(refs[len(present) :], outs):
            plgpu.store(ref, result[i].astype(ref.dtype), mask=valid)

    block = pl.BlockSpec((ROWS, 4), lambda i: (i, 0))
    return pl.pallas_call(
        body,
        grid=(pl.cdiv(quads, ROWS),),
        in_specs=[pl.BlockSpec((_width(len(dynamic) + 1),), lambda i: (0,))]
        + [block] * len(present),
        out_specs=[block] * len(outs),
        out_shape=[
            jax.ShapeDtypeStruct(
                (quads, 4), d, **({} if mat is None else {"manual_axis_type": mat})
            )
            for d in out_dtypes
        ],
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=WARPS),
        interpret=interpret,
        name="srround_leaf_update",
    )
