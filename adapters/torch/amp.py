"""``srround.adapters.torch.GradScaler``: a drop-in for ``torch.amp.GradScaler``.

Same methods and state dict as torch's (``scale``, ``unscale_``, ``step``, ``update``,
``get_scale``, ``state_dict``/``load_state_dict``, ``is_enabled``), with:

* one fused ``srround.unscale_and_check`` launch per optimizer, whatever the number of
  gradients, for float32, fp16 *and* bf16 gradients (torch's scaler refuses fp16 gradients
  unless told otherwise and needs one launch per device and dtype);
* ``hysteresis`` (back off only after that many consecutive overflows), ``min_scale`` and
  ``max_scale``, on the device like the rest of the update;
* ``last_step_skipped`` and ``skipped_steps``: device tensors, so reading them is the only sync.

Skipping a step needs to know on the host whether any gradient overflowed, so ``step`` reads the
flag (one sync), exactly as torch's scaler does for any optimizer - except for srround's own
optimizers (``srround.adapters.torch.AdamW``/``SGD``, marked ``_srround_fused``): for them
``step`` runs the overflow check only, then one fused optimizer step that multiplies the
gradients by 1/scale as it reads them and skips itself on the device when the flag is set (no
sync, no separate unscale pass writing the gradients).

Per-tensor (per-layer) scales (Zhao et al. 2019, "Adaptive loss scaling for mixed precision
training"): ``GradScaler(per_tensor=True)``, then ``scaler.attach(model)`` once. Every module
that directly owns parameters gets a dynamic scale ``s_m`` of its own, so a layer whose
gradients overflow at a scale that keeps another layer's tiny gradients from underflowing no
longer decides for all of them. Rescaling a gradient after it was computed would be too late
(it already over- or underflowed in fp16), so the scales act inside the backward pass:

* the loss is multiplied by ``S`` (``get_scale()``: ``init_scale``, fixed), the scale of the
  activation gradients between modules;
* the gradient reaching module ``m``'s outputs is multiplied by ``s_m / S`` (a tensor hook,
  registered by a forward hook), so ``m``'s parameter gradients come out scaled by ``s_m``;
* the gradients leaving ``m`` through its arguments are multiplied by ``S / s_m`` (an identity
  autograd function wrapped around them by a forward pre-hook). Inside a module that owns
  parameters, its scale takes the place of ``S`` for its submodules.

``unscale_`` multiplies every gradient by its own ``1 / s_m`` and flags it per module (one
``unscale_and_check(per_tensor=True)`` launch; ``found_inf(optimizer)`` stays one float32
flag, the max), ``update`` moves every ``s_m`` by the rule above from its own flag (one vector
``update_scale`` launch) and leaves ``S``. A step is skipped when any gradient overflowed, as
torch does, but only the modules that overflowed back off. ``tensor_scales`` holds one scale
per parameter tensor: the tensors of a module share its scale (its flag is the OR of theirs),
and so do modules that share a parameter object (tied weights). Parameters outside the attached
model are scaled by ``S``, which does not adapt.

Cost: per attached module and forward, a gradient hook per output and an autograd node per
input that needs a gradient; per backward, two elementwise multiplies of activation gradients
(exact for power-of-two scales). Assumptions, not checked: a module reads its parameters only
in its own ``forward`` (a weight read as ``other.weight`` in another module's forward gets two
scales mixed); gradient-carrying tensors enter a module through its arguments (also inside
lists, tuples and dicts); ``S`` keeps the activation gradients finite (otherwise every step is
skipped: lower ``init_scale``, or set ``S`` with ``update(new_scale)``). As with torch's full
backward hooks, a module's forward must not modify its inputs in place (autograd raises).

Several ranks: with DTensor gradients (FSDP2, tensor parallel) each rank checks its local
pieces, and the flag is all-reduced (MAX) over the gradients' device meshes on the device, no
host sync (as torch's ``ShardedGradScaler``), in ``unscale_`` and in the fused step of srround's
optimizers, so every rank skips together. DDP needs nothing: its gradients are all-reduced,
so every rank finds the same flag. Other setups where ranks hold different plain gradients:
after ``scaler.unscale_(optimizer)`` call
``torch.distributed.all_reduce(scaler.found_inf(optimizer), op=ReduceOp.MAX)``, then ``step``
and ``update`` as usual.
In per-tensor mode the ranks' module scales must stay equal (DDP averages gradients scaled by
them); they do when every rank checks the same all-reduced gradients, as under DDP.
"""

from __future__ import annotations

import dataclasses
import operator
from collections import abc
from collections.abc import Mapping
from functools import partial

import torch

import srround
from srround import _validate

from . import _dist
from ._views import _DEVICE, _DTYPE, _IS_CONTIGUOUS, _IS_CPU
from .optim import _NAN_BITS, _canonical_nan_, _is_dense

