"""The callback backend: srround's NumPy path (the Numba kernels) called from a jitted program.

On the CPU the host functions are an XLA FFI custom call (``_ffi.py``) on XLA's own buffers,
and the elementwise calls partition: under ``jit`` each shard runs with its global origin
(``_per_shard``). Elsewhere they are a ``jax.pure_callback`` (operands copied to the host and
back), so this path is only sensible on CPU. Vmapped calls equal the per-example calls.

XLA's CPU runtime runs computations, and the host calls inside them, with
flush-to-zero/denormals-are-zero set (MXCSR 0x8040 on x86-64), which would make the Numba fma
treat subnormal operands as zero. On x86-64 Linux the host work runs on XLA's thread with
those two bits cleared for its duration (``_ieee_floats``: glibc's ``fegetenv``/``fesetenv``,
the caller's environment restored after). Elsewhere it runs on a thread of this module
(``_HOST``), started at import outside any XLA computation: a new thread inherits its
creator's floating-point environment. The hand-over costs two thread switches (about 200 us a
call on the 2-core CI machine), running in place does not. Numba's worker pool is started at
``import srround`` (``srround._threads``), with the default environment.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import ctypes.util
import functools
import math
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

import srround._api as _srround_api
from srround._elements import STEP_SHIFT
from srround._formats import FORMATS

from . import _ffi
from ._lax import _u, _varying_axes, result_dtype


class _X86Env(ctypes.Structure):  # glibc's fenv_t on x86-64: the x87 state, then MXCSR
    _fields_ = [("x87", ctypes.c_uint8 * 28), ("mxcsr", ctypes.c_uint32)]


_FTZ_DAZ = 0x8040  # MXCSR's flush-to-zero and denormals-are-zero bits


def _libm():
    """glibc's libm on x86-64 Linux (its ``fenv_t`` layout is known), else ``None``."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    name = ctypes.util.find_library("m")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


_LIBM = _libm()
_HOST = None
if _LIBM is None:
    _HOST = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="srround-jax-host")
    _HOST.submit(int).result()  # start the thread now, outside any XLA computation


@contextlib.contextmanager
def _ieee_floats():
    """IEEE subnormals on this thread for the block (MXCSR's FTZ/DAZ cleared), then the
    thread's own floating-point environment again."""
    saved = _X86Env()
    _LIBM.fegetenv(ctypes.byref(saved))
    if not saved.mxcsr & _FTZ_DAZ:
        yield
        return
    env = _X86Env.from_buffer_copy(saved)
    env.mxcsr &= ~_FTZ_DAZ
    _LIBM.fesetenv(ctypes.byref(env))
    try:
        yield
    finally:
        _LIBM.fesetenv(ctypes.byref(saved))


def _run_on_host(fn, *arrays, **outs):
    """``fn(*arrays, **outs)`` with IEEE subnormals: in place where ``_ieee_floats`` can set
    them, else on ``_HOST`` (module docstring)."""
    if _HOST is not None:
        return _HOST.submit(fn, *arrays, **outs).result()
    with _ieee_floats():
        return fn(*arrays, **outs)


def _seed_of(k0, k1) -> int:
    """The int of 32-bit words ``(k0, k1)`` (host scalars): a seed from its Threefry key words,
    an offset from ``offset_words``."""
    return int(k0) | (int(k1) << 32)


def offset_words(offset: int) -> tuple:
    """A stream offset as uint32 words ``(low, high)``: operands of the host call, so a new
    offset compiles and registers nothing."""
    return np.uint32(offset & 0xFFFFFFFF), np.uint32(offset >> 32)


