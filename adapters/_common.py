"""Validation shared by the NumPy and Numba adapters (both expose NumPy dtypes and flags)."""

from __future__ import annotations

import numpy as np

from srround._formats import FORMATS, Format

from ._view import check_shape


def narrow_format(dtype, name: str, fmt: Format | None) -> Format:
    """The format of a narrow array: from its dtype, or from ``dtype=`` for raw ``uint16``."""
    for candidate in FORMATS.values():
        if dtype == candidate.numpy_dtype:
            if fmt is not None and fmt is not candidate:
                raise TypeError(f"{name}: dtype {dtype} does not match dtype={fmt.name!r}")
            return candidate
    if dtype == np.uint16 and fmt is not None:
        return fmt
    expected = ", ".join(str(f.numpy_dtype) for f in FORMATS.values())
    hint = " (or uint16 bit patterns with dtype= given)"
    raise TypeError(f"{name}: expected a narrow float array ({expected}{hint}), got {dtype}")


def check_float32(dtype, name: str) -> None:
    if dtype != np.float32:
        extra = ""
        if dtype == np.float64:
            extra = (
                "; float64 is rejected rather than rounded through float32, which would round"
                " twice - cast with .astype(np.float32) if that is what you want"
            )
        raise TypeError(f"{name}: expected a float32 array, got {dtype}{extra}")


def check_contiguous(is_contiguous: bool, name: str, fix: str) -> None:
    if not is_contiguous:
        raise ValueError(
            f"{name}: must be C-contiguous (srround works in place on the caller's memory and"
            f" never copies silently); pass {fix} to copy it explicitly"
        )


def check_source(dtype, is_contiguous: bool, name: str, fmt: Format | None, narrow: bool, fix: str):
    """Checks of a read view: ``(format, bit dtype)`` - the narrow format (from the dtype or
    ``fmt``) and ``uint16`` for ``narrow``, else float32 data: ``(None, uint32)``."""
    if narrow:
        fmt = narrow_format(dtype, name, fmt)
    else:
        check_float32(dtype, name)
    check_contiguous(is_contiguous, name, fix)
    return fmt, np.uint16 if narrow else np.uint32


def check_counter(dtype, shape, is_contiguous: bool, name: str, like_shape, fix: str) -> None:
    """An int32 counter array updated in place: dtype, shape and contiguity."""
    if dtype != np.int32:
        raise TypeError(f"{name}: expected an int32 array, got {dtype}")
    check_shape(name, shape, like_shape, "the expected")
    check_contiguous(is_contiguous, name, fix)


# format codes of the tensor-list kernels (srround._tensor_list), by NumPy dtype
# (int16: the raw 16-bit remainders of the optimizers' "remainder" weight mode)
BUFFER_CODES = {
    np.dtype(np.float32): 0,
    FORMATS["bfloat16"].numpy_dtype: 1,
    FORMATS["float16"].numpy_dtype: 2,
    np.dtype(np.int16): 3,
}


def buffer_code(dtype, name: str) -> int:
    """Tensor-list format code of a float32 / bf16 / fp16 dtype, else a TypeError."""
    try:
        return BUFFER_CODES[dtype]
    except KeyError:
        expected = ", ".join(str(d) for d in BUFFER_CODES)
        raise TypeError(f"{name}: expected a {expected} array, got {dtype}") from None


def buffer_table(arrays, name: str, buffer_info):
    """``(addresses, sizes, format codes, place)`` of arrays updated in place by a tensor-list
    kernel; ``buffer_info(array, name)`` checks one array (errors name ``name[i]``)."""
    infos = [buffer_info(a, f"{name}[{i}]") for i, a in enumerate(arrays)]
    places = {info[3] for info in infos}
    if len(places) > 1:
        raise ValueError(
            f"{name}: arrays on several devices ({sorted(places)}); pass one"
            " device's arrays per call"
        )
    addresses, sizes, codes, _ = zip(*infos)
    return list(addresses), list(sizes), list(codes), places.pop()
