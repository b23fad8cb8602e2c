"""The functional API on JAX arrays: ``srround.stochastic_round(jax_array)`` etc. delegate here.

JAX arrays are immutable and may live on an accelerator, so this adapter hands no views to
the kernels (``MUTABLE = False``, ``srround._dispatch``): it implements ``stochastic_round``,
``round_nearest``, ``to_float32`` and ``stochastic_add`` itself, inside ``jit`` and ``vmap``,
and returns new arrays (``jnp.bfloat16`` / ``jnp.float16`` / ``jnp.float32``), bit for bit those
of srround's NumPy path for the same input bits, seed and offset, under either implementation
(``impl=``):

* ``"native"`` (default, ``None``): the ``jax.lax`` backend (``_lax.py``), any backend, fuses
  with the surrounding ops.
* ``"callback"``: the Numba kernels on the host (``_callback.py``: an XLA FFI call on the
  CPU, per shard under ``jit``; ``jax.pure_callback`` elsewhere); CPU only in practice.

Seeds (``seed=``):

* ``None``: a seed drawn from srround's library generator (``srround.manual_seed``) when the
  function runs in Python. Under ``jax.jit`` that is at *trace* time: the seed is baked into the
  compiled function and every call of it reuses the same random bits. Pass a key under ``jit``.
* an ``int`` in [0, 2**64): key words ``(seed & 0xFFFFFFFF, seed >> 32)``.
* a JAX PRNG key, new style (``jax.random.key(...)``, threefry implementation) or legacy
  (``jax.random.PRNGKey(...)``: a ``uint32[2]`` array): its key data words ``(w0, w1)`` are the
  Threefry key, so it equals the int seed ``w0 | (w1 << 32)``. Keys may be traced. Note
  ``jax.random.key(s)`` for a small int ``s`` has data ``(0, s)``: the int seed ``s << 32``.

``offset`` is a Python int, as in the NumPy path (calls at new offsets reuse the compiled
program when ``offset % 4`` is the same); ``alpha`` may be a Python float or a (traced) scalar.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from srround import _validate
from srround._formats import (
    FORMATS,
    Format,
    check_float32_dtype,
    check_fp4_top,
    get_format,
    saturate_flag,
)
from srround._rng import check_offset, check_seed, next_seed, split_seed

from . import _callback, _lax, _leaves, _pallas
from ._lax import _JNP_DTYPES, _U32, _u

MUTABLE = False  # the adapter protocol of srround._dispatch: the functional API is here
IMPLS = ("native", "callback")


# -- argument handling ------------------------------------------------------------------------


def _impl(impl, x) -> str:
    if impl is None:
        return "native"
    if impl not in IMPLS:
        options = ", ".join(map(repr, IMPLS))
        raise ValueError(f"impl: expected one of {options} or None, got {impl!r}")
    return impl


def _no_out(out) -> None:
    if out is not None:
        raise TypeError(
            "out: JAX arrays are immutable, so out= is not supported; use the returned array"
        )


def _deleted(name: str) -> ValueError:
    return ValueError(
        f"{name}: the array was deleted (its buffer was donated to an earlier jit call, e.g."
        " donate_argnums): use the array that call returned"
    )


_FLOAT64_REFUSED = (
    "float64 is rejected rather than rounded through float32, which would round twice - cast"
    " with .astype(jnp.float32) if that is what you want"
)


def refuse_host_float64(x, name: str, expected: str = "a float32 array") -> None:
    """``TypeError`` for a float64 NumPy array or scalar, which ``jnp.asarray`` would round to
    float32 without ``jax_enable_x64`` (the result rounded twice, silently)."""
    if not isinstance(x, jax.Array) and getattr(x, "dtype", None) == np.float64:
        raise TypeError(f"{name}: expected {expected}, got float64; {_FLOAT64_REFUSED}")


def _as_jax(x, name: str):
    if isinstance(x, jax.Array):  # includes tracers
        if not isinstance(x, jax.core.Tracer) and x.is_deleted():
            raise _deleted(name)
        return x
    refuse_host_float64(x, name)
    try:
        return jnp.asarray(x)
    except TypeError:
        raise TypeError(f"{name}: expected a JAX array, got {type(x).__name__}") from None


def _placement(x):
    """A committed array's mesh (``None`` for another sharding) and ordered device ids."""
    sharding = x.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        return sharding.mesh, tuple(sharding.mesh.device_ids.flat)
    return None, tuple(sorted(d.id for d in sharding.device_set))