def _callback(fn, result_shape, *args, key, aliases=None, into=False):
    """``fn(*host arrays)`` run with IEEE subnormals (``_run_on_host``) from a jitted program:
    on the CPU through srround's FFI target (``_ffi``: callable from a per-shard function too;
    ``key``: what ``fn`` does, see ``_ffi.call``), elsewhere through ``jax.pure_callback``.
    Vmapped calls are sequential. ``aliases`` (``{operand: result}``): ``fn`` updates those
    operands in place and returns them as those results - XLA's buffers on the CPU
    (``_ffi.call``), host copies elsewhere. ``into``: ``fn(*arrays, outs=...)`` writes the
    results into the arrays ``outs`` (XLA's result buffers on the CPU, new arrays elsewhere)
    and returns nothing."""

    def on_host(*arrays, **outs):
        return _run_on_host(fn, *arrays, **outs)

    def ffi(*a):
        return _ffi.call(on_host, result_shape, *a, key=key, aliases=aliases, into=into)

    def on_host_copies(*arrays):  # pure_callback's: read-only, and JAX arrays in recent JAX
        arrays = [
            (np.array if i in (aliases or {}) else np.asarray)(a) for i, a in enumerate(arrays)
        ]
        if not into:
            return on_host(*arrays)
        shapes = result_shape if isinstance(result_shape, tuple) else (result_shape,)
        outs = tuple(np.empty(s.shape, s.dtype) for s in shapes)
        on_host(*arrays, outs=outs)
        return outs if isinstance(result_shape, tuple) else outs[0]

    def pure(*a):
        return jax.pure_callback(on_host_copies, result_shape, *a, vmap_method="sequential")

    return lax.platform_dependent(*args, cpu=ffi, default=pure)


def varying_as(results, like):
    """``results`` typed as varying over the mesh axes the matching leaves of ``like`` vary
    over inside ``shard_map`` (same values, other type): a host call's results carry no such
    type, and ``lax.platform_dependent`` between a host call and ``jax.lax`` ops needs both
    branches typed alike."""

    def typed(r, model):
        missing = tuple(sorted(_varying_axes(model) - _varying_axes(r)))
        return lax.pcast(r, missing, to="varying") if missing else r

    return jax.tree.map(typed, results, like)


def _shard_index(entry, mesh):
    """This device's block index along a dimension partitioned over mesh axes ``entry``
    (``None``, a name or a tuple of names, major first)."""
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    index = jnp.uint32(0)
    for name in names:
        index = index * jnp.uint32(mesh.shape[name]) + _u(lax.axis_index(name))
    return index


def _per_shard(body, leaf_of, *args, result_leaves=(0,), platform="cpu", default=None):
    """``body(*args, origins)`` run on each shard under ``jit``: on a mesh with explicit axes
    through ``shard_map`` (each leaf's spec from its type); else by XLA's partitioner on the
    CPU (``custom_partitioning`` around the FFI call), and on the whole arrays elsewhere.

    ``leaf_of[i]``: the leaf of operand ``i`` (a leaf's operands take the sharding of its first
    one), or ``None`` for a replicated scalar. ``result_leaves``: the leaf of each result (one
    result: an array, else a tuple). ``origins``: per leaf, the shard's first element in the
    global array (uint32 scalars, one per dimension), or ``None`` for the whole arrays.
    ``platform``: where XLA's partitioner runs ``body`` per shard; elsewhere ``default(*args)``
    (``None``: ``body`` on the whole arrays)."""
    leaves = sorted({j for j in leaf_of if j is not None})
    first = {j: leaf_of.index(j) for j in leaves}
    if all(args[first[j]].ndim == 0 for j in leaves):
        return body(*args, None)
    single = len(result_leaves) == 1

    def origins_of(a, specs, mesh):
        origins = {}
        for j in leaves:
            local = a[first[j]].shape  # uneven splits: padded to one shape on all devices
            spec = tuple(specs[j]) + (None,) * (len(local) - len(specs[j]))
            origins[j] = [_shard_index(e, mesh) * jnp.uint32(n) for e, n in zip(spec, local)]
        return origins

    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.are_all_axes_explicit:  # shardings in the types: shard_map
        specs = {j: jax.typeof(args[first[j]]).sharding.spec for j in leaves}
        in_specs = tuple(PartitionSpec() if j is None else specs[j] for j in leaf_of)
        out_specs = tuple(specs[j] for j in result_leaves)
        operands = [
            a if j is None else jax.sharding.reshard(a, specs[j]) for a, j in zip(args, leaf_of)
        ]
        return jax.shard_map(
            lambda *a: body(*a, origins_of(a, specs, mesh)),
            mesh=mesh,
            in_specs=in_specs,
            out_specs=out_specs[0] if single else out_specs,
        )(*operands)

    @custom_partitioning
    def whole(*a):
        return body(*a, None)

    def results(shardings):
        out = tuple(shardings[first[j]] for j in result_leaves)
        return out[0] if single else out

    def infer(mesh, arg_shapes, result_shape):
        return results([a.sharding for a in arg_shapes])

    def partition(mesh, arg_shapes, result_shape):
        replicated = NamedSharding(mesh, PartitionSpec())
        operands = [replicated if j is None else arg_shapes[first[j]].sharding for j in leaf_of]

        specs = {j: operands[first[j]].spec for j in leaves}

        def shard(*a):
            return body(*a, origins_of(a, specs, mesh))

        return mesh, shard, results(operands), tuple(operands)

    def factors(j):
        return "" if j is None else " ".join(f"l{j}d{i}" for i in range(args[first[j]].ndim))

    rule = ", ".join(factors(j) for j in leaf_of)
    rule += " -> " + ", ".join(factors(j) for j in result_leaves)
    whole.def_partition(infer_sharding_from_operands=infer, partition=partition, sharding_rule=rule)

    # vmapped: one call per example (custom_partitioning has no batching rule)
    @jax.custom_batching.sequential_vmap
    def call(*a):
        other = default or (lambda *b: body(*b, None))
        return lax.platform_dependent(*a, **{platform: whole}, default=other)

    return call(*args)


