"""Fused optimizer steps (AdamW, SGD) over many tensors: ``FusedStep`` runs a planned pointer
table on its device.

One step reads every parameter, gradient and state element once and writes each once, for all
tensors of an optimizer in O(1) launches (a prepare pass over the tensors, then one pass over
all elements), through a pointer table of one row per tensor (columns: ``Column``), a
float64[G, 5] hyperparameter array (columns: ``Hyper``), int32 step counters and float32[N, 4]
per-tensor coefficients. The math, the weight modes and the noise offsets are the optimizer
contract of ``docs/contracts.md``; the element bodies are in ``_elements.py``, the loops in
``_cpu.py`` / ``_cuda.py``, and tables are planned (validated, built) by ``_plan.py``.

The names of ``_elements.py`` that describe an optimizer (``Kind``, ``Mode``, ``Column``,
``MODES``, ``prepare_coefs``, ...) are re-exported here.
"""

from __future__ import annotations

import numpy as np

from . import _cpu, _state8, _validate
from ._elements import (  # noqa: F401  (re-exported: the optimizer's names)
    ADAMW,
    AUX_ADDR,
    COEF_COLUMNS,
    G_ADDR,
    G_FMT,
    GROUP,
    HYPER_COLUMNS,
    KAHAN,
    MASTER,
    MAX_ELEMENTS,
    MAX_STEPS,
    MODES,
    NEAREST,
    NOISE,
    NOISE_RUN,
    NOISE_SKIP,
    P_ADDR,
    P_FMT,
    REMAINDER,
    S1_ADDR,
    S2_ADDR,
    SGD,
    STEP_SHIFT,
    STOCHASTIC,
    STREAM_SHIFT,
    TABLE_COLUMNS,
    Column,
    Hyper,
    Kind,
    Mode,
    _power,
    adamw_math,
    group_constants,
    prepare_coefs,
    scale_usable,
    sgd_math,
    stream_offset,
    weight_value,
    weight_write,
)
from ._loss_scale import unscale_and_check

_SIGN_BIT = 0x80000000  # of a float32 pattern
_ONE_BITS = 0x3F800000  # 1.0f: the value a flag is set to