_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LAYOUT = operator.attrgetter("layout")
_UNSCALED, _STEPPED = "unscaled", "stepped"  # per-optimizer stage of an iteration


def update_scale(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    overflow_tracker: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
    min_scale: float | None,
    max_scale: float | None,
) -> None:
    """``srround.update_scale`` in place, positional (the body of the custom op
    ``srround::update_scale_``, which ``GradScaler.update()`` calls under torch.compile)."""
    srround.update_scale(
        scale,
        growth_tracker,
        found_inf,
        overflow_tracker=overflow_tracker,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        hysteresis=hysteresis,
        min_scale=min_scale,
        max_scale=max_scale,
    )


def _all_contiguous_on(grads, device) -> bool:
    """Whether every gradient is a contiguous fp32/bf16/fp16 tensor on ``device`` (C-level
    ``map`` calls: a model has thousands of gradients)."""
    return (
        all(layout is torch.strided for layout in map(_LAYOUT, grads))
        and all(map(_IS_CONTIGUOUS, grads))
        and all(map(_FUSED_DTYPES.__contains__, map(_DTYPE, grads)))
        and (
            all(map(_IS_CPU, grads))
            if device.type == "cpu"
            else all(d == device for d in map(_DEVICE, grads))
        )
    )


def unscale_grads(grads, inv_scale, found_inf, per_tensor=False) -> None:
    """Multiply ``grads`` by ``inv_scale`` in place and set ``found_inf`` (float32, 1 value)
    to 1 if any was inf/NaN. Dense fp32/bf16/fp16 gradients of ``found_inf``'s device (any
    dense layout: channels_last too) go through srround's fused kernel, one launch; the rest
    (float64, non-dense strided views, sparse values, other devices) through torch's own
    ``torch._amp_foreach_non_finite_check_and_unscale_``, per device and dtype (NaN products
    then +qNaN, as the fused kernel writes them).
    ``per_tensor``: one scale and one flag per gradient (one fused launch if all are dense)."""
    local = _dist.locals_of(grads, "grads")  # DTensors: their local pieces
    if local and _all_contiguous_on(local, found_inf.device):  # common: no per-tensor Python
        srround.unscale_and_check(local, inv_scale, found_inf=found_inf, per_tensor=per_tensor)
        return
    if per_tensor:
        grads = local
        if all(g.layout is torch.strided and _is_dense(g) for g in grads):
            flat = [g.as_strided((g.numel(),), (1,)) for g in grads]
            srround.unscale_and_check(flat, inv_scale, found_inf=found_inf, per_tensor=True)
        else:  # one tensor at a time, each by its own scale
            for i, g in enumerate(grads):
                unscale_grads([g], inv_scale[i : i + 1], found_inf[i : i + 1])
        return
    device = found_inf.device
    fused: list = []
    others: dict = {}
    for g in local:
        if g.layout is not torch.strided:
            g = g._values()  # sparse COO (fp16 ones coalesced by the caller, as torch does)
        elif g.dtype in _FUSED_DTYPES and g.device == device and _is_dense(g):
            fused.append(g.as_strided((g.numel(),), (1,)))
            continue
        others.setdefault((g.device, g.dtype), []).append(g)
    if fused:
        srround.unscale_and_check(fused, inv_scale, found_inf=found_inf)
    for (dev, _), group in others.items():
        if dev == device:
            flag, inv = found_inf.view(()), inv_scale.view(())
        else:
            flag = torch.zeros((), dtype=torch.float32, device=dev)
            inv = inv_scale.view(()).to(dev)
        torch._amp_foreach_non_finite_check_and_unscale_(group, flag, inv)
        for g in group:
            if g.dtype in _NAN_BITS:  # NaN products as the fused kernel writes them
                _canonical_nan_(g)
        if dev != device:
            torch.maximum(found_inf, flag.to(device).reshape(1), out=found_inf)


def unscale_and_reduce(grads, inv_scale, found_inf, groups, per_tensor=False) -> None:
    """``unscale_grads`` of plain (local) gradients, then ``found_inf`` all-reduced (MAX) over
    the process groups ``groups`` (a DTensor's meshes). Under torch.compile one call of the
    custom op ``srround::unscale_and_check_``, which takes the groups by name."""
    if torch.compiler.is_compiling():
        torch.ops.srround.unscale_and_check_(
            grads,
            inv_scale,
            found_inf,
            per_tensor=per_tensor,
            mesh_groups=_dist.group_names(groups),
        )
        return
    unscale_grads(grads, inv_scale, found_inf, per_tensor)
    _dist.all_reduce_max(found_inf, groups)


