"""Checks of the scalar arguments of the functional API, in one place, run before any buffer is
viewed or any kernel launched. Each error names the argument, says what was expected and what
was given.

The ranges are those of the torch classes the functions mirror (``torch.optim.AdamW``,
``torch.optim.SGD``, ``torch.amp.GradScaler``), plus finiteness, which torch leaves to the
user: a NaN learning rate writes NaN into every weight.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import numpy as np

_F32_MAX = float(np.finfo(np.float32).max)
# float64 values from here on round to inf in float32 (round to nearest even)
F32_ROUNDS_TO_INF = 2.0**128 - 2.0**103


def _describe(value) -> str:
    shape = getattr(value, "shape", None)
    if shape is not None and not isinstance(value, np.generic):
        return f"an array of shape {tuple(shape)} ({type(value).__module__}.{type(value).__name__})"
    return f"{value!r} ({type(value).__name__})"


def number(value, name: str) -> float:
    """``value`` as a Python float: a real number (int, float, NumPy scalar; not bool, str,
    array or complex), else a ``TypeError`` naming ``name``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        fix = ""
        if getattr(value, "shape", None) is not None:
            fix = "; pass a Python float (e.g. float(x.item()) for a one-element array)"
        raise TypeError(f"{name}: expected a real number, got {_describe(value)}{fix}")
    return float(value)


def real(
    value,
    name: str,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    finite: bool = True,
    float32: bool = True,
) -> float:
    """A real number in a range: ``number(value)``, finite (unless ``finite=False``), within
    ``[low, high]`` (``low_open`` / ``high_open``: the bound itself excluded), and, with
    ``float32``, finite as a float32 too (the kernels compute in float32). Returns the float."""
    x = number(value, name)
    if finite and not math.isfinite(x):
        raise ValueError(f"{name}: expected a finite number, got {x!r}")
    if math.isnan(x):
        raise ValueError(f"{name}: expected a number, got nan")
    if float32 and finite and abs(x) > _F32_MAX:
        raise ValueError(f"{name}: {x!r} overflows float32 (largest finite: {_F32_MAX:.6g})")
    too_low = low is not None and (x <= low if low_open else x < low)
    too_high = high is not None and (x >= high if high_open else x > high)
    if too_low or too_high:
        left = "(" if low_open else "["
        right = ")" if high_open else "]"
        lo = "-inf" if low is None else repr(low)
        hi = "inf" if high is None else repr(high)
        raise ValueError(f"{name}: expected a value in {left}{lo}, {hi}{right}, got {x!r}")
    return x


def integer(value, name: str, *, low: int, high: int | None = None) -> int:
    """An int (Python or NumPy integer; not bool, not a float such as 2.5 or 2.0) in
    ``[low, high)``. Returns the int."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {_describe(value)}")
    n = int(value)
    if n < low or (high is not None and n >= high):
        bound = f">= {low}" if high is None else f"in [{low}, {high})"
        raise ValueError(f"{name}: expected an int {bound}, got {n}")
    return n


def steps_taken(count: float, name: str, max_steps: int) -> None:
    """A step count (steps taken: the kernels add 1 before use) that can take one more step: a
    whole number in ``[0, max_steps - 1)``, so step ``count + 1`` is in ``[1, max_steps)``.
    Below, AdamW's bias correction ``1 - beta1**0`` is 0 (NaN weights); beyond, the noise
    offsets leave the stream (``docs/contracts.md``, section 3)."""
    count = float(count)
    if 0 <= count < max_steps - 1 and count == math.floor(count):
        return
    shown = int(count) if math.isfinite(count) and count == math.floor(count) else count
    raise ValueError(
        f"{name}: {shown} steps taken; expected a whole number in [0, {max_steps - 1}) (the"
        f" next step, counted from 1, must be below {max_steps})"
    )


def flag(value, name: str) -> bool:
    """A bool (Python or NumPy)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {_describe(value)}")
    return bool(value)


def inv_scale(value, name: str = "inv_scale") -> float:
    """A host ``inv_scale``: positive and finite, also as a float32 (1e-50 rounds to 0)."""
    x = real(value, name, low=0.0, low_open=True)
    if np.float32(x) == 0:
        raise ValueError(f"{name}: {x!r} rounds to 0 in float32; expected a positive scale")
    return x


def adamw(lr, betas, eps, weight_decay) -> tuple[float, float, float, float, float]:
    """``(lr, beta1, beta2, eps, weight_decay)`` checked as ``torch.optim.AdamW`` does, and
    finite: lr >= 0, 0 <= beta < 1, eps >= 0, weight_decay >= 0."""
    lr = real(lr, "lr", low=0.0)
    pair = hasattr(betas, "__len__") and getattr(betas, "ndim", 1) == 1  # (0-d arrays: no len)
    if isinstance(betas, (str, bytes)) or not pair or len(betas) != 2:
        raise TypeError(f"betas: expected a pair (beta1, beta2), got {_describe(betas)}")
    beta1 = real(betas[0], "betas[0]", low=0.0, high=1.0, high_open=True)
    beta2 = real(betas[1], "betas[1]", low=0.0, high=1.0, high_open=True)
    eps = real(eps, "eps", low=0.0)
    weight_decay = real(weight_decay, "weight_decay", low=0.0)
    adamw_coefficients(lr, beta1, weight_decay)
    return lr, beta1, beta2, eps, weight_decay


