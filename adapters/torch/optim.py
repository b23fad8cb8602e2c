"""``srround.adapters.torch.AdamW`` and ``.SGD``: ``torch.optim.Optimizer`` subclasses running
srround's fused low-precision step (contract: ``docs/contracts.md``).

One step is one fused pass (one CPU call, two CUDA launches) over every parameter, gradient and
state element, whatever the number of tensors: bf16/fp16/fp32 parameters (mixed), fp32 math in
torch.optim's order, results written back per ``rounding`` mode, optional loss-scale multiply
and overflow skip fused in (``step(inv_scale=..., found_inf=...)``, used by
``srround.adapters.torch.GradScaler``; ``torch.amp.GradScaler`` drives it through torch's
fused-optimizer protocol, ``_step_supports_amp_scaling``), no host synchronisation.

Host cost: the pointer table (``_optim.FusedStep``) is built once, at the first step, and
cached. Each step then only walks the parameters to check that the same parameters have
gradients at the same addresses (``data_ptr()``) and that ``optimizer.state`` holds the same
objects, builds the float64[G, 5] hyperparameter array from ``param_groups`` (so lr
schedulers and edits of ``group["lr"]`` etc. take effect; the array is uploaded only when it
changed) and bumps the parameters' version counters. Gradients at new addresses (the same
parameters with gradients, each of the dtype and layout the table was built with) are read in
place of the old ones: the table's gradient column is rewritten (``rebind_grads``). The table
is rebuilt when the set of parameters with gradients changes, a parameter changes group, a
parameter moved (``p.data = ...``), a gradient changed dtype or layout, or
``optimizer.state`` was reset or a state tensor replaced (then used, as by torch's optimizers).

``zero_grad``: both settings are correct and cheap. ``zero_grad(set_to_none=True)`` (torch's
default) frees the gradients (the table keeps none alive, only weak references to them), and
the next step points the table at the new ones; ``zero_grad(set_to_none=False)`` keeps them in
place.

Memory layouts: a parameter in any dense, non-overlapping layout (contiguous, channels_last,
a permuted tensor) is updated in place without copies; its states get its layout and a
gradient of the same layout is read in place (a gradient of another layout is copied into a
buffer of the parameter's layout each step). Random bits follow *memory* order: element ``j``
of the stream is the ``j``-th element in memory, so a channels_last parameter draws other bits
than a contiguous copy of it. A parameter that is not dense (a strided view, e.g. every other
column of a matrix) takes a slower path: a contiguous working copy, refreshed before and written
back after each step, so it gets exactly the bits a contiguous parameter would.

State per parameter (``optimizer.state[p]``): ``exp_avg``, ``exp_avg_sq`` (AdamW),
``momentum_buffer`` (SGD with momentum), in ``state_dtype`` (float32 or bfloat16; AdamW also
float8_e4m3fn / float8_e5m2, with ``exp_avg_scale`` / ``exp_avg_sq_scale`` block scales; narrow
states are written with stochastic rounding); the weight mode's buffer for bf16/fp16 parameters:
``kahan_comp`` (parameter dtype), ``master_weight`` (float32) or ``remainder`` (int16); and
``step``: a 0-d int32 tensor (a view of one flat per-optimizer counter the kernel increments on
the device; torch's optimizers keep a float32 tensor, and load this one). ``rounding``,
``state_dtype`` (by name: ``"float32"``, ``"bfloat16"``, ...) and ``seed`` live in every param
group (one value per optimizer), so
``state_dict()`` carries the random stream: ``load_state_dict`` then continues bit-identically.
A ``torch.optim.AdamW`` / ``SGD`` state dict loads too (the srround keys come from the
optimizer's defaults), and torch's optimizers load srround's.

torch.compile: ``step()`` inside a compiled function traces without graph breaks: the states
are created at trace time (``_init_group``, as torch's optimizers do) and the step is one call
of the custom op ``torch.ops.srround.fused_step`` (``_ops.py``; with AMSGrad
``torch.ops.srround.amsgrad_step``) with the eager stream starts (DTensor parameters: their
local pieces), which gives the eager bits.
Hyperparameters are constants of the compiled graph (changing ``lr`` recompiles, as with
torch's optimizers given a float ``lr``).
"""

from __future__ import annotations

import contextlib
import math
import operator
import weakref
from itertools import chain

import numpy as np
import torch

from srround import _optim, _plan, _state8, _validate
from srround._rng import check_seed, manually_seeded, next_seed, split_seed

from . import _dist, _lazy_dynamo, _views
from ._views import (
    _BUFFER_CODES,
    _DATA_PTR,
    _check_storage,
    _check_writable,
    _external_stream,
    _view,
)

__all__ = ["SGD", "AdamW"]

# weight mode -> name of its per-parameter buffer in optimizer.state
AUX_NAMES = {"kahan": "kahan_comp", "master": "master_weight", "remainder": "remainder"}
_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FP8_STATE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)  # AdamW: block-scaled moments
_STATE_DTYPES = (torch.float32, torch.bfloat16, *_FP8_STATE_DTYPES)
# the float32 block scales of fp8 moments in optimizer.state (``_state8``)
_SCALE_NAMES = {"exp_avg": "exp_avg_scale", "exp_avg_sq": "exp_avg_sq_scale"}
_ONE_BITS = np.array([1.0], np.float32).view(np.uint32)
_ZERO_BITS = np.zeros(1, np.uint32)
_GRAD = operator.attrgetter("grad")
_F32_MAX = float(np.finfo(np.float32).max)
# the flags of torch.optim's constructors that select an implementation: srround has one
# (fused, no graph); a flag asking for what it lacks is refused
_FLAG_KEYS = ("foreach", "fused", "differentiable", "capturable")


# (integer view, magnitude mask, inf pattern, +qNaN) of each parameter dtype: ``_canonical_nan_``
_NAN_BITS = {
    torch.float32: (torch.int32, 0x7FFFFFFF, 0x7F800000, 0x7FC00000),
    torch.bfloat16: (torch.int16, 0x7FFF, 0x7F80, 0x7FC0),
    torch.float16: (torch.int16, 0x7FFF, 0x7C00, 0x7E00),
}


def _canonical_nan_(t):
    """In place, every NaN of ``t`` becomes its format's +qNaN, in integer ops: the NaN of
    srround's arithmetic on every device (torch's float ops keep a NaN operand's sign on x86,
    write 0x7FFFFFFF on CUDA; its CPU bf16 cast writes 0xFFFF)."""
    view, magnitude, inf, qnan = _NAN_BITS[t.dtype]
    bits = t.view(view)
    bits.masked_fill_((bits & magnitude) > inf, qnan)


def _on(device):
    """Make a CUDA ``device`` current (Numba launches on the current device); CPU: nothing."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _check_rounding(rounding):
    _plan.check_rounding(rounding)


_STATE_DTYPE_NAMES = {t: str(t).removeprefix("torch.") for t in _STATE_DTYPES}
_STATE_DTYPE_NAMES.update({name: name for name in list(_STATE_DTYPE_NAMES.values())})
_STATE_DTYPE_OF = {str(t).removeprefix("torch."): t for t in _STATE_DTYPES}


def _check_state_dtype(state_dtype) -> str:
    """The name (``"float32"``, ``"bfloat16"``, ``"float8_e4m3fn"``, ``"float8_e5m2"``) param
    groups store: a torch.dtype in a param group stops the distributed state-dict helpers
    (``get_optimizer_state_dict`` with ``full_state_dict=True``), which take only tensors and
    Python scalars there."""
    name = (
        _STATE_DTYPE_NAMES.get(state_dtype) if isinstance(state_dtype, (str, torch.dtype)) else None
    )
    if name is None:
        raise ValueError(
            "state_dtype: expected torch.float32, torch.bfloat16, torch.float8_e4m3fn or"
            f" torch.float8_e5m2 (AdamW), got {state_dtype!r}"
        )
    return name


def _check_hyper(value, name: str, where: str, minimum: float = 0.0) -> float:
    """A hyperparameter: a real number >= ``minimum``, finite as a float32 (the kernels'
    arithmetic); a tensor is refused: srround's hyperparameters are host values, copied to the
    device only when they change."""
    if isinstance(value, torch.Tensor):
        raise ValueError(
            f"{name}{where}: a tensor is not supported (srround's hyperparameters are host"
            f" floats); pass a float, e.g. {name}.item()"
        )
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name}{where}: expected a float, got {type(value).__name__}")
    if not value >= minimum:  # NaN too
        raise ValueError(f"{name}{where}: expected a float >= {minimum}, got {value}")
    if not abs(value) <= _F32_MAX:
        raise ValueError(f"{name}{where}: expected a finite float32 value, got {value}")
    return float(value)


def _check_flags(group, where="") -> None:
    """torch.optim's implementation flags: accepted unless they ask for what srround lacks."""
    if group.get("differentiable"):
        raise ValueError(
            f"differentiable{where}: srround's step writes through raw buffers and records no"
            " autograd graph; use torch.optim for a differentiable step"
        )
    for name in ("foreach", "fused", "capturable"):
        if group.get(name) not in (None, False, True):
            raise ValueError(f"{name}{where}: expected None, False or True, got {group[name]!r}")


