"""PyTorch adapter: CPU and CUDA tensors, zero-copy, results as native torch dtypes.

Tensors are viewed as raw bit patterns before any kernel sees them: NumPy ``uint32`` (fp32)
and ``uint16`` (bf16/fp16, through an ``int16`` torch view) arrays on the CPU, Numba device
arrays of the ``int32``/``int16`` views through ``__cuda_array_interface__`` on CUDA. A bf16
tensor is never handed to Numba itself: numba-cuda would take it as ``__nv_bfloat16`` and
convert stored values instead of copying bits. Results are ``torch.bfloat16`` /
``torch.float16`` / ``torch.float32`` tensors on the input's device; ``out=`` and in-place
targets are written in their own storage and returned as the same tensor objects. Raw bit
patterns are ``torch.uint16`` tensors with ``dtype=`` given, as with the NumPy adapter.

fp8 results are ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``. torch has no one-value-per-byte
fp4 dtype (``torch.float4_e2m1fn_x2`` packs two), so ``dtype="float4_e2m1fn"`` results are
``torch.uint8`` tensors of bit patterns (low 4 bits; bit 3 the sign), and fp4 inputs are such
``uint8`` tensors with ``dtype="float4_e2m1fn"`` given.

CUDA work is launched on the caller's current torch stream of the tensor's device
(``numba.cuda.external_stream``), so it is ordered with the surrounding torch work without any
synchronisation. The tensor's device must be the current CUDA device
(``torch.cuda.current_device()``; wrap calls in ``with torch.cuda.device(t.device):``
otherwise), because Numba launches in the current CUDA context.

Autograd: srround never records anything in the autograd graph. Out-of-place calls return new
tensors that do not require grad (as if run under ``torch.no_grad()``), also for inputs that
require grad. In-place calls (``stochastic_add``'s ``w``, ``out=``) on tensors that require
grad - e.g. an ``nn.Parameter`` - behave like an in-place update under ``torch.no_grad()``: the
data changes, no graph is recorded, and the tensor's version counter is bumped, so autograd
still reports a tensor that a pending backward saved and that was modified since. As there,
an inference tensor is updated only inside ``torch.inference_mode()`` (a ``RuntimeError``
outside it, naming the argument).
"""

from __future__ import annotations

import operator

import numpy as np
import torch

from srround._dispatch import View
from srround._formats import CODE_DTYPES, FORMATS, Format, bits_dtype, code_name

from .._common import (
    Dtypes,
    buffer_dtypes,
    check_contiguous,
    check_counter,
    check_source,
    check_target,
)
from ..numba import external_stream
from . import _dist

MUTABLE = True  # the adapter protocol of srround._dispatch: views of the caller's memory
_FIX = ".contiguous()"

# srround format name -> torch dtype
_TORCH_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
_FORMAT_OF = {_TORCH_DTYPES[name]: FORMATS[name] for name in _TORCH_DTYPES}
# fp4: bit patterns; block results: e8m0 scales, packed fp4 bytes
_RESULT_DTYPES = {
    **_TORCH_DTYPES,
    "float4_e2m1fn": torch.uint8,
    "float8_e8m0fnu": torch.float8_e8m0fnu,
    "uint8": torch.uint8,
}
_SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32}  # element width -> signed view dtype
_DTYPES = Dtypes(
    noun="tensor",
    float32=torch.float32,
    float64=torch.float64,
    int32=torch.int32,
    raw=torch.uint16,  # raw bit patterns (torch >= 2.3; the extra needs >= 2.4)
    raw8=torch.uint8,
    narrow=_FORMAT_OF,
    cast=".float()",
    contiguous="contiguous",
)


def _as_tensor(x, name: str):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.layout != torch.strided:
        raise TypeError(
            f"{name}: {x.layout} tensors are not supported; pass a dense tensor (.to_dense())"
        )
    _check_storage(x, name)
    return x


def _check_storage(t, name: str) -> None:
    """``t`` (a DTensor: its local piece) has storage of its own: a wrapper tensor subclass
    (torchao's weight and state wrappers, torch's TwoTensor) reports ``data_ptr()`` 0, and
    the kernels read and write raw addresses (meta tensors: the device's own error). A traced
    tensor (torch.export's default non-strict mode, make_fx) has no memory: an error that
    says how to trace srround."""
    piece = _dist.local(t)
    try:
        address = piece.data_ptr()
    except RuntimeError as error:  # FakeTensor, FunctionalTensor: torch's "data pointer" error
        raise TypeError(
            f"{name}: a traced {type(piece).__name__} has no memory for srround's kernels;"
            " trace with torch.compile or torch.export.export(..., strict=True) (they take"
            " srround.unscale_and_check as a custom op) or call srround.adapters.torch's ops"
        ) from error
    if address == 0 and piece.numel() != 0 and not piece.is_meta:
        raise TypeError(
            f"{name}: a {type(piece).__name__} (a tensor subclass with no storage of its"
            " own) is not supported; srround's kernels need plain tensors"
        )


def _check_contiguous(t, name: str) -> None:
    check_contiguous(t.is_contiguous(), name, f"{name}{_FIX}", _DTYPES)


