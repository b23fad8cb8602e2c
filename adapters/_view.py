"""The hand-over object between adapters and backends, and the checks every adapter shares."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class View:
    """A zero-copy view of one array argument.

    Attributes:
        bits: flat C-contiguous bit-pattern buffer the kernels take: ``uint32`` for fp32 data,
            ``uint16`` for bf16/fp16; a NumPy array (``device == "cpu"``) or a Numba device
            array (``device == "cuda"``).
        device: ``"cpu"`` or ``"cuda"``; on CUDA ``device_id`` names the GPU.
        shape: the caller's shape.
        result: what to hand back to the caller (the caller's type and dtype).
        stream: the CUDA stream to launch on (``None`` on the CPU).
        device_id: CUDA device ordinal, ``None`` on the CPU.
    """

    bits: Any
    device: str
    shape: tuple
    result: Any
    stream: Any = None
    device_id: int | None = None

    @property
    def where(self) -> str:
        return self.device if self.device_id is None else f"{self.device}:{self.device_id}"


def check_same_place(**views: View) -> None:
    """Raise ``ValueError`` if the views are on different devices (no silent transfers)."""
    items = [(name, v) for name, v in views.items() if v is not None]
    first_name, first = items[0]
    for name, view in items[1:]:
        if view.where != first.where:
            raise ValueError(
                f"{name}: is on {view.where} but {first_name} is on {first.where}; move both to"
                " one device first"
            )


def check_shape(name: str, shape: tuple, expected: tuple, expected_from: str) -> None:
    if tuple(shape) != tuple(expected):
        raise ValueError(
            f"{name}: shape {tuple(shape)} does not match {expected_from} shape {tuple(expected)}"
        )


def describe_dtype(expected) -> str:
    return " or ".join(str(e) for e in expected) if isinstance(expected, tuple) else str(expected)
