"""srround's torch entry points as ``torch.library`` custom ops, so torch.compile traces them
as opaque calls (Dynamo never looks into Numba) and functionalizes their in-place writes:

* ``torch.ops.srround.stochastic_round(x, dtype, k0, k1, offset, saturate) -> Tensor``:
  float32 ``x`` rounded to bf16/fp16 (``srround.stochastic_round`` with the seed ``k0 +
  2**32 k1``); wrapper: ``srround.adapters.torch.stochastic_round``.
* ``torch.ops.srround.unscale_and_check_(grads, inv_scale, found_inf, per_tensor=False,
  strict=False, mesh_groups="", inv_value=1.0)``: the loss scaler's fused unscale and
  overflow check (``srround.unscale_and_check``), in place, then the flag all-reduced over
  the named process groups.
* ``torch.ops.srround.update_scale_(scale, growth_tracker, found_inf, overflow_tracker,
  ...)``: ``srround.update_scale`` in place (``GradScaler.update()``).
* ``torch.ops.srround.fused_step(...)``: the fused optimizer step of
  ``srround.adapters.torch.AdamW`` / ``SGD`` over lists of parameters, gradients and states,
  and the step counters as one int32 tensor in a one-item list (what their ``step()`` calls
  under torch.compile), with the eager step's
  stream starts; DTensor parameters pass their local pieces.
* ``torch.ops.srround.amsgrad_step(...)``: ``AdamW(amsgrad=True)``'s per-tensor step, the
  same way.

``srround.unscale_and_check`` on torch tensors traces as ``unscale_and_check_`` (Dynamo
substitutes ``_traceable_unscale_and_check``; DTensor gradients: local pieces, the flag
all-reduced over their meshes inside the op, as eagerly).

Each op runs the same kernels as the eager calls, so compiled code gives the eager bits. A
``seed`` is a constant of the compiled graph: pass a different ``offset`` per call (a tensor
argument is not needed: an int that changes makes Dynamo treat it as a dynamic size).
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

import srround
from srround._rng import check_offset, check_seed, split_seed

from . import _dist, _lazy_dynamo
from .amp import update_scale
from .optim import _TRACED, amsgrad_update, build_entry, rebind_grads, run_entry

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# fused_step: buffers' addresses -> entry, one per set of parameters; a table keeps the
# buffers it writes alive (``forget`` drops a collected optimizer's), so the latest few only:
# four, or one per live optimizer whose step was traced (aot_eager passes new copies each step)
_CACHE: dict = {}
_CACHE_SIZE = 4


@torch.library.custom_op("srround::stochastic_round", mutates_args=())
def _stochastic_round(
    x: Tensor, dtype: str, k0: int, k1: int, offset: int, saturate: bool
) -> Tensor:
    return srround.stochastic_round(
        x.contiguous(),
        dtype=dtype,
        seed=k0 | (k1 << 32),
        offset=offset,
        overflow="saturate" if saturate else "inf",
    )


@_stochastic_round.register_fake
def _(x, dtype, k0, k1, offset, saturate):
    return torch.empty(x.shape, dtype=_DTYPES[dtype], device=x.device)


def stochastic_round(x, *, dtype="bfloat16", seed, offset=0, overflow="inf"):
    """``srround.stochastic_round`` of a float32 tensor as a custom op (traceable by
    torch.compile, same bits as the eager call). ``seed`` is required (an int in [0, 2**64)):
    a seed drawn inside a compiled function would be a constant of the graph. As the eager
    call, records no autograd graph: the result never requires grad. A DTensor ``x`` gives a
    DTensor placed as ``x`` whose full value is the call on the full tensor (its local piece
    rounded at its global stream positions, ``_dist.stream_layout``)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: expected 'bfloat16' or 'float16', got {dtype!r}")
    if overflow not in ("inf", "saturate"):
        raise ValueError(f"overflow: expected 'inf' or 'saturate', got {overflow!r}")
    k0, k1 = split_seed(check_seed(seed, "seed"))
    if not isinstance(offset, torch.SymInt):  # compiled, a dynamic offset: the op checks it
        offset = check_offset(offset, "offset")
    if _dist.is_dtensor(x):
        start, run, skip = _dist.stream_layout(x, "x")
        piece = _dist.local(x.detach())

        def round_flat(flat, at):
            op = torch.ops.srround.stochastic_round
            return op(flat, dtype, k0, k1, at, overflow == "saturate")

        if run:  # a piece of runs (tensor parallel's Shard(1)): rows at their stream places
            flat = piece.contiguous().view(-1)
            rounded = _dist.round_runs(
                flat, (run, skip), round_flat, _DTYPES[dtype], offset + start
            )
            return _dist.like_dtensor(rounded.view(piece.shape), x)
        return _dist.like_dtensor(round_flat(piece, offset + start), x)
    return torch.ops.srround.stochastic_round(
        x.detach(), dtype, k0, k1, offset, overflow == "saturate"
    )


