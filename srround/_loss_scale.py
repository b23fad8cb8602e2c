"""Loss scaling on a device: run the fused unscale-and-check pass over a tensor list and the
scale update, on the CPU or CUDA, with scalars read from and flags written to device arrays
(no host synchronisation). The update rule is the loss-scale contract of
``docs/contracts.md``; the element bodies are in ``_elements.py``, the loops in ``_cpu.py`` /
``_cuda.py``.
"""

from __future__ import annotations

from . import _cpu


def unscale_and_check(
    addresses,
    formats,
    starts,
    inv_scales,
    found,
    per_tensor,
    device,
    *,
    total,
    stream=None,
    device_table=None,
) -> None:
    """Unscale every element of a tensor list in place and flag non-finite inputs.

    Args:
        addresses, formats, starts: the tensor list (``_tensor_list.TensorList``), host
            arrays; on CUDA their device copies are cached (``_cuda._device_table``), or
            ``device_table`` holds the copies the caller keeps (``_optim.FusedStep``).
        inv_scales, found: uint32 float32 patterns (1, or one per tensor with ``per_tensor``;
            there one scale is shared) on ``device``; ``found`` is set to 1.0 where an input
            was non-finite.
        device: ``"cpu"`` or ``"cuda"``; total: elements over all tensors; stream: CUDA stream.
    """
    args = (addresses, formats, starts, inv_scales, found, per_tensor)
    if device == "cpu":
        _cpu.run(_cpu.unscale_and_check, total, *args)
    else:
        from . import _cuda

        _cuda.unscale_and_check(*args, total=total, stream=stream, device_table=device_table)


def update_scale(scale, growth_tracker, overflow_tracker, found, *factors, device, stream=None):
    """The loss-scale update of every scale of ``scale`` (float32 patterns) in place, with the
    int32 trackers and float32 ``found`` flags on ``device``; ``factors``: ``(growth_factor,
    backoff_factor, growth_interval, hysteresis, min_scale, max_scale)``."""
    args = (scale, growth_tracker, overflow_tracker, found, factors)
    if device == "cpu":
        _cpu.update_scale(*args)
    else:
        from . import _cuda

        _cuda.update_scale(*args, stream=stream)
