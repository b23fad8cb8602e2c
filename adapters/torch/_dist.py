"""DTensor support (FSDP2, tensor parallel) and noise keyed to the global element.

A ``torch.distributed.tensor.DTensor`` has no storage of its own (``data_ptr()`` is 0): every
kernel works on its local piece (``to_local()``), and an element's place in the random stream
is its place in the full, unsharded tensor, so the bits never depend on the rank, the shard
shape or the optimizer partition:

* a local piece is one contiguous range of the full tensor's row-major order (``Shard(0)``,
  as FSDP2 shards, uneven and empty pieces included; ``Replicate()``), or evenly spaced runs
  of it (``Shard(1)`` of a matrix, as ``RowwiseParallel`` shards; FSDP2 + tensor parallel's
  ``(Shard(0), Shard(1))``), and each element is keyed to its flat index in the full tensor
  (``stream_layout``, from ``compute_local_shape_and_global_offset``): the optimizers' table
  holds a piece's runs; the functional calls round a piece of runs as rows padded to the
  stream's spacing (``round_runs``; ``srround._api._launch_runs``). ``Partial`` placements
  raise ``ValueError``.
* a replicated piece starts at 0 on every rank: replicas draw the same noise and never drift.

Parameter identity in the optimizers (``stream_base``): parameter ``i`` of an optimizer's
parameter order (every group, in order, with or without a gradient) starts at the sum of the
full sizes (``numel()``) of parameters ``0..i-1``; ``assign_stream_offsets(params)`` sets that
start on the parameter objects themselves, from a list the caller chooses (the model's
``parameters()``), which an optimizer given only part of the model (a
``ZeroRedundancyOptimizer`` partition) then uses. Keep the order and shapes of that list
stable across a resume: the seed and step counts are in the state dict, the order is not.
"""

from __future__ import annotations

import math
import sys

import torch

from . import _lazy_dynamo

__all__ = ["assign_stream_offsets"]

_TAG = "_srround_stream_offset"