def _runs(local_shape, origin, global_shape):
    """Contiguous runs of a block (``origin`` in an array of ``global_shape``) as
    ``(local flat start, length, global flat start)``: one run for a whole array; a block
    split in some dimension has a run per index of the dimensions before the last split one."""
    local_shape = tuple(int(n) for n in local_shape)
    if origin is None:
        return [(0, math.prod(local_shape), 0)]
    origin = [int(o) for o in np.asarray(origin).reshape(-1)]
    ndim = len(local_shape)
    k = ndim  # dims k.. are whole (so contiguous in the global array too)
    while k > 0 and local_shape[k - 1] == global_shape[k - 1]:
        k -= 1
    if k == 0:
        return [(0, math.prod(local_shape), 0)]
    k -= 1  # the last split dimension: its run is local_shape[k:] long
    strides = [math.prod(global_shape[d + 1 :]) for d in range(ndim)]
    length = math.prod(local_shape[k:])
    runs = []
    for r, lead in enumerate(np.ndindex(*local_shape[:k])):
        start = sum((origin[d] + i) * strides[d] for d, i in enumerate(lead))
        runs.append((r * length, length, start + origin[k] * strides[k]))
    return runs


def _origin_arg(origin, ndim: int):
    if origin is None:
        return jnp.zeros((max(ndim, 1),), jnp.uint32)
    return jnp.stack([_u(o) for o in origin]) if origin else jnp.zeros((1,), jnp.uint32)


def _host(name: str):
    """srround's own API function ``name`` (the NumPy path, run on host arrays)."""
    return getattr(_srround_api, name)


# The functional calls are jitted with their settings static (key words, offset words and
# alpha are operands): an eager call at a new seed or offset reuses the compiled program (the
# per-shard wrappers, made anew each call, would compile one every call).