@torch.library.custom_op("srround::unscale_and_check_", mutates_args=("grads", "found_inf"))
def _unscale_and_check(
    grads: list[Tensor],
    inv_scale: Tensor | None,
    found_inf: Tensor,
    per_tensor: bool = False,
    strict: bool = False,
    mesh_groups: str = "",
    inv_value: float = 1.0,
) -> None:
    """Unscale plain tensors (a DTensor's local pieces) in place and flag inf/NaN in
    ``found_inf``: ``strict``, exactly ``srround.unscale_and_check`` (its checks and errors;
    ``inv_scale`` None: the host scale ``inv_value``), else the GradScaler's
    ``unscale_grads`` (any gradient); then ``found_inf`` all-reduced (MAX) over the process
    groups named in ``mesh_groups``, one a line."""
    from .amp import unscale_grads

    if strict:
        scale = inv_value if inv_scale is None else inv_scale
        srround.unscale_and_check(grads, scale, found_inf=found_inf, per_tensor=per_tensor)
    else:
        unscale_grads(grads, inv_scale, found_inf, per_tensor)
    _dist.all_reduce_max(found_inf, _dist.resolve_groups(mesh_groups))


@_unscale_and_check.register_fake
def _(grads, inv_scale, found_inf, *args, **kwargs):
    return None


def _traceable_unscale_and_check(grads, inv_scale, *, found_inf=None, per_tensor=False):
    """What torch.compile traces in place of ``srround.unscale_and_check``: torch gradients go
    to the custom op (DTensors as their local pieces, the op all-reduces ``found_inf`` over
    their meshes; the eager function's checks run inside the op), anything else runs eagerly
    at a graph break."""
    items = list(grads) if isinstance(grads, (list, tuple)) else [grads]
    kind = _dist.dtensor_type()
    dtensors = [kind is not None and isinstance(g, kind) for g in items]
    if (
        not items
        or not all(isinstance(g, Tensor) for g in items)
        or any(dtensors) != all(dtensors)
        or not isinstance(per_tensor, bool)
        or not isinstance(inv_scale, (Tensor, float, int))
        or isinstance(inv_scale, bool)
        or not (found_inf is None or isinstance(found_inf, Tensor))
    ):  # the eager call raises the error naming the argument
        return _eager_unscale_and_check(
            grads, inv_scale, found_inf=found_inf, per_tensor=per_tensor
        )
    names = _dist.group_names(_dist.mesh_groups(items))
    pieces = [_dist.local(g) for g in items]
    if found_inf is None:
        count = len(pieces) if per_tensor else 1
        found_inf = torch.zeros(count, dtype=torch.float32, device=pieces[0].device)
    scale, value = (inv_scale, 1.0) if isinstance(inv_scale, Tensor) else (None, inv_scale)
    torch.ops.srround.unscale_and_check_(
        pieces, scale, found_inf, per_tensor, True, names, float(value)
    )
    return found_inf


# the eager call, run at a graph break (its checks raise the errors naming the argument):
# Dynamo's ``disable`` of it once Dynamo is imported (``_tell_dynamo``, ``_lazy_dynamo``)
_eager_unscale_and_check = srround.unscale_and_check


def _tell_dynamo(dynamo) -> None:
    """srround's rules for torch.compile, given to Dynamo when it is imported
    (``_lazy_dynamo``):

    - Dynamo must not trace into Numba's dispatcher (it fails on its bytecode, even with
      fullgraph=False), nor into srround's functions (it traced ``np.float32(x)`` as a 0-d
      array, which Numba refused: ``GradScaler.update()`` in a compiled function died): an
      srround call that is not one of these ops (``srround.update_scale``,
      ``srround.stochastic_round(tensor)``) is one graph break (its file skipped) that runs
      eagerly with Dynamo off in all it calls;
    - ``srround.unscale_and_check`` on torch tensors traces as ``_traceable_unscale_and_check``.
    """
    global _eager_unscale_and_check
    with contextlib.suppress(Exception):  # private hooks: without them, use the ops below
        for module in ("numba", "srround._api", "srround._blocks"):
            dynamo.trace_rules.add(module)
    with contextlib.suppress(Exception):  # a newer private hook (without it: the files above)
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy

        for name in srround.__all__:
            code = getattr(getattr(srround, name), "__code__", None)
            if code is not None:
                set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
    _eager_unscale_and_check = dynamo.disable(srround.unscale_and_check)
    with contextlib.suppress(ValueError):  # registered already: this module was reloaded
        dynamo.substitute_in_graph(srround.unscale_and_check)(_traceable_unscale_and_check)


