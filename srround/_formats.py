"""Low-precision formats and buffer codes, described as data.

A format is an IEEE-754-style binary layout: one sign bit, ``exponent_bits`` of biased exponent
and ``mantissa_bits`` of stored fraction. Kernels receive ``(mantissa_bits, exponent_bits)`` and
derive every constant (bias, infinity pattern, quantum) from them.

Buffers of tensor-list kernels (pointer tables) carry a ``BufferCode``; ``CODE_DTYPES`` maps each
code to its NumPy dtype, and the kernels look up a code's field widths and element width (1, 2
or 4 bytes) in tables built here from ``FORMATS``. Adding a format is a new ``BufferCode``
member and a new ``FORMATS`` entry, not new kernel code. ``specials`` says what the top patterns
mean (``_scalar.IEEE``, ``FN`` or ``FINITE``):

======================  =====  ========  =====================  ===========  ============
format                  e, m   max       specials               NaN input    inf input
======================  =====  ========  =====================  ===========  ============
bfloat16, float16       8,7 /  3.4e38 /  IEEE: inf, NaN         quiet NaN    inf
                        5,10   65504
float8_e5m2             5, 2   57344     IEEE: inf, NaN         0x7E (qNaN)  inf
float8_e4m3fn           4, 3   448       FN: 0x7F/0xFF is NaN   0x7F         NaN; 448 (sat)
float4_e2m1fn           2, 1   6         FINITE: no inf or NaN  +-0          +-6
======================  =====  ========  =====================  ===========  ============

A finite value past the largest finite one becomes, with ``overflow="inf"`` (the format's own
rule, ml_dtypes' casts), inf (IEEE), NaN (e4m3fn) or +-6 (e2m1fn, which has neither); with
``overflow="saturate"`` the largest finite value (torch's e4m3fn cast, inf included there).
fp8 and fp4 are stored one value per byte.
"""

from __future__ import annotations

import dataclasses
import enum

import ml_dtypes
import numpy as np


class BufferCode(enum.IntEnum):
    """Format code of a buffer in a pointer table (the ``*_FMT`` columns, ``TensorList.formats``).

    ``INT16`` holds raw signed 16-bit integers (the optimizers' ``"remainder"`` buffers).
    """

    FLOAT32 = 0
    BFLOAT16 = 1
    FLOAT16 = 2
    INT16 = 3
    FLOAT8_E4M3FN = 4
    FLOAT8_E5M2 = 5
    FLOAT4_E2M1FN = 6


@dataclasses.dataclass(frozen=True)
class Format:
    """A binary floating-point storage format narrower than float32.

    Attributes:
        name: canonical name, e.g. ``"bfloat16"``.
        exponent_bits: width of the biased exponent field.
        mantissa_bits: width of the stored fraction field (no implicit bit).
        numpy_dtype: the NumPy dtype holding the format (``ml_dtypes.bfloat16`` for bf16).
        code: the format's ``BufferCode`` in pointer tables (``None``: a storage-only format
            of block results, never in a table).
        specials: 0 (IEEE: all-ones exponent is inf/NaN), 1 (FN: only all ones is NaN, no inf)
            or 2 (FINITE: no inf, no NaN), the codes of ``srround._scalar``.
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    numpy_dtype: np.dtype
    code: BufferCode | None = None
    specials: int = 0

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def width(self) -> int:
        """Bytes per stored element (1, 2 or 4)."""
        return self.numpy_dtype.itemsize

    @property
    def bits_dtype(self) -> np.dtype:
        """The unsigned integer dtype kernels view the format's buffers as."""
        return bits_dtype(self.width)

    @property
    def bias(self) -> int:
        return (1 << (self.exponent_bits - 1)) - 1

    @property
    def inf_bits(self) -> int:
        """Bit pattern of +inf (exponent all ones, fraction zero)."""
        return ((1 << self.exponent_bits) - 1) << self.mantissa_bits

    @property
    def max_finite(self) -> float:
        if self.specials == 0:  # the all-ones exponent is taken by inf/NaN
            return float((2.0 - 2.0**-self.mantissa_bits) * 2.0**self.bias)
        top = (1 << self.exponent_bits) - 1 - self.bias  # the all-ones exponent holds numbers
        fraction = (1 << self.mantissa_bits) - (1 if self.specials == 1 else 0)
        return float((1.0 + (fraction - 1) * 2.0**-self.mantissa_bits) * 2.0**top)

    @property
    def smallest_subnormal(self) -> float:
        return float(2.0 ** (1 - self.bias - self.mantissa_bits))


FORMATS: dict[str, Format] = {
    "bfloat16": Format("bfloat16", 8, 7, np.dtype(ml_dtypes.bfloat16), BufferCode.BFLOAT16),
    "float16": Format("float16", 5, 10, np.dtype(np.float16), BufferCode.FLOAT16),
    "float8_e4m3fn": Format(
        "float8_e4m3fn", 4, 3, np.dtype(ml_dtypes.float8_e4m3fn), BufferCode.FLOAT8_E4M3FN, 1
    ),
    "float8_e5m2": Format(
        "float8_e5m2", 5, 2, np.dtype(ml_dtypes.float8_e5m2), BufferCode.FLOAT8_E5M2
    ),
    "float4_e2m1fn": Format(
        "float4_e2m1fn", 2, 1, np.dtype(ml_dtypes.float4_e2m1fn), BufferCode.FLOAT4_E2M1FN, 2
    ),
}
_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "fp4_e2m1": "float4_e2m1fn",
}