def _described(mesh, ids) -> str:
    ids = [int(i) for i in ids]
    return f"devices {ids}" if mesh is None else f"mesh {dict(mesh.shape)} of devices {ids}"


def check_arrays(*named) -> None:
    """Clear errors, before anything is computed, for the concrete arrays of one call:
    ``named`` holds ``(name, array)`` or ``(name, [leaves])`` pairs. A deleted (donated) array is
    a ``ValueError``; so are committed arrays on other devices (or the same devices in another
    order), which ``jit`` would refuse naming srround's internal functions, and arrays on two
    meshes, even of the same devices under other axis names (the per-shard host calls,
    ``custom_partitioning``, take one mesh per program)."""
    first = first_mesh = None  # (mesh, ids, name) of the first committed array / on a mesh
    for name, leaves in named:
        single = not isinstance(leaves, (list, tuple))
        for k, x in enumerate([leaves] if single else leaves):
            if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
                continue
            where = name if single else f"{name}[{k}]"
            if x.is_deleted():
                raise _deleted(where)
            if not x.committed:  # jit moves it to the others' devices
                continue
            mesh, ids = _placement(x)
            first = first or (mesh, ids, where)
            if mesh is not None:
                first_mesh = first_mesh or (mesh, ids, where)
            other = None
            if ids != first[1]:
                other = first
            elif mesh is not None and mesh != first_mesh[0]:
                other = first_mesh
            if other is not None:
                raise ValueError(
                    f"{where}: on {_described(mesh, ids)}, but {other[2]} is on"
                    f" {_described(*other[:2])}: put every array of the call on one mesh"
                    " (jax.device_put with a NamedSharding)"
                )


def _check_float32(x, name: str):
    x = _as_jax(x, name)
    if x.dtype != jnp.float32:
        extra = f"; {_FLOAT64_REFUSED}" if x.dtype == jnp.float64 else ""
        raise TypeError(f"{name}: expected a float32 array, got {x.dtype}{extra}")
    return x


def _narrow(y, name: str, fmt: Format | None):
    """``(array, format)`` of a bf16/fp16/fp8 array (or uint16 / uint8 patterns with ``dtype=``
    given); a ``float4_e2m1fn`` array comes back as its uint8 codes (no float4 gradient)."""
    if not isinstance(y, jax.Array) and getattr(y, "dtype", None) == np.float64:
        raise _not_narrow(name, "float64")  # before jnp.asarray, which would make it float32
    y = _as_jax(y, name)
    if y.dtype == jnp.float4_e2m1fn:
        fp4 = FORMATS["float4_e2m1fn"]
        if fmt is not None and fmt is not fp4:
            raise TypeError(f"{name}: dtype {y.dtype} does not match dtype={fmt.name!r}")
        return _fp4_codes(y), fp4
    for candidate_name, dtype in _JNP_DTYPES.items():
        if y.dtype == dtype:
            candidate = FORMATS[candidate_name]
            if fmt is not None and fmt is not candidate:
                raise TypeError(f"{name}: dtype {y.dtype} does not match dtype={fmt.name!r}")
            return y, candidate
    if fmt is not None and y.dtype == jnp.dtype(fmt.bits_dtype):
        if fmt.bits == 4 and y.size and not isinstance(y, jax.core.Tracer):
            check_fp4_top(int(jnp.max(y)), name)  # traced: the callback raises at run time,
            # jax.lax reads the byte as NaN (_lax._decode)
        return y, fmt
    raise _not_narrow(name, y.dtype)