@functools.partial(jax.jit, static_argnames=("fmt_name", "overflow", "global_shape"))
def stochastic_round(x, k0, k1, offset, origin, *, fmt_name: str, overflow: str, global_shape):
    """``srround.stochastic_round`` of float32 ``x`` on the host, run by run at the global
    offsets of a block (``origin`` traced inside ``shard_map``; under ``jit``, each shard's),
    from stream position ``offset`` (``offset_words``)."""
    fmt = FORMATS[fmt_name]

    def host(xh, h0, h1, o0, o1, oh, *, outs):
        flat, y = xh.reshape(-1), outs[0].reshape(-1).view(fmt.numpy_dtype)  # views
        for lo, n, start in _runs(xh.shape, oh, global_shape):
            _host("stochastic_round")(
                flat[lo : lo + n],
                dtype=fmt_name,
                seed=_seed_of(h0, h1),
                offset=_seed_of(o0, o1) + start,
                overflow=overflow,
                out=y[lo : lo + n],
            )

    def body(x, k0, k1, o0, o1, origins):
        shape = jax.ShapeDtypeStruct(x.shape, result_dtype(fmt))
        origin_arg = _origin_arg(None if origins is None else origins[0], x.ndim)
        key = ("stochastic_round", fmt_name, overflow, global_shape)
        return _callback(host, shape, x, k0, k1, o0, o1, origin_arg, key=key, into=True)

    scalars = (_u(k0), _u(k1), *map(_u, offset))
    if origin is not None:
        return body(x, *scalars, {0: origin})
    return _per_shard(body, (0, None, None, None, None), x, *scalars)


@functools.partial(jax.jit, static_argnames=("fmt_name", "overflow"))
def round_nearest(x, *, fmt_name: str, overflow: str):
    """``srround.round_nearest`` of float32 ``x`` on the host (per shard under ``jit``)."""
    fmt = FORMATS[fmt_name]

    def host(xh, *, outs):
        out = outs[0].view(fmt.numpy_dtype)
        _host("round_nearest")(xh, dtype=fmt.name, overflow=overflow, out=out)

    def body(x, origins):
        shape = jax.ShapeDtypeStruct(x.shape, result_dtype(fmt))
        key = ("round_nearest", fmt_name, overflow)
        return _callback(host, shape, x, key=key, into=True)

    return _per_shard(body, (0,), x)


@functools.partial(jax.jit, static_argnames=("fmt_name",))
def to_float32(y, *, fmt_name: str):
    """``srround.to_float32`` of narrow ``y`` (format ``fmt_name``) on the host (per shard under
    ``jit``)."""

    def host(yh, *, outs):
        _host("to_float32")(yh, dtype=fmt_name, out=outs[0])

    def body(y, origins):
        shape = jax.ShapeDtypeStruct(y.shape, jnp.float32)
        return _callback(host, shape, y, key=("to_float32", fmt_name), into=True)

    return _per_shard(body, (0,), y)


@functools.partial(jax.jit, static_argnames=("fmt_name", "overflow", "global_shape"))
def stochastic_add(
    w, u, alpha, k0, k1, offset, origin, *, fmt_name: str, overflow: str, global_shape
):
    """``srround.stochastic_add`` of one array on the host: ``stochastic_add_leaves`` of one
    leaf at stream position ``offset`` (``offset_words``; ``origin`` traced inside
    ``shard_map``; under ``jit``, each shard's)."""
    (out,) = stochastic_add_leaves(
        [w],
        [u],
        alpha,
        [FORMATS[fmt_name]],
        k0,
        k1,
        [0],
        overflow,
        [origin],
        [global_shape],
        base=offset,
    )
    return out