_BITS_DTYPES = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32)}


def bits_dtype(width: int) -> np.dtype:
    """The unsigned integer dtype of ``width``-byte elements (1, 2 or 4): how kernels see them."""
    return _BITS_DTYPES[width]


#: NumPy dtype of every buffer code.
CODE_DTYPES: dict[BufferCode, np.dtype] = {
    BufferCode.FLOAT32: np.dtype(np.float32),
    **{fmt.code: fmt.numpy_dtype for fmt in FORMATS.values()},
    BufferCode.INT16: np.dtype(np.int16),
}
#: Buffer code of every NumPy dtype of ``CODE_DTYPES``.
DTYPE_CODES: dict[np.dtype, BufferCode] = {dtype: code for code, dtype in CODE_DTYPES.items()}


def code_name(code) -> str:
    """Readable name of a buffer code, for error messages (``"bfloat16"``, ``"int16"``)."""
    return str(CODE_DTYPES[BufferCode(code)])


def _code_table(field, fp32_value, int16_value):
    """Per-code values (a tuple indexed by code) for the kernels: ``field(fmt)`` of each
    narrow format, ``fp32_value`` for FLOAT32, ``int16_value`` for INT16."""
    by_code = {BufferCode.FLOAT32: fp32_value, BufferCode.INT16: int16_value}
    by_code.update({fmt.code: field(fmt) for fmt in FORMATS.values()})
    return tuple(by_code[code] for code in sorted(BufferCode))


#: Kernel tables indexed by buffer code: mantissa and exponent bits (float32's own for FLOAT32,
#: 0 for INT16) and element width in bytes.
CODE_MANTISSA_BITS = _code_table(lambda f: f.mantissa_bits, 23, 0)
CODE_EXPONENT_BITS = _code_table(lambda f: f.exponent_bits, 8, 0)
CODE_WIDTH = _code_table(lambda f: f.width, 4, 2)
#: ``specials`` code and the float32 bits of the largest finite value, by buffer code.
CODE_SPECIALS = _code_table(lambda f: f.specials, 0, 0)
CODE_MAX_BITS = _code_table(lambda f: int(np.float32(f.max_finite).view(np.uint32)), 0x7F7FFFFF, 0)


def get_format(dtype) -> Format:
    """Return the ``Format`` for a name (``"bfloat16"``, ``"bf16"``, ``"float16"``, ``"fp16"``,
    ``"float8_e4m3fn"``, ``"float8_e5m2"``, ``"float4_e2m1fn"``, ...) or a NumPy / ml_dtypes /
    framework dtype; raise ``ValueError`` listing the valid names otherwise."""
    if isinstance(dtype, Format):
        return dtype
    if isinstance(dtype, str):
        name = _ALIASES.get(dtype.lower(), dtype.lower())
        if name in FORMATS:
            return FORMATS[name]
    else:
        try:
            np_dtype = np.dtype(dtype)
        except TypeError:
            np_dtype = None
        for fmt in FORMATS.values():
            if np_dtype == fmt.numpy_dtype:
                return fmt
        name = getattr(dtype, "__name__", None) or str(dtype)
        # framework dtypes (torch.bfloat16, jnp.bfloat16) spell themselves "...bfloat16"
        short = name.rsplit(".", 1)[-1]
        if short in FORMATS:
            return FORMATS[short]
    valid = ", ".join(repr(n) for n in [*FORMATS, *_ALIASES])
    raise ValueError(f"dtype: unsupported target format {dtype!r}; expected one of {valid}")


def check_fp4_top(top: int, name: str) -> None:
    """fp4 is one code per byte, ``0x00``-``0x0F``: an input whose largest byte ``top`` is above
    (the high nibble of torchao's two-per-byte ``float4_e2m1fn_x2``) is a ValueError naming
    ``name``."""
    if top > 0xF:
        raise ValueError(
            f"{name}: holds byte 0x{top:02X}, not an fp4 code: float4_e2m1fn is one value per"
            " byte (0x00-0x0F); unpack two-per-byte data (torch.float4_e2m1fn_x2) first"
        )


def check_float32_dtype(dtype, name="dtype") -> None:
    """A ``dtype=`` that may only be float32: ``"float32"``, NumPy's, or a framework's dtype
    object spelled ``"...float32"`` (``torch.float32``), as ``get_format`` reads them; else a
    ValueError naming ``name``."""
    if isinstance(dtype, str):
        ok = dtype == "float32"
    else:
        try:
            ok = np.dtype(dtype) == np.float32
        except TypeError:
            ok = str(dtype).rsplit(".", 1)[-1] == "float32"
    if not ok:
        raise ValueError(f"{name}: only float32 is supported, got {dtype!r}")


OVERFLOW_POLICIES = {"inf": False, "saturate": True}  # name -> saturate flag of the kernels


def saturate_flag(overflow) -> bool:
    """The kernels' ``saturate`` flag of an ``overflow=`` policy name, else a ValueError."""
    try:
        return OVERFLOW_POLICIES[overflow]
    except (KeyError, TypeError):
        raise ValueError(
            f"overflow: expected one of {sorted(OVERFLOW_POLICIES)}, got {overflow!r}"
        ) from None