def dtensor_type():
    """``DTensor`` if ``torch.distributed.tensor`` is imported (else no DTensor can exist)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def is_dtensor(t) -> bool:
    kind = dtensor_type()
    return kind is not None and isinstance(t, kind)


def any_dtensor(tensors, kind) -> bool:
    """Whether any of ``tensors`` is a ``kind`` (``dtensor_type()``, not None): by the set of
    their types, a C-level pass (``isinstance`` of each tensor against DTensor costs about 70
    ns, 14 us for a list of 200 gradients)."""
    return any(issubclass(tp, kind) for tp in set(map(type, tensors)))


def local(t):
    """The local piece of a DTensor, ``t._local_tensor``, eager and traced alike, else ``t``.
    Not ``to_local()``: under torch.compile its op, with FSDP2 gradients (views of a flat
    buffer) on torch 2.14, failed Dynamo's guard building (an ``IndexError`` in
    ``produce_guards``); and a piece reached both ways in one graph fails AOT's
    functionalization."""
    return t._local_tensor if is_dtensor(t) else t


def locals_of(tensors, name: str) -> list:
    """Local pieces of a list that is all DTensors or all plain tensors (``ValueError``
    naming the first odd one otherwise); ``None`` entries stay."""
    kind = dtensor_type()
    if kind is None:
        return list(tensors)
    tensors = list(tensors)
    if not any_dtensor(tensors, kind):
        return tensors
    if not all(isinstance(t, kind) for t in tensors if t is not None):
        i = next(i for i, t in enumerate(tensors) if t is not None and not isinstance(t, kind))
        raise ValueError(
            f"{name}[{i}]: a plain tensor in a list of DTensors; pass all DTensors (one"
            " sharded model) or all plain tensors"
        )
    return [None if t is None else local(t) for t in tensors]


def _mesh_text(t) -> str:
    return f"{t.device_mesh} {tuple(t.placements)}"


def stream_layout(t, name: str) -> tuple[int, int, int]:
    """Where DTensor ``t``'s local piece lies in the full tensor's row-major order, as
    ``(start, run, skip)``: element ``j`` of the piece (row-major) is element
    ``start + j + (j // run) * skip`` of the full tensor (``run`` 0: one contiguous range,
    ``start + j``); ``(0, 0, 0)`` for a plain tensor. A ``Shard(1)`` piece of a matrix
    (``RowwiseParallel``) is its rows: runs of the piece's width, ``skip`` the other ranks'
    columns. ``ValueError`` for a ``Partial`` placement (pending reduction) and for a piece
    whose runs are not evenly spaced (two dimensions split, with a larger one between or
    before them)."""
    if not is_dtensor(t):
        return 0, 0, 0
    from torch.distributed.tensor import Partial

    for placement in t.placements:
        if isinstance(placement, Partial):
            raise ValueError(
                f"{name}: a DTensor with a Partial placement ({_mesh_text(t)}) holds unreduced"
                " values; redistribute it to Shard/Replicate first"
            )
    shape = tuple(t.shape)
    if torch.compiler.is_compiling() and all(type(n) is int for n in shape):
        # a constant of the graph: Dynamo before torch 2.13 cannot trace torch's own function
        local_shape, offset = _static_piece(torch.Size(shape), t.device_mesh, t.placements)
    else:
        local_shape, offset = _piece(shape, t.device_mesh, t.placements)
    if tuple(t._local_tensor.shape) != tuple(local_shape):
        raise ValueError(
            f"{name}: local piece of shape {tuple(t._local_tensor.shape)}, but its placements"
            f" ({_mesh_text(t)}) give {local_shape}"
        )
    layout = piece_layout(shape, local_shape, offset)
    if layout is None:
        raise ValueError(
            f"{name}: the local piece of this DTensor ({_mesh_text(t)}, global shape"
            f" {shape}, local {local_shape}) is not evenly spaced runs of the full tensor,"
            " so its elements cannot be keyed to their global positions; shard at most one"
            " dimension after the first (as Shard(0), Shard(1) and FSDP2 + tensor parallel do)"
        )
    if layout[1] and not t._local_tensor.is_contiguous():
        raise ValueError(
            f"{name}: a local piece of runs ({_mesh_text(t)}) must be contiguous, its strides"
            f" are {t._local_tensor.stride()}"
        )
    return layout


def piece_layout(shape, local_shape, offset) -> tuple[int, int, int] | None:
    """``stream_layout`` of the piece of local shape ``local_shape`` at global ``offset`` of a
    tensor of full ``shape``: ``(start, run, skip)``, or None when its runs are not evenly
    spaced in the full tensor's row-major order. (Loops, not ``max(default=)``: Dynamo traces
    this.)"""
    if math.prod(local_shape) == 0:
        return 0, 0, 0
    start, stride = 0, 1
    for d in reversed(range(len(shape))):
        start += offset[d] * stride
        stride *= shape[d]
    split = 0  # the last split dimension: the piece is full after it
    for d in range(len(shape)):
        if local_shape[d] != shape[d]:
            split = d
    lead = [d for d in range(split) if local_shape[d] != 1]  # what indexes the runs
    if not lead:
        return start, 0, 0  # one range
    for d in range(lead[0] + 1, lead[-1] + 1):
        if local_shape[d] != shape[d]:
            return None
    run = math.prod(local_shape[split:])
    return start, run, math.prod(shape[lead[-1] + 1 :]) - run


PADDED_ELEMENTS = 1 << 22  # the most elements round_runs rounds in one call


def round_runs(flat, runs, round_flat, dtype, offset):
    """Stochastic rounding of float32 ``flat`` (1-D) whose element ``j`` is at stream position
    ``offset + j + (j // run) * skip`` (``runs``: ``(run, skip)``, ``stream_layout``'s):
    ``round_flat(x, at)`` (a one-range call: ``x[i]`` at position ``at + i``) of its runs
    placed in rows as wide as the stream's distance between them (the skipped positions zero,
    their results dropped), a batch of rows a call; the ``dtype`` result, 1-D."""
    run, skip = runs
    rows, width = flat.view(-1, run), run + skip
    batch = max(1, PADDED_ELEMENTS // width)
    out = torch.empty(rows.shape, dtype=dtype, device=flat.device)
    for r0 in range(0, rows.shape[0], batch):
        block = rows[r0 : r0 + batch]
        padded = block.new_zeros(block.shape[0], width)
        padded[:, :run] = block
        rounded = round_flat(padded.view(-1), offset + r0 * width)
        out[r0 : r0 + batch] = rounded.view(-1, width)[:, :run]
    return out.view(-1)


def _piece(shape, mesh, placements) -> tuple[tuple, tuple]:
    """``(local shape, global offset)`` of this rank's piece of a DTensor of full ``shape``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    return tuple(local_shape), tuple(offset)


# ``_piece`` as a constant of a compiled graph, marked when Dynamo is imported (``_lazy_dynamo``)
_static_piece = _piece


def _mark_piece_constant(dynamo) -> None:
    global _static_piece
    _static_piece = dynamo.assume_constant_result(_piece)


_lazy_dynamo.when_imported(_mark_piece_constant)