def adamw_coefficients(
    lr: float,
    beta1: float,
    weight_decay: float,
    where: str = "",
    names: tuple[str, str, str] = ("lr", "betas[0]", "weight_decay"),
) -> None:
    """The step's coefficients within float32: the first step's step size ``lr / (1 - beta1)``
    (the largest of any step: the bias correction ``1 - beta1**t`` grows with t) and the decay
    factor ``1 - lr * weight_decay``. Beyond, the step would compute ``inf * 0 = NaN`` where a
    first moment or a weight is 0 (torch's for-each AdamW raises there; its fused one writes
    the NaN). ``ValueError`` naming the learning rate; ``where``: a suffix for the names (a
    param group); ``names``: the front end's names of the three arguments."""
    lr_name = names[0]
    # plain float arithmetic (torch.compile traces the torch optimizers' checks): float64
    # holds both values
    step_size = float(lr) / (1.0 - float(beta1))
    decay = 1.0 - float(lr) * float(weight_decay)
    for value, what in ((step_size, "{0} / (1 - {1})"), (decay, "1 - {0} * {2}")):
        if abs(value) >= F32_ROUNDS_TO_INF:  # the names formatted on failure only
            raise ValueError(
                f"{lr_name}{where}: {what.format(*names)} = {value:.4g} overflows float32"
                f" (largest finite: {_F32_MAX:.6g}): the step would write NaN"
            )


def sgd(lr, momentum, dampening, weight_decay, nesterov) -> tuple[float, float, float, float, bool]:
    """``(lr, momentum, dampening, weight_decay, nesterov)`` checked as ``torch.optim.SGD``
    does, and finite: lr >= 0, momentum >= 0, weight_decay >= 0, nesterov a bool that needs
    momentum > 0 and dampening == 0."""
    lr = real(lr, "lr", low=0.0)
    momentum = real(momentum, "momentum", low=0.0)
    dampening = real(dampening, "dampening")
    weight_decay = real(weight_decay, "weight_decay", low=0.0)
    nesterov = flag(nesterov, "nesterov")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("nesterov: needs momentum > 0 and dampening == 0 (as torch.optim.SGD)")
    return lr, momentum, dampening, weight_decay, nesterov


def scale_update(growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale):
    """``update_scale``'s factors: growth_factor >= 1 and backoff_factor in (0, 1] (torch
    GradScaler's > 1 and < 1, with 1 allowed for a static scale), int growth_interval and
    hysteresis >= 1 (int32 counters), min_scale >= 0 finite, max_scale > 0 (inf allowed),
    min_scale <= max_scale; max_scale nonzero and finite or inf in float32, where the bounds
    are applied, and backoff_factor nonzero in float32 (the products are float64, rounded to
    float32: a smaller factor zeroes a scale in a step or two). Returns the checked values,
    the bounds as floats."""
    growth_factor = real(growth_factor, "growth_factor", low=1.0)
    backoff_factor = real(backoff_factor, "backoff_factor", low=0.0, high=1.0, low_open=True)
    if np.float32(backoff_factor) == 0:
        raise ValueError(f"backoff_factor: {backoff_factor!r} rounds to 0 in float32")
    growth_interval = integer(growth_interval, "growth_interval", low=1, high=2**31)
    hysteresis = integer(hysteresis, "hysteresis", low=1, high=2**31)
    low = 0.0 if min_scale is None else real(min_scale, "min_scale", low=0.0)
    high = math.inf
    if max_scale is not None:
        high = real(max_scale, "max_scale", low=0.0, low_open=True, finite=False)
        if math.isfinite(high) and high > _F32_MAX:
            raise ValueError(f"max_scale: {high!r} overflows float32; pass inf for no bound")
        if np.float32(high) == 0:
            raise ValueError(
                f"max_scale: {high!r} rounds to 0 in float32; expected a positive bound"
            )
    if low > high:
        raise ValueError(f"min_scale: {low!r} is above max_scale {high!r}")
    return growth_factor, backoff_factor, growth_interval, hysteresis, low, high


_FEW_BUFFERS = 8  # up to this many single buffers, ``no_overlap`` compares pairs in Python


