"""Loss scaling: a fused unscale-and-check pass over many gradients, and the scale update.

The algorithm (Micikevicius et al. 2018; torch AMP, apex): the loss is multiplied by a scale S
before backward; afterwards every gradient is multiplied by 1/S and checked for inf/NaN; a step
with any non-finite gradient is skipped and S backs off, and S grows after ``growth_interval``
clean steps in a row. Everything here runs on the device that holds the buffers, reads its
scalars from device arrays and writes its flags to device arrays: no host synchronisation.

``update_scale`` rule, per scale k (one scale, or one per tensor):

    if found_inf[k]:
        growth_tracker[k] = 0
        overflow_tracker[k] += 1
        if overflow_tracker[k] >= hysteresis:        # hysteresis=1: every overflow (torch)
            scale[k] = max(scale[k] * backoff_factor, min_scale)
            overflow_tracker[k] = 0
    else:
        overflow_tracker[k] = 0                       # hysteresis counts consecutive overflows
        growth_tracker[k] += 1
        if growth_tracker[k] == growth_interval:
            grown = scale[k] * growth_factor          # float32, as torch
            if isfinite(grown): scale[k] = min(grown, max_scale)
            growth_tracker[k] = 0

With ``hysteresis=1``, no ``min_scale``/``max_scale`` this is exactly torch's
``_amp_update_scale_``; ``growth_factor=1, backoff_factor=1`` is a static scale.
"""

from __future__ import annotations

import math

import numpy as np
from numba import carray, njit, prange

from ._scalar import bits_to_f32, decode, encode_nearest, f32_to_bits
from ._tensor_list import FORMAT_F32, find_tensor, load_bits, store_bits, typed_pointer

_ONE_F32 = 0x3F800000


@njit(inline="always", cache=True)
def unscale_bits(bits, fmt, inv_scale):
    """``(new_bits, finite)`` for one gradient element: ``bits`` in format code ``fmt``
    (FORMAT_F32 / FORMAT_BF16 / FORMAT_F16) times float32 ``inv_scale``, rounded back to the
    gradient's format to nearest (as ``grad.mul_(inv_scale)`` in torch); ``finite`` is whether
    the *input* was finite (torch checks before multiplying). ``inv_scale == 1`` leaves bits."""
    if fmt == FORMAT_F32:
        wide = bits
    elif fmt == 1:
        wide = bits << 16  # = decode(bits, 7, 8): bf16 is the top half of fp32
    else:
        wide = decode(bits, 10, 5)
    finite = (wide & 0x7F800000) != 0x7F800000
    product = f32_to_bits(bits_to_f32(wide) * inv_scale)
    if fmt == FORMAT_F32:
        scaled = product
    elif fmt == 1:
        scaled = encode_nearest(product, 7, 8, False)
    else:
        scaled = encode_nearest(product, 10, 5, False)
    return (bits if inv_scale == 1.0 else scaled), finite


@njit(inline="always", cache=True)
def unscale_in_place(address, fmt, j, inv_scale_bits):
    """Unscale element ``j`` of the buffer at ``address`` (format code ``fmt``) in place by the
    float32 whose bits are ``inv_scale_bits``; returns whether it was finite. Scalars only, so
    CUDA kernels call it directly (also in the simulator, where device functions cannot take
    arrays)."""
    inv_scale = bits_to_f32(inv_scale_bits)
    write = inv_scale_bits != _ONE_F32  # the overflow check alone reads and never writes
    if fmt == FORMAT_F32:
        new, finite = unscale_bits(load_bits(address, j, 32), fmt, inv_scale)
        if write:
            store_bits(address, j, new, 32)
    else:
        new, finite = unscale_bits(load_bits(address, j, 16), fmt, inv_scale)
        if write:
            store_bits(address, j, new, 16)
    return finite


@njit(inline="always", cache=True)
def _unscale_array(a, fmt, inv_scale):
    """``unscale_bits`` over a whole array in place; True if every element was finite."""
    finite = True
    for j in range(a.size):
        new, ok = unscale_bits(a[j], fmt, inv_scale)
        a[j] = new
        finite &= ok
    return finite