def stochastic_add_leaves(
    ws,
    us,
    alpha,
    fmts,
    k0,
    k1,
    offsets,
    overflow: str,
    origins,
    global_shapes,
    step=None,
    base=(0, 0),
    joined=None,
):
    """``srround.stochastic_add`` of every leaf ``w`` with its ``u`` (same shapes, float32) in
    one host call, in place in the results' buffers (``_callback``'s ``aliases``); returns the
    new leaves. Leaf ``k`` is added run by run at its block's global offsets from
    ``base + offsets[k]`` (``base``: ``offset_words``, possibly traced; ``origins[k]``: traced
    inside ``shard_map``; ``None``: each shard's under ``jit``, or the whole leaf). ``step``: a
    traced step count ``t`` whose stream, ``t * 2**STEP_SHIFT`` further on, is used
    (``apply_updates``), or ``None``. ``joined``: per leaf ``None``, or the runs ``(flat
    start, length, stream position)`` of a whole leaf that joins several (``apply_updates``
    on one CPU device)."""
    n = len(ws)
    names = [fmt.name for fmt in fmts]
    shapes = [tuple(w.shape) if g is None else tuple(g) for w, g in zip(ws, global_shapes)]
    joined = [None] * n if joined is None else list(joined)

    def host(ah, h0, h1, th, b0, b1, *arrays):
        seed, first = _seed_of(h0, h1), (int(th) << STEP_SHIFT) + _seed_of(b0, b1)
        targets, updates, where = arrays[:n], arrays[n : 2 * n], arrays[2 * n :]
        add = _host("stochastic_add") if np.isfinite(ah) else _add_non_finite
        leaves = zip(targets, updates, where, shapes, names, offsets, joined)
        for w, uh, o, shape, name, offset, runs in leaves:
            flat_w, flat_u = w.reshape(-1), uh.reshape(-1)  # views: w is updated in place
            for lo, size, start in _runs(w.shape, o, shape) if runs is None else runs:
                add(
                    flat_w[lo : lo + size],
                    flat_u[lo : lo + size],
                    alpha=np.float32(ah),
                    seed=seed,
                    offset=first + offset + start,
                    dtype=name,
                    overflow=overflow,
                )
        return targets[0] if n == 1 else tuple(targets)

    scalars = (
        jnp.asarray(alpha, jnp.float32),
        _u(k0),
        _u(k1),
        jnp.asarray(0 if step is None else step, jnp.int32),
        *map(_u, base),
    )

    def body(*operands_and_origins):
        *operands, blocks = operands_and_origins
        local = operands[len(scalars) : len(scalars) + n]
        result = tuple(jax.ShapeDtypeStruct(w.shape, w.dtype) for w in local)
        where = [
            _origin_arg(None if blocks is None else blocks.get(k), w.ndim)
            for k, w in enumerate(local)
        ]
        key = ("stochastic_add", tuple(names), tuple(offsets), overflow, tuple(shapes))
        key += (tuple(joined),)
        aliases = {len(scalars) + k: k for k in range(n)}
        return _callback(
            host, result[0] if n == 1 else result, *operands, *where, key=key, aliases=aliases
        )

    blocks = {k: o for k, o in enumerate(origins) if o is not None}
    if blocks:  # inside shard_map: each block's origin
        out = body(*scalars, *ws, *us, blocks)
    else:
        leaf_of = (None,) * len(scalars) + (*range(n), *range(n))
        out = _per_shard(body, leaf_of, *scalars, *ws, *us, result_leaves=tuple(range(n)))
    return [out] if n == 1 else list(out)


def _add_non_finite(w, u, *, alpha, seed, offset, dtype, overflow):
    """``srround.stochastic_add`` for a traced ``alpha`` that is inf or NaN (which it refuses),
    as the native path computes it: every sum ``alpha * u + w`` is exact (+-inf, or a NaN as
    +qNaN), then stochastically rounded in place."""
    with np.errstate(invalid="ignore"):
        total = alpha * u + _host("to_float32")(w, dtype=dtype)
    total[np.isnan(total)] = np.float32(np.nan)
    _host("stochastic_round")(
        total, dtype=dtype, seed=seed, offset=offset, overflow=overflow, out=w
    )


_LANE_PIECE = 1 << 16  # positions per parallel piece of ``random_lanes``


