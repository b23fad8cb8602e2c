"""The optimizer planner: validate the buffers of a fused step and build its pointer table.

One planner serves ``srround.adamw_step`` / ``sgd_step`` and the torch optimizers
(``srround.adapters.torch.AdamW`` / ``SGD``): the rounding-mode rules, the buffer checks (formats,
sizes, one device) and the table (columns: ``_elements.Column``) are written once, here. Buffers
are described by an array adapter's ``buffer_table(arrays, name)`` (``srround._dispatch``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from . import _validate
from ._elements import (
    AUX_ADDR,
    G_ADDR,
    G_FMT,
    GROUP,
    NOISE,
    NOISE_RUN,
    NOISE_SKIP,
    P_ADDR,
    P_FMT,
    S1_ADDR,
    S1_SCALE,
    S2_ADDR,
    S2_SCALE,
    TABLE_COLUMNS,
    Mode,
)
from ._formats import CODE_WIDTH, FORMATS, BufferCode, code_name
from ._state8 import FP8_CODES, STATE_BLOCK, block_counts

__all__ = ["RoundingError", "Plan", "check_rounding", "check_param_codes", "plan_step"]

#: Codes a parameter or gradient may have (fp32 and the 16-bit formats: the optimizer and
#: loss-scale elements treat every narrow code as IEEE-like, which fp8 e4m3fn and fp4 are not);
#: codes a state buffer may have (fp8 ones too where the step takes block scales).
FLOAT_CODES = (BufferCode.FLOAT32, *(fmt.code for fmt in FORMATS.values() if fmt.bits == 16))
STATE_CODES = (BufferCode.FLOAT32, BufferCode.BFLOAT16)
#: Parameter codes the ``"remainder"`` mode can take (its aux holds the low half of fp32).
REMAINDER_CODES = (BufferCode.FLOAT32, BufferCode.BFLOAT16)


class RoundingError(ValueError, TypeError):
    """A ``rounding=`` mode that is unknown or that the given buffers cannot use.

    A ``ValueError`` (a bad argument value) and a ``TypeError`` (a buffer of the wrong dtype for
    the mode), so either ``except`` catches it.
    """


def _names(codes) -> str:
    names = [code_name(c) for c in codes]
    return ", ".join(names[:-1]) + " or " + names[-1]


_MODES = {mode.name.lower(): mode for mode in Mode}


def check_rounding(rounding) -> Mode:
    """The ``Mode`` of a ``rounding=`` name, else a ``RoundingError`` listing the names."""
    mode = _MODES.get(rounding) if isinstance(rounding, str) else None
    if mode is None:
        raise RoundingError(f"rounding: expected one of {sorted(_MODES)}, got {rounding!r}")
    return mode


def _first_bad(codes, allowed):
    """Index of the first code of ``codes`` not in ``allowed``, else None (a set test first:
    lists of hundreds of tensors)."""
    if set(codes) <= set(allowed):
        return None
    return next(i for i, c in enumerate(codes) if c not in allowed)


def _check_codes(name, codes, allowed, expected=None, where=""):
    i = _first_bad(codes, allowed)
    if i is not None:
        expected = expected or _names(allowed)
        raise TypeError(f"{name}[{i}]{where}: expected {expected}, got {code_name(codes[i])}")


def check_grad_codes(name, codes) -> None:
    """Gradient codes are float formats, else a TypeError naming ``name[i]``."""
    _check_codes(name, codes, FLOAT_CODES)


def check_param_codes(codes, mode: Mode, name: str = "params", where: str = "") -> None:
    """Parameter codes are float formats, and ones the weight mode can write (errors name
    ``name[i]``, then ``where``: e.g. the param group).

    Raises:
        TypeError: a parameter of another dtype.
        RoundingError: ``"remainder"`` with a parameter other than bfloat16 or float32.
    """
    _check_codes(name, codes, FLOAT_CODES, where=where)
    if mode == Mode.REMAINDER:
        i = _first_bad(codes, REMAINDER_CODES)
        if i is not None:
            raise RoundingError(
                f"{name}[{i}]{where}: rounding='remainder' needs {_names(REMAINDER_CODES)}"
                " parameters,"
                f" got {code_name(codes[i])} (use 'master' or 'kahan')"
            )


# weight mode -> (aux code for a parameter of code c, description of the aux dtype)
_AUX = {
    Mode.KAHAN: (lambda c: c, "the parameter's dtype"),
    Mode.MASTER: (lambda c: BufferCode.FLOAT32, "float32"),
    Mode.REMAINDER: (lambda c: BufferCode.INT16, "int16"),
}


def needs_aux(mode: Mode) -> bool:
    """Whether the weight mode keeps a buffer per bf16/fp16 parameter."""
    return mode in _AUX


@dataclasses.dataclass
class Plan:
    """A planned fused step.

    Attributes:
        table: int64[N, len(Column)] host pointer table.
        sizes: elements per tensor.
        state_fmt: ``BufferCode`` of every state buffer (FLOAT32 when there is none).
        place: where the buffers live (``"cpu"``, ``"cuda:0"``, ...).
        spans: every buffer's ``(name, address, nbytes, writes)``, checked for shared memory
            (``_validate.no_overlap``) by ``plan_step``; callers add their own buffers.
    """

    table: np.ndarray
    sizes: list
    state_fmt: BufferCode
    place: str
    spans: list = dataclasses.field(default_factory=list)


def _columns(
    adapter, arrays, name, sizes, place, allowed, expected=None, size_rule=None, writes=True
):
    """Addresses and codes of one buffer list, checked against the parameters' sizes (or the
    sizes ``size_rule`` names) and place; ``None`` entries (no buffer) give address 0 and
    code 0. ``writes=False``: the step only reads the list (read-only arrays are taken)."""
    present = [i for i, a in enumerate(arrays) if a is not None]
    addresses, codes = [0] * len(arrays), [0] * len(arrays)
    if present:
        adds, got, cods, where = adapter.buffer_table(
            [arrays[i] for i in present], name, writes=writes
        )
        if where != place:
            raise ValueError(f"{name}: on {where}, but params are on {place}")
        bad = _first_bad(cods, allowed)
        if bad is not None:
            expected = expected or _names(allowed)
            i = present[bad]
            raise TypeError(f"{name}[{i}]: expected {expected}, got {code_name(cods[bad])}")
        for i, a, n, c in zip(present, adds, got, cods):
            if n != sizes[i] and size_rule:
                raise ValueError(f"{name}[{i}]: {n} elements, expected {sizes[i]} ({size_rule})")
            if n != sizes[i]:
                raise ValueError(f"{name}[{i}]: {n} elements, but params[{i}] has {sizes[i]}")
            addresses[i], codes[i] = a, c
    return addresses, codes


def plan_step(
    adapter,
    rounding,
    params,
    grads,
    states,
    aux,
    groups=None,
    noise=None,
    scales=None,
    runs=None,
) -> Plan:
    """Validate the buffer lists of a fused step and build its pointer table.

    Args:
        adapter: an array adapter (``buffer_table(arrays, name)``).
        rounding: the ``rounding=`` name (or a ``Mode``).
        params, grads: lists of arrays, one gradient per parameter (same sizes, same place).
        states: ``((label, arrays or None), (label, arrays or None))``: the first and second
            state lists (float32 or bfloat16, one dtype for all); ``None`` entries: no buffer.
        aux: the weight mode's buffers, one per parameter (``None`` for float32 parameters),
            or ``None`` for modes without one.
        groups: the parameter-group index of each parameter (default 0).
        noise: the stream start of each parameter's element 0 (default: the prefix sums of
            the sizes, each tensor's start in the table's element range).
        scales: ``((label, arrays or None), (label, arrays or None))``: the float32 block
            scales of fp8 states (``_state8``), one list per state; ``None`` (the default):
            the step takes no fp8 states.
        runs: per parameter ``(run, skip)``, the table's ``NOISE_RUN`` and ``NOISE_SKIP``
            (``_elements.run_noise``; default: every stream one range from ``noise``).

    Raises:
        RoundingError: an unknown mode, or parameters the mode cannot write.
        TypeError: a buffer of a dtype the step cannot take.
        ValueError: sizes or devices that do not match, missing aux buffers.
    """
    mode = check_rounding(rounding) if isinstance(rounding, str) else Mode(rounding)
    count = len(params)
    p_addr, sizes, p_codes, place = adapter.buffer_table(params, "params")
    check_param_codes(p_codes, mode)
    g_addr, g_codes = _columns(adapter, grads, "grads", sizes, place, FLOAT_CODES, writes=False)
    spans = _validate.list_spans("params", p_addr, sizes, p_codes, CODE_WIDTH, True)
    spans += _validate.list_spans("grads", g_addr, sizes, g_codes, CODE_WIDTH, False)
    columns, state_fmt = [], None
    allowed = STATE_CODES if scales is None else (*STATE_CODES, *FP8_CODES)
    for label, arrays in states:
        if arrays is None:
            columns.append([0] * count)
            continue
        addrs, codes = _columns(adapter, arrays, label, sizes, place, allowed)
        for i, (a, c) in enumerate(zip(arrays, codes)):
            if a is None:
                continue
            if state_fmt is not None and c != state_fmt:
                raise TypeError(
                    f"{label}[{i}]: every state must have one dtype ({_names(allowed)})"
                )
            state_fmt = c
        columns.append(addrs)
        present = [i for i, a in enumerate(arrays) if a is not None]
        spans += _validate.list_spans(label, addrs, sizes, codes, CODE_WIDTH, True, present)
    scale_columns = [[0] * count, [0] * count]
    if scales is not None:
        scale_columns, scale_spans = _scale_columns(
            adapter, scales, states, state_fmt in FP8_CODES, sizes, place
        )
        spans += scale_spans
    aux_addr = [0] * count
    if mode in _AUX:
        code_of, expected = _AUX[mode]
        if aux is None and any(c != BufferCode.FLOAT32 for c in p_codes):
            raise ValueError(
                f"aux: rounding={mode.name.lower()!r} needs one buffer per parameter"
                f" ({expected}; None for float32 parameters)"
            )
        aux = [None] * count if aux is None else aux  # float32 parameters only: none needed
        aux = [a if c != BufferCode.FLOAT32 else None for a, c in zip(aux, p_codes)]
        aux_addr, a_codes = _columns(adapter, aux, "aux", sizes, place, tuple(BufferCode), expected)
        for i, (a, c) in enumerate(zip(aux, p_codes)):
            if a is None and c != BufferCode.FLOAT32:
                raise ValueError(
                    f"aux[{i}]: missing ({expected} buffer for rounding={mode.name.lower()!r})"
                )
            if a is not None and a_codes[i] != code_of(c):
                raise TypeError(f"aux[{i}]: expected {expected} for rounding={mode.name.lower()!r}")
        present = [i for i, a in enumerate(aux) if a is not None]
        spans += _validate.list_spans("aux", aux_addr, sizes, a_codes, CODE_WIDTH, True, present)
    table = np.zeros((count, TABLE_COLUMNS), np.int64)
    table[:, P_ADDR], table[:, P_FMT] = p_addr, p_codes
    table[:, G_ADDR], table[:, G_FMT] = g_addr, g_codes
    table[:, S1_ADDR], table[:, S2_ADDR] = columns
    table[:, AUX_ADDR] = aux_addr
    table[:, S1_SCALE], table[:, S2_SCALE] = scale_columns
    if groups is not None:
        table[:, GROUP] = groups
    if noise is None:
        noise = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)[:-1]]) if count else []
    table[:, NOISE] = noise
    if runs is not None and count:
        table[:, NOISE_RUN], table[:, NOISE_SKIP] = np.array(runs, np.int64).reshape(count, 2).T
    state = BufferCode.FLOAT32 if state_fmt is None else BufferCode(state_fmt)
    _validate.no_overlap(spans)  # sorted once per table: shared memory between any two buffers
    return Plan(table, sizes, state, place, spans)


def _scale_columns(adapter, scales, states, fp8, sizes, place):
    """Addresses of the block-scale lists (``plan_step``'s ``scales``) and their spans: float32,
    ``ceil(size / STATE_BLOCK)`` per tensor, given exactly when the states are fp8."""
    counts = block_counts(sizes)
    columns, spans = [], []
    for (label, arrays), (state_label, state_arrays) in zip(scales, states):
        if not fp8 or state_arrays is None:
            if arrays is not None:
                raise ValueError(f"{label}: block scales are only for float8 {state_label}")
            columns.append([0] * len(sizes))
            continue
        if arrays is None:
            raise ValueError(
                f"{label}: float8 {state_label} need float32 block scales, one array per"
                f" param of ceil(size / {STATE_BLOCK}) elements, zeros at the first step"
            )
        rule = f"ceil(params[i].size / {STATE_BLOCK})"
        addrs, codes = _columns(
            adapter, arrays, label, counts, place, (BufferCode.FLOAT32,), "float32", rule
        )
        columns.append(addrs)
        spans += _validate.list_spans(label, addrs, counts, codes, CODE_WIDTH, True)
    return columns, spans