# -- layouts ---------------------------------------------------------------------------------


def _is_dense(t) -> bool:
    """Whether ``t``'s elements fill one block of memory exactly once (any dimension order)."""
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _element_bytes(t) -> np.ndarray:
    """The byte address of every element of ``t`` (int64, flat, in ``t``'s index order)."""
    offsets = np.int64(t.storage_offset())
    for size, stride in zip(t.shape, t.stride()):
        offsets = np.add.outer(offsets, np.arange(size, dtype=np.int64) * stride)
    return t.untyped_storage().data_ptr() + np.reshape(offsets, -1) * t.element_size()


def check_non_dense(params) -> None:
    """Non-dense parameters are updated through a contiguous copy (``build_entry``), so the
    plan's memory check sees the copy: here their own elements are checked, before anything
    is written. ``ValueError`` naming the parameter if two of its elements share memory (an
    ``expand``-ed view: the step would write an element twice), or naming both if it shares an
    element with another parameter (one update would be lost)."""
    for i, p in enumerate(params):
        if _is_dense(p) or p.numel() == 0:
            continue
        mine = _element_bytes(p)
        unique = np.unique(mine)
        if unique.size != mine.size:
            raise ValueError(
                f"params[{i}]: several of its elements share memory (an expanded view): the"
                " step would write them more than once - pass a tensor that owns its elements"
                " (.clone())"
            )
        size, storage = p.element_size(), p.untyped_storage().data_ptr()
        for j, q in enumerate(params):
            if j == i or q.numel() == 0 or q.untyped_storage().data_ptr() != storage:
                continue
            if _is_dense(q):  # one block of memory from its first element
                low, high = q.data_ptr(), q.data_ptr() + q.numel() * q.element_size()
                shared = bool(np.any((unique < high) & (unique + size > low)))
            elif q.element_size() == size:  # elements at the same addresses
                shared = np.intersect1d(unique, _element_bytes(q)).size > 0
            else:  # elements of other widths: where their extents overlap
                theirs = _element_bytes(q)
                shared = bool(
                    unique[0] < theirs.max() + q.element_size() and theirs.min() < unique[-1] + size
                )
            if shared:
                first, second = sorted((i, j))
                raise ValueError(
                    f"params[{second}]: shares memory with params[{first}]; srround reads and"
                    " writes buffers in one pass, so overlapping arguments give wrong results -"
                    " pass separate buffers (e.g. a copy)"
                )


def _same_layout(a, b) -> bool:
    """Same shape and the same element order in memory (strides of dimensions of size > 1)."""
    return a.shape == b.shape and all(
        s == t for s, t, n in zip(a.stride(), b.stride(), a.shape) if n != 1
    )


def _like(p):
    """A tensor of ``p``'s layout for its states: ``p`` if dense, else a contiguous one."""
    return p if _is_dense(p) else torch.empty(p.shape, dtype=p.dtype, device=p.device)


def _in_layout(buf, like, dtype):
    """``buf`` (a state) as ``dtype`` on ``like``'s device in ``like``'s layout; copied only if
    it differs."""
    if buf.dtype == dtype and buf.device == like.device and _same_layout(buf, like):
        return buf
    return torch.empty_like(like, dtype=dtype).copy_(buf)


def check_pairs(params, grads, rounding, names) -> None:
    """Raise the error of the first (parameter, gradient) pair the step cannot take, naming
    pair ``i`` ``params{names[i]}`` / ``grads{names[i]}``."""
    device = params[0].device if params else None
    for i, p in enumerate(params):
        if p.dtype not in _PARAM_DTYPES:
            raise TypeError(
                f"params{names[i]}: expected a float32, bfloat16 or float16 parameter,"
                f" got {p.dtype}"
            )
        _check_storage(p, f"params{names[i]}")
    _plan.check_param_codes(
        [_BUFFER_CODES[p.dtype] for p in params], _plan.check_rounding(rounding)
    )
    for i, (p, g) in enumerate(zip(params, grads)):
        if g.layout is not torch.strided:
            raise TypeError(
                f"grads{names[i]}: {g.layout} gradients are not supported; srround needs dense"
                " ones (for a sparse embedding use sparse=False)"
            )
        _check_storage(g, f"grads{names[i]}")
        if g.shape != p.shape or g.dtype not in _PARAM_DTYPES:
            raise ValueError(
                f"grads{names[i]}: shape {tuple(g.shape)} / dtype {g.dtype} does not fit its"
                f" parameter (shape {tuple(p.shape)}; float32, bfloat16 or float16 needed)"
            )
        if p.device != device or g.device != device:
            raise ValueError(
                f"params{names[i]}: parameters and gradients must be on one device ({device}),"
                f" got {p.device} / {g.device}"
            )


_TRACED: weakref.WeakSet = weakref.WeakSet()  # optimizers that ran _init_group (traced steps)


def _forget_tables(addresses) -> None:
    """Drop the compiled step's cached tables that write any of ``addresses``."""
    from ._ops import forget

    forget(addresses)


class _Entry:
    """The cached fused step of one set of buffers."""

    __slots__ = (
        "buffers",
        "copy_in",
        "copy_out",
        "defaults",
        "device",
        "freed",
        "fused",
        "grad_addresses",
        "grad_bytes",
        "grad_layouts",
        "inference",
        "key",
        "params",
        "state_refs",
        "watch",
        "written",
        "written_spans",
        "groups",
    )


def _state_refs(state) -> tuple:
    """What ``_state_unchanged`` compares: ``state`` (``optimizer.state``), its per-parameter
    dicts and the values in them, in order."""
    dicts = list(state.values())
    return state, dicts, list(chain.from_iterable(map(dict.values, dicts)))


def _state_unchanged(state, refs) -> bool:
    """Whether ``state`` holds the objects it held when ``refs`` were taken: not replaced or
    cleared, no parameter's state removed or replaced, no state tensor replaced (C-level
    passes, about 0.2 us per parameter). In-place changes of state tensors need no check."""
    saved, dicts, values = refs
    return (
        state is saved
        and len(state) == len(dicts)
        and all(map(operator.is_, state.values(), dicts))
        and sum(map(len, dicts)) == len(values)
        and all(map(operator.is_, chain.from_iterable(map(dict.values, dicts)), values))
    )


def _watch(tensors) -> tuple[list, list]:
    """``(freed, refs)``: ``freed``, a list, is non-empty once any of ``tensors`` was freed;
    ``refs``, weak references the caller keeps (they keep no tensor alive)."""
    freed: list = []
    return freed, [weakref.ref(t, freed.append) for t in tensors]


def build_entry(
    kind,
    rounding,
    state_fmt,
    params,
    grads,
    states,
    steps,
    group_index,
    stream,
    noise=None,
    scales=None,
):
    """A ``_optim.FusedStep`` over ``params`` (validated by ``check_pairs``) and their
    ``grads``; ``states``: per parameter ``(state 1, state 2, aux)`` (None where absent), in the
    parameter's working layout (``_like``); ``steps``: int32[N] contiguous counter tensor;
    ``scales``: per parameter the float32 block scales of fp8 states ``(state 1, state 2)``;
    ``noise``: 3 ints per parameter, flat: stream start, run, skip (``_dist.stream_layout``).
    Non-dense parameters work on a contiguous copy, gradients of another layout are copied
    into one of the parameter's: ``copy_in`` / ``copy_out`` pairs run around each step."""
    device = params[0].device
    check_non_dense(params)
    works, grad_bufs, copy_in, copy_out = [], [], [], []
    grad_layouts = [_grad_layout(g) for g in grads]
    for i, (p, g) in enumerate(zip(params, grads)):
        work = p.detach()
        if not _is_dense(p):
            work = work.contiguous()
            copy_in.append((p, work))
            copy_out.append((work, p))
        if not (_is_dense(g) and _same_layout(g, work)):
            buf = torch.empty_like(work, dtype=g.dtype)
            copy_in.append((g, buf))
            g = buf
            grad_layouts = None  # read through a copy: a new gradient means a new table
        for name, s in zip(("state", "state", "aux"), states[i]):
            if s is not None and not _same_layout(s, work):
                raise ValueError(
                    f"params[{i}]: its {name} buffer has strides {s.stride()}, the parameter"
                    f" {work.stride()} (states must share the parameter's memory layout)"
                )
        works.append(work)
        grad_bufs.append(g)

    def flat(tensors):  # dense tensors as 1-D views of their memory (the table's order)
        return [None if t is None else t.as_strided((t.numel(),), (1,)) for t in tensors]

    aux = [row[2] for row in states]
    plan = _plan.plan_step(
        _views,
        rounding,
        flat(works),
        flat(grad_bufs),
        (("states1", flat([r[0] for r in states])), ("states2", flat([r[1] for r in states]))),
        flat(aux) if _plan.needs_aux(_plan.check_rounding(rounding)) else None,
        group_index,
        None if noise is None else noise[0::3],
        None
        if scales is None
        else (
            ("exp_avg_scale", [r[0] for r in scales]),
            ("exp_avg_sq_scale", [r[1] for r in scales]),
        ),
        None if noise is None else list(zip(noise[1::3], noise[2::3])),
    )
    fused = _optim.FusedStep(
        kind,
        _plan.check_rounding(rounding),
        plan.state_fmt,
        plan.table,
        plan.sizes,
        _view(steps, False, "step").bits,
        device.type,
        stream,
    )
    if stream is not None:
        stream.synchronize()  # the table copy, before launches on another stream
    entry = _Entry()
    entry.fused, entry.params, entry.device = fused, params, device
    entry.copy_in, entry.copy_out = copy_in, copy_out
    entry.written = [p for p in params if not p.is_inference()]
    # the first inference tensor, which torch updates only inside torch.inference_mode()
    entry.inference = next((i for i, p in enumerate(params) if p.is_inference()), None)
    entry.groups = []
    # the kernel writes through raw addresses: keep every buffer it writes alive; the
    # gradients it reads in place only watched (zero_grad() frees them: the table is stale)
    entry.freed, entry.watch = _watch(grad_bufs)
    entry.grad_layouts = grad_layouts
    entry.grad_addresses = [g.data_ptr() for g in grads]
    entry.grad_bytes = [g.numel() * g.element_size() for g in grad_bufs]
    entry.written_spans = [span for span in plan.spans if span[3]]
    entry.buffers = [steps, *works, *(s for row in states for s in row)]
    entry.buffers += [s for row in scales or () for s in row]
    entry.defaults = {}
    return entry