def _not_narrow(name: str, dtype) -> TypeError:
    return TypeError(
        f"{name}: expected a narrow float array (bfloat16, float16, float8_e4m3fn, float8_e5m2,"
        f" float4_e2m1fn, or uint16 / uint8 bit patterns with dtype= given), got {dtype}"
    )


def _fp4_codes(y):
    """The uint8 codes of a ``float4_e2m1fn`` array (a 4-bit type: bitcast to uint4 first)."""
    return lax.bitcast_convert_type(y, jnp.uint4).astype(jnp.uint8)


def _fp4_array(codes):
    """The ``float4_e2m1fn`` array of uint8 codes (below 16)."""
    return lax.bitcast_convert_type(codes.astype(jnp.uint4), jnp.float4_e2m1fn)


def _key_words(seed):
    """Threefry key ``(k0, k1)``: Python ints (static) or uint32 scalars (possibly traced)."""
    if seed is None:
        return split_seed(next_seed())
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, (bool, np.bool_)):
        return split_seed(check_seed(seed, "seed"))
    if isinstance(seed, (jax.Array, np.ndarray)):
        if jnp.issubdtype(seed.dtype, jax.dtypes.prng_key):
            impl = str(jax.random.key_impl(seed))
            if seed.shape != () or "threefry" not in impl:
                raise TypeError(
                    f"seed: expected a single threefry PRNG key, got shape {seed.shape} of {impl}"
                )
            data = jax.random.key_data(seed)
        else:
            data = seed
        if data.shape == (2,) and data.dtype == jnp.uint32:
            if isinstance(data, np.ndarray) or (
                not isinstance(data, jax.core.Tracer)
                and all(d.platform == "cpu" for d in data.devices())
            ):  # on the host: two NumPy words, as an int seed's (two eager slices cost more
                # than the call they feed); elsewhere no copy to the host (it would wait)
                words = np.asarray(data)
                return np.uint32(words[0]), np.uint32(words[1])
            return data[0], data[1]
        raise TypeError(
            f"seed: expected a PRNG key (jax.random.key / PRNGKey: uint32[2]), got"
            f" {data.dtype}{list(data.shape)}"
        )
    raise TypeError(
        f"seed: expected None, an int in [0, 2**64) or a JAX PRNG key, got {type(seed).__name__}"
    )


# -- gradients ------------------------------------------------------------------------------


def _straight_through(fn, diff, rest=(), tangent=lambda diff, d: d[0]):
    """``fn(*diff, *rest)`` with the straight-through gradient: the derivative of a rounding
    is taken as 1 (``E[SR(x)] = x``, so for stochastic rounding it is exactly the derivative
    of the expected value), the tangent ``tangent(diff, d)`` of the unrounded value (default:
    that of ``diff[0]``) cast to the result's dtype. ``fn``'s bit operations would otherwise
    give a gradient of 0, silently. ``rest`` (a pytree: key words, block origin, step) is not
    differentiated; it is passed, never closed over, as it may hold tracers of an inner trace
    (``lax.scan``, ``jax.checkpoint``), which a closure would leak. Concrete inputs (an eager
    call, not differentiated) skip the ``custom_jvp``, whose eager dispatch cost ~0.2 ms."""
    if not any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(diff)):
        return fn(*diff, *rest)

    @jax.custom_jvp
    def rounded(diff, rest):
        y = fn(*diff, *rest)
        if not jax.sharding.get_abstract_mesh().manual_axes:
            return y
        # inside shard_map: typed as varying over the mesh axes of the unrounded value, as
        # its tangent is (a host call's result is not typed so)
        return _callback.varying_as(y, tangent(diff, diff))

    @rounded.defjvp
    def rounded_jvp(primals, tangents):
        y = rounded(*primals)
        t = jax.tree_util.tree_map(
            lambda t, y: t.astype(y.dtype), tangent(primals[0], tangents[0]), y
        )
        return y, _callback.varying_as(t, y)

    return rounded(tuple(diff), tuple(rest))


