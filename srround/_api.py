"""The functional API: validate, view the caller's arrays (``srround._dispatch``), launch the
backend kernel where the data lives, and return the caller's own type.

Every rounding call is a pure function of (input bits, seed, offset, index): see ``_rng.py``
for the stream and ``_scalar.py`` for the rounding rules (contracts: ``docs/contracts.md``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import numbers

import numpy as np

from . import _cpu, _loss_scale, _optim, _plan, _validate
from ._dispatch import View, adapter_for, check_same_place, check_shape, mutable_adapter_for
from ._formats import CODE_WIDTH, BufferCode, check_fp4_top, get_format, saturate_flag
from ._rng import check_offset, check_seed, manually_seeded, next_seed, split_seed
from ._tensor_list import TensorList, address


def _key(seed) -> tuple[int, int]:
    return split_seed(next_seed() if seed is None else check_seed(seed, "seed"))


def _check_shard_seed(seed, view: View) -> None:
    """``seed=None`` for a sharded tensor (a DTensor, whose pieces live in several processes;
    the fused steps pass their first parameter): each process would draw its own seed, so
    replicated pieces would differ. ``ValueError`` unless ``srround.manual_seed`` seeded the
    library generator."""
    if seed is None and view.sharded and not manually_seeded():
        raise ValueError(
            "seed: pass a seed (the same on every rank) for a DTensor; seed=None draws a"
            " different one in each process, so replicated pieces would differ (or call"
            " srround.manual_seed on every rank first)"
        )


def _span(name: str, view: View | None, writes: bool):
    """``(name, address, nbytes, writes)`` of a view, for ``_validate.no_overlap``."""
    if view is None:
        return (name, 0, 0, writes)
    return (name, address(view.bits), view.bits.size * view.bits.dtype.itemsize, writes)


def _own(adapter, name: str):
    """The adapter's own implementation of API function ``name`` for immutable arrays (JAX:
    ``MUTABLE = False``, ``srround._dispatch``), else ``None``."""
    return None if adapter.MUTABLE else getattr(adapter, name)


def _launch(kernel: str, view: View, *args) -> None:
    """Run ``kernel`` of the backend where ``view`` lives (CUDA on the view's stream)."""
    if view.bits.size == 0:
        return
    if view.device == "cpu":
        _cpu.run(getattr(_cpu, kernel), view.bits.size, *args)
    else:
        from . import _cuda  # compiles CUDA kernels on first use only

        getattr(_cuda, kernel)(*args, stream=view.stream)


def check_fp4_codes(view: View, fmt, name: str) -> None:
    """``_formats.check_fp4_top`` of the bytes of an fp4 view, before anything runs (one read
    of the bytes; on CUDA a device reduction and a sync)."""
    if fmt.bits != 4 or view.bits.size == 0:
        return
    if view.device == "cpu":
        top = int(view.bits.max())
    else:
        from . import _cuda

        top = _cuda.max_byte(view.bits, stream=view.stream)
    check_fp4_top(top, name)


def _launch_random(kernel, view, src_bits, dst_bits, alpha, key, offset, fmt, saturate) -> None:
    """``_launch`` of a random kernel (``_cpu.stochastic_round``/``stochastic_add`` and their
    CUDA twins) with the key, the stream offset and the target format's constants; a view of
    runs (``View.runs``) through ``_launch_runs``."""
    if view.runs[0]:
        _launch_runs(kernel, view, src_bits, dst_bits, alpha, key, offset, fmt, saturate)
        return
    _launch(
        kernel,
        view,
        src_bits,
        dst_bits,
        np.float32(alpha),
        *key,
        offset,
        fmt.mantissa_bits,
        fmt.exponent_bits,
        saturate,
        fmt.specials,
    )


_PADDED_ELEMENTS = 1 << 22  # the most elements _launch_runs rounds in one launch


def _launch_runs(kernel, view, src_bits, dst_bits, alpha, key, offset, fmt, saturate) -> None:
    """``_launch_random`` of a piece of runs (``View.runs``; ``offset``: its first element's
    position): its rows placed in rows as wide as the stream's distance between them (the
    skipped positions' inputs unset, their results dropped), a batch of rows a launch."""
    run, skip = view.runs
    width = run + skip
    rows = src_bits.size // run
    batch = min(rows, max(1, _PADDED_ELEMENTS // width))
    if view.device == "cpu":
        empty, zeros, stream = np.empty, np.zeros, None
    else:
        from ._numba_cuda_compat import import_numba_cuda

        cuda, stream = import_numba_cuda(), view.stream
        empty = functools.partial(cuda.device_array, stream=stream)

        def zeros(shape, dtype):
            return cuda.to_device(np.zeros(shape, dtype), stream=stream)

    src_rows, dst_rows = src_bits.reshape(rows, run), dst_bits.reshape(rows, run)

    def put(target, key, value):  # a device copy on the stream (NumPy, the simulator: [] =)
        setitem = getattr(target, "setitem", None)
        if stream is None or setitem is None:
            target[key] = value
        else:
            setitem(key, value, stream=stream)

    src_buffer = empty((batch, width), dtype=src_bits.dtype)  # reused: one page-in
    # stochastic_add reads the narrow values: the skipped ones valid codes (fp4: < 16)
    dst_buffer = (zeros if kernel == "stochastic_add" else empty)((batch, width), dst_bits.dtype)
    for r0 in range(0, rows, batch):
        r1 = min(rows, r0 + batch)
        src, dst = src_buffer[: r1 - r0], dst_buffer[: r1 - r0]
        put(src, (slice(None), slice(0, run)), src_rows[r0:r1])
        if kernel == "stochastic_add":  # it reads the narrow values it updates
            put(dst, (slice(None), slice(0, run)), dst_rows[r0:r1])
        padded = dataclasses.replace(view, bits=dst.reshape(-1), runs=(0, 0))
        at = offset + r0 * width
        args = (_cpu.read_only(src.reshape(-1)), dst.reshape(-1), alpha, key, at, fmt, saturate)
        _launch_random(kernel, padded, *args)
        put(dst_rows, slice(r0, r1), dst[:, :run])


def stochastic_round(x, *, dtype="bfloat16", seed=None, offset=0, out=None, overflow="inf"):
    """Stochastically round float32 ``x`` to bf16, fp16, fp8 (e4m3fn, e5m2) or fp4 (e2m1fn).

    Each element rounds to one of its two neighbours in the target format, up with probability
    equal to the distance from the lower one in units of their spacing (16 random bits), so
    ``E[result] = x``; representable values and +-0 come back unchanged, NaN as the format's
    quiet NaN with its sign and +-inf as +-inf where the format has them (e4m3fn: NaN or +-448
    for inf, e2m1fn: +-0 for NaN and +-6 for inf; see ``overflow``).

    Args:
        x: float32 array (any supported framework, C-contiguous, any shape).
        dtype: target format, ``"bfloat16"`` (default), ``"float16"``, ``"float8_e4m3fn"``,
            ``"float8_e5m2"`` or ``"float4_e2m1fn"`` (one value per byte; what NaN, inf and
            overflow become in each is in ``srround/_formats.py``).
        seed: int in [0, 2**64) makes the call a pure function of (x, seed, offset); ``None``
            draws a seed from the library generator (see ``srround.manual_seed``).
        offset: position of ``x[0]`` in the random stream (elements); rounding ``x[k:]`` with
            ``offset=k`` gives the same bits as the matching part of one call on ``x``.
        out: optional result array (target dtype, ``x``'s shape, writable, contiguous).
        overflow: ``"inf"`` (the format's rule: past the largest finite value is inf) or
            ``"saturate"`` (clamp to the largest finite value).

    Returns:
        the rounded array, the caller's type with the target dtype (``ml_dtypes.bfloat16`` or
        ``np.float16`` for NumPy).

    Example:
        >>> y = srround.stochastic_round(np.float32([1.0 + 2**-9]), seed=0)
    """
    adapter = adapter_for(x=x, out=out)
    if own := _own(adapter, "stochastic_round"):
        return own(x, dtype=dtype, seed=seed, offset=offset, out=out, overflow=overflow)
    fmt = get_format(dtype)
    saturate = saturate_flag(overflow)
    offset = check_offset(offset)
    src, _ = adapter.source(x, "x")
    dst = adapter.target(out, "out", src, fmt)
    check_same_place(x=src, out=dst)
    if out is not None:
        _validate.no_overlap([_span("x", src, False), _span("out", dst, True)])
    _check_shard_seed(seed, src)
    offset = check_offset(offset + src.stream_offset())  # (a shard: its global position)
    k0, k1 = _key(seed)  # after the checks: a refused call draws no seed
    _launch_random(
        "stochastic_round",
        src,
        _cpu.read_only(src.bits),
        dst.bits,
        1.0,
        (k0, k1),
        offset,
        fmt,
        saturate,
    )
    return dst.result


def round_nearest(x, *, dtype="bfloat16", out=None, overflow="inf"):
    """Round float32 ``x`` to the nearest value of ``dtype``, ties to even: bit for bit the cast
    of ml_dtypes, NumPy and torch on every non-NaN input. Every NaN becomes the format's
    canonical quiet NaN with its sign (ml_dtypes' bf16 rule); NumPy's fp16 cast keeps payload
    bits, torch's CPU casts keep the top ones (fp16) or write 0xFFFF (vectorised bf16).

    Args and returns as ``stochastic_round`` (no randomness)."""
    adapter = adapter_for(x=x, out=out)
    if own := _own(adapter, "round_nearest"):
        return own(x, dtype=dtype, out=out, overflow=overflow)
    fmt = get_format(dtype)
    saturate = saturate_flag(overflow)
    src, _ = adapter.source(x, "x")
    dst = adapter.target(out, "out", src, fmt)
    check_same_place(x=src, out=dst)
    if out is not None:
        _validate.no_overlap([_span("x", src, False), _span("out", dst, True)])
    _launch(
        "round_nearest",
        src,
        _cpu.read_only(src.bits),
        dst.bits,
        fmt.mantissa_bits,
        fmt.exponent_bits,
        saturate,
        fmt.specials,
    )
    return dst.result


def to_float32(y, *, dtype=None, out=None):
    """Widen a bf16/fp16/fp8/fp4 array to float32 exactly (NaN payloads kept).

    Args:
        y: narrow array; a raw ``uint16`` (16-bit formats) or ``uint8`` (fp8, fp4) bit-pattern
            array needs ``dtype=``.
        dtype: the format of ``y`` when its dtype does not say it.
        out: optional float32 result array of ``y``'s shape.
    """
    adapter = adapter_for(y=y, out=out)
    if own := _own(adapter, "to_float32"):
        return own(y, dtype=dtype, out=out)
    fmt = None if dtype is None else get_format(dtype)
    src, fmt = adapter.source(y, "y", fmt, narrow=True)
    check_fp4_codes(src, fmt, "y")
    dst = adapter.target(out, "out", src, None)
    check_same_place(y=src, out=dst)
    if out is not None:
        _validate.no_overlap([_span("y", src, False), _span("out", dst, True)])
    _launch(
        "to_float32",
        src,
        _cpu.read_only(src.bits),
        dst.bits,
        fmt.mantissa_bits,
        fmt.exponent_bits,
        fmt.specials,
    )
    return dst.result


def stochastic_add(w, u, *, alpha=1.0, seed=None, offset=0, dtype=None, overflow="inf"):
    """In place ``w <- SR(w + alpha * u)``: the primitive a custom low-precision optimizer needs.

    The sum is formed in float32 with a single rounding (``fma(alpha, u, w)``), then rounded
    stochastically to ``w``'s format with the stream of ``(seed, offset)``.

    Args:
        w: narrow array updated in place (writable, contiguous; ``uint16``/``uint8`` bit
            patterns need ``dtype=``).
        u: float32 update of ``w``'s shape, same framework and device.
        alpha: scale of ``u`` (rounded to float32).
        seed, offset, overflow: as ``stochastic_round``.
        dtype: the format of ``w`` when its dtype does not say it.

    Returns:
        ``w`` (updated); for JAX arrays, which are immutable, the new array (``w`` unchanged).
    """
    adapter = adapter_for(w=w, u=u)
    if own := _own(adapter, "stochastic_add"):
        return own(w, u, alpha=alpha, seed=seed, offset=offset, dtype=dtype, overflow=overflow)
    alpha = _validate.real(alpha, "alpha")
    fmt = None if dtype is None else get_format(dtype)
    saturate = saturate_flag(overflow)
    offset = check_offset(offset)
    dst, fmt = adapter.inplace(w, "w", fmt)
    src, _ = adapter.source(u, "u")
    check_shape("u", src.shape, dst.shape, "w's")
    check_same_place(w=dst, u=src)
    _validate.no_overlap([_span("w", dst, True), _span("u", src, False)])
    check_fp4_codes(dst, fmt, "w")
    _check_shard_seed(seed, dst)
    offset = check_offset(offset + dst.stream_offset())  # (a shard: its global position)
    k0, k1 = _key(seed)  # after the checks: a refused call draws no seed
    _launch_random(
        "stochastic_add",
        dst,
        _cpu.read_only(src.bits),
        dst.bits,
        alpha,
        (k0, k1),
        offset,
        fmt,
        saturate,
    )
    return dst.result


# -- loss scaling ---------------------------------------------------------------------------


def _is_float32(array) -> bool:
    return str(getattr(array, "dtype", "")).rsplit(".", 1)[-1] == "float32"


def _writable_view(adapter, array, name):
    """``(view, format code)`` of an array updated in place: float32, bf16 or fp16."""
    if _is_float32(array):
        view, _ = adapter.source(array, name)
        return adapter.target(array, name, view, None), BufferCode.FLOAT32
    view, fmt = adapter.inplace(array, name, None)
    return view, fmt.code


def _is_host_scalar(value) -> bool:
    """A Python or NumPy scalar (validated on the host), not an array of the caller's."""
    return isinstance(value, (numbers.Number, np.generic))


def _scalar_buffer(adapter, value, name, like: View, count: int, *, writable=False):
    """A float32[count] device buffer (as bits) for a scalar argument: the caller's array, or a
    new one holding ``value`` (a float, validated by the caller) on ``like``'s device."""
    if value is None or _is_host_scalar(value):
        host = np.full(count, np.float32(0.0 if value is None else value)).view(np.uint32)
        if like.device == "cpu":
            return View(host, "cpu", (count,), None)
        from ._numba_cuda_compat import import_numba_cuda

        device = import_numba_cuda().to_device(host, stream=like.stream)
        return View(device, like.device, (count,), None, like.stream, like.device_id)
    view, _ = adapter.source(value, name)
    if view.bits.size not in (1, count):
        expected = "1 value" if count == 1 else f"1 or {count} values"
        raise ValueError(f"{name}: expected {expected}, got {view.bits.size}")
    if writable:
        view = adapter.target(value, name, view, None)
    return view


def unscale_and_check(grads, inv_scale, *, found_inf=None, per_tensor=False):
    """Multiply every gradient by ``inv_scale`` in place and flag any inf/NaN: one fused pass,
    one launch whatever the number of tensors, no host synchronisation.

    Args:
        grads: an array or a list of arrays (float32, bf16 or fp16; one framework, one device),
            updated in place. Narrow gradients are rounded back to nearest, as
            ``grad.mul_(inv_scale)`` does in torch.
        inv_scale: 1 / loss scale: a positive finite float (else ``ValueError``), or a float32
            array of 1 value (or one per tensor with ``per_tensor=True``) on the gradients'
            device, read by the kernel; a zero, negative, NaN or inf value there sets
            ``found_inf`` (it cannot be checked on the host without a synchronisation).
        found_inf: optional float32 array (1 value, or one per tensor) set to 1.0 where an
            *unscaled* gradient - what the optimizer reads - is non-finite (an inf/NaN input,
            an unusable scale, or an fp16 product past 65504); it is not cleared first, so one
            array can accumulate over several calls. Allocated zeroed when omitted. torch
            DTensor gradients: all-reduced (MAX) over their meshes, on the device, so every
            rank gets the same flags (a collective: every rank of the mesh calls).
        per_tensor: one scale and one flag per tensor (the per-layer scaling option).

    Returns:
        ``found_inf`` (the caller's array type, on the gradients' device).
    """
    grads = list(grads) if isinstance(grads, (list, tuple)) else [grads]
    if not grads:
        raise ValueError("grads: expected at least one array")
    if _is_host_scalar(inv_scale):
        inv_scale = _validate.inv_scale(inv_scale)
    elif inv_scale is None or isinstance(inv_scale, (str, bytes, list, tuple)):
        raise TypeError(
            f"inv_scale: expected a positive float or a float32 array, got {inv_scale!r}"
        )
    per_tensor = _validate.flag(per_tensor, "per_tensor")
    if found_inf is not None and _is_host_scalar(found_inf):
        raise TypeError("found_inf: expected a float32 array updated in place (or None)")
    extra = {n: v for n, v in (("inv_scale", inv_scale), ("found_inf", found_inf)) if v is not None}
    extra = {n: v for n, v in extra.items() if not _is_host_scalar(v)}
    adapter = mutable_adapter_for(grads=grads[0], **extra)
    _check_one_type(grads, "grads", grads[0], "grads[0]")
    addresses, sizes, codes, place = adapter.buffer_table(grads, "grads")
    _plan.check_grad_codes("grads", codes)
    first, _ = _writable_view(adapter, grads[0], "grads[0]")
    if place != first.where:  # a device index the table and the view disagree on
        raise ValueError(f"grads: on {place}, expected {first.where}")
    count = len(grads) if per_tensor else 1
    scales = _scalar_buffer(adapter, inv_scale, "inv_scale", first, count)
    if found_inf is None:
        like = dataclasses.replace(first, shape=(count,), offset=None)  # not a piece of grads
        flags = adapter.target(None, "found_inf", like, None)
        flags.bits[:] = 0
    else:
        flags = _scalar_buffer(adapter, found_inf, "found_inf", first, count, writable=True)
        if flags.bits.size != count:
            raise ValueError(f"found_inf: expected {count} values, got {flags.bits.size}")
    check_same_place(**{"grads[0]": first, "inv_scale": scales, "found_inf": flags})
    table = TensorList(addresses, codes, sizes, grads)
    _validate.no_overlap(
        _validate.list_spans("grads", table.addresses, table.sizes, table.formats, CODE_WIDTH, True)
        + [_span("inv_scale", scales, False), _span("found_inf", flags, True)]
    )
    if table.total:
        _loss_scale.unscale_and_check(
            table.addresses,
            table.formats,
            table.starts,
            scales.bits,
            flags.bits,
            per_tensor,
            first.device,
            total=table.total,
            stream=flags.stream,
        )
    reduce = getattr(adapter, "reduce_flags", None)
    if reduce is not None:  # sharded arrays (torch DTensors): one verdict on every rank
        reduce(grads, flags.result)
    return flags.result


def update_scale(
    scale,
    growth_tracker,
    found_inf,
    *,
    overflow_tracker=None,
    growth_factor=2.0,
    backoff_factor=0.5,
    growth_interval=2000,
    hysteresis=1,
    min_scale=None,
    max_scale=None,
):
    """Update loss scale(s) in place on their device (the rule in ``docs/contracts.md``):
    back off on overflow, grow after ``growth_interval`` clean steps; no host sync.

    Args:
        scale: float32 array, 1 value or one per tensor; updated in place.
        growth_tracker: int32 array like ``scale``: clean steps since the last change.
        found_inf: float32 array like ``scale`` (from ``unscale_and_check``).
        overflow_tracker: int32 array like ``scale``, consecutive overflows (needed when
            ``hysteresis > 1``).
        growth_factor, backoff_factor, growth_interval: torch GradScaler's parameters:
            ``growth_factor >= 1``, ``0 < backoff_factor <= 1`` (1 and 1: a static scale),
            ``growth_interval`` an int >= 1.
        hysteresis: back off only after this many consecutive overflows (1: every overflow).
        min_scale, max_scale: bounds of the scale (None: unbounded), ``0 <= min <= max``.

    Raises:
        TypeError, ValueError: naming the argument, before anything is read or written.
    """
    checked = _validate.scale_update(
        growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale
    )
    growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale = checked
    if overflow_tracker is None and hysteresis > 1:
        raise ValueError("overflow_tracker: needed when hysteresis > 1")
    adapter = mutable_adapter_for(
        scale=scale,
        growth_tracker=growth_tracker,
        found_inf=found_inf,
        overflow_tracker=overflow_tracker,
    )
    scale_view, _ = adapter.source(scale, "scale")
    scale_view = adapter.target(scale, "scale", scale_view, None)
    found_view, _ = adapter.source(found_inf, "found_inf")
    check_shape("found_inf", found_view.shape, scale_view.shape, "scale's")
    trackers = [
        adapter.counter(t, name, scale_view)
        for name, t in (("growth_tracker", growth_tracker), ("overflow_tracker", overflow_tracker))
    ]
    check_same_place(
        scale=scale_view,
        found_inf=found_view,
        growth_tracker=trackers[0],
        overflow_tracker=trackers[1],
    )
    _validate.no_overlap(
        [
            _span("scale", scale_view, True),
            _span("found_inf", found_view, False),
            _span("growth_tracker", trackers[0], True),
            _span("overflow_tracker", trackers[1], True),
        ]
    )
    factors = (
        np.float64(growth_factor),  # float64, as torch: the product is rounded once
        np.float64(backoff_factor),
        int(growth_interval),
        int(hysteresis),
        np.float32(min_scale),
        np.float32(max_scale),
    )
    _loss_scale.update_scale(
        scale_view.bits,
        trackers[0].bits,
        trackers[1].bits,
        found_view.bits,
        *factors,
        device=scale_view.device,
        stream=scale_view.stream,
    )
    return scale


# -- fused optimizer steps ------------------------------------------------------------------


def _check_one_type(arrays, name, reference, reference_name):
    """Every array of ``arrays`` has the type of ``reference``, else ``adapter_for``'s
    mixed-frameworks error naming the first other one."""
    kind = type(reference)
    if set(map(type, arrays)) == {kind}:  # (C-level: lists of hundreds of tensors)
        return
    for i, a in enumerate(arrays):
        if type(a) is not kind:
            adapter_for(**{reference_name: reference, f"{name}[{i}]": a})


def _as_list(arrays, name, count=None, *, whole=False):
    """``arrays`` as a list of ``count`` entries; ``whole``: every entry an array (a ``None``
    would reach the kernel as address 0)."""
    arrays = list(arrays) if isinstance(arrays, (list, tuple)) else [arrays]
    if count is not None and len(arrays) != count:
        raise ValueError(f"{name}: expected {count} arrays (one per parameter), got {len(arrays)}")
    missing = next((i for i, a in enumerate(arrays) if a is None), None) if whole else None
    if missing is not None:
        raise ValueError(f"{name}[{missing}]: missing (None); expected one array per parameter")
    return arrays


class StepReuse:
    """A one-entry memory of the last fused step's table, for a caller that runs the same
    step on the same buffers call after call (the JAX host step: one per program call site,
    whose buffers have fixed dtypes and shapes and, with donation, the same addresses from
    step to step). Around ``adamw_step``/``sgd_step`` as ``with reuse.active():``, a call
    whose buffers (address, dtype, size, strides, read-only flag), stream starts and settings
    equal the last one's skips the validation and the table build and only sets the step
    count, scale, hyperparameters and seed; any other call validates and plans in full and
    becomes the entry. NumPy (CPU) buffers, host ``step`` and ``inv_scale``, no
    ``found_inf``; other calls are not kept."""

    def __init__(self):
        self._entry = None  # (key, what _build_fused returned): replaced whole, read once

    @contextlib.contextmanager
    def active(self):
        """Within: ``adamw_step``/``sgd_step`` calls of this thread use this memory. Several
        threads may use one ``StepReuse`` at once (XLA runs a step's shards in parallel):
        calls on other buffers then plan afresh, and the entry is replaced whole."""
        token = _REUSE.set(self)
        try:
            yield self
        finally:
            _REUSE.reset(token)


_REUSE: contextvars.ContextVar[StepReuse | None] = contextvars.ContextVar(
    "srround_step_reuse", default=None
)


def _buffers(arrays) -> tuple | None:
    """Per NumPy array of ``arrays`` what its table row depends on (address, dtype, size,
    strides, writability; ``None`` entries as ``None``), or ``None`` when one is not a NumPy
    array."""
    out = []
    for a in arrays:
        if a is None:
            out.append(None)
        elif type(a) is np.ndarray:
            info = a.__array_interface__
            out.append((info["data"], a.dtype, a.size, info["strides"]))
        else:
            return None
    return tuple(out)


def _reuse_key(kind, params, grads, states, aux, rounding, scales, stream_starts, extra):
    """What ``StepReuse`` compares: every buffer's address and the step's settings, or
    ``None`` where the call is not one it keeps (arrays other than NumPy's, device scalars)."""
    if any(v is not None and not _is_host_scalar(v) for v in extra.values()):
        return None
    if not isinstance(params, list) or not isinstance(grads, list):
        return None
    lists = [params, grads, *(a for _, a in states), aux, *(a for _, a in scales or ())]
    key = [kind, rounding, extra["found_inf"] is None]
    for arrays in lists:
        if arrays is None:
            key.append(None)
            continue
        if not isinstance(arrays, list):
            return None
        found = _buffers(arrays)
        if found is None:
            return None
        key.append(found)
    key.append(None if stream_starts is None else tuple(np.asarray(stream_starts).tolist()))
    return tuple(key)


def _build_fused(
    kind,
    params,
    grads,
    states,
    aux,
    *,
    step,
    rounding,
    inv_scale,
    found_inf,
    name,
    scales=None,
    stream_starts=None,
):
    """Validate the buffer lists and plan (``_plan.plan_step``) one ``FusedStep``: returns it
    with its step counters, scale and flag buffers and the first param's view."""
    mode = _plan.check_rounding(rounding)
    if inv_scale is not None and _is_host_scalar(inv_scale):
        inv_scale = _validate.inv_scale(inv_scale)
    if found_inf is not None and _is_host_scalar(found_inf):
        raise TypeError("found_inf: expected a float32 array of 1 value (or None)")
    params = _as_list(params, "params")
    if not params:
        raise ValueError("params: expected at least one array")
    count = len(params)
    grads = _as_list(grads, "grads", count, whole=True)
    extra = {
        n: v
        for n, v in (("inv_scale", inv_scale), ("found_inf", found_inf), ("step", step))
        if v is not None and not _is_host_scalar(v)
    }
    adapter = adapter_for(params=params[0], grads=grads[0], **extra)
    if _own(adapter, "stochastic_round"):  # immutable arrays (JAX)
        raise TypeError(
            f"params: {name} updates buffers in place; for JAX use"
            " srround.adapters.jax.adamw or .apply_updates"
        )
    _check_one_type(params, "params", params[0], "params[0]")
    _check_one_type(grads, "grads", params[0], "params[0]")
    states = [
        (label, None if a is None else _as_list(a, label, count, whole=True)) for label, a in states
    ]
    if aux is not None and _plan.needs_aux(mode):
        aux = _as_list(aux, "aux", count)
    if scales is not None:
        scales = [
            (label, None if a is None else _as_list(a, label, count, whole=True))
            for label, a in scales
        ]
    noise = None
    if stream_starts is not None:
        if scales is not None and any(a is not None for _, a in scales):
            raise ValueError("stream_starts: not with fp8 states (their blocks span the params)")
        if isinstance(stream_starts, np.ndarray):  # NumPy ints (np.cumsum's): their list
            stream_starts = stream_starts.tolist()
        noise = _as_list(stream_starts, "stream_starts", count)
        noise = [
            _validate.integer(s, f"stream_starts[{i}]", low=0, high=1 << _optim.STREAM_SHIFT)
            for i, s in enumerate(noise)
        ]
    plan = _plan.plan_step(
        adapter, rounding, params, grads, states, aux, noise=noise, scales=scales
    )
    for i, (start, size) in enumerate(zip(noise or (), plan.sizes)):
        if start + size > _optim.MAX_ELEMENTS:
            raise ValueError(
                f"stream_starts[{i}]: {start} + {size} elements of params[{i}] pass"
                f" {_optim.MAX_ELEMENTS}, the end of a step's stream"
            )
    first, _ = _writable_view(adapter, params[0], "params[0]")
    steps = _step_counter(adapter, step, first, count)
    scales = _scalar_buffer(adapter, 1.0 if inv_scale is None else inv_scale, "inv_scale", first, 1)
    flags = _scalar_buffer(adapter, found_inf, "found_inf", first, 1, writable=True)
    check_same_place(**{"params[0]": first, "inv_scale": scales, "found_inf": flags, "step": steps})
    extra = [_span("inv_scale", scales, False), _span("found_inf", flags, True)]
    _validate.no_overlap([*plan.spans, *extra, _span("step", steps, True)])
    fused = _optim.FusedStep(
        kind,
        mode,
        plan.state_fmt,
        plan.table,
        plan.sizes,
        steps.bits,
        first.device,
        first.stream,
    )
    return fused, steps, scales, flags, first


def _fused_step(
    kind, hyper, params, grads, states, aux, *, step, seed, inv_scale, found_inf, **options
):
    """Validate the buffer lists, plan (``_plan.plan_step``) and run one ``FusedStep``; within
    ``with StepReuse()`` a call on the last call's buffers reuses its table."""
    reuse = _REUSE.get()
    key = None
    if reuse is not None:
        extra = {"step": step, "inv_scale": inv_scale, "found_inf": found_inf}
        key = _reuse_key(
            kind,
            params,
            grads,
            states,
            aux,
            options.get("rounding"),
            options.get("scales"),
            options.get("stream_starts"),
            extra,
        )
    entry = None if key is None else reuse._entry
    if entry is not None and entry[0] == key:
        fused, steps, scales, flags, first = entry[1]
        count = steps.bits.size
        step = _validate.integer(step, "step", low=1, high=_optim.MAX_STEPS)
        steps.bits[:] = np.full(count, step - 1, np.int32).view(np.uint32)
        value = 1.0 if inv_scale is None else _validate.inv_scale(inv_scale)
        scales.bits[:] = np.float32(value).view(np.uint32)
        flags.bits[:] = 0
    else:
        built = _build_fused(
            kind,
            params,
            grads,
            states,
            aux,
            step=step,
            inv_scale=inv_scale,
            found_inf=found_inf,
            **options,
        )
        if reuse is not None:
            reuse._entry = None if key is None else (key, built)
        fused, steps, scales, flags, first = built
    _check_shard_seed(seed, first)
    k0, k1 = _key(seed)  # after the checks: a refused call draws no seed
    fused.set_hyper(np.asarray([hyper], np.float64))
    fused.run(scales.bits, flags.bits, k0, k1)


def _step_counter(adapter, step, like: View, count: int) -> View:
    """The int32 step counters of the kernel: the caller's array (updated in place; on the
    host each must be able to take a step, checked by ``FusedStep.run``), or new ones holding
    ``step - 1`` for an int ``step`` (the kernel increments before use)."""
    shaped = dataclasses.replace(like, shape=(count,), offset=None)
    if _is_host_scalar(step) or step is None:
        step = _validate.integer(step, "step", low=1, high=_optim.MAX_STEPS)
        host = np.full(count, step - 1, np.int32).view(np.uint32)
        if like.device == "cpu":
            return View(host, "cpu", (count,), None)
        from ._numba_cuda_compat import import_numba_cuda

        device = import_numba_cuda().to_device(host, stream=like.stream)
        return View(device, like.device, (count,), None, like.stream, like.device_id)
    return adapter.counter(step, "step", shaped)  # host counters: checked by FusedStep.run


def adamw_step(
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    *,
    lr,
    betas=(0.9, 0.999),
    eps=1e-8,
    weight_decay=1e-2,
    step,
    rounding="stochastic",
    aux=None,
    seed=None,
    inv_scale=None,
    found_inf=None,
    exp_avg_scales=None,
    exp_avg_sq_scales=None,
    stream_starts=None,
):
    """One fused AdamW step (torch.optim.AdamW's math) over lists of buffers, in place: each
    element read and written once, one launch (two on CUDA) for any number of tensors.

    Args:
        params: array or list of arrays: bf16, fp16 or fp32 weights, updated in place.
        grads: gradients (one per param, same sizes): bf16, fp16 or fp32.
        exp_avgs, exp_avg_sqs: first and second moments, fp32, bf16 or fp8 (float8_e4m3fn,
            float8_e5m2), updated in place; narrow states are written back with stochastic
            rounding. fp8 states are block-scaled and ``exp_avg_sqs`` holds ``sqrt(v)``
            (``docs/contracts.md``, "fp8 states").
        lr, betas, eps, weight_decay: as torch.optim.AdamW (decoupled weight decay).
        step: int32 array of one step count per param, incremented in place before use (torch's
            ``state["step"]``), or an int: the 1-based number of this step.
        rounding: how fp32 results reach bf16/fp16 params: ``"stochastic"`` (default),
            ``"nearest"``, ``"kahan"``, ``"master"`` or ``"remainder"`` (``docs/contracts.md``).
        aux: per-param buffers of the mode: kahan compensation (param dtype, start at 0),
            master weights (float32), remainder (int16, start at 0); None for fp32 params
            (``aux=None`` where every param is fp32).
        seed: the optimizer's seed (int in [0, 2**64)); the noise of step t is the stream at
            ``t * 2**36`` (weights), so every step gets fresh bits. ``None``: library generator.
        inv_scale: 1 / loss scale multiplied into the gradients: a positive finite float
            (else ``ValueError``), or a float32 array of 1, checked in the kernel: a zero,
            negative, NaN or inf one sets ``found_inf`` to 1 and the step changes nothing.
        found_inf: float32 array of 1; when nonzero the step changes nothing (no host sync).
        exp_avg_scales, exp_avg_sq_scales: with fp8 states only: float32 arrays of
            ``ceil(size / srround.STATE_BLOCK)`` block scales per param (zeros before the first
            step), updated in place.
        stream_starts: per param, the position of its element 0 in the step's random stream
            (ints in [0, 2**34), a list or a NumPy array); default: the prefix sums of the
            sizes. A tensor updated in pieces (shards) gets the bits of the whole when each
            piece starts at the tensor's start plus the piece's first flat index. Not with fp8
            states (their blocks).
    """
    lr, beta1, beta2, eps, weight_decay = _validate.adamw(lr, betas, eps, weight_decay)
    for label, states in (("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs)):
        if states is None:
            raise ValueError(f"{label}: needed (one state array per parameter)")
    _fused_step(
        _optim.ADAMW,
        (lr, beta1, beta2, eps, weight_decay),
        params,
        grads,
        (("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs)),
        aux,
        step=step,
        rounding=rounding,
        seed=seed,
        inv_scale=inv_scale,
        found_inf=found_inf,
        name="adamw_step",
        scales=(("exp_avg_scales", exp_avg_scales), ("exp_avg_sq_scales", exp_avg_sq_scales)),
        stream_starts=stream_starts,
    )


def sgd_step(
    params,
    grads,
    momentum_buffers=None,
    *,
    lr,
    momentum=0.0,
    dampening=0.0,
    weight_decay=0.0,
    nesterov=False,
    step,
    rounding="stochastic",
    aux=None,
    seed=None,
    inv_scale=None,
    found_inf=None,
    stream_starts=None,
):
    """One fused SGD step (torch.optim.SGD's math: momentum, dampening, nesterov, weight
    decay) over lists of buffers, in place. ``momentum_buffers`` (fp32 or bf16, one per param)
    are needed when ``momentum != 0``; at step 1 they are set to the gradient, as torch does.
    Other arguments as ``adamw_step``."""
    checked = _validate.sgd(lr, momentum, dampening, weight_decay, nesterov)
    lr, momentum, dampening, weight_decay, nesterov = checked
    if momentum != 0 and momentum_buffers is None:
        raise ValueError("momentum_buffers: needed when momentum != 0")
    _fused_step(
        _optim.SGD,
        (lr, momentum, dampening, weight_decay, float(nesterov)),
        params,
        grads,
        (("momentum_buffers", momentum_buffers if momentum != 0 else None), ("unused", None)),
        aux,
        step=step,
        rounding=rounding,
        seed=seed,
        inv_scale=inv_scale,
        found_inf=found_inf,
        name="sgd_step",
        stream_starts=stream_starts,
    )