class _ScaleGrad(torch.autograd.Function):
    """Identity in forward; multiplies the gradient by ``factor`` (a 0-d float32 tensor)."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def _map_tensors(fn, obj):
    """``obj`` with ``fn`` applied to every tensor in it, through lists, tuples and dicts."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(_map_tensors(fn, o) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(fn, o) for o in obj)
    if isinstance(obj, Mapping):
        return {k: _map_tensors(fn, v) for k, v in obj.items()}
    return obj


@dataclasses.dataclass(frozen=True)
class _Attached:
    """What ``GradScaler.attach`` found in the model. Slots 0..count-1 are the module scales
    (modules sharing a parameter share a slot), slot ``count`` is ``S``."""

    count: int  # number of module scales
    params: list  # the model's parameters, model.parameters() order (kept alive: ids below)
    slot_of: dict  # id(parameter) -> slot
    hook_slots: list  # per hooked module: its slot
    hook_outer: list  # per hooked module: the slot of the scale around it (count: S)


class GradScaler:
    """Dynamic loss scaling for torch, torch.amp.GradScaler's interface.

    Args:
        device: where the scale lives before the first ``scale`` call infers it ("cuda").
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: as torch.
        hysteresis: consecutive overflows before backing off (1 = torch's behaviour).
        min_scale, max_scale: bounds of the scale (None: unbounded, as torch).
        per_tensor: one scale per module that owns parameters (module docstring); needs
            ``attach(model)`` before the first ``scale``. ``init_scale`` is then ``S`` and the
            modules' initial scale.
        unscale_grads: ``step`` leaves the gradients unscaled, as torch's scaler does (True,
            default: for srround's optimizers one fused launch unscales and checks them, then
            the step reads them). False: ``step`` of srround's optimizers only checks the
            gradients (reads, no write) and multiplies by 1/scale inside the step, so after it
            ``p.grad`` still holds the *scaled* gradient - one write pass over the gradients
            less, for code that does not read them after ``step``.
    """

    def __init__(
        self,
        device="cuda",
        init_scale=2.0**16,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=2000,
        enabled=True,
        *,
        hysteresis=1,
        min_scale=None,
        max_scale=None,
        per_tensor=False,
        unscale_grads=True,
    ):
        _check_settings(
            growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale
        )
        self._device = torch.device(device)
        self._unscale_grads = bool(unscale_grads)
        self._enabled = enabled
        self._init_scale = _positive_scale(init_scale, "init_scale")
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self._hysteresis = int(hysteresis)
        self._min_scale, self._max_scale = min_scale, max_scale
        self._per_tensor = bool(per_tensor)
        self._init_growth_tracker = 0
        self._init_counters = (0, 0)  # overflow tracker, skipped steps (from load_state_dict)
        self._init_modules = None  # (scales, growth, overflow trackers) lists from a state dict
        self._attached = None  # _Attached after attach()
        # created lazily like torch's: float32 scales and int32 trackers, one entry per module
        # scale (per-tensor mode) then S; _scale, _growth_tracker, _overflow_tracker: S's [1]
        self._scales = self._growth_trackers = self._overflow_trackers = None
        self._scale = self._growth_tracker = self._overflow_tracker = None
        self._skipped = self._last_skipped = None  # int32[1], float32[1]
        self._scaled = False  # scale() called: unscale_/step before it are torch's error
        self._found = {}  # id(optimizer) -> float32[1] found_inf of this iteration
        self._stage = {}  # id(optimizer) -> _UNSCALED / _STEPPED this iteration
        self._slot_found = None  # per-tensor mode: float32[count + 1], flags per slot
        self._slot_index = {}  # per-tensor mode: id(optimizer) -> (slots, int64 device tensor)
        self._to_inner = self._to_outer = ()  # per hooked module: 0-d s_m/outer, outer/s_m
        self._hook_index = self._param_index = None  # int64 device tensors: slots of hooks/params

    # -- torch.amp.GradScaler's interface ------------------------------------------------

    def is_enabled(self) -> bool:
        """Whether scaling is on (``enabled=True`` at construction)."""
        return self._enabled

    def _initial_state(self):
        """Host lists (scales, growth trackers, overflow trackers): each module scale's, then
        S's, from the constructor or the last ``load_state_dict``."""
        count = self._attached.count if self._attached else 0
        modules = self._init_modules or ([self._init_scale] * count, [0] * count, [0] * count)
        return (
            [*modules[0], self._init_scale],
            [*modules[1], self._init_growth_tracker],
            [*modules[2], self._init_counters[0]],
        )

    def _check_module_count(self, saved, count):
        if saved is not None and len(saved) != count:
            raise ValueError(
                f"state_dict: {len(saved)} module scales, but the attached model"
                f" has {count} (modules that own parameters, tied ones as one)"
            )

    def _lazy_init(self, device):
        if self._scales is None:
            self._device = device
            scales, growth, overflows = self._initial_state()
            vector = partial(torch.tensor, device=device)
            self._scales = vector(scales, dtype=torch.float32)
            self._growth_trackers = vector(growth, dtype=torch.int32)
            self._overflow_trackers = vector(overflows, dtype=torch.int32)
            s = len(scales) - 1  # S's slot
            self._scale = self._scales[s:]
            self._growth_tracker = self._growth_trackers[s:]
            self._overflow_tracker = self._overflow_trackers[s:]
            self._skipped = vector([self._init_counters[1]], dtype=torch.int32)
            self._last_skipped = torch.zeros(1, dtype=torch.float32, device=device)
            if self._per_tensor:
                attached = self._attached
                self._slot_found = torch.zeros(s + 1, dtype=torch.float32, device=device)
                index = partial(torch.tensor, dtype=torch.int64, device=device)  # once: syncs
                self._hook_index = index(attached.hook_slots), index(attached.hook_outer)
                self._param_index = index([attached.slot_of[id(p)] for p in attached.params])
                self._refresh_factors()

    def _require_scaled(self, call):
        """torch's error for ``unscale_``/``step`` before any ``scale()``: the gradients came
        from an unscaled loss, and dividing them by the scale would shrink every update."""
        if not self._scaled:
            raise AssertionError(
                f"Attempted {call} but _scale is None.  This may indicate your script did not"
                " use scaler.scale(loss or outputs) earlier in the iteration."
            )

    def _require_attached(self):
        if self._per_tensor and self._attached is None:
            raise RuntimeError("GradScaler(per_tensor=True): call scaler.attach(model) first")

    def scale(self, outputs):
        """``outputs`` times the current scale: a tensor (same shape), or any iterable of them,
        nested (lists, tuples and namedtuples keep their type; another iterable comes back as
        a lazy ``map``, as with torch's scaler)."""
        if not self._enabled:
            return outputs
        self._require_attached()
        self._scaled = True
        if isinstance(outputs, torch.Tensor):
            self._lazy_init(outputs.device)
            scale = self._scale.reshape(())
            return outputs * scale.to(device=outputs.device, non_blocking=True)
        if isinstance(outputs, abc.Iterable) and not isinstance(outputs, (str, bytes)):
            scaled = map(self.scale, outputs)
            if isinstance(outputs, tuple) and hasattr(outputs, "_fields"):  # a namedtuple
                return type(outputs)(*scaled)
            if isinstance(outputs, (list, tuple)):
                return type(outputs)(scaled)
            return scaled
        raise ValueError(
            f"outputs: expected a tensor or an iterable of tensors, got {type(outputs).__name__}"
        )

    def _params_with_grads(self, optimizer):
        return [
            p for group in optimizer.param_groups for p in group["params"] if p.grad is not None
        ]

    def _slots(self, optimizer, params):
        """int64 device tensor: the slot of each of ``params`` (S's for a parameter outside the
        attached model), cached per optimizer."""
        attached = self._attached
        slots = tuple(attached.slot_of.get(id(p), attached.count) for p in params)
        cached = self._slot_index.get(id(optimizer))
        if cached is None or cached[0] != slots:
            cached = slots, torch.tensor(slots, dtype=torch.int64, device=self._scales.device)
            self._slot_index[id(optimizer)] = cached
        return cached[1]

    def unscale_(self, optimizer) -> None:
        """Divide the optimizer's gradients by the scale in place, one fused launch; flags
        inf/NaN in ``found_inf(optimizer)``. No host sync. Per-tensor mode: each gradient by
        its module's scale, flags per module kept for ``update``."""
        if not self._enabled:
            return
        self._require_attached()
        self._require_scaled("unscale_")
        stage = self._stage.get(id(optimizer))
        if stage is _UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if stage is _STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        params = self._params_with_grads(optimizer)
        if not params:  # torch records no check: step() and update() then raise
            self._found.pop(id(optimizer), None)
            self._stage[id(optimizer)] = _UNSCALED
            return
        for p in params:  # as torch: fp16 sparse gradients are coalesced (replaced) first
            if p.grad.layout is not torch.strided and p.grad.dtype == torch.float16:
                p.grad = p.grad.coalesce()
        grads = [p.grad for p in params]
        # DTensor gradients (FSDP2): each rank checks its local pieces, then one verdict for
        # all ranks, all-reduced (MAX) on the device over the gradients' meshes
        dist_groups = _dist.mesh_groups(grads)
        grads = _dist.locals_of(grads, "grads")
        self._lazy_init(grads[0].device if grads else self._device)
        found = torch.zeros(1, dtype=torch.float32, device=self._scale.device)
        inv_scales = self._scales.double().reciprocal().float()
        if grads and self._per_tensor:  # each gradient by its module's scale
            slots = self._slots(optimizer, params)
            flags = torch.zeros(len(grads), dtype=torch.float32, device=found.device)
            unscale_and_reduce(grads, inv_scales[slots], flags, dist_groups, per_tensor=True)
            self._slot_found.index_add_(0, slots, flags)  # nonzero: a tensor overflowed
            torch.amax(flags, 0, keepdim=True, out=found)
        elif grads:
            unscale_and_reduce(grads, inv_scales, found, dist_groups)
        self._found[id(optimizer)] = found
        self._stage[id(optimizer)] = _UNSCALED

    def found_inf(self, optimizer) -> torch.Tensor:
        """The float32[1] overflow flag of ``optimizer`` for this iteration (after unscale_)."""
        return self._found[id(optimizer)]

    def step(self, optimizer, *args, **kwargs):
        """``unscale_`` (if not done yet), then ``optimizer.step(...)`` unless a gradient was
        inf/NaN. Returns what ``optimizer.step`` returned, or None when skipped."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._require_scaled("step")
        stage = self._stage.get(id(optimizer))
        if stage is _STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if stage is _UNSCALED:  # an unscale_() with gradients recorded a check
            checked = id(optimizer) in self._found
        else:  # this step checks: it needs a gradient
            checked = any(p.grad is not None for g in optimizer.param_groups for p in g["params"])
        if not checked:  # torch's error; an update() would grow the scale unchecked
            raise AssertionError("No inf checks were recorded for this optimizer.")
        if getattr(optimizer, "_srround_fused", False):
            result = self._fused_step(optimizer, *args, **kwargs)
        elif getattr(optimizer, "_step_supports_amp_scaling", False):
            result = self._torch_fused_step(optimizer, stage, *args, **kwargs)
        else:
            if stage is None:
                self.unscale_(optimizer)
            # one sync, as in torch's scaler
            result = None if self._found[id(optimizer)].item() else optimizer.step(*args, **kwargs)
        self._stage[id(optimizer)] = _STEPPED
        return result

    def _torch_fused_step(self, optimizer, stage, *args, **kwargs):
        """torch's protocol for optimizers that unscale and skip inside their step (e.g.
        ``torch.optim.AdamW(fused=True)``): check the gradients for inf/NaN (unless
        ``unscale_`` did; on DTensor gradients all-reduced over their meshes, as in
        ``unscale_``), set ``optimizer.grad_scale`` (None if already unscaled) and
        ``optimizer.found_inf``, step, remove both attributes. No host sync."""
        if stage is None:
            params = self._params_with_grads(optimizer)
            self._lazy_init(params[0].grad.device if params else self._device)
            found = torch.zeros(1, dtype=torch.float32, device=self._scale.device)
            if params:  # DTensor gradients: the flag all-reduced over their meshes
                one = torch.ones(1, dtype=torch.float32, device=found.device)
                grads = [p.grad for p in params]
                groups = _dist.mesh_groups(grads)
                unscale_and_reduce(_dist.locals_of(grads, "grads"), one, found, groups)
            self._found[id(optimizer)] = found
            optimizer.grad_scale = self._scale.reshape(()) * getattr(optimizer, "grad_scale", 1)
        else:
            optimizer.grad_scale = getattr(optimizer, "grad_scale", None)
        optimizer.found_inf = self._found[id(optimizer)].reshape(())
        try:
            return optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale
            del optimizer.found_inf

    def _fused_step(self, optimizer, *args, **kwargs):
        """srround's optimizers (``srround.adapters.torch.AdamW``/``SGD``): one call that runs
        the overflow check over the optimizer's cached gradient table (reads the gradients,
        writes nothing), then the fused step, which multiplies by 1/scale while it reads the
        gradients and is a no-op on the device when the flag is set: no host sync, gradients
        never written (``unscale_grads=False``). By default, and after an explicit
        ``unscale_`` (e.g. for clipping), ``unscale_`` runs (one fused launch) and only the
        flag is passed; so too in per-tensor mode (the fused step takes one inv_scale)."""
        stage = self._stage.get(id(optimizer))
        if stage is None and (self._per_tensor or self._unscale_grads):
            self.unscale_(optimizer)
            stage = _UNSCALED
        if stage is _UNSCALED:
            return optimizer.step(*args, found_inf=self._found[id(optimizer)], **kwargs)
        device = next((p.device for g in optimizer.param_groups for p in g["params"]), self._device)
        self._lazy_init(device)
        found = torch.zeros(1, dtype=torch.float32, device=self._scale.device)
        self._found[id(optimizer)] = found
        inv_scale = self._scale.double().reciprocal().float()
        return optimizer.step(
            *args, inv_scale=inv_scale, found_inf=found, check_grads=True, **kwargs
        )

    def update(self, new_scale=None) -> None:
        """Back off or grow the scale from this iteration's flags (on the device), or set it.

        ``new_scale``: a float or a float32 tensor of 1 value. Without it, at least one
        optimizer must have been unscaled or stepped since the last update (torch's
        ``AssertionError`` "No inf checks were recorded prior to update.").

        Per-tensor mode: one launch moves every module scale by its own flag (``S`` stays);
        ``new_scale`` sets ``S`` only (the module scales keep theirs)."""
        if not self._enabled:
            return
        if new_scale is None and not self._found:
            raise AssertionError("No inf checks were recorded prior to update.")
        if new_scale is not None and self._scale is None:  # before first use: the initial
            self._init_scale = _positive_scale(new_scale, "new_scale")
        elif new_scale is not None:
            if isinstance(new_scale, torch.Tensor):
                if new_scale.numel() != 1 or new_scale.dtype != torch.float32:
                    raise ValueError(
                        "new_scale: expected a float or a float32 tensor of 1 value, got"
                        f" {new_scale.dtype} with {new_scale.numel()} values"
                    )
                self._scale.copy_(new_scale.reshape(1))
            else:
                self._scale.fill_(_positive_scale(new_scale, "new_scale"))
        else:
            found = torch.zeros(1, dtype=torch.float32, device=self._scale.device)
            for flag in self._found.values():
                found = torch.maximum(found, flag.to(found.device))
            dynamic = slice(0, len(self._scales) - 1) if self._per_tensor else slice(None)
            # compiled: the custom op (``_ops.py``), so update() traces with fullgraph=True;
            # eagerly the op's body (the op's dispatch would double the call's time)
            compiled = torch.compiler.is_compiling()
            (torch.ops.srround.update_scale_ if compiled else update_scale)(
                self._scales[dynamic],
                self._growth_trackers[dynamic],
                self._slot_found[dynamic] if self._per_tensor else found,
                self._overflow_trackers[dynamic],
                self._growth_factor,
                self._backoff_factor,
                self._growth_interval,
                self._hysteresis,
                self._min_scale,
                self._max_scale,
            )
            self._last_skipped.copy_(found)
            self._skipped += (found > 0).to(torch.int32)
        if self._per_tensor:
            self._slot_found.zero_()
            self._refresh_factors()
        self._found.clear()
        self._stage.clear()

    def get_scale(self) -> float:
        """The current scale as a Python float (a sync); the initial scale before first use.
        Per-tensor mode: ``S``, the scale of the loss (module scales: ``tensor_scales``)."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else float(self._scale.item())

    def get_growth_factor(self) -> float:
        """The scale multiplier after ``growth_interval`` clean steps."""
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (a float > 1)."""
        self._growth_factor = _check_growth_factor(new_factor)

    def get_backoff_factor(self) -> float:
        """The scale multiplier after an overflow."""
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (a finite float in (0, 1))."""
        self._backoff_factor = _check_backoff_factor(new_factor)

    def get_growth_interval(self) -> int:
        """Clean steps before the scale grows."""
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (a positive int)."""
        self._growth_interval = _check_growth_interval(new_interval)

    def _get_growth_tracker(self) -> int:
        """Clean steps since the last change of the scale (``S``'s in per-tensor mode)."""
        if not self._enabled:
            return 0
        if self._growth_tracker is None:
            return self._init_growth_tracker
        return int(self._growth_tracker.item())

    def __getstate__(self):
        """Pickle / deepcopy: the current scale and counters become the copy's initial ones
        (the copy creates its device tensors at first use, one storage with its views). Only
        between iterations, as torch's; a per-tensor scaler attached to a model (its hooks
        live on the model) is saved with ``state_dict`` instead."""
        if self._enabled and (self._stage or self._found):
            raise RuntimeError(
                "A GradScaler instance may only be pickled at the beginning of an iteration,"
                " or at the end after scaler.update()."
            )
        if self._attached is not None:
            raise RuntimeError(
                "GradScaler(per_tensor=True) attached to a model: save scaler.state_dict()"
                " and load it into a scaler attached to the restored model"
            )
        state = self.__dict__.copy()
        if self._scales is not None:
            scales, growth, overflows = (
                t.tolist() for t in (self._scales, self._growth_trackers, self._overflow_trackers)
            )
            state["_init_scale"] = scales[-1]
            state["_init_growth_tracker"] = growth[-1]
            state["_init_counters"] = (overflows[-1], int(self._skipped.item()))
            state["_device"] = self._scales.device
        for name in (
            "_scales",
            "_growth_trackers",
            "_overflow_trackers",
            "_scale",
            "_growth_tracker",
            "_overflow_tracker",
            "_skipped",
            "_last_skipped",
            "_slot_found",
            "_hook_index",
            "_param_index",
        ):
            state[name] = None
        state.update(_found={}, _stage={}, _slot_index={}, _to_inner=(), _to_outer=())
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)

    @property
    def last_step_skipped(self) -> torch.Tensor:
        """float32[1] device tensor: 1.0 if the last iteration's step was skipped."""
        return self._last_skipped

    @property
    def skipped_steps(self) -> torch.Tensor:
        """int32[1] device tensor: steps skipped so far."""
        return self._skipped

    def state_dict(self) -> dict:
        """torch's keys (``scale``, ``_growth_tracker``: ``S``'s in per-tensor mode), plus the
        bounds, counters and, in per-tensor mode, ``module_scales``, ``module_growth_trackers``
        and ``module_overflow_trackers`` (lists, one entry per module scale)."""
        if not self._enabled:
            return {}
        if self._scales is None:
            scales, growth, overflows = self._initial_state()
        else:
            scales, growth, overflows = (
                t.tolist() for t in (self._scales, self._growth_trackers, self._overflow_trackers)
            )
        state = {
            "scale": scales[-1],
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": growth[-1],
            "hysteresis": self._hysteresis,
            "min_scale": self._min_scale,
            "max_scale": self._max_scale,
            "_overflow_tracker": overflows[-1],
            "skipped_steps": self._init_counters[1]
            if self._skipped is None
            else int(self._skipped.item()),
        }
        if self._per_tensor and (self._attached or self._init_modules):
            state.update(
                module_scales=scales[:-1],
                module_growth_trackers=growth[:-1],
                module_overflow_trackers=overflows[:-1],
            )
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of this class or of ``torch.amp.GradScaler``, every value checked
        as the constructor checks it before any is loaded. Per-tensor mode: one without module
        scales starts every module at its ``scale``."""
        if not self._enabled:
            return
        if not state_dict:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved"
                " from a disabled instance of GradScaler."
            )
        modules: list = [
            state_dict.get(k)
            for k in ("module_scales", "module_growth_trackers", "module_overflow_trackers")
        ]
        if modules[0] is not None and not self._per_tensor:
            raise ValueError(
                "state_dict: saved in per-tensor mode; load it into GradScaler(per_tensor=True)"
            )
        if modules[0] is not None and not len(modules[0]) == len(modules[1]) == len(modules[2]):
            raise ValueError(
                "state_dict: module_scales, module_growth_trackers and"
                " module_overflow_trackers differ in length"
            )
        if self._attached is not None:
            self._check_module_count(modules[0], self._attached.count)
        # every value checked before any is loaded
        scale = _positive_scale(state_dict["scale"], "scale")
        for i, value in enumerate(modules[0] or ()):
            _positive_scale(value, f"module_scales[{i}]")
        settings = (
            state_dict["growth_factor"],
            state_dict["backoff_factor"],
            state_dict["growth_interval"],
            state_dict.get("hysteresis", 1),
            state_dict.get("min_scale"),
            state_dict.get("max_scale"),
        )
        _check_settings(*settings)
        growth, overflows, skipped = (
            _validate.integer(state_dict.get(key, 0), key, low=0)
            for key in ("_growth_tracker", "_overflow_tracker", "skipped_steps")
        )
        self._init_scale = scale
        self._growth_factor = float(settings[0])
        self._backoff_factor = float(settings[1])
        self._growth_interval = settings[2]
        self._init_growth_tracker = growth
        self._hysteresis = int(settings[3])
        self._min_scale, self._max_scale = settings[4], settings[5]
        self._init_counters = (overflows, skipped)
        self._init_modules = None if modules[0] is None else tuple(list(m) for m in modules)
        if self._scales is not None:
            for tensor, values in zip(
                (self._scales, self._growth_trackers, self._overflow_trackers),
                self._initial_state(),
            ):
                tensor.copy_(torch.tensor(values, dtype=tensor.dtype))
            self._skipped.fill_(self._init_counters[1])
            if self._per_tensor:
                self._refresh_factors()

    # -- per-tensor mode ----------------------------------------------------------------------

    @property
    def tensor_scales(self):
        """Per-tensor mode: float32[N] device tensor, the scale of each parameter of the
        attached model in ``model.parameters()`` order (a copy; tensors of one module share its
        scale). None before ``attach``."""
        return None if self._param_index is None else self._scales[self._param_index]

    def attach(self, model) -> None:
        """Per-tensor mode: give every module of ``model`` that directly owns parameters its
        own scale, applied by hooks in the backward pass (module docstring). Call once, after
        moving ``model`` to its device (the scales are created there). The hooks stay: every
        later backward through ``model`` with gradients enabled is rescaled, also one whose
        loss did not go through ``scale``."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        if not self._per_tensor:
            raise RuntimeError("attach: only for GradScaler(per_tensor=True)")
        if self._attached is not None:
            raise RuntimeError(
                "attach: already attached to a model (one per scaler; attach a"
                " module that contains all of them)"
            )
        owners = [m for m in model.modules() if next(m.parameters(recurse=False), None) is not None]
        if not owners:
            raise ValueError("model: no module owns parameters")
        slot_of_owner = _share_slots(owners)
        count = max(slot_of_owner) + 1
        owner_index = {id(m): i for i, m in enumerate(owners)}
        outer: dict[int, int] = {}  # owner index -> slot of the scale around it

        def visit(module, around):
            i = owner_index.get(id(module))
            if i is not None:
                if outer.setdefault(i, around) != around:
                    raise ValueError(
                        f"model: {type(module).__name__} module is reached under"
                        " two modules with different scales"
                    )
                around = slot_of_owner[i]
            for child in module.children():
                visit(child, around)

        visit(model, count)
        self._check_module_count(self._init_modules and self._init_modules[0], count)
        slot_of = {
            id(p): slot_of_owner[i]
            for i, m in enumerate(owners)
            for p in m.parameters(recurse=False)
        }
        if self._enabled:
            for i, module in enumerate(owners):
                module.register_forward_pre_hook(partial(self._wrap_inputs, i), with_kwargs=True)
                module.register_forward_hook(partial(self._hook_outputs, i))
        self._attached = _Attached(
            count,
            list(model.parameters()),
            slot_of,
            slot_of_owner,
            [outer[i] for i in range(len(owners))],
        )
        if self._enabled:
            self._lazy_init(self._attached.params[0].device)

    def _refresh_factors(self):
        """The hooks' 0-d factors ``s_m / outer`` and ``outer / s_m`` from the current scales
        (after every change of a scale: the hooks read them, no sync)."""
        inner, outer = (self._scales[index] for index in self._hook_index)
        self._to_inner = (inner / outer).unbind()
        self._to_outer = (outer / inner).unbind()

    def _wrap_inputs(self, index, module, args, kwargs):
        """Forward pre-hook of owner ``index``: the gradients that leave it through its inputs
        are multiplied by ``outer / s_m``."""
        if not torch.is_grad_enabled():
            return None
        factor = self._to_outer[index]

        def wrap(t):
            return _ScaleGrad.apply(t, factor) if t.requires_grad else t

        return _map_tensors(wrap, args), _map_tensors(wrap, kwargs)

    def _hook_outputs(self, index, module, args, output):
        """Forward hook of owner ``index``: the gradient reaching each of its outputs is
        multiplied by ``s_m / outer`` before its backward runs."""
        factor = self._to_inner[index]
        for tensor in _tensors(output):
            if tensor.requires_grad:
                tensor.register_hook(partial(torch.mul, other=factor))