def assign_stream_offsets(params) -> int:
    """Key the optimizers' noise of ``params`` (e.g. ``model.parameters()``) to this order.

    Parameter ``i`` gets stream start ``sum(params[j].numel() for j < i)`` (full, unsharded
    sizes), stored on the parameter object; srround's optimizers then use it instead of their
    own parameter order. Needed where an optimizer holds part of the model, as each rank's
    partition of a ``ZeroRedundancyOptimizer``: every rank calls it with the same list, before
    the first step. Call it again after ``fully_shard`` (which replaces the parameters).

    Returns:
        the total number of elements (the next free stream start).
    """
    start = 0
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"params[{i}]: expected a tensor, got {type(p).__name__}")
        setattr(p, _TAG, start)
        start += p.numel()
    return start


def check_default_seed() -> None:
    """``seed=None`` with several ranks (``torch.distributed`` initialized, world size > 1):
    each process would draw a seed of its own (ranks often seed torch differently), so DDP
    replicas and FSDP2's replicated mesh dimensions would round differently and drift apart.
    ``ValueError`` unless ``srround.manual_seed`` seeded the library generator (the same calls
    then draw the same seeds on every rank)."""
    from srround._rng import manually_seeded

    module = sys.modules.get("torch.distributed")
    if module is None or not module.is_available() or not module.is_initialized():
        return
    if module.get_world_size() > 1 and not manually_seeded():
        raise ValueError(
            "seed: pass a seed (the same on every rank) when torch.distributed runs several"
            " ranks; seed=None may draw a different one in each process, and replicas (DDP,"
            " Replicate placements) would drift apart (or call srround.manual_seed on every"
            " rank first)"
        )


def stream_bases(params) -> dict:
    """``id(p) -> stream start`` of every parameter of an optimizer, in its parameter order
    (``params``: all of them, every group): the ``assign_stream_offsets`` tags where every
    parameter has one, else the prefix sums of the full sizes."""
    tags = [getattr(p, _TAG, None) for p in params]
    if all(t is not None for t in tags):
        return {id(p): t for p, t in zip(params, tags)}
    if any(t is not None for t in tags):
        i = next(i for i, t in enumerate(tags) if t is None)
        raise ValueError(
            f"params[{i}]: has no stream offset, but other parameters of this optimizer do;"
            " call assign_stream_offsets with a list that holds every parameter"
        )
    bases, start = {}, 0
    for p in params:
        bases.setdefault(id(p), start)
        start += p.numel()
    return bases


def check_group(params, first_index: int = 0) -> bool:
    """Check one param group: all DTensors on one device mesh, or all plain tensors (clear
    ``ValueError`` otherwise). Returns whether they are DTensors."""
    kind = dtensor_type()
    if kind is None or not params:
        return False
    flags = [isinstance(p, kind) for p in params]
    if not any(flags):
        return False
    if not all(flags):
        i = flags.index(False)
        raise ValueError(
            f"params[{first_index + i}]: a plain tensor in a param group of DTensors; shard the"
            " whole model (or none of it) or put it in another optimizer"
        )
    mesh = params[0].device_mesh
    for i, p in enumerate(params):
        if p.device_mesh != mesh:
            raise ValueError(
                f"params[{first_index + i}]: on device mesh {p.device_mesh}, but"
                f" params[{first_index}] is on {mesh}; one mesh per param group"
            )
        stream_layout(p, f"params[{first_index + i}]")
    return True


def check_grad(p, i: int):
    """The local gradient of parameter ``p`` (``i``: its index in the error message):
    a DTensor gradient for a DTensor parameter with the same mesh and placements, a plain one
    for a plain parameter."""
    g = p.grad
    p_dt, g_dt = is_dtensor(p), is_dtensor(g)
    if g_dt and not p_dt:
        raise ValueError(
            f"grads[{i}]: a DTensor gradient ({_mesh_text(g)}) for a plain parameter;"
            " the parameter and its gradient must both be DTensors or both plain"
        )
    if p_dt and not g_dt:
        raise ValueError(
            f"grads[{i}]: a plain gradient for a DTensor parameter ({_mesh_text(p)});"
            " the parameter and its gradient must both be DTensors or both plain"
        )
    if not p_dt:
        return g
    if g.device_mesh != p.device_mesh or tuple(g.placements) != tuple(p.placements):
        raise ValueError(
            f"grads[{i}]: placed as {_mesh_text(g)}, its parameter as {_mesh_text(p)};"
            " redistribute the gradient to the parameter's placements"
        )
    return g._local_tensor