def no_overlap(buffers) -> None:
    """Raise ``ValueError`` naming both arguments if two buffers share memory and at least one
    of them is written (two read-only inputs may share memory).

    ``buffers``: ``(name, address, nbytes, writes)`` per buffer (empty ones are skipped; a name
    is a string or a ``(list name, index)`` pair, spelled ``name[index]``), or ``ListSpans``
    (``list_spans``: a tensor list's buffers as arrays). A few single buffers (a call's
    arguments) are compared pair by pair (NumPy's calls would cost more than the kernel on a
    small array); otherwise the ranges are sorted by start once; without any overlap (the usual
    case) the check is vectorised passes over arrays, and only an overlap makes per-buffer
    entries, for a sweep that finds and names the pair.
    """
    singles = [b for b in buffers if not isinstance(b, ListSpans)]
    lists = [b for b in buffers if isinstance(b, ListSpans)]
    if not lists and len(singles) <= _FEW_BUFFERS:  # a call's few arguments: pairs in Python
        live = [b for b in singles if b[2] > 0]
        for i, a in enumerate(live):
            for b in live[i + 1 :]:
                if (a[3] or b[3]) and a[1] < b[1] + b[2] and b[1] < a[1] + a[2]:
                    _name_an_overlap(live)
        return
    starts = np.concatenate(
        [np.fromiter((b[1] for b in singles), np.int64, len(singles))]
        + [spans.addresses for spans in lists]
    )
    sizes = np.concatenate(
        [np.fromiter((b[2] for b in singles), np.int64, len(singles))]
        + [spans.nbytes for spans in lists]
    )
    nonempty = sizes > 0
    count = np.count_nonzero(nonempty)
    if count < 2:
        return
    if count < sizes.size:
        starts, sizes = starts[nonempty], sizes[nonempty]
    ends = starts + sizes
    order = np.argsort(starts, kind="stable")
    reach = np.maximum.accumulate(ends[order])
    if np.all(starts[order][1:] >= reach[:-1]):
        return
    entries = [e for b in buffers for e in (b.entries() if isinstance(b, ListSpans) else [b])]
    _name_an_overlap([e for e in entries if e[2] > 0])


def _name_an_overlap(items) -> None:
    """The sweep of ``no_overlap`` over per-buffer entries (non-empty), in argument order."""
    starts = np.fromiter((b[1] for b in items), np.int64, len(items))
    ends = starts + np.fromiter((b[2] for b in items), np.int64, len(items))
    order = np.argsort(starts, kind="stable")
    furthest_any = furthest_written = None  # (end, item) reaching furthest so far
    for k in order:
        name, start, _, writes = items[k]
        for other in (furthest_any if writes else furthest_written,):
            if other is not None and start < other[0]:
                first, second = sorted((other[1][0], name), key=_argument_order(items))
                first, second = _spelled(first), _spelled(second)
                raise ValueError(
                    f"{second}: shares memory with {first}; srround reads and writes buffers in"
                    " one pass, so overlapping arguments give wrong results - pass separate"
                    " buffers (e.g. a copy)"
                )
        end = int(ends[k])
        if furthest_any is None or end > furthest_any[0]:
            furthest_any = (end, items[k])
        if writes and (furthest_written is None or end > furthest_written[0]):
            furthest_written = (end, items[k])


def _spelled(name) -> str:
    return name if isinstance(name, str) else f"{name[0]}[{name[1]}]"


def _argument_order(items):
    rank = {item[0]: i for i, item in enumerate(items)}
    return rank.__getitem__


class ListSpans(NamedTuple):
    """``no_overlap`` entries ``name[i]`` of a tensor list as arrays (``list_spans``): fields
    0-3 as a single entry's (``name``, start ``addresses``, ``nbytes``, ``writes``), plus the
    list indices. A list of hundreds of buffers is checked in vectorised passes; ``entries``
    makes the per-buffer ones, only to name an overlap."""

    name: str
    addresses: np.ndarray
    nbytes: np.ndarray
    writes: bool
    index: np.ndarray | None  # None: every index, in order

    def entries(self) -> list:
        index = range(self.addresses.size) if self.index is None else self.index.tolist()
        rows = zip(index, self.addresses.tolist(), self.nbytes.tolist())
        return [((self.name, i), a, n, self.writes) for i, a, n in rows]


def list_spans(name: str, addresses, sizes, codes, widths, writes: bool, present=None):
    """``[ListSpans]`` of a tensor list given by its table columns (lists or int64 arrays):
    its buffers named ``name[i]`` (spelled only for an error); ``widths[code]``: bytes per
    element of a buffer code; ``present``: the indices that hold a buffer (default: every
    one)."""
    addresses, codes, sizes = (np.asarray(c, np.int64) for c in (addresses, codes, sizes))
    index = None
    if present is not None:
        index = np.asarray(present, np.int64)
        addresses, codes, sizes = addresses[index], codes[index], sizes[index]
    nbytes = sizes * np.asarray(widths, np.int64)[codes]
    return [ListSpans(name, addresses, nbytes, bool(writes), index)]