def noise_spans(table, sizes):
    """How many stream positions each tensor's noise spans from its ``NOISE`` start: its size,
    plus the skipped positions between its runs (``NOISE_RUN``, ``NOISE_SKIP``)."""
    run, skip = table[:, NOISE_RUN], table[:, NOISE_SKIP]
    runs = np.where(run > 0, -(-sizes // np.maximum(run, 1)), 1)
    return sizes + np.maximum(runs - 1, 0) * skip


def _check_disjoint_noise(noise, spans) -> None:
    """The tensors of one step draw disjoint ranges of the random stream (``stream_starts``):
    two that overlap would round with shared, correlated noise, which no caller intends."""
    nonempty = np.flatnonzero(spans > 0)
    order = nonempty[np.argsort(noise[nonempty], kind="stable")]
    ends = noise[order] + spans[order]
    clash = np.flatnonzero(noise[order][1:] < ends[:-1])
    if clash.size:
        i, j = order[clash[0]], order[clash[0] + 1]
        raise ValueError(
            f"stream_starts[{j}]: params[{j}]'s noise [{noise[j]}, {noise[j] + spans[j]})"
            f" overlaps params[{i}]'s [{noise[i]}, {noise[i] + spans[i]}): give each tensor its"
            " own range of the stream"
        )


class FusedStep:
    """A fused step over a fixed set of buffers: the pointer table is built and (on CUDA)
    copied to the device once; each ``run`` is one CPU call or two CUDA launches, whatever the
    number of tensors. The caller keeps the buffers alive and in place.

    Args:
        kind: ``Kind``; mode: ``Mode``; state_fmt: ``BufferCode`` of every state buffer.
        table: int64[N, len(Column)] host pointer table; sizes: elements per tensor.
        steps: uint32[N] bits of the int32 step counters (host or device array).
        device: ``"cpu"`` or ``"cuda"``; stream: the CUDA stream to launch on.
    """

    def __init__(self, kind, mode, state_fmt, table, sizes, steps, device, stream=None):
        self.kind, self.mode, self.state_fmt = int(kind), int(mode), int(state_fmt)
        starts = np.concatenate([[0], np.cumsum(np.asarray(sizes, np.int64))]).astype(np.int64)
        self.total, self._host_starts = int(starts[-1]), starts
        if self.total >= MAX_ELEMENTS:
            raise ValueError(f"params: {self.total} elements, at most {MAX_ELEMENTS - 1} per step")
        if len(table):
            spans = noise_spans(table, np.diff(starts))
            if int((table[:, NOISE] + spans).max()) > MAX_ELEMENTS:
                raise ValueError(f"params: noise starts past {MAX_ELEMENTS} elements")
            _check_disjoint_noise(table[:, NOISE], spans)
            if state_fmt in _state8.FP8_CODES and table[:, NOISE_RUN].any():
                raise ValueError("params: float8 states take tensors whose noise is one range")
        self.device, self.stream, self.steps = device, stream, steps
        coefs = np.zeros((len(table), COEF_COLUMNS), np.float32)
        self._hyper_host = None
        self._hyper = None
        self._host_table, self._grad_table = table, None  # gradient columns: check_grads
        self.fp8 = state_fmt in _state8.FP8_CODES
        # fp8 states: work items are blocks of a tensor (no blocks for the other formats)
        counts = _state8.block_counts(sizes) if self.fp8 else np.zeros(0, np.int64)
        bstarts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.blocks = int(bstarts[-1])
        if device == "cpu":
            self.table, self.starts, self.coefs, self.bstarts = table, starts, coefs, bstarts
            if not self.fp8:
                self._kernel = _cpu.optim_step_kernel(kind, mode, state_fmt, table)
        else:
            from ._numba_cuda_compat import import_numba_cuda

            cuda = import_numba_cuda()
            self.table, self.starts, self.coefs, self.bstarts = (
                cuda.to_device(a, stream=stream) for a in (table, starts, coefs, bstarts)
            )
            if not self.fp8:
                from . import _cuda

                self._kernel = _cuda.optim_step_kernel(kind, mode, state_fmt, table)

    def set_hyper(self, hyper: np.ndarray) -> None:
        """Per-group hyperparameters (float64[G, len(Hyper)]); copied to the device only when
        changed (a learning-rate schedule changes them every step: one small copy)."""
        if self._hyper_host is not None and np.array_equal(hyper, self._hyper_host):
            return
        self._hyper_host = hyper.copy()
        if self.device == "cpu":
            self._hyper = self._hyper_host
        elif self._hyper is not None and self._hyper.shape == hyper.shape:
            # stream-ordered: the previous step's kernels have read the old values by then
            self._hyper.copy_to_device(self._hyper_host, stream=self.stream)
        else:
            from ._numba_cuda_compat import import_numba_cuda

            self._hyper = import_numba_cuda().to_device(self._hyper_host, stream=self.stream)

    def set_grad_addresses(self, addresses) -> None:
        """Point the table at new gradient buffers: ``addresses`` (int64[N], one per row) of
        buffers with the dtypes and sizes of those the table was built with, which the caller
        checked (no shared memory with a written buffer). For gradients that were freed and
        reallocated between steps; on CUDA one small stream-ordered copy of the table."""
        self._host_table[:, G_ADDR] = addresses
        if self.device == "cuda":
            self.table.copy_to_device(self._host_table, stream=self.stream)
        self._grad_table = None  # check_grads' columns: rebuilt at its next call

    def check_grads(self, found) -> None:
        """Set ``found`` (uint32[1], float32 bits, on the table's device) to 1.0 if any gradient
        of the table is inf/NaN: the loss-scale overflow check, one pass that reads the
        gradients and writes nothing, through the cached table (no per-call table build)."""
        if self._grad_table is None:
            columns = [np.ascontiguousarray(self._host_table[:, c]) for c in (G_ADDR, G_FMT)]
            one = np.array([1.0], np.float32).view(np.uint32)
            on_device = None
            if self.device == "cuda":
                from ._numba_cuda_compat import import_numba_cuda

                cuda = import_numba_cuda()
                on_device = [cuda.to_device(a, stream=self.stream) for a in columns]
                on_device = (*on_device, self.starts)
                one = cuda.to_device(one, stream=self.stream)
            self._grad_table = (*columns, self._host_starts, one), on_device
        (addresses, formats, starts, one), on_device = self._grad_table
        unscale_and_check(
            addresses,
            formats,
            starts,
            one,
            found,
            False,
            self.device,
            total=self.total,
            stream=self.stream,
            device_table=on_device,
        )

    def run(self, inv_scale, found, k0, k1, *, negated=False) -> None:
        """One step; ``inv_scale``, ``found``: uint32[1] float32 bits on the table's device.

        A nonzero ``found`` skips the step (step counters included). So does an ``inv_scale``
        that is not a positive finite float (``scale_usable``; ``negated``: a negative one,
        torch's ``maximize``), and it sets ``found`` to 1.0: on the CPU checked here, on CUDA
        by the prepare kernel (no host read of a device scale)."""
        sign = _SIGN_BIT if negated else 0
        if self.device == "cpu":
            # host counters are checked before each step (a GPU's are not read: a sync)
            counts = self.steps.view(np.int32)
            bad = np.flatnonzero((counts < 0) | (counts >= MAX_STEPS - 1))
            if bad.size:
                k = int(bad[0])
                _validate.steps_taken(counts[k], f"step[{k}]", MAX_STEPS)
            if not scale_usable.py_func(int(inv_scale[0]) ^ sign):
                found[0] = _ONE_BITS
                return
        args = (
            self.table,
            self.starts,
            self._hyper,
            self.steps,
            self.coefs,
            inv_scale,
            found,
            k0,
            k1,
        )
        if self.fp8:  # AdamW with fp8 states: one work item per block of a tensor
            head, tail = args[:2], args[2:]
            if self.device == "cpu":
                _cpu.run(
                    _cpu.optim_step8,
                    self.total,
                    *head,
                    self.bstarts,
                    *tail,
                    self.mode,
                    self.state_fmt,
                )
            else:
                from . import _cuda

                _cuda.optim_step8(
                    self.mode,
                    self.state_fmt,
                    *head,
                    self.bstarts,
                    *tail,
                    sign=sign,
                    blocks=self.blocks,
                    stream=self.stream,
                )
        elif self.device == "cpu":
            _cpu.run(self._kernel, self.total, *args)
        else:
            from . import _cuda

            _cuda.optim_step(
                self._kernel,
                self.kind,
                *args,
                sign=sign,
                total=self.total,
                stream=self.stream,
            )
