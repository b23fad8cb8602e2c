"""Low-precision formats described as data.

A format is an IEEE-754-style binary layout: one sign bit, ``exponent_bits`` of biased exponent
and ``mantissa_bits`` of stored fraction. Kernels receive ``(mantissa_bits, exponent_bits)`` and
derive every constant (bias, infinity pattern, quantum) from them, so a new format (fp8 e5m2,
say) is a new entry in ``FORMATS``, not new kernel code. ``specials`` says what the top patterns
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
Narrow patterns of up to 8 bits are stored one per byte (``uint8``), wider ones in ``uint16``.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np


@dataclasses.dataclass(frozen=True)
class Format:
    """A binary floating-point storage format narrower than float32.

    Attributes:
        name: canonical name, e.g. ``"bfloat16"``.
        exponent_bits: width of the biased exponent field.
        mantissa_bits: width of the stored fraction field (no implicit bit).
        numpy_dtype: the NumPy dtype holding the format (``ml_dtypes.bfloat16`` for bf16).
        specials: 0 (IEEE: all-ones exponent is inf/NaN), 1 (FN: only all ones is NaN, no inf)
            or 2 (FINITE: no inf, no NaN), the codes of ``srround._scalar``.
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    numpy_dtype: np.dtype
    specials: int = 0

    @property
    def storage(self) -> np.dtype:
        """The unsigned integer dtype of one bit pattern: uint8 up to 8 bits, else uint16."""
        return np.dtype(np.uint8 if self.bits <= 8 else np.uint16)

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

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
    "bfloat16": Format("bfloat16", 8, 7, np.dtype(ml_dtypes.bfloat16)),
    "float16": Format("float16", 5, 10, np.dtype(np.float16)),
    "float8_e4m3fn": Format("float8_e4m3fn", 4, 3, np.dtype(ml_dtypes.float8_e4m3fn), 1),
    "float8_e5m2": Format("float8_e5m2", 5, 2, np.dtype(ml_dtypes.float8_e5m2)),
    "float4_e2m1fn": Format("float4_e2m1fn", 2, 1, np.dtype(ml_dtypes.float4_e2m1fn), 2),
}
_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "fp4_e2m1": "float4_e2m1fn",
}


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


OVERFLOW_POLICIES = {"inf": False, "saturate": True}  # name -> saturate flag of the kernels


def saturate_flag(overflow) -> bool:
    """The kernels' ``saturate`` flag of an ``overflow=`` policy name, else a ValueError."""
    try:
        return OVERFLOW_POLICIES[overflow]
    except (KeyError, TypeError):
        raise ValueError(
            f"overflow: expected one of {sorted(OVERFLOW_POLICIES)}, got {overflow!r}"
        ) from None