def _grad_layout(g) -> tuple:
    """What a gradient must keep for a table to read a new one in its place."""
    return g.dtype, g.device, g.shape, g.stride()


def rebind_grads(entry, grads) -> bool:
    """Point ``entry``'s table at ``grads`` (plain tensors, one per row) in place of the
    gradients it was built with, when each has their dtype, device, shape and strides (read
    in place: none was copied) and none shares memory with a buffer the step writes (else the
    rebuild's error). What torch's default ``zero_grad(set_to_none=True)`` needs every step:
    backward allocates new gradients. Returns whether it did (else: rebuild the table)."""
    if entry.grad_layouts is None or len(grads) != len(entry.grad_layouts):
        return False
    try:
        if list(map(_grad_layout, grads)) != entry.grad_layouts:
            return False
        addresses = list(map(_DATA_PTR, grads))
    except (AttributeError, RuntimeError):  # None, or a tensor without strides or storage
        return False
    if 0 in addresses:  # a tensor subclass without storage: the rebuild names it
        return False
    spans = [
        (("grads", i), a, n, False) for i, (a, n) in enumerate(zip(addresses, entry.grad_bytes))
    ]
    _validate.no_overlap(entry.written_spans + spans)
    entry.fused.set_grad_addresses(np.array(addresses, np.int64))
    entry.grad_addresses = addresses
    entry.freed, entry.watch = _watch(grads)
    return True


def scalar_bits(value, name, entry, default_bits, negate=False):
    """uint32[1] float32 bits of ``value`` (None, a float, or a float32 tensor of 1 value on
    the parameters' device) for the kernel, negated if asked (``maximize``: a negative
    gradient multiplier, exact)."""
    device = entry.device
    if value is None or isinstance(value, (int, float, np.floating)):
        host = default_bits if value is None else np.array([value], np.float32).view(np.uint32)
        if negate:
            host = (host.view(np.float32) * -1).view(np.uint32)
        if device.type == "cpu":
            return host
        cached = entry.defaults.get((name, negate)) if value is None else None
        if cached is None:
            cached = torch.tensor(host.view(np.float32), device=device)
            if value is None:
                entry.defaults[(name, negate)] = cached
        value = cached
    elif not isinstance(value, torch.Tensor) or value.dtype != torch.float32 or value.numel() != 1:
        raise TypeError(f"{name}: expected a float or a float32 tensor of 1 value")
    elif negate:
        value = -value
    if value.device != device:
        raise ValueError(f"{name}: on {value.device}, but params are on {device}")
    return _view(value.reshape(1), False, name).bits


def run_entry(entry, inv_scale, found_inf, check_grads, negate, k0, k1) -> None:
    """One step of ``entry`` (copies in, the fused kernel, copies out)."""
    if entry.inference is not None:  # as torch.optim's in-place updates
        _check_writable(entry.params[entry.inference], f"params[{entry.inference}]")
    fused = entry.fused
    with _on(entry.device):
        if entry.device.type == "cuda":
            fused.stream = _external_stream(entry.device)  # torch's current stream
        if entry.copy_in:
            dst, src = zip(*((d, s) for s, d in entry.copy_in))
            torch._foreach_copy_(list(dst), list(src))
        if found_inf is None and isinstance(inv_scale, torch.Tensor):
            # the step sets it when inv_scale is unusable: not the shared default
            found_inf = torch.zeros(1, dtype=torch.float32, device=entry.device)
        found_bits = scalar_bits(found_inf, "found_inf", entry, _ZERO_BITS)
        if check_grads:
            fused.check_grads(found_bits)
            # FSDP2 / tensor parallel: one verdict for all ranks, on the device
            _dist.all_reduce_max(found_inf, entry.groups)
        inv_bits = scalar_bits(inv_scale, "inv_scale", entry, _ONE_BITS, negate)
        fused.run(inv_bits, found_bits, k0, k1, negated=negate)
        for src, dst in entry.copy_out:
            dst.copy_(src)


def _default_seed() -> int:
    """An optimizer's ``seed=None``: after ``srround.manual_seed``, the library generator's next
    seed; else 64 bits from torch's default generator, so ``torch.manual_seed`` (which
    ``transformers.set_seed`` and Lightning's ``seed_everything`` call) makes the run
    reproducible, as it does torchao's stochastic rounding."""
    if manually_seeded():
        return next_seed()
    high, low = torch.randint(0, 2**32, (2,), dtype=torch.int64, device="cpu").tolist()
    return high << 32 | low