def _external_stream(device):
    """The Numba stream object for torch's current stream on ``device`` (cached)."""
    return external_stream(device.index, torch.cuda.current_stream(device).cuda_stream)


def _cuda_view(t, flat, bits_dtype, name: str) -> View:
    device = t.device
    current = torch.cuda.current_device()
    if device.index != current:
        raise ValueError(
            f"{name}: is on {device} but the current CUDA device is cuda:{current}; call inside"
            f" `with torch.cuda.device({name}.device):` (Numba launches on the current device)"
        )
    if flat.numel() == 0:
        # nothing to launch (the API returns before any kernel on empty views); avoid asking the
        # driver about a null pointer
        bits = np.empty(0, bits_dtype)
    else:
        from srround._numba_cuda_compat import import_numba_cuda

        cuda = import_numba_cuda()
        # int16/int32 view: bits, not values, reach Numba; torch's interface carries no stream
        bits = cuda.as_cuda_array(flat, sync=False).view(bits_dtype)
    return View(
        bits=bits,
        device="cuda",
        shape=tuple(t.shape),
        result=t,
        stream=_external_stream(device),
        device_id=device.index,
    )


def _view(t, narrow: bool, name: str) -> View:
    """Zero-copy flat bit view of contiguous ``t``: unsigned words of its element width (fp32
    as uint32, bf16/fp16 as uint16). A DTensor: a view of its local piece, with the piece's
    place in the full tensor as the view's stream offset and runs (``_dist.stream_layout``)
    and the DTensor as the result."""
    if _dist.is_dtensor(t):
        view = _view(t._local_tensor, narrow, name)
        try:
            start, run, skip = _dist.stream_layout(t, name)
            view.offset, view.runs = start, (run, skip)
        except ValueError as error:  # only an error where noise is drawn
            view.offset = error
        view.result = t
        view.sharded = True
        return view
    width = t.element_size()
    if t.is_cpu:
        # float32 converts to NumPy as it is, narrow data as int16 (NumPy has no bf16); the
        # bit views and the reshape of a contiguous array (torch and NumPy agree on contiguity)
        # are NumPy's own, the cheapest views there are, never copies
        base = t.detach() if t.requires_grad else t
        a = base.view(_SIGNED[width]).numpy() if narrow else base.numpy()
        bits = a.reshape(-1).view(bits_dtype(width))
        return View(bits=bits, device="cpu", shape=tuple(t.shape), result=t)
    if t.is_cuda:
        # signed views: their __cuda_array_interface__ typestr is supported by every torch
        flat = t.detach().view(-1).view(_SIGNED[width])
        return _cuda_view(t, flat, bits_dtype(width), name)
    raise ValueError(f"{name}: is on {t.device}; srround runs on CPU and CUDA tensors only")


def _check_writable(t, name: str) -> None:
    """An inference tensor outside ``torch.inference_mode()`` is a ``RuntimeError``: torch's
    in-place ops refuse it too."""
    if t.is_inference() and not torch.is_inference_mode_enabled():
        raise RuntimeError(
            f"{name}: an inference tensor (made under torch.inference_mode()), which torch does"
            " not update in place outside torch.inference_mode(): clone it, or call inside"
            " torch.inference_mode()"
        )


def _mark_written(t, name: str) -> None:
    """``_check_writable``, then bump ``t``'s version counter as a ``torch.no_grad()`` in-place
    op would."""
    _check_writable(t, name)
    if not t.is_inference():
        torch.autograd.graph.increment_version(t)


def source(
    x, name: str, fmt: Format | None = None, *, narrow: bool = False
) -> tuple[View, Format | None]:
    """A read view of ``x``: float32 data (``narrow=False``) or narrow data (``narrow=True``,
    format from the dtype or ``fmt``). Returns ``(view, format)``."""
    t = _as_tensor(x, name)
    piece = _dist.local(t)
    fmt, _ = check_source(
        t.dtype, piece.is_contiguous(), name, fmt, narrow, f"{name}{_FIX}", _DTYPES
    )
    return _view(t, narrow, name), fmt


def target(out, name: str, like: View, fmt: Format | None) -> View:
    """A write view for the result: ``out`` validated, or a new tensor shaped like ``like`` on
    its device. ``fmt=None`` means float32. For a DTensor input the result is a DTensor of its
    mesh and placements (``out`` must be one too)."""
    narrow = fmt is not None
    like_dtensor = like.offset is not None and _dist.is_dtensor(like.result)
    if out is None:
        dtype = _RESULT_DTYPES[fmt.name] if narrow else torch.float32
        if like.device == "cpu":
            new = torch.empty(like.shape, dtype=dtype)
        else:
            new = torch.empty(like.shape, dtype=dtype, device=like.result.device)
        if like_dtensor:  # a DTensor of the input's mesh and placements
            return _view(_dist.like_dtensor(new, like.result), narrow, name)
        return _view(new, narrow, name)
    t = _as_tensor(out, name)
    fix = f"{name}{_FIX}"
    if like_dtensor or _dist.is_dtensor(t):
        _dist.check_same_layout(t, like.result, name, "the input")
        if tuple(t.shape) != tuple(like.result.shape):
            raise ValueError(
                f"{name}: shape {tuple(t.shape)} does not match the input's shape"
                f" {tuple(like.result.shape)}"
            )
    piece = _dist.local(t)
    check_target(
        t.dtype, tuple(piece.shape), piece.is_contiguous(), name, like.shape, fmt, fix, _DTYPES
    )
    view = _view(t, narrow, name)
    _mark_written(piece, name)
    return view