def _sum_tangent(diff, d):
    """The tangent of ``w + alpha * u`` (``diff = (w, u, alpha)``): ``dw + alpha du + u
    dalpha``."""
    _, u, alpha = diff
    dw, du, dalpha = d
    return dw.astype(jnp.float32) + alpha * du + u * dalpha


# -- the functional API ----------------------------------------------------------------------


def _layout(x, shard_spec, name: str):
    """``(origin, global_shape)`` of ``x``'s elements: the whole array, or this device's block
    inside ``shard_map`` when ``shard_spec`` (its partition spec) is given; an ``x`` split over
    mesh axes ``shard_spec`` does not name is a ``ValueError`` (``_lax._check_split``)."""
    _lax._check_split(x, shard_spec, name, "shard_spec")
    if shard_spec is None:
        origin, global_shape = None, tuple(x.shape)
    else:
        origin, global_shape = _lax._shard_layout(x.shape, shard_spec, name)
    _lax._check_count(int(np.prod(global_shape, dtype=np.int64)), name)
    return origin, global_shape


def _native_stream(native, arrays, stream, fmt: Format, saturate: bool):
    """``native(*arrays, ...)``, a stochastic ``_lax._native_*`` function, at the stream
    position ``stream = (k0, k1, offset, origin, global_shape)``: key words, offset in the
    stream, and the block's origin and global shape (``_layout``)."""
    k0, k1, offset, origin, global_shape = stream
    return native(
        *arrays,
        _u(k0),
        _u(k1),
        *_lax._first_block(offset),
        origin,
        lane0=offset & 3,
        fmt_name=fmt.name,
        saturate=saturate,
        global_shape=global_shape,
    )


@_pallas.elementwise
def _rounding_update(cfg, x, bits):
    """``stochastic_round``'s elements as a leaf update (``_leaves._leaf_call``, the Pallas
    kernels): ``cfg = (format name, saturate)``; stream 0's bits."""
    fmt_name, saturate = cfg
    fmt = FORMATS[fmt_name]
    return (
        _lax._to_narrow(_lax._encode(_lax._bits(x, _U32), fmt, saturate, bits(0)), fmt, x.shape),
    )


@_pallas.elementwise
def _adding_update(cfg, w, u, bits, alpha):
    """``stochastic_add``'s elements as a leaf update (``_rounding_update``'s ``cfg``;
    ``_lax.stochastic_sum`` with stream 0's bits)."""
    fmt_name, saturate = cfg
    return (_lax.stochastic_sum(w, u, alpha, FORMATS[fmt_name], saturate, bits(0)),)


def _in_kernels(update, arrays, extra, stream, fmt: Format, saturate: bool):
    """The native path of ``stochastic_round`` / ``stochastic_add`` (``update``: the leaf
    update above, of ``arrays`` and the scalars ``extra``) as Pallas kernels where ``_pallas``
    takes it (a GPU, bf16 or fp16, a multiple of four elements; the same bits at the stream
    position ``stream``, ``_native_stream``'s), else ``None``."""
    k0, k1, offset, origin, global_shape = stream
    if fmt.name not in ("bfloat16", "float16") or not _pallas.takes(update, arrays):
        return None
    first_lo, first_hi = _lax._first_block(offset)
    (y,) = _pallas.leaf_call(
        _leaves._leaf_call,
        arrays,
        _u(k0),
        _u(k1),
        first_hi,
        first_lo,
        offset & 3,
        origin,
        extra,
        update=update,
        cfg=(fmt.name, saturate),
        global_shape=None if origin is None else global_shape,
    )
    return y


