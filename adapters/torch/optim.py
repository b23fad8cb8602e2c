"""``srround.adapters.torch.AdamW`` and ``.SGD``: ``torch.optim.Optimizer`` subclasses running
srround's fused low-precision step (contract: ``docs/contracts.md``).

One step is one fused pass (one CPU call, two CUDA launches) over every parameter, gradient and
state element, whatever the number of tensors: bf16/fp16/fp32 parameters (mixed), fp32 math in
torch.optim's order, results written back per ``rounding`` mode, optional loss-scale multiply
and overflow skip fused in (``step(inv_scale=..., found_inf=...)``, used by
``srround.adapters.torch.GradScaler``), no host synchronisation.

Host cost: the pointer table (``_optim.FusedStep``) is built once, at the first step, and
cached. Each step then only walks the parameters to check that the same parameters have
gradients at the same addresses (``data_ptr()``), builds the float64[G, 5] hyperparameter array
from ``param_groups`` (so lr schedulers and edits of ``group["lr"]`` etc. take effect; the array
is uploaded only when it changed) and bumps the parameters' version counters. The table is
rebuilt when the set of parameters with gradients changes, a parameter changes group, or a
gradient / parameter moved (``p.data = ...``).

``zero_grad``: both settings are correct. ``zero_grad(set_to_none=True)`` (torch's default)
frees the gradients; the next backward allocates new ones, and if any lands at another address
the table is rebuilt (a host loop over the tensors, no device work beyond a small step-counter
copy). ``zero_grad(set_to_none=False)`` keeps the gradients in place and never rebuilds: prefer
it when the step's host cost matters. Gradients must be dense and contiguous.

State per parameter (``optimizer.state[p]``): ``exp_avg``, ``exp_avg_sq`` (AdamW),
``momentum_buffer`` (SGD with momentum), in ``state_dtype`` (float32 or bfloat16; bf16 states are
written with stochastic rounding); the weight mode's buffer for bf16/fp16 parameters:
``kahan_comp`` (parameter dtype), ``master_weight`` (float32) or ``remainder`` (int16); and
``step``: a 0-d int32 tensor (a view of one flat per-optimizer counter the kernel increments on
the device; torch's optimizers keep a float32 tensor). ``rounding``, ``state_dtype`` (by name,
``"float32"`` or ``"bfloat16"``) and ``seed`` live in every param group (one value per
optimizer), so ``state_dict()`` carries the random stream: ``load_state_dict`` then continues
bit-identically.

DTensor parameters (FSDP2's ``fully_shard``, tensor parallel): the step runs on the local
pieces, states are DTensors placed as their parameter, and the noise is keyed to each element's
place in the full tensor (``_dist.py``; README "Distributed training").
"""

from __future__ import annotations

import contextlib
import operator
from itertools import chain

import numpy as np
import torch

from srround import _optim, _plan
from srround._rng import check_seed, next_seed, split_seed

from . import _dist, _views
from ._views import _BUFFER_CODES, _DATA_PTR, _external_stream, _view

__all__ = ["SGD", "AdamW"]

# weight mode -> name of its per-parameter buffer in optimizer.state
AUX_NAMES = {"kahan": "kahan_comp", "master": "master_weight", "remainder": "remainder"}
_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_STATE_DTYPES = (torch.float32, torch.bfloat16)
_STATE_DTYPE_NAMES = {t: str(t).removeprefix("torch.") for t in _STATE_DTYPES}
_STATE_DTYPE_NAMES.update({name: name for name in list(_STATE_DTYPE_NAMES.values())})
_STATE_DTYPE_OF = {str(t).removeprefix("torch."): t for t in _STATE_DTYPES}
_ONE_BITS = np.array([1.0], np.float32).view(np.uint32)
_ZERO_BITS = np.zeros(1, np.uint32)
_GRAD = operator.attrgetter("grad")