def inplace(w, name: str, fmt: Format | None) -> tuple[View, Format]:
    """A read-write view of a narrow tensor updated in place (``requires_grad`` allowed: the
    update acts as under ``torch.no_grad()``)."""
    view, fmt = source(w, name, fmt, narrow=True)
    _mark_written(_dist.local(view.result), name)
    return view, fmt


def counter(c, name: str, like: View) -> View:
    """An int32 counter tensor of ``like``'s shape updated in place (a new zeroed one on
    ``like``'s device for ``None``), as a 32-bit view."""
    if c is None:
        c = torch.zeros(like.shape, dtype=torch.int32, device=like.result.device)
    t = _as_tensor(c, name)
    fix = f"{name}{_FIX}"
    check_counter(t.dtype, tuple(t.shape), t.is_contiguous(), name, like.shape, fix, _DTYPES)
    view = _view(t, False, name)
    _mark_written(t, name)
    return view


# BufferCode of each torch dtype of CODE_DTYPES (torch spells its dtypes as NumPy/ml_dtypes do)
_BUFFER_CODES = {
    getattr(torch, code_name(code)): code for code in CODE_DTYPES if hasattr(torch, code_name(code))
}  # (torch has no one-per-byte fp4 dtype)
_DTYPE, _DEVICE = operator.attrgetter("dtype"), operator.attrgetter("device")
_IS_CPU = operator.attrgetter("is_cpu")
_DATA_PTR, _NUMEL = torch.Tensor.data_ptr, torch.Tensor.numel
_IS_CONTIGUOUS = torch.Tensor.is_contiguous
_IS_INFERENCE = torch.Tensor.is_inference


def buffer_table(tensors, name: str, writes: bool = True):
    """``(addresses, sizes, format codes, place)`` of tensors a tensor-list kernel reads (and
    updates in place: ``writes``; tensors are always writable). A gradient list has hundreds
    of tensors: the per-tensor work is C-level ``map`` calls, with only the checks that matter
    (dtype, contiguity, one device); the first bad tensor is then found and named. DTensors
    (all or none): their local pieces."""
    tensors = _dist.locals_of(tensors, name)
    try:
        codes = list(map(_BUFFER_CODES.__getitem__, map(_DTYPE, tensors)))
        if not all(map(_IS_CONTIGUOUS, tensors)):
            raise ValueError
        addresses = list(map(_DATA_PTR, tensors))
        sizes = list(map(_NUMEL, tensors))
        # all on the CPU: a flag read (torch.device objects are made per read, 2x the time)
        devices = None if all(map(_IS_CPU, tensors)) else set(map(_DEVICE, tensors))
    except Exception:  # not a tensor, another dtype, a layout without storage
        _buffer_error(tensors, name)
        raise
    if 0 in addresses:  # an empty tensor, or a subclass without storage (a wrapper)
        for i, t in enumerate(tensors):
            _check_storage(t, f"{name}[{i}]")
    if writes and any(map(_IS_INFERENCE, tensors)):
        for i, t in enumerate(tensors):
            _check_writable(t, f"{name}[{i}]")
    if devices is None:
        return addresses, sizes, codes, "cpu"
    if len(devices) > 1:
        raise ValueError(
            f"{name}: tensors on several devices ({sorted(map(str, devices))});"
            " pass one device's tensors per call"
        )
    (device,) = devices
    if device.type == "cpu":
        return addresses, sizes, codes, "cpu"
    if device.type != "cuda":
        raise ValueError(f"{name}: is on {device}; srround runs on CPU and CUDA tensors only")
    if device.index != torch.cuda.current_device():
        raise ValueError(
            f"{name}: is on {device}, not the current CUDA device; call inside"
            " `with torch.cuda.device(...)`"
        )
    return addresses, sizes, codes, f"cuda:{device.index}"


def reduce_flags(tensors, flags) -> None:
    """DTensors (FSDP2, tensor parallel): all-reduce the overflow ``flags`` (MAX) over the
    process groups of their meshes, on the device, as the GradScaler does; plain tensors:
    nothing."""
    _dist.all_reduce_max(_dist.local(flags), _dist.mesh_groups(tensors))


def _buffer_error(tensors, name):
    """Raise the error of the first tensor that a tensor-list kernel cannot take."""
    for i, t in enumerate(tensors):
        item = f"{name}[{i}]"
        _as_tensor(t, item)
        if t.dtype not in _BUFFER_CODES:
            raise TypeError(f"{item}: expected {buffer_dtypes(item)} tensor, got {t.dtype}")
        _check_contiguous(t, item)