@njit(inline="always", cache=True)
def _all_finite(a, fmt):
    """True if every element of ``a`` (format code ``fmt``) is finite; reads only."""
    finite = True
    for j in range(a.size):
        finite &= unscale_bits(a[j], fmt, np.float32(1.0))[1]
    return finite


@njit(inline="always", cache=True)
def _unscale_run(address, fmt, j0, j1, inv_scale_bits):
    """Elements [j0, j1) of one buffer, as a typed array, one loop per format with literal
    constants (LLVM vectorizes each); True if all were finite. ``inv_scale == 1``: the check
    alone, no stores."""
    if inv_scale_bits == _ONE_F32:
        if fmt == FORMAT_F32:
            return _all_finite(carray(typed_pointer(address, 32), j1)[j0:], FORMAT_F32)
        if fmt == 1:
            return _all_finite(carray(typed_pointer(address, 16), j1)[j0:], 1)
        return _all_finite(carray(typed_pointer(address, 16), j1)[j0:], 2)
    inv_scale = bits_to_f32(inv_scale_bits)
    if fmt == FORMAT_F32:
        return _unscale_array(carray(typed_pointer(address, 32), j1)[j0:], FORMAT_F32, inv_scale)
    if fmt == 1:
        return _unscale_array(carray(typed_pointer(address, 16), j1)[j0:], 1, inv_scale)
    return _unscale_array(carray(typed_pointer(address, 16), j1)[j0:], 2, inv_scale)


@njit(parallel=True, cache=True)
def unscale_and_check_cpu(addresses, formats, starts, inv_scales, found, per_tensor):
    """CPU: all elements of all tensors; ``inv_scales``/``found``: uint32 (fp32 bits) [1 or N].
    Work is split into equal chunks of the global element range; a chunk walks the runs of the
    tensors it covers."""
    total = starts[-1]
    chunk = 1 << 16
    for c in prange((total + chunk - 1) // chunk):
        i = c * chunk
        hi = min(i + chunk, total)
        k = find_tensor(starts, i)
        while i < hi:
            end = min(hi, starts[k + 1])
            slot = k if per_tensor else 0
            if not _unscale_run(
                addresses[k], formats[k], i - starts[k], end - starts[k], inv_scales[slot]
            ):
                found[slot] = _ONE_F32
            i = end
            k += 1


@njit(inline="always", cache=True)
def update_one(
    scale_bits,
    growth,
    overflows,
    found_bits,
    growth_factor,
    backoff_factor,
    growth_interval,
    hysteresis,
    min_scale,
    max_scale,
):
    """The rule of the module docstring for one scale (float32 bits) and its two counters;
    returns the new ``(scale_bits, growth, overflows)``."""
    current = bits_to_f32(scale_bits)
    if (found_bits & 0x7FFFFFFF) != 0:  # any nonzero float32 flag
        growth = 0
        overflows += 1
        if overflows >= hysteresis:
            current = max(current * backoff_factor, min_scale)
            overflows = 0
    else:
        overflows = 0
        growth += 1
        if growth == growth_interval:
            grown = current * growth_factor
            if math.isfinite(grown):
                current = min(grown, max_scale)
            growth = 0
    return f32_to_bits(current), growth, overflows


@njit(cache=True)
def update_scale_cpu(
    scale,
    growth_tracker,
    overflow_tracker,
    found,
    growth_factor,
    backoff_factor,
    growth_interval,
    hysteresis,
    min_scale,
    max_scale,
):
    for k in range(scale.size):
        scale[k], growth_tracker[k], overflow_tracker[k] = update_one(
            scale[k],
            growth_tracker[k],
            overflow_tracker[k],
            found[k],
            growth_factor,
            backoff_factor,
            growth_interval,
            hysteresis,
            min_scale,
            max_scale,
        )


def float32_bits(value: float) -> int:
    return int(np.float32(value).view(np.uint32))
