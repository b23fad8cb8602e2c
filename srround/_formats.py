"""Low-precision formats described as data.

A format is an IEEE-754-style binary layout: one sign bit, ``exponent_bits`` of biased exponent
and ``mantissa_bits`` of stored fraction. Kernels receive ``(mantissa_bits, exponent_bits)`` and
derive every constant (bias, infinity pattern, quantum) from them, so a new format (fp8 e5m2,
say) is a new entry in ``FORMATS``, not new kernel code.
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
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    numpy_dtype: np.dtype

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
        return float((2.0 - 2.0**-self.mantissa_bits) * 2.0**self.bias)

    @property
    def smallest_subnormal(self) -> float:
        return float(2.0 ** (1 - self.bias - self.mantissa_bits))


FORMATS: dict[str, Format] = {
    "bfloat16": Format("bfloat16", 8, 7, np.dtype(ml_dtypes.bfloat16)),
    "float16": Format("float16", 5, 10, np.dtype(np.float16)),
}
_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def get_format(dtype) -> Format:
    """Return the ``Format`` for a name (``"bfloat16"``, ``"bf16"``, ``"float16"``, ``"fp16"``)
    or a NumPy / ml_dtypes dtype; raise ``ValueError`` listing the valid names otherwise."""
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
