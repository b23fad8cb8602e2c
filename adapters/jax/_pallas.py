"""The native fused step's leaves as Pallas (Triton) kernels on a CUDA GPU.

XLA's GPU backend has no fma, and divides and takes square roots of float32 approximately
(``div.full.f32``, ``sqrt.approx.f32``), so the XLA path (``_lax``, ``optim._fma``) takes
srround's correctly rounded fma, division and square root in float64 and rounds them back:
about half of the fused AdamW step's instructions on a GPU. Here a leaf's update runs as one
Pallas kernel - the same code (``optim._update``, ``optim._sgd_update``), traced inside the
kernel - in which those ops are the GPU's own correctly rounded instructions (``fma.rn.f32``,
``div.rn.f32``, ``sqrt.rn.f32``, inline PTX: what the Numba CUDA kernels run), and a row of four
elements draws one Threefry block. The bits are the XLA path's (``tests/test_jax_pallas.py``:
Pallas' interpreter on the CPU, the compiled kernels on a GPU; ``benchmarks/jax_gpu_check.py``).

Where (``takes``): a whole leaf (not a block inside ``shard_map``) of an elementwise update
(``elementwise``) with a multiple of four elements, in a process whose JAX backend is one GPU:
a Pallas call does not partition, and under ``jit`` over several devices XLA would gather a
sharded leaf into it. Everywhere else, and on GPUs other than NVIDIA's
(``lax.platform_dependent``), the XLA path runs.

``MODE`` (the environment variable ``SRROUND_JAX_PALLAS`` at import, default ``"auto"``; to
change it later set the attribute and call ``jax.clear_caches()``):

* ``"auto"``: as above;
* ``"off"``: the XLA path everywhere (the benchmark times both);
* ``"on"``: the kernels wherever the program is lowered for CUDA, any device count (compiling
  for a compile-only GPU);
* ``"interpret"``: Pallas' interpreter on any platform, with the XLA path's exact ops (tests of
  the kernel's indexing, masks, scalar words and random bits without a GPU).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _lax

MODES = ("auto", "off", "on", "interpret")
MODE = os.environ.get("SRROUND_JAX_PALLAS", "auto")
if MODE not in MODES:
    raise ValueError(f"SRROUND_JAX_PALLAS: expected one of {', '.join(MODES)}, got {MODE!r}")
ROWS = 256  # rows of four elements per program (1024 elements; H200: 85 % of copy, 128: 87 %)
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


def takes(update, arrays, layout, lane0) -> bool:
    """Whether a leaf's update (``arrays``: its buffers, ``None`` where absent; ``layout``:
    ``None`` for a whole leaf; ``lane0``: its first lane) runs as a Pallas kernel where the
    program runs on CUDA."""
    if MODE == "off" or not getattr(update, "srround_elementwise", False):
        return False
    if MODE == "auto" and (jax.default_backend() != "gpu" or jax.device_count() != 1):
        return False
    if not _has_triton():
        return False
    p = arrays[0]
    return (
        layout is None
        and lane0 == 0
        and p.size % 4 == 0
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

    def add(self, a, b):
        return self._ptx("add.rn.f32 $0, $1, $2;", a, b)


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
    xla_call, arrays, k0, k1, t, start_lo, lane0, origin, extra, *, update, cfg, global_shape
):
    """``xla_call``'s leaf update (``_leaves._leaf_call``, same arguments) as a Pallas kernel
    where the program runs on CUDA, ``xla_call`` elsewhere (``MODE``)."""
    args = (arrays, k0, k1, t, start_lo, lane0, origin, extra)
    kw = {"update": update, "cfg": cfg, "global_shape": global_shape}
    present = [i for i, x in enumerate(arrays) if x is not None]
    scalars, tree = jax.tree_util.tree_flatten((k0, k1, start_lo, _lax._u(t) * np.uint32(4), extra))
    dynamic = [i for i, v in enumerate(scalars) if isinstance(v, jax.Array)]
    if any(scalars[i].size != 1 or _word_dtype(scalars[i].dtype) is None for i in dynamic):
        return xla_call(*args, **kw)
    kernel = _kernel(
        update,
        cfg,
        tree,
        tuple(scalars),
        tuple(dynamic),
        tuple(present),
        len(arrays),
        xla_call,
        args,
        kw,
    )

    def on_xla(*_):
        return xla_call(*args, **kw)

    words = [_as_word(scalars[i]) for i in dynamic]
    words = jnp.stack(words + [jnp.uint32(0)] * (_width(len(words)) - len(words)))
    blocks = [arrays[i].reshape(-1, 4) for i in present]
    if MODE == "interpret":
        return kernel(words, *blocks)
    return lax.platform_dependent(words, *blocks, cuda=kernel, default=on_xla)


def _kernel(update, cfg, tree, scalars, dynamic, present, n_arrays, xla_call, args, kw):
    """The Pallas call of one leaf: ``(words, *blocks) -> outputs`` (the leaf update's tuple,
    ``None`` where the update gives ``None``)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    interpret = MODE == "interpret"
    shape = args[0][0].shape
    quads = int(np.prod(shape)) // 4
    out_shapes = jax.eval_shape(lambda *xs: xla_call(xs, *args[1:], **kw), *args[0])
    outs = [i for i, s in enumerate(out_shapes) if s is not None]
    dtypes = [jnp.dtype(scalars[i].dtype) for i in dynamic]

    def body(w_ref, *refs):
        values = list(scalars)
        for slot, (i, dtype) in enumerate(zip(dynamic, dtypes)):
            values[i] = _from_word(w_ref[slot], dtype)
        k0, k1, first_lo, first_hi, extra = jax.tree_util.tree_unflatten(tree, values)
        row = pl.program_id(0).astype(jnp.uint32) * np.uint32(ROWS)
        row = row + lax.broadcasted_iota(jnp.uint32, (ROWS, 1), 0)  # its Threefry block
        valid = jnp.broadcast_to(row < np.uint32(quads), (ROWS, 4))
        lane = lax.broadcasted_iota(jnp.uint32, (1, 4), 1)
        inputs = [None] * n_arrays
        for ref, i in zip(refs, present):
            inputs[i] = plgpu.load(ref, mask=valid, other=0)

        def bits(stream):  # _lax._random16 with lane0 = 0 and index 4 row + lane
            c_lo = first_lo + row
            c_hi = first_hi + np.uint32(stream) + (c_lo < row).astype(jnp.uint32)
            x0, x1 = _lax._threefry2x32(k0, k1, c_lo, c_hi)
            r = (jnp.where((lane & 2) == 0, x0, x1) >> ((lane & 1) << 4)) & 0xFFFF
            return jnp.broadcast_to(r, (ROWS, 4))

        with _lax.kernel_ops(None if interpret else _Exact()):
            result = update(cfg, *inputs, bits, *extra)
        for ref, i in zip(refs[len(present) :], outs):
            plgpu.store(ref, result[i].astype(ref.dtype), mask=valid)

    block = pl.BlockSpec((ROWS, 4), lambda i: (i, 0))
    call = pl.pallas_call(
        body,
        grid=(pl.cdiv(quads, ROWS),),
        in_specs=[pl.BlockSpec((_width(len(dynamic)),), lambda i: (0,))] + [block] * len(present),
        out_specs=[block] * len(outs),
        out_shape=[jax.ShapeDtypeStruct((quads, 4), out_shapes[i].dtype) for i in outs],
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=WARPS),
        interpret=interpret,
        name="srround_leaf_update",
    )

    def run(words, *blocks):
        got = call(words, *blocks)
        result = [None] * len(out_shapes)
        for i, r in zip(outs, got):
            result[i] = r.reshape(shape)
        return tuple(result)

    return run