def stochastic_round(
    x,
    *,
    dtype="bfloat16",
    seed=None,
    offset=0,
    overflow="inf",
    impl=None,
    out=None,
    shard_spec=None,
):
    """Stochastically round a float32 JAX array to bf16/fp16 (see ``srround.stochastic_round``).

    Args:
        x: float32 array (any shape; a tracer under ``jit``/``vmap``).
        dtype: ``"bfloat16"`` (default) or ``"float16"``.
        seed: ``None``, an int in [0, 2**64) or a JAX PRNG key (module docstring).
        offset: Python int, position of ``x``'s first element in the random stream.
        overflow: ``"inf"`` or ``"saturate"``.
        impl: ``"native"``, ``"callback"`` or ``None`` (default: ``"native"``).
        shard_spec: inside ``shard_map`` only: the ``PartitionSpec`` of ``x`` in ``in_specs``;
            the block then rounds with the noise of its elements' global indices, so the
            result equals the unsharded call. Not needed under ``jit`` with sharded arrays
            (the native path partitions by itself). An ``x`` that varies over a mesh axis
            ``shard_spec`` does not split it over is a ``ValueError``.

    Returns:
        a new ``jnp.bfloat16`` / ``jnp.float16`` array of ``x``'s shape (and sharding). Under
        ``jax.grad`` its derivative is 1 (straight-through, ``_straight_through``).

    Example::

        y = stochastic_round(x, seed=jax.random.fold_in(key, step))
    """
    _no_out(out)
    fmt = get_format(dtype)
    saturate = saturate_flag(overflow)
    offset = check_offset(offset)
    x = _check_float32(x, "x")
    check_arrays(("x", x), ("seed", seed))
    impl = _impl(impl, x)
    k0, k1 = _key_words(seed)
    origin, global_shape = _layout(x, shard_spec, "x")

    def rounded(x, k0, k1, origin):
        if impl == "native":
            if x.size == 0:
                return jnp.zeros(x.shape, _lax.result_dtype(fmt))
            stream = (k0, k1, offset, origin, global_shape)
            y = _in_kernels(_rounding_update, (x,), (), stream, fmt, saturate)
            if y is not None:
                return y
            return _native_stream(_lax._native_stochastic_round, (x,), stream, fmt, saturate)

        return _callback.stochastic_round(
            x,
            k0,
            k1,
            _callback.offset_words(offset),
            origin,
            fmt_name=fmt.name,
            overflow=overflow,
            global_shape=global_shape,
        )

    rest = (_u(k0), _u(k1), origin)
    if not jnp.issubdtype(_lax.result_dtype(fmt), jnp.floating):  # packed fp4: no gradient
        return rounded(x, *rest)
    return _straight_through(rounded, (x,), rest)


def round_nearest(x, *, dtype="bfloat16", overflow="inf", impl=None, out=None):
    """Round a float32 JAX array to the nearest bf16/fp16 value, ties to even (see
    ``srround.round_nearest``; every NaN becomes the format's quiet NaN with its sign)."""
    _no_out(out)
    fmt = get_format(dtype)
    saturate = saturate_flag(overflow)
    x = _check_float32(x, "x")
    impl = _impl(impl, x)

    def rounded(x):
        if impl == "native":
            if x.size == 0:
                return jnp.zeros(x.shape, _lax.result_dtype(fmt))
            return _lax._native_round_nearest(x, fmt_name=fmt.name, saturate=saturate)
        return _callback.round_nearest(x, fmt_name=fmt.name, overflow=overflow)

    if not jnp.issubdtype(_lax.result_dtype(fmt), jnp.floating):  # packed fp4: no gradient
        return rounded(x)
    return _straight_through(rounded, (x,))


def to_float32(y, *, dtype=None, impl=None, out=None):
    """Widen a bf16/fp16 JAX array (or uint16 patterns with ``dtype=``) to float32 exactly
    (NaN payloads kept)."""
    _no_out(out)
    y, fmt = _narrow(y, "y", None if dtype is None else get_format(dtype))

    def widened(y):
        if _impl(impl, y) == "native":
            if y.size == 0:
                return jnp.zeros(y.shape, jnp.float32)
            return _lax._native_to_float32(y, fmt_name=fmt.name)
        return _callback.to_float32(y, fmt_name=fmt.name)

    if not jnp.issubdtype(y.dtype, jnp.floating):  # uint16 patterns: nothing to differentiate
        return widened(y)
    return _straight_through(widened, (y,))  # exact: the derivative is 1