def mesh_groups(tensors) -> list:
    """The process groups of every dimension of the device meshes of DTensors ``tensors``
    (deduplicated, in order)."""
    kind = dtensor_type()
    if kind is None or not any_dtensor(tensors, kind):
        return []
    groups, meshes = [], []
    for t in tensors:  # `is`, not id(): torch 2.11's Dynamo cannot trace id() of a mesh
        if isinstance(t, kind) and all(t.device_mesh is not m for m in meshes):
            mesh = t.device_mesh
            meshes.append(mesh)
            for d in range(mesh.ndim):
                group = mesh.get_group(d)
                if all(group is not g for g in groups):
                    groups.append(group)
    return groups


def group_names(groups) -> str:
    """Process groups by name, one a line: how the custom ops take them (``resolve_groups``)."""
    return "\n".join(g.group_name for g in groups)


def resolve_groups(names: str) -> list:
    """The process groups ``group_names`` named."""
    if not names:
        return []
    from torch.distributed.distributed_c10d import _resolve_process_group

    return [_resolve_process_group(name) for name in names.splitlines()]


def all_reduce_max(flags, groups) -> None:
    """All-reduce ``flags`` (a float32 tensor) with MAX over every group in ``groups``, in
    place and on the device: the ranks agree on an overflow without a host sync (as torch's
    ``ShardedGradScaler``)."""
    if not groups:
        return
    import torch.distributed as dist

    for group in groups:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)


def like_dtensor(local_tensor, like):
    """A DTensor of ``like``'s mesh, placements, shape and stride around ``local_tensor``."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local_tensor,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def check_same_layout(t, like, name: str, like_name: str) -> None:
    """``t`` and ``like`` both DTensors with one mesh and placements, or both plain."""
    t_dt, like_dt = is_dtensor(t), is_dtensor(like)
    if t_dt != like_dt:
        raise ValueError(
            f"{name}: is a {'DTensor' if t_dt else 'plain tensor'} but {like_name} is a"
            f" {'DTensor' if like_dt else 'plain tensor'}; pass both as DTensors or both plain"
        )
    if t_dt and (
        t.device_mesh != like.device_mesh or tuple(t.placements) != tuple(like.placements)
    ):
        raise ValueError(
            f"{name}: placed as {_mesh_text(t)}, but {like_name} as {_mesh_text(like)}"
        )


def check_state_placement(buf, p, name: str) -> None:
    """A DTensor state ``buf`` must have parameter ``p``'s mesh and placements (its local
    piece is what the kernels pair with ``p``'s); ``ValueError`` naming ``name`` otherwise."""
    if not is_dtensor(buf):
        return
    if not is_dtensor(p):
        raise ValueError(
            f"{name}: a DTensor state ({_mesh_text(buf)}) for a plain parameter; load the"
            " state dict with the parameters sharded as they were saved, or full_tensor() it"
        )
    if buf.device_mesh != p.device_mesh or tuple(buf.placements) != tuple(p.placements):
        raise ValueError(
            f"{name}: placed as {_mesh_text(buf)}, its parameter as {_mesh_text(p)};"
            " redistribute the state to the parameter's placements (or load the state dict"
            " through torch.distributed.checkpoint, which reshards)"
        )


def shard_like(buf, p, name: str):
    """State ``buf`` laid out as parameter ``p``: a full plain tensor (a state dict saved
    without sharding) becomes ``p``'s local piece wrapped as a DTensor like ``p``; a DTensor
    placed otherwise than ``p`` is an error (``check_state_placement``)."""
    check_state_placement(buf, p, name)
    if is_dtensor(p) == is_dtensor(buf):
        return buf
    if tuple(buf.shape) != tuple(p.shape):
        raise ValueError(f"{name}: shape {tuple(buf.shape)}, its parameter {tuple(p.shape)}")
    piece = p._local_tensor
    stream_layout(p, name)  # the placements' checks
    local_shape, offset = _piece(tuple(p.shape), p.device_mesh, p.placements)
    window = tuple(slice(o, o + n) for o, n in zip(offset, local_shape))
    values = buf.detach()[window].to(piece.device)
    return like_dtensor(values.clone(memory_format=torch.contiguous_format), p)


def cache_key(groups, params, grads):
    """The optimizers' table cache key for DTensor parameters: the parameter count of every
    group, then the addresses of the local pieces of every parameter and gradient (0: none)."""
    ptrs = [local(p).data_ptr() for p in params]
    grad_ptrs = [0 if g is None else local(g).data_ptr() for g in grads]
    return ([len(g["params"]) for g in groups], ptrs, grad_ptrs)
