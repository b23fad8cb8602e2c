"""Validation shared by the view adapters (NumPy, Numba, CuPy, torch): dtype, shape and
layout checks with errors naming the argument, and the tensor-list table."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from srround._dispatch import check_shape
from srround._formats import DTYPE_CODES, FORMATS, BufferCode, Format


@dataclasses.dataclass(frozen=True)
class Dtypes:
    """One framework's dtypes and words, for the checks and error messages shared by adapters.

    Attributes:
        noun: what the framework's arrays are called (``"array"``, ``"tensor"``).
        float32, float64, int32: the framework's dtype objects.
        raw: the dtype of 16-bit narrow bit patterns (uint16), taken with ``dtype=`` given.
        narrow: the framework's dtype of each narrow format.
        cast: how to cast to float32 (suggested when float64 is rejected).
        contiguous: the layout the kernels need (``"C-contiguous"``, ``"contiguous"``).
    """

    noun: str
    float32: Any
    float64: Any
    int32: Any
    raw: Any
    narrow: dict
    cast: str
    contiguous: str = "C-contiguous"
    raw8: Any = None  # the dtype of 8-bit patterns (fp8, fp4 one per byte): uint8


NUMPY = Dtypes(
    noun="array",
    float32=np.dtype(np.float32),
    float64=np.dtype(np.float64),
    int32=np.dtype(np.int32),
    raw=np.dtype(np.uint16),
    narrow={fmt.numpy_dtype: fmt for fmt in FORMATS.values()},
    cast=".astype(np.float32)",
    raw8=np.dtype(np.uint8),
)


def _a(word: str) -> str:
    return f"an {word}" if word[0] in "aeiou" else f"a {word}"


def narrow_format(dtype, name: str, fmt: Format | None, dtypes: Dtypes = NUMPY) -> Format:
    """The format of a narrow array: from its dtype, or from ``dtype=`` for raw bit patterns
    (``uint16`` for 16-bit formats, ``uint8`` for fp8 and fp4)."""
    candidate = dtypes.narrow.get(dtype)
    if candidate is not None:
        if fmt is not None and fmt is not candidate:
            raise TypeError(f"{name}: dtype {dtype} does not match dtype={fmt.name!r}")
        return candidate
    if fmt is not None and dtype == (dtypes.raw if fmt.bits > 8 else dtypes.raw8):
        return fmt
    if fmt is not None and str(dtype).rsplit(".", 1)[-1] == fmt.name:
        return fmt  # a storage-only format of block results (float8_e8m0fnu scales)
    if fmt is not None:  # the one format the call reads: name it, not every narrow dtype
        raw = dtypes.raw if fmt.bits > 8 else dtypes.raw8
        own = [str(d) for d, f in dtypes.narrow.items() if f is fmt]
        if not own and fmt.name != str(raw):  # storage-only (e8m0 scales) or torch's fp4
            own = [fmt.name]
        if own:
            expected = f"{_a(' / '.join(own))} {dtypes.noun} (or {raw} bit patterns)"
        else:
            expected = f"{_a(str(raw))} {dtypes.noun} of bit patterns"
        raise TypeError(f"{name}: expected {expected}, got {dtype}")
    expected = ", ".join(str(d) for d in dtypes.narrow)
    hint = f" (or {dtypes.raw} / {dtypes.raw8} bit patterns with dtype= given)"
    raise TypeError(
        f"{name}: expected a narrow float {dtypes.noun} ({expected}{hint}), got {dtype}"
    )


def check_float32(dtype, name: str, dtypes: Dtypes = NUMPY) -> None:
    """A float32 array; float64 is refused with a hint (rounding through float32 rounds twice)."""
    if dtype != dtypes.float32:
        extra = ""
        if dtype == dtypes.float64:
            extra = (
                "; float64 is rejected rather than rounded through float32, which would round"
                f" twice - cast with {dtypes.cast} if that is what you want"
            )
        raise TypeError(
            f"{name}: expected {_a(str(dtypes.float32))} {dtypes.noun}, got {dtype}{extra}"
        )


def check_contiguous(is_contiguous: bool, name: str, fix: str, dtypes: Dtypes = NUMPY) -> None:
    """Contiguous memory: the kernels work in place and never copy silently."""
    if not is_contiguous:
        raise ValueError(
            f"{name}: must be {dtypes.contiguous} (srround works in place on the caller's memory"
            f" and never copies silently); pass {fix} to copy it explicitly"
        )


def check_source(
    dtype,
    is_contiguous: bool,
    name: str,
    fmt: Format | None,
    narrow: bool,
    fix: str,
    dtypes: Dtypes = NUMPY,
):
    """Checks of a read view: ``(format, bit dtype)`` - the narrow format (from the dtype or
    ``fmt``) and its ``bits_dtype`` for ``narrow``, else float32 data: ``(None, uint32)``."""
    if narrow:
        fmt = narrow_format(dtype, name, fmt, dtypes)
    else:
        check_float32(dtype, name, dtypes)
    check_contiguous(is_contiguous, name, fix, dtypes)
    return fmt, bits_of(fmt if narrow else None)


def bits_of(fmt: Format | None) -> np.dtype:
    """The dtype kernels view a buffer of ``fmt`` as (by element width); ``None``: float32."""
    return np.dtype(np.uint32) if fmt is None else fmt.bits_dtype


def check_target(
    dtype,
    shape,
    is_contiguous: bool,
    name: str,
    like_shape,
    fmt: Format | None,
    fix: str,
    dtypes: Dtypes = NUMPY,
) -> None:
    """Checks of a caller's ``out=``: float32 (``fmt=None``) or ``fmt``'s narrow dtype, the
    input's shape, contiguous."""
    if fmt is None:
        check_float32(dtype, name, dtypes)
    else:
        narrow_format(dtype, name, fmt, dtypes)
    check_shape(name, shape, like_shape, "the input's")
    check_contiguous(is_contiguous, name, fix, dtypes)