_lazy_dynamo.when_imported(_tell_dynamo)


# GradScaler.update()'s srround.update_scale
_update_scale = torch.library.custom_op(
    "srround::update_scale_",
    update_scale,
    mutates_args=("scale", "growth_tracker", "overflow_tracker"),
)


@_update_scale.register_fake
def _(*args):
    return None


@torch.library.custom_op(
    "srround::fused_step", mutates_args=("params", "states1", "states2", "auxes", "steps", "found")
)
def _fused_step(
    params: list[Tensor],
    grads: list[Tensor],
    states1: list[Tensor],
    states2: list[Tensor],
    auxes: list[Tensor],
    steps: list[Tensor],
    found: Tensor,
    inv_scale: Tensor | None,
    opt_kind: int,
    weight_mode: int,
    state_fmt: int,
    group_index: list[int],
    s1_index: list[int],
    aux_index: list[int],
    hyper: list[float],
    k0: int,
    k1: int,
    negate: bool,
    noise: list[int],
    mesh_groups: str,
    check_grads: bool,
) -> None:
    """The fused step over plain tensors (a DTensor parameter's local pieces); ``steps``: one
    int32[N] tensor, the N parameters' step counters (a list of 0-d counters reached the op
    as uninitialised copies in torch 2.11's inductor); ``noise``: each parameter's stream
    layout, 3 ints each (the eager step's ``_noise``), ``mesh_groups``: the names of the
    process groups that all-reduce ``found`` after ``check_grads``, one a line (FSDP2)."""
    import numpy as np

    from srround import _optim

    count = len(params)
    rows = [[None, None, None] for _ in range(count)]
    for i, s in zip(s1_index, states1):
        rows[i][0] = s
    for i, s in enumerate(states2):
        rows[i][1] = s
    for i, s in zip(aux_index, auxes):
        rows[i][2] = s
    (flat,) = steps  # the counters as one int32 tensor (``_init_group``)
    tensors = [*params, *grads, *states1, *states2, *auxes]
    written = [*params, *states1, *states2, *auxes]
    key = (
        tuple(t.data_ptr() for t in written),  # first: ``forget`` reads it
        opt_kind,
        weight_mode,
        state_fmt,
        tuple(group_index),
        tuple(s1_index),
        tuple(aux_index),
        tuple(noise),
        mesh_groups,
        # the tables keep no gradient alive: new gradients of the same dtypes and layouts
        # (zero_grad(set_to_none=True)) reuse the table, which then reads them
        tuple(t.dtype for t in tensors),
        tuple(t.shape for t in tensors),
        tuple(t.stride() for t in tensors),
    )
    entry = _CACHE.get(key)
    if entry is not None and entry.grad_addresses != [g.data_ptr() for g in grads]:
        if not rebind_grads(entry, grads):
            entry = None  # a gradient read through a copy: a table for these
    if entry is None:
        rounding = {code: name for name, code in _optim.MODES.items()}[weight_mode]
        device = params[0].device
        stream = None
        if device.type == "cuda":
            from ._views import _external_stream

            stream = _external_stream(device)
        entry = build_entry(
            opt_kind, rounding, state_fmt, params, grads, rows, flat, group_index, stream, noise
        )
        entry.groups = _dist.resolve_groups(mesh_groups)
        forget({p.data_ptr() for p in params})  # this table replaces its parameters' old ones
        if len(_CACHE) >= max(_CACHE_SIZE, len(_TRACED)):
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = entry
    else:
        from ._views import _view

        entry.fused.steps = _view(flat, False, "step").bits
        entry.buffers[0] = flat
    entry.fused.set_hyper(np.array(hyper, np.float64).reshape(-1, _optim.HYPER_COLUMNS))
    run_entry(entry, inv_scale, found, check_grads, negate, k0, k1)


def forget(addresses) -> None:
    """Drop the cached tables that write any of ``addresses`` (a collected optimizer's
    parameters: each table keeps the buffers it writes alive)."""
    for key in [k for k in _CACHE if not addresses.isdisjoint(k[0])]:
        del _CACHE[key]


@_fused_step.register_fake
def _(params, grads, states1, states2, auxes, steps, found, inv_scale, *args):
    return None


# AdamW(amsgrad=True)'s per-tensor step over plain tensors (DTensors' local pieces)
_amsgrad_step = torch.library.custom_op(
    "srround::amsgrad_step",
    amsgrad_update,
    mutates_args=(
        "params",
        "grads",
        "exp_avgs",
        "exp_avg_sqs",
        "auxes",
        "steps",
        "maxes",
        "found_inf",
    ),
)


@_amsgrad_step.register_fake
def _(*args):
    return None


__all__ = ["stochastic_round"]