def _on(device):
    """Make a CUDA ``device`` current (Numba launches on the current device); CPU: nothing."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _check_rounding(rounding):
    _plan.check_rounding(rounding)


def _check_state_dtype(state_dtype) -> str:
    """The name (``"float32"``/``"bfloat16"``) param groups store: a torch.dtype in a param
    group stops the distributed state-dict helpers (``get_optimizer_state_dict`` with
    ``full_state_dict=True``), which take only tensors and Python scalars there."""
    name = _STATE_DTYPE_NAMES.get(state_dtype)
    if name is None:
        raise ValueError(
            f"state_dtype: expected torch.float32 or torch.bfloat16, got {state_dtype!r}"
        )
    return name


class _Entry:
    """The cached fused step of one set of (parameter, gradient) buffers."""

    __slots__ = ("buffers", "defaults", "device", "fused", "key", "params", "written", "groups")


class _FusedOptimizer(torch.optim.Optimizer):
    """Common machinery: lazy table, cache check, hyperparameters, scaler protocol."""

    _srround_fused = True  # srround's GradScaler passes inv_scale/found_inf to step()
    _KIND: int | None = None
    _STATE_NAMES: tuple = ()

    def __init__(self, params, defaults, rounding, state_dtype, seed):
        _check_rounding(rounding)
        state_dtype = _check_state_dtype(state_dtype)
        seed = next_seed() if seed is None else check_seed(seed, "seed")
        defaults = dict(defaults, rounding=rounding, state_dtype=state_dtype, seed=seed)
        self._entry = None
        self._dtensors = False  # any DTensor parameter (FSDP2, tensor parallel): _dist.py
        super().__init__(params, defaults)

    # -- groups -----------------------------------------------------------------------------

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        group["state_dtype"] = _check_state_dtype(group["state_dtype"])
        for name in ("rounding", "state_dtype", "seed"):
            if group[name] != self.defaults[name]:
                raise ValueError(
                    f"{name}: one value per optimizer; param group"
                    f" {len(self.param_groups) - 1} has {group[name]!r}, the"
                    f" optimizer {self.defaults[name]!r}"
                )
        devices = {p.device for g in self.param_groups for p in g["params"]}
        if len(devices) > 1:
            raise ValueError(
                f"params: on several devices ({sorted(map(str, devices))}); use one"
                " optimizer per device"
            )
        self._dtensors |= _dist.check_group(group["params"])
        for i, p in enumerate(group["params"]):
            if p.dtype not in _PARAM_DTYPES:
                raise TypeError(
                    f"params[{i}]: expected a float32, bfloat16 or float16 parameter, got {p.dtype}"
                )
        codes = [_BUFFER_CODES[p.dtype] for p in group["params"]]
        _plan.check_param_codes(codes, _plan.check_rounding(group["rounding"]))
        self._entry = None

    def _config(self):
        """Per-optimizer settings, from param_groups (what load_state_dict restores)."""
        first = self.param_groups[0]
        name = _STATE_DTYPE_NAMES.get(first["state_dtype"])  # (a torch.dtype: older dicts)
        config = (first["rounding"], name, first["seed"])
        for i, g in enumerate(self.param_groups):
            if (g["rounding"], _STATE_DTYPE_NAMES.get(g["state_dtype"]), g["seed"]) != config:
                raise ValueError(
                    f"param_groups[{i}]: rounding, state_dtype and seed must be the"
                    " same in every group (one value per optimizer)"
                )
        if name is None:
            _check_state_dtype(first["state_dtype"])
        return config[0], _STATE_DTYPE_OF[name], config[2]

    # -- the cached table -------------------------------------------------------------------

    def _key(self):
        """The cache key: the parameter count of every group, then the addresses of every
        parameter and of its gradient (0: none) - lists built by C-level ``map`` (about
        0.2 us per tensor)."""
        groups = self.param_groups
        params = list(chain.from_iterable(g["params"] for g in groups))
        grads = list(map(_GRAD, params))
        if self._dtensors:  # a DTensor's data_ptr() is 0: key on the local pieces
            return _dist.cache_key(groups, params, grads)
        try:
            try:
                grad_ptrs = list(map(_DATA_PTR, grads))
            except TypeError:  # parameters without a gradient
                grad_ptrs = [0 if g is None else g.data_ptr() for g in grads]
        except RuntimeError:  # a gradient without strided storage (sparse)
            self._collect()
            raise
        return ([len(g["params"]) for g in groups], list(map(_DATA_PTR, params)), grad_ptrs)

    def _collect(self):
        """``(params with grads, their group indices)``, checking the gradients' layout."""
        params, groups = [], []
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if g.layout is not torch.strided:
                    raise TypeError(
                        f"grads: {g.layout} gradients are not supported (parameter"
                        f" {len(params)} with a gradient); srround needs dense ones"
                    )
                params.append(p)
                groups.append(gi)
        return params, groups

    def _state_buffers(self, p, group, rounding, state_dtype):
        """Allocate (zeros; master = the parameter in fp32) or cast this parameter's state."""
        state = self.state[p]
        for name in self._needed_states(group):
            buf = state.get(name)
            if buf is None:
                state[name] = torch.zeros_like(
                    p, dtype=state_dtype, memory_format=torch.contiguous_format
                )
            elif buf.dtype != state_dtype or buf.device != p.device:
                state[name] = buf.to(device=p.device, dtype=state_dtype).contiguous()
            if self._dtensors:
                state[name] = _dist.shard_like(state[name], p, name)
        name = AUX_NAMES.get(rounding)
        if name is not None and p.dtype != torch.float32 and name not in state:
            if rounding == "master":
                state[name] = p.detach().float().contiguous()
            else:
                state[name] = torch.zeros_like(
                    p,
                    dtype=p.dtype if rounding == "kahan" else torch.int16,
                    memory_format=torch.contiguous_format,
                )
        return state

    def _build(self, params, group_index, key, config):
        rounding, state_dtype, _seed = config
        # DTensors (FSDP2): the kernel works on the local pieces; plain tensors: themselves
        local_grads = [_dist.check_grad(p, i) for i, p in enumerate(params)]
        pieces = [_dist.local(p) for p in params] if self._dtensors else params
        for i, (p, grad) in enumerate(zip(pieces, local_grads)):
            if not p.is_contiguous():
                raise ValueError(f"params[{i}]: must be contiguous (updated in place)")
            if grad.shape != p.shape or grad.dtype not in _BUFFER_CODES:
                raise ValueError(
                    f"grads[{i}]: shape {tuple(grad.shape)} / dtype"
                    f" {grad.dtype} does not fit its parameter"
                )
            if not grad.is_contiguous():
                raise ValueError(f"grads[{i}]: must be contiguous")
        # noise keyed to the parameter's identity and the piece's place in the full tensor
        bases = _dist.stream_bases(
            list(chain.from_iterable(g["params"] for g in self.param_groups))
        )
        noise = [bases[id(p)] + _dist.global_start(p, f"params[{i}]") for i, p in enumerate(params)]
        device = params[0].device
        groups = self.param_groups
        states = [
            self._state_buffers(p, groups[gi], rounding, state_dtype)
            for p, gi in zip(params, group_index)
        ]
        # step counters: one flat int32 tensor, state["step"] views of it
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
        state_lists = [
            (
                name,
                [
                    s[name] if name in s and self._uses_state(groups[gi], name) else None
                    for s, gi in zip(states, group_index)
                ],
            )
            for name in self._STATE_NAMES
        ]
        while len(state_lists) < 2:
            state_lists.append(("unused", None))
        aux_name = AUX_NAMES.get(rounding)
        aux = None
        if aux_name is not None:
            aux = [
                s[aux_name] if p.dtype != torch.float32 else None for s, p in zip(states, params)
            ]
        grads = [p.grad for p in params]
        plan = _plan.plan_step(
            _views, rounding, params, grads, state_lists, aux, group_index, noise
        )
        mode = _plan.check_rounding(rounding)
        entry = _Entry()
        if device.type == "cuda":  # (the caller made the parameters' device current)
            stream = _external_stream(device)
            fused = _optim.FusedStep(
                self._KIND,
                mode,
                plan.state_fmt,
                plan.table,
                plan.sizes,
                _view(steps, False, "step").bits,
                "cuda",
                stream,
            )
            stream.synchronize()  # the table copy, before launches on another stream
        else:
            fused = _optim.FusedStep(
                self._KIND,
                mode,
                plan.state_fmt,
                plan.table,
                plan.sizes,
                _view(steps, False, "step").bits,
                "cpu",
            )
        entry.key, entry.fused, entry.params, entry.device = key, fused, params, device
        entry.written = [p for p in params if not p.is_inference()]
        if self._dtensors:
            entry.written += [p for p in pieces if not p.is_inference()]
        # FSDP2 / tensor parallel: ranks agree on an overflow (GradScaler's check_grads)
        entry.groups = _dist.mesh_groups(params)
        # the kernel writes through raw addresses: keep every buffer of the table alive
        entry.buffers = [steps] + [
            v for s in states for v in s.values() if isinstance(v, torch.Tensor)
        ]
        entry.defaults = {}
        self._entry = entry
        return entry

    def _needed_states(self, group):
        return [n for n in self._STATE_NAMES if self._uses_state(group, n)]

    def _uses_state(self, group, name):
        return True

    def _layout_key(self):
        """Extra cache key: what changes which buffers exist (SGD: momentum on/off)."""
        return ()

    # -- scalars ----------------------------------------------------------------------------

    def _scalar_bits(self, value, name, entry, default_bits):
        """uint32[1] float32 bits of ``value`` (None, a float, or a float32 tensor of 1 value
        on the parameters' device) for the kernel."""
        device = entry.device
        if value is None or isinstance(value, (int, float, np.floating)):
            host = default_bits if value is None else np.array([value], np.float32).view(np.uint32)
            if device.type == "cpu":
                return host
            cached = entry.defaults.get(name) if value is None else None
            if cached is None:
                cached = torch.tensor(host.view(np.float32), device=device)
                if value is None:
                    entry.defaults[name] = cached
            value = cached
        if (
            not isinstance(value, torch.Tensor)
            or value.dtype != torch.float32
            or value.numel() != 1
        ):
            raise TypeError(f"{name}: expected a float or a float32 tensor of 1 value")
        if value.device != device:
            raise ValueError(f"{name}: on {value.device}, but params are on {device}")
        return _view(value.reshape(1), False, name).bits

    # -- step -------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None, *, inv_scale=None, found_inf=None, check_grads=False):
        """One fused step over every parameter that has a gradient.

        Args:
            closure: re-evaluates the model and returns the loss (as torch.optim).
            inv_scale: 1 / loss scale multiplied into the gradients inside the step (a float,
                or a float32 tensor of 1 value on the parameters' device): the gradients are
                read once and not modified.
            found_inf: float32 tensor of 1 value; when nonzero the step changes nothing
                (parameters, states, step counts), decided on the device without a sync.
            check_grads: first set ``found_inf`` to 1 if any gradient is inf/NaN (one launch
                over the cached table that reads the gradients and writes nothing): the loss
                scaler's overflow check and step in one call (``GradScaler.step``).
        """
        if check_grads and found_inf is None:
            raise ValueError("found_inf: needed with check_grads=True (the flag to set)")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        config = self._config()
        key = (self._key(), config, self._layout_key())
        entry = self._entry
        if entry is None or entry.key != key:
            params, group_index = self._collect()
            if not params:  # no gradients
                return loss
            with _on(params[0].device):
                entry = self._build(params, group_index, key, config)
        fused = entry.fused
        k0, k1 = split_seed(config[2])
        with _on(entry.device):
            if entry.device.type == "cuda":
                fused.stream = _external_stream(entry.device)  # torch's current stream
            found_bits = self._scalar_bits(found_inf, "found_inf", entry, _ZERO_BITS)
            if check_grads:
                fused.check_grads(found_bits)
                _dist.all_reduce_max(found_inf, entry.groups)
            fused.set_hyper(self._hyper())
            fused.run(
                self._scalar_bits(inv_scale, "inv_scale", entry, _ONE_BITS), found_bits, k0, k1
            )
        if entry.written:
            torch.autograd.graph.increment_version(entry.written)
        return loss

    # -- state dict -------------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's ``load_state_dict``, keeping srround's state dtypes (torch casts every
        floating state to the parameter's dtype, which would round fp32 moments and master
        weights of bf16 parameters, and turn int16 remainders into values)."""
        super().load_state_dict(state_dict)
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
                self.state[p] = restored
        self._entry = None  # new state tensors: rebuild the table at the next step


class AdamW(_FusedOptimizer):
    """torch.optim.AdamW (decoupled weight decay) as one fused srround step.

    Args:
        params, lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (``amsgrad`` is not
            supported).
        rounding: how the fp32 result reaches bf16/fp16 parameters: ``"stochastic"`` (default,
            no extra memory), ``"nearest"``, ``"kahan"``, ``"master"`` (fp32 master weights) or
            ``"remainder"`` (bf16 only; exact fp32 weights in 2 extra bytes). fp32 parameters
            are updated exactly in every mode.
        state_dtype: ``torch.float32`` (default) or ``torch.bfloat16`` moments.
        seed: the random stream of the stochastic roundings (int in [0, 2**64)); None draws
            one from srround's generator. Stored in the param groups (and the state dict).

    ``step(closure=None, *, inv_scale=None, found_inf=None)``; see the module docstring for
    the cache, ``zero_grad`` and state layout.
    """

    _KIND = _optim.ADAMW
    _STATE_NAMES = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        amsgrad=False,
        *,
        rounding="stochastic",
        state_dtype=torch.float32,
        seed=None,
    ):
        if amsgrad:
            raise ValueError("amsgrad: not supported by srround's AdamW")
        if not 0.0 <= float(lr):
            raise ValueError(f"lr: expected >= 0, got {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"eps: expected >= 0, got {eps}")
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"betas[{i}]: expected in [0, 1), got {beta}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"weight_decay: expected >= 0, got {weight_decay}")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults, rounding, state_dtype, seed)

    def _hyper(self):
        return np.array(
            [
                (float(g["lr"]), g["betas"][0], g["betas"][1], g["eps"], g["weight_decay"])
                for g in self.param_groups
            ],
            np.float64,
        )


class SGD(_FusedOptimizer):
    """torch.optim.SGD (momentum, dampening, nesterov, weight decay) as one fused srround step.

    Args:
        params, lr, momentum, dampening, weight_decay, nesterov: as ``torch.optim.SGD``.
        rounding, state_dtype, seed: as ``AdamW`` (``state_dtype``: the momentum buffers).
    """

    _KIND = _optim.SGD
    _STATE_NAMES = ("momentum_buffer", "unused")

    def __init__(
        self,
        params,
        lr=1e-3,
        momentum=0.0,
        dampening=0.0,
        weight_decay=0.0,
        nesterov=False,
        *,
        rounding="stochastic",
        state_dtype=torch.float32,
        seed=None,
    ):
        if not 0.0 <= float(lr):
            raise ValueError(f"lr: expected >= 0, got {lr}")
        if momentum < 0.0:
            raise ValueError(f"momentum: expected >= 0, got {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"weight_decay: expected >= 0, got {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("nesterov: needs momentum > 0 and dampening == 0")
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
        }
        super().__init__(params, defaults, rounding, state_dtype, seed)

    def _uses_state(self, group, name):
        return name == "momentum_buffer" and group["momentum"] != 0

    def _layout_key(self):
        return tuple(g["momentum"] != 0 for g in self.param_groups)

    def _hyper(self):
        rows = []
        for g in self.param_groups:
            if g["nesterov"] and (g["momentum"] <= 0 or g["dampening"] != 0):
                raise ValueError("nesterov: needs momentum > 0 and dampening == 0")
            rows.append(
                (
                    float(g["lr"]),
                    g["momentum"],
                    g["dampening"],
                    g["weight_decay"],
                    float(g["nesterov"]),
                )
            )
        return np.array(rows, np.float64)