def check_counter(
    dtype, shape, is_contiguous: bool, name: str, like_shape, fix: str, dtypes: Dtypes = NUMPY
) -> None:
    """An int32 counter array updated in place: dtype, shape and contiguity."""
    if dtype != dtypes.int32:
        raise TypeError(f"{name}: expected {_a(str(dtypes.int32))} {dtypes.noun}, got {dtype}")
    check_shape(name, shape, like_shape, "the expected")
    check_contiguous(is_contiguous, name, fix, dtypes)


def buffer_code(dtype, name: str) -> BufferCode:
    """Tensor-list ``BufferCode`` of a dtype of ``CODE_DTYPES``, else a TypeError."""
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        raise TypeError(f"{name}: expected {buffer_dtypes(name)} array, got {dtype}") from None


def buffer_dtypes(name: str) -> str:
    """The dtypes a tensor-list argument may have, in words: int16 only for ``aux`` (the
    remainders of ``rounding="remainder"``); tensor lists take float32 and the 16-bit formats."""
    words = ["float32", *(name for name, fmt in FORMATS.items() if fmt.bits == 16)]
    if name.startswith("aux"):
        return f"a {', '.join(words)} or int16 (remainder mode)"
    return f"a {', '.join(words[:-1])} or {words[-1]}"


def buffer_table(arrays, name: str, buffer_info, writes: bool = True):
    """``(addresses, sizes, format codes, place)`` of arrays a tensor-list kernel reads (and
    updates in place: ``writes``); ``buffer_info(array, name, writes)`` checks one array (errors
    name ``name[i]``)."""
    infos = [buffer_info(a, f"{name}[{i}]", writes) for i, a in enumerate(arrays)]
    places = {info[3] for info in infos}
    if len(places) > 1:
        raise ValueError(
            f"{name}: arrays on several devices ({sorted(places)}); pass one"
            " device's arrays per call"
        )
    addresses, sizes, codes, _ = zip(*infos)
    return list(addresses), list(sizes), list(codes), places.pop()