class _FusedOptimizer(torch.optim.Optimizer):
    """Common machinery: lazy table, cache check, hyperparameters, scaler protocols."""

    _KIND: int | None = None
    _STATE_NAMES: tuple = ()
    _ONE_PER_OPTIMIZER: tuple[str, ...] = ("rounding", "state_dtype", "seed", "maximize")

    def __init__(self, params, defaults, rounding, state_dtype, seed):
        _check_rounding(rounding)
        state_dtype = _check_state_dtype(state_dtype)
        if _STATE_DTYPE_OF[state_dtype] in _FP8_STATE_DTYPES and self._KIND != _optim.ADAMW:
            raise ValueError(
                f"state_dtype: float8 states (block-scaled) are AdamW's only, got {state_dtype}"
            )
        _check_flags(defaults)
        if seed is None:
            _dist.check_default_seed()
        seed = _default_seed() if seed is None else check_seed(seed, "seed")
        defaults = dict(defaults, rounding=rounding, state_dtype=state_dtype, seed=seed)
        self._entry = None
        self._dtensors = False  # any DTensor parameter (FSDP2, tensor parallel): _dist.py
        super().__init__(params, defaults)

    @property
    def _srround_fused(self) -> bool:
        """srround's GradScaler passes ``inv_scale`` / ``found_inf`` to ``step()``: declared by
        the optimizer itself only (``_step_supports_amp_scaling``)."""
        return self._step_supports_amp_scaling

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """torch's GradScaler sets ``grad_scale`` / ``found_inf`` on the optimizer and calls
        ``step()``. False for a delegating wrapper, an instance of a subclass that is not itself
        an initialised optimizer (Lightning's ``LightningOptimizer``, Fabric's
        ``_FabricOptimizer``): what is set on it, or passed to its ``step``, does not reach the
        step that runs, so the scalers unscale, check and skip it themselves. Assigning False
        (as torch's non-fused optimizers declare) makes torch's scaler and Lightning unscale
        the gradients before ``step()`` (one host sync per step), e.g. for Lightning's gradient
        clipping with ``precision="16-mixed"``."""
        return "param_groups" in vars(self) and vars(self).get("_amp_in_step", True)

    @_step_supports_amp_scaling.setter
    def _step_supports_amp_scaling(self, value: bool) -> None:
        self.__dict__["_amp_in_step"] = bool(value)

    def __setstate__(self, state: dict) -> None:
        """Unpickle / deepcopy (torch pickles defaults, state and groups only): the table is
        rebuilt at the next step."""
        super().__setstate__(state)
        self._entry = None
        self._find_dtensors()

    def _find_dtensors(self) -> bool:
        """Whether any parameter is a DTensor, from the param groups as they are now (each
        group checked: one mesh, no plain tensors among DTensors). accelerate's FSDP2
        ``prepare`` switches the groups of an optimizer built on plain parameters to the sharded
        ones; the step then keys, checks and all-reduces on the local pieces."""
        self._dtensors = any(_dist.check_group(group["params"]) for group in self.param_groups)
        return self._dtensors

    # -- groups -----------------------------------------------------------------------------

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        where = f" (param group {len(self.param_groups) - 1})"
        try:
            group["state_dtype"] = _check_state_dtype(group["state_dtype"])
            _check_flags(group, where)
            self._check_group(group, len(self.param_groups) - 1)
            self._dtensors |= _dist.check_group(group["params"])
            for name in self._ONE_PER_OPTIMIZER:
                if group[name] != self.defaults[name]:
                    raise ValueError(
                        f"{name}: one value per optimizer; param group"
                        f" {len(self.param_groups) - 1} has {group[name]!r}, the"
                        f" optimizer {self.defaults[name]!r}"
                    )
            seen: set = set()
            for i, p in enumerate(group["params"]):
                if id(p) in seen:  # torch only warns; the fused step would alias it
                    raise ValueError(
                        f"params[{i}]: appears twice in param group {len(self.param_groups) - 1}"
                        " (one fused pass cannot update a tensor twice); pass it once"
                    )
                seen.add(id(p))
            devices = {p.device for g in self.param_groups for p in g["params"]}
            if len(devices) > 1:
                raise ValueError(
                    f"params: on several devices ({sorted(map(str, devices))}); use one"
                    " optimizer per device"
                )
            for i, p in enumerate(group["params"]):
                if p.dtype not in _PARAM_DTYPES:
                    hint = " (float64 parameters are not supported)" * (p.dtype == torch.float64)
                    raise TypeError(
                        f"params[{i}]{where}: expected a float32, bfloat16 or float16 parameter,"
                        f" got {p.dtype}{hint}"
                    )
            codes = [_BUFFER_CODES[p.dtype] for p in group["params"]]
            _plan.check_param_codes(codes, _plan.check_rounding(group["rounding"]), where=where)
        except Exception:
            self.param_groups.pop()
            raise
        self._entry = None

    def _check_group(self, group, index) -> None:
        """Per-group checks of hyperparameters (subclasses)."""

    def _hyper_rows(self) -> list[tuple]:
        """Per param group its hyperparameters, host floats (subclasses)."""
        raise NotImplementedError

    def _hyper(self):
        """``_hyper_rows`` as the float64 table the kernels read."""
        return np.array(self._hyper_rows(), np.float64)

    def _config(self):
        """Per-optimizer settings, from param_groups (what load_state_dict restores)."""
        first = self.param_groups[0]
        state_dtype = _STATE_DTYPE_OF[_check_state_dtype(first["state_dtype"])]
        config = (first["rounding"], state_dtype, first["seed"], first["maximize"])
        names = self._ONE_PER_OPTIMIZER
        for i, g in enumerate(self.param_groups):
            if any(g[n] != first[n] for n in names):
                raise ValueError(
                    f"param_groups[{i}]: {', '.join(names)} must be the same in every group"
                    " (one value per optimizer)"
                )
        return config

    # -- the cached table -------------------------------------------------------------------

    def _key(self):
        """The cache key: the parameter count of every group, then the addresses of every
        parameter and of its gradient (0: none) - lists built by C-level ``map`` (about
        0.2 us per tensor)."""
        groups = self.param_groups
        params = list(chain.from_iterable(g["params"] for g in groups))
        grads = list(map(_GRAD, params))
        ptrs = None if self._dtensors else list(map(_DATA_PTR, params))
        # a DTensor's data_ptr() is 0: key on the local pieces (0 also: an empty tensor, or a
        # DTensor put into the groups after construction, found here)
        if ptrs is None or (0 in ptrs and self._find_dtensors()):
            return _dist.cache_key(groups, params, grads)
        try:
            try:
                grad_ptrs = list(map(_DATA_PTR, grads))
            except TypeError:  # parameters without a gradient
                grad_ptrs = [0 if g is None else g.data_ptr() for g in grads]
        except RuntimeError:  # a gradient without strided storage (sparse)
            params, _ = self._collect()
            rounding = self.param_groups[0]["rounding"]
            check_pairs(params, [p.grad for p in params], rounding, self._names())
            raise
        return ([len(g["params"]) for g in groups], ptrs, grad_ptrs)

    def _names(self) -> list[str]:
        """``"[j] (param group g)"`` for the parameters ``_collect`` returns: their indices
        in their groups, as the constructor's errors name them."""
        return [
            f"[{j}] (param group {gi})"
            for gi, group in enumerate(self.param_groups)
            for j, p in enumerate(group["params"])
            if p.grad is not None
        ]

    def _collect(self):
        """``(params with grads, their group indices)``."""
        params, groups = [], []
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p.grad is not None:
                    params.append(p)
                    groups.append(gi)
        return params, groups

    def _state_buffers(self, p, group, rounding, state_dtype):
        """Allocate (zeros; master = the parameter in fp32) or cast this parameter's state,
        in the parameter's working layout."""
        state = self.state[p]
        like = _like(p)
        fp8 = state_dtype in _FP8_STATE_DTYPES
        for name in (*self._needed_states(group), AUX_NAMES.get(rounding)):
            buf = state.get(name)
            if isinstance(buf, torch.Tensor) and buf.shape != like.shape:
                raise ValueError(  # before: a broadcasting error from the copy below
                    f"state: {name} has shape {tuple(buf.shape)}, its parameter"
                    f" {tuple(like.shape)} (was the parameter's .data replaced? a state follows"
                    " the tensor it was made for: make a new optimizer, or load a state dict"
                    " of these shapes)"
                )
        for name in self._needed_states(group):
            buf = state.get(name)
            if buf is None:
                state[name] = torch.zeros_like(like, dtype=state_dtype)
            elif fp8 and buf.dtype != state_dtype:
                raise ValueError(
                    f"state_dtype: {name} of a parameter is {buf.dtype}, and float8 states are"
                    " not converted (their block scales come from the step that wrote them)"
                )
            else:
                state[name] = _in_layout(buf.detach(), like, state_dtype)
            scale = _SCALE_NAMES.get(name)
            if fp8 and state.get(scale) is None:
                blocks = -(-p.numel() // _state8.STATE_BLOCK)
                state[scale] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
        name = AUX_NAMES.get(rounding)
        if name is not None and p.dtype != torch.float32:
            buf = state.get(name)
            dtype = {"master": torch.float32, "kahan": p.dtype}.get(rounding, torch.int16)
            if buf is None:
                if rounding == "master":
                    state[name] = torch.empty_like(like, dtype=dtype).copy_(p.detach())
                else:
                    state[name] = torch.zeros_like(like, dtype=dtype)
            else:
                state[name] = _in_layout(buf.detach(), like, dtype)
        if self._dtensors:  # a full plain state (a state dict saved unsharded): its piece
            for name in list(state):
                if name != "step" and isinstance(state[name], torch.Tensor):
                    state[name] = _dist.shard_like(state[name], p, name)
        return state

    def _scale_row(self, state):
        """``(state 1, state 2)`` block scales of one parameter's fp8 states."""
        return tuple(state[_SCALE_NAMES[name]] for name in self._STATE_NAMES)

    def _row(self, state, group, p, rounding):
        """``(state 1, state 2, aux)`` buffers of one parameter (None where absent)."""
        names = self._STATE_NAMES
        s1 = state[names[0]] if self._uses_state(group, names[0]) else None
        s2 = state[names[1]] if self._uses_state(group, names[1]) else None
        aux = AUX_NAMES.get(rounding)
        return s1, s2, state[aux] if aux is not None and p.dtype != torch.float32 else None

    def _prepare(self, params, group_index, config):
        """Validate, then create or cast the states; ``(states rows, flat int32 steps)`` with
        ``state["step"]`` views of the flat counter."""
        rounding, state_dtype = config[0], config[1]
        for i, p in enumerate(params):  # DTensor and plain parameters and gradients not mixed
            _dist.check_grad(p, i)
        check_pairs(params, [p.grad for p in params], rounding, self._names())
        for gi in sorted(set(group_index)):
            self._check_group(self.param_groups[gi], gi)
        groups = self.param_groups
        states = [
            self._state_buffers(p, groups[gi], rounding, state_dtype)
            for p, gi in zip(params, group_index)
        ]
        device = params[0].device
        zero = torch.zeros((), dtype=torch.int32, device=device)
        steps = torch.stack(
            [
                zero
                if s.get("step") is None
                else s["step"].detach().to(device=device, dtype=torch.int32).reshape(())
                for s in states
            ]
        )
        for i, s in enumerate(states):
            s["step"] = steps[i]
        rows = [
            self._row(s, groups[gi], p, rounding) for s, p, gi in zip(states, params, group_index)
        ]
        return rows, steps

    def _build(self, params, group_index, key, config):
        rows, steps = self._prepare(params, group_index, config)
        scales = None
        if config[1] in _FP8_STATE_DTYPES:
            if self._dtensors:
                raise ValueError(
                    "state_dtype: float8 states are not supported with DTensor parameters"
                    " (their blocks would follow the local pieces)"
                )
            scales = [self._scale_row(self.state[p]) for p in params]
        device = params[0].device
        stream = _external_stream(device) if device.type == "cuda" else None
        noise = self._noise(params)
        local = _dist.local  # DTensors (FSDP2): the kernel works on the local pieces
        entry = build_entry(
            self._KIND,
            config[0],
            0 if config[1] == torch.float32 else 1,
            [local(p) for p in params],
            [local(p.grad) for p in params],
            [tuple(None if s is None else local(s) for s in row) for row in rows],
            steps,
            group_index,
            stream,
            noise,
            scales,
        )
        if self._dtensors:
            entry.written += [p for p in params if not p.is_inference()]
            entry.buffers += list(params) + rows
            entry.params = params  # (their .grad: torch's scaler protocol unscales them)
            entry.groups = _dist.mesh_groups(params)
        entry.key = key
        entry.state_refs = _state_refs(self.state)
        self._entry = entry
        return entry

    def _regrad(self, entry, key) -> bool:
        """``rebind_grads`` when only gradients moved since ``entry`` was built: the same
        parameters in the same groups, each with a gradient, no other with one, the same
        settings and ``optimizer.state`` objects. Returns whether the table now reads the new
        gradients (else it is rebuilt)."""
        old = entry.key
        if old[1:] != key[1:] or old[0][:2] != key[0][:2]:
            return False
        if not _state_unchanged(self.state, entry.state_refs):
            return False
        params = entry.params
        every = chain.from_iterable(g["params"] for g in self.param_groups)
        if sum(g is not None for g in map(_GRAD, every)) != len(params):
            return False
        if self._dtensors:
            if any(p.grad is None for p in params):
                return False
            grads = [_dist.check_grad(p, i) for i, p in enumerate(params)]
        else:
            grads = list(map(_GRAD, params))
        return rebind_grads(entry, grads)

    def _noise(self, params) -> list[int]:
        """Where the noise of each of ``params`` (those with gradients) lies in the step's
        stream, 3 ints a parameter, flat: ``(start, run, skip)`` (``_dist.stream_layout``),
        the start keyed to the parameter's identity (``_dist.stream_bases``) and the piece's
        place in the full tensor, so a parameter without a gradient moves no other's noise."""
        every = list(chain.from_iterable(g["params"] for g in self.param_groups))
        bases = _dist.stream_bases(every)
        noise = []
        for i, p in enumerate(params):
            start, run, skip = _dist.stream_layout(p, f"params[{i}]")
            noise += [bases[id(p)] + start, run, skip]
        return noise

    def _needed_states(self, group):
        return [n for n in self._STATE_NAMES if self._uses_state(group, n)]

    def _uses_state(self, group, name):
        return True

    def _layout_key(self):
        """Extra cache key: what changes which buffers exist (SGD: momentum on/off)."""
        return ()

    # -- step -------------------------------------------------------------------------------

    @torch.no_grad()
    def step(
        self,
        closure=None,
        *,
        inv_scale=None,
        found_inf=None,
        check_grads=False,
        grad_scale=None,
    ):
        """One fused step over every parameter that has a gradient.

        Args:
            closure: re-evaluates the model and returns the loss (as torch.optim).
            inv_scale: 1 / loss scale multiplied into the gradients inside the step (a float,
                or a float32 tensor of 1 value on the parameters' device): the gradients are
                read once and not modified. A float must be positive and finite
                (``ValueError``; under torch.compile it becomes a tensor); a tensor that is
                not sets ``found_inf`` and skips the step.
            found_inf: float32 tensor of 1 value; when nonzero the step changes nothing
                (parameters, states, step counts), decided on the device without a sync.
            check_grads: first set ``found_inf`` to 1 if any gradient as stored (scaled) is
                inf/NaN (one launch over the cached table that reads the gradients and writes
                nothing), as torch's fused optimizers check: the loss scaler's overflow check
                and step in one call (``GradScaler.step``).
            grad_scale: torch's fused-optimizer protocol (``torch.amp.GradScaler`` sets the
                ``grad_scale`` and ``found_inf`` attributes instead): the loss scale (float32
                tensor of 1 value); the gradients are unscaled in place first, as torch's
                fused optimizers leave them.
        """
        if grad_scale is None:
            grad_scale = getattr(self, "grad_scale", None)
        if found_inf is None:
            found_inf = getattr(self, "found_inf", None)
        if check_grads and found_inf is None:
            raise ValueError("found_inf: needed with check_grads=True (the flag to set)")
        if grad_scale is not None and inv_scale is not None:
            raise ValueError("grad_scale, inv_scale: pass one of them")
        if inv_scale is not None and not isinstance(inv_scale, torch.Tensor):
            if not torch.compiler.is_compiling():  # compiled: _traced_step makes it a tensor
                inv_scale = _validate.inv_scale(inv_scale)  # a tensor is checked by the step
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.param_groups[0].get("amsgrad"):
            self._amsgrad_step(inv_scale, found_inf, check_grads, grad_scale)
            return loss
        if torch.compiler.is_compiling():
            self._traced_step(inv_scale, found_inf, check_grads, grad_scale)
            return loss
        self._eager_step(inv_scale, found_inf, check_grads, grad_scale)
        return loss

    def _eager_step(self, inv_scale, found_inf, check_grads, grad_scale):
        """``step()`` outside torch.compile: the optimizer's cached table, then one launch."""
        config = self._config()
        hyper = self._hyper()  # checked before anything is written
        key = (self._key(), config, self._layout_key())
        entry = self._entry
        if entry is not None and (entry.freed or entry.key != key) and self._regrad(entry, key):
            entry.key = key
        if (
            entry is None
            or entry.freed
            or entry.key != key
            or not _state_unchanged(self.state, entry.state_refs)  # a state reset or replaced
        ):
            params, group_index = self._collect()
            if not params:  # no gradients
                return
            with _on(params[0].device):
                entry = self._build(params, group_index, key, config)
        if grad_scale is not None:
            inv_scale = self._unscale_grads(entry, grad_scale, found_inf)
        entry.fused.set_hyper(hyper)
        k0, k1 = split_seed(config[2])
        run_entry(entry, inv_scale, found_inf, check_grads, config[3], k0, k1)
        if entry.written:
            torch.autograd.graph.increment_version(entry.written)

    def _unscale_grads(self, entry, grad_scale, found_inf):
        """torch's protocol: divide the gradients by ``grad_scale`` in place (one fused
        launch; a flag of this pass that is not ``found_inf`` is discarded: torch's scaler
        checked them before). Returns the step's ``inv_scale`` (None: 1)."""
        from .amp import unscale_grads

        if not isinstance(grad_scale, torch.Tensor):
            grad_scale = torch.tensor([float(grad_scale)], device=entry.device)
        inv = grad_scale.double().reciprocal().float().reshape(1)
        scratch = torch.zeros(1, dtype=torch.float32, device=inv.device)
        unscale_grads([p.grad for p in entry.params], inv, scratch)
        return None

    def _traced_step(self, inv_scale, found_inf, check_grads, grad_scale):
        """The step under torch.compile: states at trace time (``_init_group``), then the
        custom op (``srround::fused_step``, or ``srround::amsgrad_step`` with AMSGrad)."""
        if self._config()[1] in _FP8_STATE_DTYPES:  # eagerly, at a graph break
            _eager_fp8_step(self, inv_scale, found_inf, check_grads, grad_scale)
            return
        lists = [[] for _ in range(7)]
        meta = list(self._init_group(*lists))
        if not lists[0]:
            return
        # the hyperparameters read here, in traced code: Dynamo runs _init_group eagerly, so
        # what it returns is a constant of the graph with no guard - a learning rate changed
        # by a scheduler after the first recompile was silently not used (before)
        meta[6] = [float(v) for row in self._hyper_rows() for v in row]
        if meta[-1]:  # DTensors (FSDP2): the op works on the local pieces
            lists = [[_dist.local(t) for t in ts] for ts in lists]
        params, grads, states1, states2, auxes, steps, maxes = lists
        device = params[0].device
        if found_inf is None:
            found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        if isinstance(inv_scale, (int, float)):
            inv_scale = torch.full((1,), float(inv_scale), device=device)
        if self.param_groups[0].get("amsgrad"):
            if isinstance(grad_scale, (int, float)):
                grad_scale = torch.full((1,), float(grad_scale), device=device)
            torch.ops.srround.amsgrad_step(
                *lists, found_inf, inv_scale, grad_scale, check_grads, *meta[1:-1]
            )
            return
        if grad_scale is not None:
            inv_scale = grad_scale.double().reciprocal().float().reshape(1)
            torch.ops.srround.unscale_and_check_(
                grads, inv_scale, torch.zeros(1, dtype=torch.float32, device=device)
            )
            inv_scale = None
        torch.ops.srround.fused_step(
            params,
            grads,
            states1,
            states2,
            auxes,
            steps,
            found_inf,
            inv_scale,
            *meta[:-1],
            check_grads,
        )

    @torch.no_grad()
    def _init_group(self, params, grads, states1, states2, auxes, steps, maxes):
        """Runs eagerly when torch.compile traces ``step`` (torch's optimizer protocol):
        validates, creates the states, fills the lists with the parameters that have
        gradients, their gradients, states (``states1`` / ``states2`` / ``auxes``: only the
        existing ones, located by the index lists returned; ``maxes``: AMSGrad's
        ``max_exp_avg_sq``) and ``steps`` with one int32[N] tensor, the step counters of the N
        parameters (``state["step"]`` are its views: one tensor, as a list of 0-d views of one
        storage reaches a mutating op in inductor (torch 2.11) as uninitialised copies).
        Returns the ops' constant arguments:
        ``(kind, mode, state format, group index, state-1 index, aux index, hyperparameters
        (flat), k0, k1, negate, noise (``_noise``), mesh process group names, whether they are
        DTensors)``."""
        config = self._config()
        self._find_dtensors()  # also those switched into the groups after construction
        found, group_index = self._collect()
        if not found:
            return (self._KIND, 0, 0, [], [], [], [], 0, 0, False, [], "", False)
        rows, flat = self._prepare(found, group_index, config)
        amsgrad = self.param_groups[0].get("amsgrad")
        s1_index, aux_index = [], []
        for i, (p, (s1, s2, aux)) in enumerate(zip(found, rows)):
            params.append(p)
            grads.append(p.grad)
            state = self.state[p]
            if s1 is not None:
                s1_index.append(i)
                states1.append(s1)
            if s2 is not None:
                states2.append(s2)
            if aux is not None:
                aux_index.append(i)
                auxes.append(aux)
            if amsgrad:
                saved = state.get("max_exp_avg_sq")
                if saved is None:
                    state["max_exp_avg_sq"] = torch.zeros_like(_like(p), dtype=torch.float32)
                else:  # float32 as the moments (torch's state dicts: the parameter's dtype)
                    state["max_exp_avg_sq"] = _in_layout(saved.detach(), _like(p), torch.float32)
                maxes.append(state["max_exp_avg_sq"])
        steps.append(flat)
        self._entry = None  # new step views: the eager table is rebuilt if used again
        if self not in _TRACED:  # the compiled step's tables keep its buffers alive: at
            _TRACED.add(self)  # its collection, drop them (they would pin the parameters)
            weakref.finalize(self, _forget_tables, {_dist.local(p).data_ptr() for p in params})
        k0, k1 = split_seed(config[2])
        return (
            self._KIND,
            _optim.MODES[config[0]],
            0 if config[1] == torch.float32 else 1,
            group_index,
            s1_index,
            aux_index,
            [float(v) for v in self._hyper().reshape(-1)],
            k0,
            k1,
            bool(config[3]),
            self._noise(found),
            _dist.group_names(_dist.mesh_groups(found)),
            self._dtensors,
        )

    # -- state dict -------------------------------------------------------------------------

    @staticmethod
    def _plain_states(state_dict: dict) -> dict:
        """``state_dict`` with torchao's conventions read: a one-value tensor ``lr`` (torchao's
        optimizers keep ``lr`` as a 0-d tensor) becomes its float, and a state tensor subclass
        without storage of its own with a ``dequantize()`` of its own (torchao's ``OptimState8bit``,
        ``OptimState4bit``, ``OptimStateFp8``: codes with block scales) becomes its float32
        values; another such subclass is a ``ValueError`` naming the state (before: its
        codes were read, or a torch dispatch error at the step)."""
        groups = [
            dict(g, lr=g["lr"].item())
            if isinstance(g.get("lr"), torch.Tensor) and g["lr"].numel() == 1
            else g
            for g in state_dict["param_groups"]
        ]
        states = {}
        for index, state in state_dict["state"].items():
            states[index] = dict(state)
            for name, value in state.items():
                if (
                    not isinstance(value, torch.Tensor)
                    or _dist.is_dtensor(value)
                    or value.data_ptr() != 0
                    or value.numel() == 0
                    or value.is_meta
                ):
                    continue
                if type(value).dequantize is torch.Tensor.dequantize:  # not its own
                    raise ValueError(
                        f"state_dict: state[{index}][{name!r}] is a {type(value).__name__} (a"
                        " tensor subclass with no storage of its own), which srround cannot"
                        " read: save its values as a plain tensor"
                    )
                states[index][name] = value.dequantize(torch.float32)
        return dict(state_dict, param_groups=groups, state=states)

    def _check_state_shapes(self, state_dict: dict) -> None:
        """A saved state of one value per element (moments, momentum, the weight mode's
        buffer) must have its parameter's shape (before: a broadcasting error in the step)
        and, a DTensor, its parameter's mesh and placements."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
            len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, self.param_groups)
        ):
            return  # torch's load_state_dict names that mismatch
        per_element = {*self._STATE_NAMES, "max_exp_avg_sq", *AUX_NAMES.values()}
        for saved_group, group in zip(saved_groups, self.param_groups):
            for index, p in zip(saved_group["params"], group["params"]):
                for name, value in state_dict["state"].get(index, {}).items():
                    if name in per_element and isinstance(value, torch.Tensor):
                        if tuple(value.shape) != tuple(p.shape):
                            raise ValueError(
                                f"state_dict: state[{index}][{name!r}] has shape"
                                f" {tuple(value.shape)}, its parameter {tuple(p.shape)}"
                            )
                        _dist.check_state_placement(
                            value, p, f"state_dict: state[{index}][{name!r}]"
                        )

    def _check_fp8_states(self, state_dict: dict, groups: list) -> None:
        """float8 states (``state_dtype`` float8) come with the block scales of the step that
        wrote them: a saved state of another dtype (a torch.optim or torchao dict, which take
        this optimizer's ``state_dtype``) is a ``ValueError`` at load, before anything is
        loaded (it was refused at the first step, after the load)."""
        for saved, group in zip(state_dict["param_groups"], groups):
            state_dtype = _STATE_DTYPE_OF[group["state_dtype"]]
            if state_dtype not in _FP8_STATE_DTYPES:
                continue
            for index in saved["params"]:
                for name in self._STATE_NAMES:
                    value = state_dict["state"].get(index, {}).get(name)
                    if isinstance(value, torch.Tensor) and value.dtype != state_dtype:
                        raise ValueError(
                            f"state_dict: state[{index}][{name!r}] is {value.dtype}, and"
                            f" state_dtype={group['state_dtype']!r} takes float8 states only"
                            " (their block scales come from the step that wrote them): load it"
                            " into an optimizer with state_dtype='float32' or 'bfloat16'"
                        )
                    scale = _SCALE_NAMES.get(name)
                    if scale and value is not None and scale not in state_dict["state"][index]:
                        # without its scales a code decodes as 0 (a zero scale is made)
                        raise ValueError(
                            f"state_dict: state[{index}] has {name!r} but not {scale!r}: float8"
                            " states are read through their block scales"
                        )

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's ``load_state_dict``, also of a ``torch.optim`` optimizer's state dict: group
        keys it lacks (``rounding``, ``state_dtype``, ``seed``, ...) come from this optimizer's
        defaults, and every group is checked before anything is loaded. srround's state dtypes
        are kept (torch casts every floating state to the parameter's dtype, which would round
        fp32 moments and master weights of bf16 parameters, and turn int16 remainders into
        values); a float ``step`` (torch's) becomes srround's int32 counter; torchao's tensor
        ``lr`` and quantized states are read (``_plain_states``). A state dict of
        another optimizer (its groups lack this one's hyperparameters: ``_SAVED_KEYS``; or
        ``torch.optim.Adam``'s with weight decay, which is not decoupled) or with states of
        another shape than their parameters is a ``ValueError``. torch's hooks run as
        torch runs them: the pre-hooks first (what they return is what is checked and loaded),
        the post-hooks last. The loaded one-per-optimizer values (``rounding``, ``state_dtype``,
        ``seed``, ...) replace the constructor's in ``defaults``: a group added later takes them."""
        hooks = (
            self._optimizer_load_state_dict_pre_hooks,
            self._optimizer_load_state_dict_post_hooks,
        )
        pre_hooks, post_hooks = (list(h.values()) for h in hooks)
        state_dict = state_dict.copy()
        for hook in pre_hooks:
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        state_dict = self._plain_states(state_dict)
        for i, saved in enumerate(state_dict["param_groups"]):
            missing = [key for key in self._SAVED_KEYS if key not in saved]
            if missing:  # before: filled from this optimizer's defaults, silently
                raise ValueError(
                    f"state_dict: param group {i} has no {', '.join(missing)}: not a state dict"
                    f" of {type(self).__name__} (torch.optim's or srround's)"
                    + (
                        "; optimi's states differ from torch's (AdamW: bias-corrected moments,"
                        " one step count per group; SGD: the momentum in exp_avg): convert it"
                        " as the README's PyTorch section says"
                        if "decouple_lr" in saved  # optimi's own key
                        else ""
                    )
                )
        self._check_state_shapes(state_dict)
        for index, state in state_dict["state"].items():  # the value read once (a sync on CUDA)
            if state.get("step") is not None:
                count = float(torch.as_tensor(state["step"]).reshape(()))
                name = f"state_dict: state[{index}]['step']"
                _validate.steps_taken(count, name, _optim.MAX_STEPS)
        groups = [dict(self.defaults, **g) for g in state_dict["param_groups"]]
        for i, group in enumerate(groups):
            where = f" (saved param group {i})"
            _check_rounding(group["rounding"])
            group["state_dtype"] = _check_state_dtype(group["state_dtype"])
            check_seed(group["seed"], f"seed{where}")
            _check_flags(group, where)
            self._check_group(group, i)
        first = groups[0] if groups else {}
        for i, group in enumerate(groups):
            for name in self._ONE_PER_OPTIMIZER:
                if group[name] != first[name]:
                    raise ValueError(
                        f"state_dict: param group {i} has {name}={group[name]!r}, group 0"
                        f" {first[name]!r} (one value per optimizer)"
                    )
        if groups:  # another weight mode's buffer would be kept unused: its weight lost
            used = AUX_NAMES.get(first["rounding"])
            for index, state in state_dict["state"].items():
                for name in AUX_NAMES.values():
                    if name != used and isinstance(state.get(name), torch.Tensor):
                        raise ValueError(
                            f"state_dict: state[{index}] has {name!r}, which rounding="
                            f"{first['rounding']!r} does not use: pass rounding="
                            f"{next(k for k, v in AUX_NAMES.items() if v == name)!r}"
                        )
        for i, (group, own) in enumerate(zip(groups, self.param_groups)):
            codes = [_BUFFER_CODES.get(p.dtype) for p in own["params"]]
            # the mode these parameters can take (add_param_group's check)
            where = f" (saved param group {i})"
            _plan.check_param_codes(codes, _plan.check_rounding(group["rounding"]), where=where)
        self._check_fp8_states(state_dict, groups)
        state_dict = dict(state_dict, param_groups=groups)
        # torch's load, without the hooks (their dicts emptied, then refilled in order: the
        # handles stay valid): they run here, around srround's restore
        registered = [dict(h) for h in hooks]
        for h in hooks:
            h.clear()
        try:
            super().load_state_dict(state_dict)
        finally:
            for h, saved in zip(hooks, registered):
                h.update(saved)
        saved = state_dict["state"]
        for saved_group, group in zip(state_dict["param_groups"], self.param_groups):
            for index, p in zip(saved_group["params"], group["params"]):
                if index not in saved:
                    continue
                restored = {}
                for name, value in saved[index].items():
                    if name == "step":
                        value = (
                            torch.as_tensor(value).detach().to(device=p.device, dtype=torch.int32)
                        )
                        restored[name] = value.reshape(()).clone()
                    elif isinstance(value, torch.Tensor):
                        restored[name] = value.detach().to(device=p.device, copy=True)
                    else:
                        restored[name] = value
                if "step" not in restored and restored:  # torch SGD: no count; not a first step
                    restored["step"] = torch.ones((), dtype=torch.int32, device=p.device)
                self.state[p] = restored
        if groups:  # the loaded one-per-optimizer values are the optimizer's: a group added
            # later (add_param_group) takes them, not the constructor's
            self.defaults.update({name: first[name] for name in self._ONE_PER_OPTIMIZER})
        self._entry = None  # new state tensors: rebuild the table at the next step
        for hook in post_hooks:
            hook(self)


class AdamW(_FusedOptimizer):
    """torch.optim.AdamW (decoupled weight decay) as one fused srround step.

    Args:
        params, lr, betas, eps, weight_decay, maximize: as ``torch.optim.AdamW``
            (``maximize``: one value per optimizer).
        amsgrad: one value per optimizer; ``True`` runs a slower per-tensor path (torch's
            math with torch ops, then srround's write-back with the fused step's random
            stream: ``amsgrad_update``) with rounding ``"stochastic"``, ``"nearest"`` or
            ``"master"`` and float32 states; state ``max_exp_avg_sq`` as torch's.
        foreach, fused, capturable: accepted and stored (srround's step is always one fused
            pass, keeps its step counts on the device and launches on the current stream);
            ``differentiable=True`` is refused.
        rounding: how the fp32 result reaches bf16/fp16 parameters: ``"stochastic"`` (default,
            no extra memory), ``"nearest"``, ``"kahan"``, ``"master"`` (fp32 master weights) or
            ``"remainder"`` (bf16 only; exact fp32 weights in 2 extra bytes). fp32 parameters
            are updated exactly in every mode.
        state_dtype: ``torch.float32`` (default), ``torch.bfloat16`` or fp8
            (``torch.float8_e4m3fn``, ``torch.float8_e5m2``) moments. fp8 moments are
            block-scaled: ``exp_avg_scale`` / ``exp_avg_sq_scale`` (float32, one per
            ``srround.STATE_BLOCK`` elements) in the state, ``exp_avg_sq`` holds ``sqrt(v)``
            (``docs/contracts.md``, "fp8 states"); eager steps only, no DTensors.
        seed: the random stream of the stochastic roundings (int in [0, 2**64)); None draws
            one from torch's default generator (from srround's after ``srround.manual_seed``).
            Stored in the param groups (and the state dict).

    ``step(closure=None, *, inv_scale=None, found_inf=None, check_grads=False,
    grad_scale=None)``; see the module docstring for the cache, layouts and state layout.
    """

    _KIND = _optim.ADAMW
    _STATE_NAMES = ("exp_avg", "exp_avg_sq")
    _SAVED_KEYS = ("lr", "betas", "eps", "weight_decay")  # in every AdamW state dict's groups
    _ONE_PER_OPTIMIZER = (*_FusedOptimizer._ONE_PER_OPTIMIZER, "amsgrad")

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        amsgrad=False,
        *,
        maximize=False,
        foreach=None,
        capturable=False,
        differentiable=False,
        fused=None,
        rounding="stochastic",
        state_dtype=torch.float32,
        seed=None,
    ):
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": bool(maximize),
            "foreach": foreach,
            "capturable": capturable,
            "differentiable": differentiable,
            "fused": fused,
        }
        self._check_group(defaults, None)
        defaults["betas"] = tuple(betas)
        super().__init__(params, defaults, rounding, state_dtype, seed)

    def _check_group(self, group, index):
        where = "" if index is None else f" (param group {index})"
        if group.get("amsgrad") and (
            group.get("rounding") in ("kahan", "remainder")
            or _STATE_DTYPE_NAMES.get(group.get("state_dtype", "float32")) != "float32"
        ):
            raise ValueError(
                f"amsgrad{where}: the per-tensor AMSGrad path supports rounding 'stochastic',"
                " 'nearest' or 'master' with float32 states, got"
                f" {group.get('rounding')!r} / {group.get('state_dtype')}"
            )
        for name in ("lr", "eps", "weight_decay"):
            _check_hyper(group[name], name, where)
        if group.get("decoupled_weight_decay") is False and group["weight_decay"] != 0:
            raise ValueError(  # torch.optim.Adam's group: L2 decay through the gradient
                f"decoupled_weight_decay{where}: False with weight_decay"
                f" {group['weight_decay']} is torch.optim.Adam's L2 weight decay; srround's"
                " AdamW decouples it (AdamW's rule)"
            )
        betas = group["betas"]
        if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__"):
            raise TypeError(f"betas{where}: expected a pair (beta1, beta2), got {betas!r}")
        if len(betas) != 2:
            raise ValueError(f"betas{where}: expected 2 values, got {len(betas)}")
        for i, beta in enumerate(betas):
            if not 0.0 <= _check_hyper(beta, f"betas[{i}]", where) < 1.0:
                raise ValueError(f"betas[{i}]{where}: expected in [0, 1), got {beta}")
        _validate.adamw_coefficients(group["lr"], betas[0], group["weight_decay"], where)

    def _hyper_rows(self):
        rows = []
        for i, g in enumerate(self.param_groups):
            self._check_group(g, i)  # edited since the last step: checked before any write
            rows.append((float(g["lr"]), g["betas"][0], g["betas"][1], g["eps"], g["weight_decay"]))
        return rows

    def _amsgrad_step(self, inv_scale, found_inf, check_grads, grad_scale):
        """AMSGrad, the per-tensor path (``amsgrad_update``) over the states ``_init_group``
        creates; under torch.compile the custom op ``srround::amsgrad_step`` (``_ops.py``)."""
        if torch.compiler.is_compiling():
            self._traced_step(inv_scale, found_inf, check_grads, grad_scale)
            return
        lists = [[] for _ in range(7)]
        meta = self._init_group(*lists)
        params = lists[0]
        if not params:
            return
        amsgrad_update(
            *([_dist.local(t) for t in ts] for ts in lists),
            found_inf,
            inv_scale,
            grad_scale,
            check_grads,
            *meta[1:-1],
        )
        written = [_dist.local(p) for p in params] + [p for p in params if _dist.is_dtensor(p)]
        torch.autograd.graph.increment_version([t for t in written if not t.is_inference()])