def stochastic_add(
    w,
    u,
    *,
    alpha=1.0,
    seed=None,
    offset=0,
    dtype=None,
    overflow="inf",
    impl=None,
    shard_spec=None,
):
    """``SR(w + alpha * u)`` for a bf16/fp16 JAX array ``w`` and a float32 ``u`` of its shape:
    the sum in float32 with one rounding (``fma(alpha, u, w)``), then stochastically rounded to
    ``w``'s format. Returns the new ``w`` (same dtype); JAX arrays are immutable, so unlike the
    NumPy path nothing is updated in place.

    Args:
        w: bf16/fp16 array (or uint16 patterns with ``dtype=``).
        u: float32 array of ``w``'s shape.
        alpha: float32 scale of ``u``: a real number or scalar array, finite, or a traced
            scalar (an inf or NaN one, known at run time only, gives the IEEE sums: +-inf,
            +qNaN, on both impls).
        seed, offset, overflow, impl, shard_spec: as ``stochastic_round``.
        dtype: the format of ``w`` when its dtype does not say it.
    """
    fp4 = getattr(w, "dtype", None) == jnp.float4_e2m1fn  # added as codes, returned as fp4
    w, fmt = _narrow(w, "w", None if dtype is None else get_format(dtype))
    u = _check_float32(u, "u")
    check_arrays(("w", w), ("u", u), ("seed", seed))
    if tuple(u.shape) != tuple(w.shape):
        raise ValueError(f"u: shape {tuple(u.shape)} does not match w's shape {tuple(w.shape)}")
    saturate = saturate_flag(overflow)
    offset = check_offset(offset)
    impl = _impl(impl, w)
    k0, k1 = _key_words(seed)
    origin, global_shape = _layout(w, shard_spec, "w")
    if isinstance(alpha, (int, float, np.number)):
        alpha = np.float32(_validate.real(alpha, "alpha"))
    else:
        alpha = _as_jax(alpha, "alpha")
        if alpha.shape != ():
            raise ValueError(f"alpha: expected a scalar, got shape {alpha.shape}")
        if not any(jnp.issubdtype(alpha.dtype, kind) for kind in (jnp.integer, jnp.floating)):
            raise TypeError(f"alpha: expected a real scalar, got dtype {alpha.dtype}")
        if isinstance(alpha, jax.core.Tracer):  # its value is known at run time only
            alpha = alpha.astype(jnp.float32)
        else:  # a concrete array: checked as a number is
            alpha = np.float32(_validate.real(float(alpha), "alpha"))

    def added(w, u, alpha, k0, k1, origin):
        if impl == "native":
            if w.size == 0:
                return w
            stream = (k0, k1, offset, origin, global_shape)
            if jnp.issubdtype(w.dtype, jnp.floating):  # not uint16 patterns or fp4 codes
                y = _in_kernels(_adding_update, (w, u), (alpha,), stream, fmt, saturate)
                if y is not None:
                    return y
            return _native_stream(_lax._native_stochastic_add, (w, u, alpha), stream, fmt, saturate)
        return _callback.stochastic_add(
            w,
            u,
            alpha,
            k0,
            k1,
            _callback.offset_words(offset),
            origin,
            fmt_name=fmt.name,
            overflow=overflow,
            global_shape=global_shape,
        )

    rest = (_u(k0), _u(k1), origin)
    if fp4:
        return _fp4_array(added(w, u, alpha, *rest))
    if not jnp.issubdtype(w.dtype, jnp.floating):  # uint16 patterns: nothing to differentiate
        return added(w, u, alpha, *rest)
    return _straight_through(added, (w, u, jnp.asarray(alpha, jnp.float32)), rest, _sum_tangent)


