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

Several ranks (data parallel): reduce the flag before ``update`` so that every rank skips
together - after ``scaler.unscale_(optimizer)`` call
``torch.distributed.all_reduce(scaler.found_inf(optimizer), op=ReduceOp.MAX)``, then
``step`` and ``update`` as usual (the gradients themselves are already all-reduced by DDP).
"""

from __future__ import annotations

import torch

import srround


class GradScaler:
    """Dynamic loss scaling for torch, torch.amp.GradScaler's interface.

    Args:
        device: where the scale lives before the first ``scale`` call infers it ("cuda").
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: as torch.
        hysteresis: consecutive overflows before backing off (1 = torch's behaviour).
        min_scale, max_scale: bounds of the scale (None: unbounded, as torch).
    """

    def __init__(self, device="cuda", init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, enabled=True, *, hysteresis=1, min_scale=None,
                 max_scale=None):
        if growth_factor <= 1.0:
            raise ValueError(f"growth_factor: expected > 1.0, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor: expected in (0, 1), got {backoff_factor}")
        self._device = torch.device(device)
        self._enabled = enabled
        self._init_scale = float(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self._hysteresis = int(hysteresis)
        self._min_scale, self._max_scale = min_scale, max_scale
        self._init_growth_tracker = 0
        self._init_counters = (0, 0)  # overflow tracker, skipped steps (from load_state_dict)
        self._scale = None  # float32[1] on the device, created lazily like torch's
        self._growth_tracker = self._overflow_tracker = None  # int32[1]
        self._skipped = self._last_skipped = None  # int32[1], float32[1]
        self._found = {}  # id(optimizer) -> float32[1] found_inf of this iteration
        self._unscaled = set()  # ids of optimizers unscaled this iteration

    # -- torch.amp.GradScaler's interface ------------------------------------------------

    def is_enabled(self) -> bool:
        return self._enabled

    def _lazy_init(self, device):
        if self._scale is None:
            self._device = device
            self._scale = torch.full((1,), self._init_scale, dtype=torch.float32, device=device)
            zeros = lambda dtype: torch.zeros(1, dtype=dtype, device=device)  # noqa: E731
            self._growth_tracker = zeros(torch.int32).fill_(self._init_growth_tracker)
            self._overflow_tracker = zeros(torch.int32).fill_(self._init_counters[0])
            self._skipped = zeros(torch.int32).fill_(self._init_counters[1])
            self._last_skipped = zeros(torch.float32)

    def scale(self, outputs):
        """``outputs`` (a tensor or a nested list/tuple of them) times the current scale."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            self._lazy_init(outputs.device)
            return outputs * self._scale.to(device=outputs.device, non_blocking=True)
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        raise ValueError("outputs: expected a tensor or a list/tuple of tensors")

    def _grads(self, optimizer):
        return [p.grad for group in optimizer.param_groups for p in group["params"]
                if p.grad is not None]

    def unscale_(self, optimizer) -> None:
        """Divide the optimizer's gradients by the scale in place, one fused launch; flags
        inf/NaN in ``found_inf(optimizer)``. No host sync."""
        if not self._enabled:
            return
        if id(optimizer) in self._unscaled:
            raise RuntimeError("unscale_() has already been called on this optimizer since the"
                               " last update().")
        grads = self._grads(optimizer)
        self._lazy_init(grads[0].device if grads else self._device)
        found = torch.zeros(1, dtype=torch.float32, device=self._scale.device)
        if grads:
            inv_scale = self._scale.double().reciprocal().float()
            srround.unscale_and_check(grads, inv_scale, found_inf=found)
        self._found[id(optimizer)] = found
        self._unscaled.add(id(optimizer))

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
        if getattr(optimizer, "_srround_fused", False):
            return self._fused_step(optimizer, *args, **kwargs)
        if id(optimizer) not in self._unscaled:
            self.unscale_(optimizer)
        if self._found[id(optimizer)].item():  # one sync, as in torch's scaler
            return None
        return optimizer.step(*args, **kwargs)

    def _fused_step(self, optimizer, *args, **kwargs):
        """srround's optimizers (``srround.adapters.torch.AdamW``/``SGD``): one call that runs
        the overflow check over the optimizer's cached gradient table (reads the gradients,
        writes nothing), then the fused step, which multiplies by 1/scale while it reads the
        gradients and is a no-op on the device when the flag is set: no host sync, gradients
        never written. After an explicit ``unscale_`` (e.g. for clipping) only the flag is
        passed."""
        if id(optimizer) in self._unscaled:
            return optimizer.step(*args, found_inf=self._found[id(optimizer)], **kwargs)
        device = next((p.device for g in optimizer.param_groups for p in g["params"]),
                      self._device)
        self._lazy_init(device)
        found = torch.zeros(1, dtype=torch.float32, device=self._scale.device)
        self._found[id(optimizer)] = found
        self._unscaled.add(id(optimizer))
        inv_scale = self._scale.double().reciprocal().float()
        return optimizer.step(*args, inv_scale=inv_scale, found_inf=found, check_grads=True,
                              **kwargs)

    def update(self, new_scale=None) -> None:
        """Back off or grow the scale from this iteration's flags (on the device), or set it."""
        if not self._enabled or self._scale is None:
            return
        if new_scale is not None:
            self._scale.fill_(float(new_scale))
        else:
            found = torch.zeros(1, dtype=torch.float32, device=self._scale.device)
            for flag in self._found.values():
                found = torch.maximum(found, flag.to(found.device))
            srround.update_scale(
                self._scale, self._growth_tracker, found,
                overflow_tracker=self._overflow_tracker, growth_factor=self._growth_factor,
                backoff_factor=self._backoff_factor, growth_interval=self._growth_interval,
                hysteresis=self._hysteresis, min_scale=self._min_scale,
                max_scale=self._max_scale,
            )
            self._last_skipped.copy_(found)
            self._skipped += (found > 0).to(torch.int32)
        self._found.clear()
        self._unscaled.clear()

    def get_scale(self) -> float:
        """The current scale as a Python float (a sync); the initial scale before first use."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else float(self._scale.item())

    @property
    def last_step_skipped(self) -> torch.Tensor:
        """float32[1] device tensor: 1.0 if the last iteration's step was skipped."""
        return self._last_skipped

    @property
    def skipped_steps(self) -> torch.Tensor:
        """int32[1] device tensor: steps skipped so far."""
        return self._skipped

    def state_dict(self) -> dict:
        if not self._enabled:
            return {}
        tracker = (self._init_growth_tracker if self._growth_tracker is None
                   else int(self._growth_tracker.item()))
        return {
            "scale": self.get_scale(), "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor, "growth_interval": self._growth_interval,
            "_growth_tracker": tracker, "hysteresis": self._hysteresis,
            "min_scale": self._min_scale, "max_scale": self._max_scale,
            "_overflow_tracker": 0 if self._overflow_tracker is None
            else int(self._overflow_tracker.item()),
            "skipped_steps": 0 if self._skipped is None else int(self._skipped.item()),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of this class or of ``torch.amp.GradScaler``."""
        if not self._enabled:
            return
        if not state_dict:
            raise RuntimeError("The source state dict is empty, possibly because it was saved"
                               " from a disabled instance of GradScaler.")
        self._init_scale = float(state_dict["scale"])
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._init_growth_tracker = int(state_dict["_growth_tracker"])
        self._hysteresis = int(state_dict.get("hysteresis", 1))
        self._min_scale = state_dict.get("min_scale")
        self._max_scale = state_dict.get("max_scale")
        self._init_counters = (
            int(state_dict.get("_overflow_tracker", 0)), int(state_dict.get("skipped_steps", 0))
        )
        if self._scale is not None:
            self._scale.fill_(self._init_scale)
            self._growth_tracker.fill_(self._init_growth_tracker)
            self._overflow_tracker.fill_(self._init_counters[0])
            self._skipped.fill_(self._init_counters[1])