def random_lanes(k0, k1, high, ranges, after, streams=(0,)):
    """The 16 random bits (uint16, a row per stream) of the stream positions in ``ranges``
    (``(start, size)`` pairs, static ints; one after another): row ``i`` at counter high word
    ``high + streams[i]`` (``high`` a traced uint32: position ``p``'s block is that word
    ``* 2**32 + (p >> 2)``, lane ``p & 3``). Filled on the host by the Numba kernel
    ``srround._cpu.random_lanes`` through the FFI target (CPU only): one Threefry block per
    four positions, in parallel. ``after``: an operand the call only waits for (the order of
    XLA's work)."""
    from srround import _cpu

    pieces, count = [], 0
    for start, size in ranges:
        for i in range(0, size, _LANE_PIECE):
            pieces.append((start + i, count + i, min(_LANE_PIECE, size - i)))
        count += size
    total = count + (count & 1)  # the kernel writes whole 32-bit words where it can
    positions, targets, lengths = (np.array(c, np.int64) for c in zip(*pieces))
    rows = np.arange(len(streams), dtype=np.int64)[:, None]
    targets, lengths = (targets + rows * total).reshape(-1), np.tile(lengths, len(streams))
    offsets = np.array(streams, np.int64)[:, None]

    def fill(h0, h1, hh, _after, *, outs):
        at = (positions + ((int(hh) + offsets) << 34)).reshape(-1)  # four positions per block
        lanes = outs[0].reshape(-1)
        _cpu.run(_cpu.random_lanes, lanes.size, lanes, int(h0), int(h1), at, targets, lengths)

    result = jax.ShapeDtypeStruct((len(streams), total), jnp.uint16)
    key = ("random_lanes", tuple(pieces), tuple(streams))
    lanes = _ffi.call(fill, result, _u(k0), _u(k1), _u(high), after, key=key, into=True)
    return lanes[:, :count]


@functools.partial(jax.jit, static_argnames=("format", "rounding", "axis", "scale"))
def quantize_blocks(x, k0, k1, offset, *, format: str, rounding: str, axis: int, scale: str):
    """``srround.quantize_blocks`` of float32 ``x`` on the host along ``axis`` (non-negative),
    from stream position ``offset`` (``offset_words``): ``(data, scales, tensor_scale)`` JAX
    arrays (``tensor_scale`` float32[1], 1.0 unread for MX)."""
    from srround import _blocks

    bf = _blocks.get_block_format(format)
    shape = tuple(x.shape)
    _blocks._layout(shape, axis, bf.block)  # errors at trace time, naming x and axis
    data_shape = _blocks._shape_with(shape, axis, shape[axis] // 2) if bf.packed else shape
    scale_shape = _blocks._shape_with(shape, axis, shape[axis] // bf.block)
    data_dtype = jnp.uint8 if bf.packed else result_dtype(bf.element)
    scale_dtype = jnp.float8_e4m3fn if bf.two_level else jnp.float8_e8m0fnu

    def host(xh, h0, h1, o0, o1):
        q = _blocks.quantize_blocks(
            np.asarray(xh, order="C"),
            bf.name,
            rounding=rounding,
            seed=_seed_of(h0, h1),
            offset=_seed_of(o0, o1),
            axis=axis,
            scale=scale,
        )
        ts = q.tensor_scale if q.tensor_scale is not None else np.ones(1, np.float32)
        return (
            np.asarray(q.data).view(data_dtype),
            np.asarray(q.scales).view(scale_dtype),
            np.asarray(ts, np.float32),
        )

    result = (
        jax.ShapeDtypeStruct(data_shape, data_dtype),
        jax.ShapeDtypeStruct(scale_shape, scale_dtype),
        jax.ShapeDtypeStruct((1,), jnp.float32),
    )
    key = ("quantize_blocks", bf.name, rounding, axis, scale)
    return _callback(host, result, x, _u(k0), _u(k1), *map(_u, offset), key=key)


@jax.jit
def dequantize_blocks(q):
    """``srround.dequantize_blocks`` of a ``QuantizedBlocks`` of JAX arrays, on the host."""
    from srround import _blocks

    bf = _blocks.get_block_format(q.format)
    shape = tuple(q.data.shape)
    if bf.packed:
        shape = _blocks._shape_with(shape, q.axis, shape[q.axis] * 2)
    tensor = q.tensor_scale if q.tensor_scale is not None else jnp.ones(1, jnp.float32)

    def host(data, scales, ts):
        host_q = _blocks.QuantizedBlocks(
            np.asarray(data),
            np.asarray(scales),
            np.asarray(ts) if bf.two_level else None,
            q.format,
            q.axis,
        )
        return _blocks.dequantize_blocks(host_q)

    shape = jax.ShapeDtypeStruct(shape, jnp.float32)
    key = ("dequantize_blocks", q.format, q.axis)
    return _callback(host, shape, q.data, q.scales, tensor, key=key)