def _tensors(obj):
    """The tensors in ``obj``, through lists, tuples and mappings."""
    found = []
    _map_tensors(found.append, obj)
    return found


def _share_slots(owners):
    """One slot per owner, owners that share a parameter in one slot (union-find); slots
    numbered in order of first appearance."""
    parent = list(range(len(owners)))

    def root(i):
        while parent[i] != i:
            parent[i] = i = parent[parent[i]]
        return i

    first = {}
    for i, module in enumerate(owners):
        for p in module.parameters(recurse=False):
            parent[root(i)] = root(first.setdefault(id(p), i))
    slots = {}
    return [slots.setdefault(root(i), len(slots)) for i in range(len(owners))]


def _positive_scale(value, name):
    """A host scale: a real number (not a bool or a string), > 0 and finite, also as the
    float32 it is kept in (a zero, negative or inf scale would skip every step or flip the
    gradients' sign; torch's scaler takes it unchecked). Plain float bounds: 1e39 rounds to
    inf in float32, 1e-50 to 0."""
    value = _validate.number(value, name)
    if not 2.0**-150 < value < _validate.F32_ROUNDS_TO_INF:
        raise ValueError(
            f"{name}: expected a positive finite scale (also in float32, which holds it), got"
            f" {value}"
        )
    return value


def _check_settings(
    growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale
):
    """torch's ranges for the factors and the interval, ``update_scale``'s rules for
    ``hysteresis`` and the bounds: the error of the first bad one, naming it."""
    _check_growth_factor(growth_factor)
    _check_backoff_factor(backoff_factor)
    _check_growth_interval(growth_interval)
    _validate.scale_update(
        growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale
    )


def _check_growth_factor(value) -> float:
    value = _validate.real(value, "growth_factor")
    if not value > 1.0:
        raise ValueError(f"growth_factor: expected > 1.0, got {value}")
    return value


def _check_backoff_factor(value) -> float:
    value = _validate.real(value, "backoff_factor")
    if not 0.0 < value < 1.0:
        raise ValueError(f"backoff_factor: expected in (0, 1), got {value}")
    return value


def _check_growth_interval(value) -> int:
    return _validate.integer(value, "growth_interval", low=1, high=2**31)