def amsgrad_update(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    auxes: list[torch.Tensor],
    steps: list[torch.Tensor],
    maxes: list[torch.Tensor],
    found_inf: torch.Tensor | None,
    inv_scale: torch.Tensor | None,
    grad_scale: torch.Tensor | None,
    check_grads: bool,
    weight_mode: int,
    state_fmt: int,
    group_index: list[int],
    s1_index: list[int],
    aux_index: list[int],
    hyper: list[float],
    k0: int,
    k1: int,
    maximize: bool,
    noise: list[int],
    mesh_groups: str,
) -> None:
    """AdamW with AMSGrad over plain tensors (DTensors' local pieces), one tensor at a time:
    torch.optim's single-tensor AdamW math with torch ops in float32 (so fp32 parameters get
    torch's bits), then srround's write-back of the result: stochastic rounding with the fused
    step's stream (element ``j`` of a parameter's piece with ``noise`` ``(start, run, skip)``
    at offset ``t * 2**36 + start + j + (j // run) * skip``, memory order), round to nearest,
    or the fp32 master weight (``auxes``). Arguments as ``_init_group`` lists them;
    ``found_inf`` (checked and all-reduced over the process groups ``mesh_groups`` names first
    with ``check_grads``) nonzero: nothing changes. A NaN result (parameter, moment, maximum)
    is +qNaN, as the fused step writes it. Reads the step counts and ``found_inf`` on the host.
    Also the custom op ``srround::amsgrad_step`` (``_ops.py``)."""
    import srround

    from .amp import unscale_grads

    if grad_scale is not None:
        inv = torch.as_tensor(grad_scale, dtype=torch.float32, device=params[0].device)
        scratch = torch.zeros(1, dtype=torch.float32, device=inv.device)
        unscale_grads(grads, inv.double().reciprocal().float().reshape(1), scratch)
    if check_grads:
        unscale_grads(grads, torch.ones_like(found_inf), found_inf)
        _dist.all_reduce_max(found_inf, _dist.resolve_groups(mesh_groups))
    if isinstance(inv_scale, torch.Tensor) and not 0 < float(inv_scale.reshape(())) < math.inf:
        if found_inf is not None:  # an unusable scale: flagged and skipped, as the fused step
            found_inf.fill_(1.0)
        return
    if found_inf is not None and float(found_inf.reshape(())) != 0:
        return
    rounding = {code: name for name, code in _optim.MODES.items()}[weight_mode]
    masters = dict(zip(aux_index, auxes))
    rows = np.array(hyper, np.float64).reshape(-1, _optim.HYPER_COLUMNS)
    seed = k0 | (k1 << 32)
    layouts = zip(noise[0::3], noise[1::3], noise[2::3])
    for i, (piece, grad, gi, layout) in enumerate(zip(params, grads, group_index, layouts)):
        lr, beta1, beta2, eps, wd = (float(v) for v in rows[gi])
        steps[0][i] += 1
        t = int(steps[0][i])
        grad = grad.float() if grad.dtype != torch.float32 else grad.clone()
        if inv_scale is not None:
            grad.mul_(inv_scale)
        if maximize:
            grad.neg_()
        exp_avg, exp_avg_sq, max_sq = exp_avgs[i], exp_avg_sqs[i], maxes[i]
        if piece.dtype == torch.float32 and _is_dense(piece):
            work = piece
        elif rounding == "master" and piece.dtype != torch.float32:
            work = masters[i]
        else:
            work = torch.empty_like(exp_avg).copy_(piece)
        work.mul_(1 - lr * wd)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        torch.maximum(max_sq, exp_avg_sq, out=max_sq)
        bias_correction2_sqrt = (1 - beta2**t) ** 0.5
        denom = (max_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        work.addcdiv_(exp_avg, denom, value=-(lr / (1 - beta1**t)))
        for result in (exp_avg, exp_avg_sq, max_sq, work):
            _canonical_nan_(result)
        if work.data_ptr() == piece.data_ptr():
            continue  # a dense fp32 parameter, updated in place
        if piece.dtype == torch.float32 or rounding != "stochastic":
            piece.copy_(work)  # fp32 exactly; nearest and master: round to nearest
            _canonical_nan_(piece)
        else:
            flat = work.as_strided((work.numel(),), (1,))  # memory order
            start, run, skip = layout
            offset = (t << _optim.STEP_SHIFT) + start
            fmt = "bfloat16" if piece.dtype == torch.bfloat16 else "float16"
            if run:  # a piece of runs (tensor parallel): rows at their places in the stream
                rounded = _dist.round_runs(
                    flat,
                    (run, skip),
                    lambda x, at: srround.stochastic_round(x, dtype=fmt, seed=seed, offset=at),
                    getattr(torch, fmt),
                    offset,
                )
            else:
                rounded = srround.stochastic_round(flat, dtype=fmt, seed=seed, offset=offset)
            piece.copy_(rounded.as_strided(work.shape, work.stride()))


def _fp8_step(opt, inv_scale, found_inf, check_grads, grad_scale):
    if inv_scale is not None and not isinstance(inv_scale, torch.Tensor):
        inv_scale = _validate.inv_scale(inv_scale)
    opt._eager_step(inv_scale, found_inf, check_grads, grad_scale)


# float8 states under torch.compile (no custom op for them yet): the eager step at a graph
# break, Dynamo off in all it calls (before: Dynamo compiled its callees and died, or with
# fullgraph=True said "Observed exception"); fullgraph=True: Dynamo's error gives the reason.
# Dynamo's ``disable`` of it is made when Dynamo is imported (``_lazy_dynamo``)
_eager_fp8_step = _fp8_step


def _disable_dynamo_in_fp8_step(dynamo) -> None:
    global _eager_fp8_step
    _eager_fp8_step = dynamo.disable(
        _fp8_step,
        reason="state_dtype: float8 states are not supported inside torch.compile yet: their"
        " step runs eagerly at a graph break (with fullgraph=True, call opt.step() outside the"
        " compiled function)",
    )


_lazy_dynamo.when_imported(_disable_dynamo_in_fp8_step)


class SGD(_FusedOptimizer):
    """torch.optim.SGD (momentum, dampening, nesterov, weight decay) as one fused srround step.

    Args:
        params, lr, momentum, dampening, weight_decay, nesterov, maximize: as
            ``torch.optim.SGD`` (``maximize``: one value per optimizer).
        foreach, fused, differentiable: as ``AdamW``.
        rounding, state_dtype, seed: as ``AdamW`` (``state_dtype``: the momentum buffers).
    """

    _KIND = _optim.SGD
    _STATE_NAMES = ("momentum_buffer", "unused")
    _SAVED_KEYS = ("lr", "momentum", "dampening", "weight_decay", "nesterov")

    def __init__(
        self,
        params,
        lr=1e-3,
        momentum=0.0,
        dampening=0.0,
        weight_decay=0.0,
        nesterov=False,
        *,
        maximize=False,
        foreach=None,
        differentiable=False,
        fused=None,
        rounding="stochastic",
        state_dtype=torch.float32,
        seed=None,
    ):
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
            "maximize": bool(maximize),
            "foreach": foreach,
            "differentiable": differentiable,
            "fused": fused,
        }
        self._check_group(defaults, None)
        super().__init__(params, defaults, rounding, state_dtype, seed)

    def _check_group(self, group, index):
        where = "" if index is None else f" (param group {index})"
        for name in ("lr", "momentum", "weight_decay"):
            _check_hyper(group[name], name, where)
        _check_hyper(group["dampening"], "dampening", where, minimum=-math.inf)
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError(f"nesterov{where}: needs momentum > 0 and dampening == 0")

    def _uses_state(self, group, name):
        return name == "momentum_buffer" and group["momentum"] != 0

    def _layout_key(self):
        return tuple(g["momentum"] != 0 for g in self.param_groups)

    def _hyper_rows(self):
        rows = []
        for i, g in enumerate(self.param_groups):
            self._check_group(g, i)
            rows.append(
                (
                    float(g["lr"]),
                    g["momentum"],
                    g["dampening"],
                    g["weight_decay"],
                    float(g["nesterov"]),
                )
            )
        return rows