def quantize_blocks(
    x, format, *, rounding="stochastic", seed=None, offset=0, axis=-1, scale=None, impl=None
):
    """``srround.quantize_blocks`` for a float32 JAX array (works under ``jit``; ``seed`` may
    be a JAX key): ``impl="native"`` (default, ``jax.lax``) or ``"callback"`` (the NumPy
    kernels through a host call, ``_callback.py``), the same bits. Returns a
    ``srround.QuantizedBlocks`` of JAX arrays (fp4 data as uint8, MX scales
    ``jnp.float8_e8m0fnu``, NVFP4 scales ``jnp.float8_e4m3fn``)."""
    from srround import _blocks

    bf = _blocks.get_block_format(format)
    x = _check_float32(x, "x")
    check_arrays(("x", x), ("seed", seed))
    impl = _impl(impl, x)
    offset = check_offset(offset)
    if rounding not in ("stochastic", "nearest"):
        raise ValueError(f"rounding: expected 'stochastic' or 'nearest', got {rounding!r}")
    if scale is None:
        scale = "ceil" if rounding == "stochastic" else "floor"
    if scale not in _blocks.SCALE_MODES:
        raise ValueError(f"scale: expected one of {list(_blocks.SCALE_MODES)}, got {scale!r}")
    axis = _blocks._layout(tuple(x.shape), axis, bf.block)[0]  # errors naming x and axis
    k0, k1 = _key_words(seed) if rounding == "stochastic" else (0, 0)
    if impl == "native" and x.size:
        _lax._check_count(x.size)
        data, scales, tensor = _lax.native_quantize_blocks(
            x,
            _u(k0),
            _u(k1),
            *_lax._first_block(offset),
            fmt_name=bf.name,
            axis=axis,
            stochastic=rounding == "stochastic",
            ceil=scale == "ceil",
            lane0=offset & 3,
        )
    else:
        data, scales, tensor = _callback.quantize_blocks(
            x,
            _u(k0),
            _u(k1),
            _callback.offset_words(offset),
            format=bf.name,
            rounding=rounding,
            axis=axis,
            scale=scale,
        )
    return _blocks.QuantizedBlocks(data, scales, tensor if bf.two_level else None, bf.name, axis)


def dequantize_blocks(q, *, dtype="float32", impl=None):
    """``srround.dequantize_blocks`` of a ``QuantizedBlocks`` of JAX arrays: ``impl="native"``
    (default, ``jax.lax``) or ``"callback"`` (host), the same bits."""
    from srround import _blocks

    check_float32_dtype(dtype)
    bf = _blocks.get_block_format(q.format)
    for name, array, fmt in (
        ("q.data", q.data, _blocks.PACKED_FP4 if bf.packed else bf.element),
        ("q.scales", q.scales, _blocks.FORMATS["float8_e4m3fn"] if bf.two_level else _blocks.E8M0),
    ):
        dtype = _as_jax(array, name).dtype
        if dtype not in (fmt.numpy_dtype, jnp.uint8):
            raise TypeError(f"{name}: expected {fmt.numpy_dtype} (or uint8 patterns), got {dtype}")
    axis = _blocks.dequantized_layout(bf, q.axis, q.data.shape, q.scales.shape)[0]
    q = q._replace(axis=axis)
    if bf.two_level:
        if q.tensor_scale is None:
            raise ValueError("q.tensor_scale: NVFP4 needs its float32 tensor scale")
        _blocks.check_tensor_scale(_check_float32(q.tensor_scale, "q.tensor_scale").size)
    if _impl(impl, q.data) == "native" and q.data.size:
        tensor = q.tensor_scale if bf.two_level else jnp.ones(1, jnp.float32)
        return _lax.native_dequantize_blocks(
            q.data, q.scales, tensor, fmt_name=bf.name, axis=q.axis
        )
    return _callback.dequantize_blocks(q)
