#!/usr/bin/env python
"""Throughput of srround's fp32 -> bf16/fp16 rounding kernels against a bandwidth floor and
against what users write today (torch, torchao, JAX, ml_dtypes).

Usage::

    python benchmarks/bench_round.py                 # CPU 2^20..2^26, GPU 2^20..2^28 if present
    python benchmarks/bench_round.py --quick         # CPU 2^20..2^22, GPU 2^20..2^24
    python benchmarks/bench_round.py --device cpu --sizes 20 24 --json out.json

What is measured
----------------
Every row converts (or moves the bytes of) ``n`` float32 values into ``n`` 16-bit values.
Throughput is reported as **GB/s of useful traffic: 6 bytes per element** (4 B read + 2 B
written), whatever the implementation really moves (torchao/JAX materialise int32 temporaries,
so they move more; their GB/s is still "6 B per element / time", i.e. an element rate).

``% floor`` divides by a bandwidth floor measured in the same run on the same buffers:

* CPU floor: a Numba ``prange`` truncation kernel ``out[i] = x[i] >> 16`` (uint32 -> uint16), the
  cheapest possible kernel with exactly srround's access pattern and thread pool. A NumPy
  ``copyto`` of 3n bytes into 3n bytes (the same 6n bytes of traffic, one thread) is printed
  beside it for context.
* GPU floor: a trivial ``numba.cuda`` device-to-device copy of the same bytes (3n bytes read,
  3n bytes written, 8-byte words, one word per thread); torch/cupy copies and a CUDA
  ``x >> 16`` kernel are printed for context when available.

A kernel at ~100 % is memory-bound; far below means compute- (RNG-) or overhead-bound. While
6n bytes fit in the last-level cache (e.g. n <= 2^22 with a 32 MiB L3), the floor and
everything near it measure cache, not DRAM, bandwidth; the large sizes are the DRAM numbers.

Rows (``op`` column: SR = stochastic rounding, RNE = round to nearest even):

* ``srround`` - the public API (``stochastic_round`` / ``round_nearest``) with a preallocated
  ``out=`` and a fixed seed, so the time includes the Python-side validation of each call.
* ``torch .to(bf16)`` - allocating cast; ``torch out.copy_(x)`` - the same cast into a
  preallocated tensor (RNE anchors).
* ``torchao SR`` - ``torchao.optim.quant_utils._fp32_to_bf16_sr`` (the SR cast torchao's
  low-bit optimizers use), eager and under ``torch.compile``. If torchao is not importable, a
  "torchao-style" reimplementation of the same formula is used and labelled so.
* ``jax SR (jit)`` - a user-level SR: ``jax.random.bits`` uint32, add the low 16 bits to the fp32
  pattern, mask, bitcast, convert to bf16; timed with ``block_until_ready``.
* ``ml_dtypes astype`` - ``x.astype(ml_dtypes.bfloat16)`` (single-threaded RNE, allocating).
* ``srround to_float32`` - bf16 -> fp32 widening (2 B read + 4 B written: the same 6 B).
* ``srround stochastic_add`` - ``w <- SR(w + alpha * u)`` in place: 2 + 4 B read, 2 B written,
  8 B per element, so its GB/s and % floor (counted at 6 B) understate its traffic by 4/3.

Below bf16 (``--lowbit-log2n``, default 22; 0 skips): the rows of ``bench_lowbit.py`` at one
size - fp8/fp4 ``stochastic_round`` / ``round_nearest`` against ml_dtypes' and torch's casts,
``quantize_blocks`` (MXFP8, MXFP4, NVFP4) against torchao's ``to_mx`` / ``nvfp4_quantize`` -
counted at 4 B read plus the bytes written (1 B per fp8 element, 0.5 B per fp4 element, and the
block scales; ``B/elem``), against their own same-run floor (CPU: a Numba ``prange`` ``x >> 24``,
uint32 -> uint8; GPU: a torch ``copy_`` of 5 B per element).

Reading the table: one row per implementation, one column per size, each cell
``GB/s  % of floor`` (same size, same run); the last column is the median milliseconds per call
at the largest size. Rows that cannot run (no torchao, no CUDA in torch, no cupy...) are listed
under "notes" instead. ``--json PATH`` keeps every cell (median/min seconds, samples, ns per
element, contention) plus the header metadata, including a hash of the kernel sources measured.

Timing: every callable is warmed up (JIT / torch.compile / XLA compile, page faults) before it is
timed; then it runs for about ``--cell-time`` seconds (0.2 s, 0.1 s with --quick; at least 3
samples). CPU: ``perf_counter`` around each call, median reported. GPU: ``perf_counter`` around a
batch of calls closed by a device synchronize (so launch overhead is pipelined and counted as a
user would see it), median over batches; no host<->device copies are timed.

Shared machines: the script samples /proc/stat around every timed cell and records how many CPUs
*other* processes used meanwhile (``others_busy_cpus``). A CPU cell where that exceeds 0.3 is
re-timed (``--retries``, default once) and, if still contended, printed with a ``*``. On a 2-core
box one busy neighbour halves a 2-thread kernel, and a ``prange`` call on a small array can wait a
whole scheduler slice for its second thread, so starred cells can be far off. The cores' contention
before and after the run is printed in the header/notes.


The script also measures **first-call latency**: two fresh subprocesses with
``NUMBA_CACHE_DIR`` pointing at a new empty directory - the first compiles srround's CPU kernel
(cold), the second loads it from that cache (warm) - each timing ``import srround`` and the first
``stochastic_round`` on a small array (and a second call); "cache hits" shows whether the warm
process really loaded the kernel (0 means it compiled again, e.g. because the source changed).

Numbers depend on the machine (cores, memory channels, turbo) and on what else runs on it; only
compare rows of one run.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np
from _harness import (
    BUSY_MARK,
    Unavailable,
    add_json_argument,
    bench_parser,
    busy_cpus,
    measure,
    print_notes,
    utc_now,
    write_json,
)
from _harness import quiet_import as _quiet_import

# JAX would otherwise reserve 75 % of GPU memory at its first use, starving the other rows
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

BYTES_PER_ELEMENT = 6  # 4 B fp32 read + 2 B written
SEED = 1234


# --------------------------------------------------------------------------------------------
# anchors shared by CPU and GPU
# --------------------------------------------------------------------------------------------


def torch_module():
    try:
        return _quiet_import("torch")
    except ImportError as exc:
        raise Unavailable(f"torch not importable ({exc})") from None


_TORCHAO = None


def torchao_sr():
    """(function, label): torchao's SR cast, or the same formula reimplemented."""
    global _TORCHAO
    if _TORCHAO is None:
        torch = torch_module()
        try:
            mod = _quiet_import("torchao.optim.quant_utils")
            _TORCHAO = (mod._fp32_to_bf16_sr, "torchao SR")
        except Exception:  # noqa: BLE001 - any import failure means "use the fallback"

            def torchao_style_sr(x):
                """torchao's ``_fp32_to_bf16_sr`` formula (torchao 0.x), reimplemented: round
                away from zero when 16 random bits < the 16 bits bf16 drops."""
                rand_16bit = torch.randint(0, 1 << 16, x.shape, device=x.device, dtype=torch.int32)
                x_fp32 = x.view(torch.int32)
                x_fraction = x_fp32 & 0xFFFF
                x_bf16_towards_zero = x_fp32 & 0xFFFF0000
                x_fp32 = torch.where(
                    rand_16bit < x_fraction, x_bf16_towards_zero + 0x10000, x_bf16_towards_zero
                )
                return x_fp32.view(torch.float32).bfloat16()

            _TORCHAO = (torchao_style_sr, "torchao-style SR")
    return _TORCHAO


_COMPILED = {}


def torchao_sr_compiled():
    torch = torch_module()
    fn, label = torchao_sr()
    if "sr" not in _COMPILED:
        _COMPILED["sr"] = torch.compile(fn)
    return _COMPILED["sr"], label


def jax_sr_fn():
    try:
        jax = _quiet_import("jax")
    except ImportError as exc:
        raise Unavailable(f"jax not importable ({exc})") from None
    import jax.numpy as jnp

    @jax.jit
    def jax_sr(key, x):
        """User-level SR to bf16: add 16 random bits below the bf16 mantissa, truncate.
        (No special care for inf/NaN/overflow - what a user typically writes.)"""
        bits = jax.random.bits(key, x.shape, jnp.uint32)
        xb = jax.lax.bitcast_convert_type(x, jnp.uint32)
        yb = (xb + (bits & jnp.uint32(0xFFFF))) & jnp.uint32(0xFFFF0000)
        return jax.lax.bitcast_convert_type(yb, jnp.float32).astype(jnp.bfloat16)

    return jax, jax_sr


# --------------------------------------------------------------------------------------------
# CPU rows
# --------------------------------------------------------------------------------------------


def _library_rows(
    sr, rne, widen, add, torch_to, torch_copy, torchao_eager, torchao_compiled, jax_sr
) -> list:
    """The rows both devices time, in order: srround's kernels, torch, torchao, jax."""
    try:
        ao_label = torchao_sr()[1]
    except Unavailable:
        ao_label = "torchao SR"
    return [
        ("srround stochastic_round", "SR bf16", sr("bfloat16")),
        ("srround stochastic_round", "SR fp16", sr("float16")),
        ("srround round_nearest", "RNE bf16", rne),
        ("srround to_float32", "bf16->fp32", widen),
        ("srround stochastic_add (8 B)", "SR add bf16", add),
        ("torch .to(bf16)", "RNE bf16", torch_to),
        ("torch out.copy_(x)", "RNE bf16", torch_copy),
        (f"{ao_label} eager", "SR bf16", torchao_eager),
        (f"{ao_label} torch.compile", "SR bf16", torchao_compiled),
        ("jax SR (jit)", "SR bf16", jax_sr),
    ]


def cpu_rows():
    """[(label, op, setup)]; ``setup(x)`` (x: float32[n]) returns ``(fn, sync)`` or raises
    ``Unavailable``. The first row is the floor."""
    import ml_dtypes
    from numba import njit, prange

    import srround

    @njit(parallel=True, cache=False)
    def trunc16(x, out):
        for i in prange(x.size):
            out[i] = np.uint16(x[i] >> np.uint32(16))

    def floor(x):
        bits, out = x.view(np.uint32), np.empty(x.size, np.uint16)
        return (lambda: trunc16(bits, out)), None

    def numpy_copy(x):
        src = x.view(np.uint8)[: 3 * x.size]
        dst = np.empty_like(src)
        return (lambda: np.copyto(dst, src)), None

    def sr(dtype):
        def setup(x):
            out = np.empty(x.size, ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16)
            return (lambda: srround.stochastic_round(x, dtype=dtype, seed=SEED, out=out)), None

        return setup

    def rne(x):
        out = np.empty(x.size, ml_dtypes.bfloat16)
        return (lambda: srround.round_nearest(x, dtype="bfloat16", out=out)), None

    def widen(x):
        narrow, out = x.astype(ml_dtypes.bfloat16), np.empty(x.size, np.float32)
        return (lambda: srround.to_float32(narrow, out=out)), None

    def add(x):
        w = x.astype(ml_dtypes.bfloat16)
        u = x * np.float32(1e-3)
        return (lambda: srround.stochastic_add(w, u, alpha=-1e-3, seed=SEED)), None

    def torch_to(x):
        torch = torch_module()
        t = torch.from_numpy(x)
        return (lambda: t.to(torch.bfloat16)), None

    def torch_copy(x):
        torch = torch_module()
        t, out = torch.from_numpy(x), torch.empty(x.size, dtype=torch.bfloat16)
        return (lambda: out.copy_(t)), None

    def torchao_eager(x):
        fn, _ = torchao_sr()
        t = torch_module().from_numpy(x)
        return (lambda: fn(t)), None

    def torchao_compiled(x):
        fn, _ = torchao_sr_compiled()
        t = torch_module().from_numpy(x)
        return (lambda: fn(t)), None

    def jax_sr(x):
        jax, fn = jax_sr_fn()
        xj = jax.device_put(x, jax.devices("cpu")[0])
        key = jax.random.key(SEED)
        return (lambda: fn(key, xj)), (lambda r: r.block_until_ready())

    def mldtypes(x):
        return (lambda: x.astype(ml_dtypes.bfloat16)), None

    return [
        ("floor: numba prange x>>16", "trunc", floor),
        ("numpy copyto 3n B", "copy", numpy_copy),
        *_library_rows(
            sr, rne, widen, add, torch_to, torch_copy, torchao_eager, torchao_compiled, jax_sr
        ),
        ("ml_dtypes astype", "RNE bf16", mldtypes),
    ]


# --------------------------------------------------------------------------------------------
# GPU rows (real GPU only: numba.cuda.is_available())
# --------------------------------------------------------------------------------------------


cuda = None  # numba.cuda, set by _cuda_reference_kernels (module-level for the CUDA simulator)


def _cuda_reference_kernels():
    """The GPU floor kernels: a word copy and ``out[i] = x[i] >> 16``, one element per thread."""
    global cuda
    from srround._numba_cuda_compat import import_numba_cuda

    cuda = import_numba_cuda()

    @cuda.jit
    def copy_words(src, dst):
        i = cuda.grid(1)
        if i < src.size:
            dst[i] = src[i]

    @cuda.jit
    def trunc16(x, out):
        i = cuda.grid(1)
        if i < x.size:
            out[i] = np.uint16(x[i] >> np.uint32(16))

    return copy_words, trunc16


def cuda_rows():
    """As ``cpu_rows``, but ``setup(dx)`` gets a Numba device array float32[n] (a prefix of
    one uploaded buffer). Results go to preallocated device arrays; nothing crosses PCIe."""
    import srround

    copy_words, trunc16 = _cuda_reference_kernels()
    threads = 256

    def numba_sync(_):
        cuda.synchronize()

    def launch(kernel, n, *args):
        blocks = (n + threads - 1) // threads
        return lambda: kernel[blocks, threads](*args)

    def floor(dx):
        # the same 6n bytes as the rounding kernels: 3n bytes read, 3n written, as uint64
        words = dx.size * 3 // 8
        src = dx.view(np.uint32).view(np.uint64)[:words]
        dst = cuda.device_array(words, np.uint64)
        return launch(copy_words, words, src, dst), numba_sync

    def trunc(dx):
        out = cuda.device_array(dx.size, np.uint16)
        return launch(trunc16, dx.size, dx.view(np.uint32), out), numba_sync

    def sr(dtype):
        def setup(dx):
            out = cuda.device_array(dx.size, np.uint16)  # uint16 bits + dtype= is accepted
            return (
                lambda: srround.stochastic_round(dx, dtype=dtype, seed=SEED, out=out)
            ), numba_sync

        return setup

    def rne(dx):
        out = cuda.device_array(dx.size, np.uint16)
        return (lambda: srround.round_nearest(dx, dtype="bfloat16", out=out)), numba_sync

    def widen(dx):
        narrow = srround.round_nearest(dx, dtype="bfloat16")
        out = cuda.device_array(dx.size, np.float32)
        return (lambda: srround.to_float32(narrow, out=out)), numba_sync

    def add(dx):
        w = srround.round_nearest(dx, dtype="bfloat16")
        return (lambda: srround.stochastic_add(w, dx, alpha=-1e-3, seed=SEED)), numba_sync

    def torch_cuda():
        torch = torch_module()
        if not torch.cuda.is_available():
            raise Unavailable("torch has no CUDA")
        return torch

    def torch_view(dx):
        torch = torch_cuda()
        return torch, torch.as_tensor(dx, device="cuda")  # zero-copy (__cuda_array_interface__)

    def torch_sync(_):
        torch_module().cuda.synchronize()

    def torch_copy_bytes(dx):
        torch, t = torch_view(dx)
        src = t.view(torch.uint8)[: 3 * dx.size]
        dst = torch.empty_like(src)
        return (lambda: dst.copy_(src)), torch_sync

    def cupy_copy_bytes(dx):
        try:
            import cupy
        except ImportError:
            raise Unavailable("cupy not installed") from None
        src = cupy.asarray(dx).view(cupy.uint8)[: 3 * dx.size]
        dst = cupy.empty_like(src)
        return (lambda: cupy.copyto(dst, src)), (lambda _: cupy.cuda.Device().synchronize())

    def torch_to(dx):
        torch, t = torch_view(dx)
        return (lambda: t.to(torch.bfloat16)), torch_sync

    def torch_copy(dx):
        torch, t = torch_view(dx)
        out = torch.empty(dx.size, dtype=torch.bfloat16, device="cuda")
        return (lambda: out.copy_(t)), torch_sync

    def torchao_eager(dx):
        fn, _ = torchao_sr()
        _, t = torch_view(dx)
        return (lambda: fn(t)), torch_sync

    def torchao_compiled(dx):
        fn, _ = torchao_sr_compiled()
        _, t = torch_view(dx)
        return (lambda: fn(t)), torch_sync

    def jax_sr(dx):
        jax, fn = jax_sr_fn()
        try:
            dev = jax.devices("gpu")[0]
        except RuntimeError:
            raise Unavailable("jax has no GPU backend") from None
        xj = jax.device_put(dx.copy_to_host(), dev)
        key = jax.device_put(jax.random.key(SEED), dev)
        return (lambda: fn(key, xj)), (lambda r: r.block_until_ready())

    return [
        ("floor: numba.cuda copy 3n B", "copy", floor),
        ("torch copy_ 3n B", "copy", torch_copy_bytes),
        ("cupy copyto 3n B", "copy", cupy_copy_bytes),
        ("numba.cuda x>>16", "trunc", trunc),
        *_library_rows(
            sr, rne, widen, add, torch_to, torch_copy, torchao_eager, torchao_compiled, jax_sr
        ),
    ]


# --------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------


def run_device(
    device: str, sizes: list[int], cell_time: float, notes: list[str], retries: int = 1
) -> list[dict]:
    rng = np.random.default_rng(0)
    x_host = rng.standard_normal(max(sizes), dtype=np.float32)
    if device == "cpu":
        rows, batch_time = cpu_rows(), 0.0
        full = x_host
    else:
        from srround._numba_cuda_compat import import_numba_cuda

        rows, batch_time = cuda_rows(), 0.02
        full = import_numba_cuda().to_device(x_host)

    try:
        from tqdm import tqdm

        progress = tqdm(
            total=len(rows) * len(sizes), desc=device, leave=False, disable=None, file=sys.stderr
        )
    except ImportError:
        progress = None

    results, skipped = [], set()
    for n in sizes:
        x = full[:n]
        floor_gbps = None
        for label, op, setup in rows:
            if progress is not None:
                progress.set_postfix_str(f"{size_label(n)} {label} {op}"[:48])
            if (label, op) not in skipped:
                try:
                    fn, sync = setup(x)
                    m = measure(fn, sync, cell_time=cell_time, batch_time=batch_time)
                    for _ in range(retries if device == "cpu" else 0):
                        if (m["others_busy_cpus"] or 0) <= BUSY_MARK or m["median_s"] * m[
                            "samples"
                        ] > 1.0:  # quiet, or too slow
                            break
                        time.sleep(0.5)  # someone else is using the cores: try again, keep the
                        again = measure(fn, sync, cell_time=cell_time)  # quietest attempt
                        m = min(m, again, key=lambda a: a["others_busy_cpus"])
                except Unavailable as exc:
                    skipped.add((label, op))
                    notes.append(f"[{device}] skipped {label} ({op}): {exc}")
                except Exception as exc:  # noqa: BLE001 - report, keep benchmarking
                    skipped.add((label, op))
                    notes.append(
                        f"[{device}] FAILED {label} ({op}) at n={n}: "
                        f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                    )
                else:
                    gbps = BYTES_PER_ELEMENT * n / m["median_s"] / 1e9
                    floor_gbps = floor_gbps or gbps  # the first row is the floor
                    results.append(
                        {
                            "device": device,
                            "method": label,
                            "op": op,
                            "n": n,
                            **m,
                            "bytes_per_element": BYTES_PER_ELEMENT,
                            "gbps": gbps,
                            "frac_of_floor": gbps / floor_gbps,
                            "ns_per_element": m["median_s"] / n * 1e9,
                        }
                    )
                fn = sync = None  # free this size's buffers before the next row
            if progress is not None:
                progress.update()
    if progress is not None:
        progress.close()
    return results


def run_lowbit(device: str, n: int, cell_time: float, notes: list[str]) -> list[dict]:
    """``bench_lowbit.py``'s rows (fp8/fp4 rounding, block quantization, their anchors) at
    ``n`` elements, each against the first row (their floor), in this run's result format."""
    from bench_lowbit import rows as lowbit_rows

    try:
        rows = lowbit_rows(device, n)
    except Unavailable as exc:
        notes.append(f"[{device}] skipped the low-bit rows: {exc}")
        return []
    results, floor_gbps = [], None
    for name, written, fn, sync in rows:
        try:
            m = measure(fn, sync, cell_time=cell_time, batch_time=0.02 if sync else 0.0)
        except Exception as exc:  # noqa: BLE001 - report, keep benchmarking
            notes.append(f"[{device}] FAILED {name}: {type(exc).__name__}: {exc}"[:200])
            continue
        gbps = (4 + written) * n / m["median_s"] / 1e9
        floor_gbps = floor_gbps or gbps
        results.append(
            {
                "device": device,
                "method": name,
                "op": "below bf16",
                "n": n,
                **m,
                "bytes_per_element": 4 + written,
                "gbps": gbps,
                "frac_of_floor": gbps / floor_gbps,
                "ns_per_element": m["median_s"] / n * 1e9,
            }
        )
    return results


def print_lowbit(results: list[dict], device: str) -> None:
    rows = [r for r in results if r["device"] == device and r["op"] == "below bf16"]
    if not rows:
        return
    print(f"\n[{device}] below bf16, n = {size_label(rows[0]['n'])} (GB/s at B/elem, % of floor)")
    for r in rows:
        star = "*" if (r["others_busy_cpus"] or 0) > BUSY_MARK else ""
        print(
            f"  {r['method']:44s} {r['bytes_per_element']:6.3g} B {r['gbps']:7.2f} GB/s"
            f" {100 * r['frac_of_floor']:5.0f} % {r['median_s'] * 1e3:8.2f} ms{star}"
        )


COLUMNS = [
    ("device", "device", ""),
    ("method", "method", ""),
    ("op", "op", ""),
    ("n", "n", ",d"),
    ("bytes_per_element", "B/elem", ".3g"),
    ("gbps", "GB/s", ".2f"),
    ("frac_of_floor", "% floor", "%"),
    ("median_s", "ms/call", "ms"),
    ("others_busy_cpus", "others busy CPUs", ".2f"),
]


def size_label(n: int) -> str:
    return f"2^{n.bit_length() - 1}" if n & (n - 1) == 0 else str(n)


def print_table(results: list[dict], device: str) -> None:
    rows = [r for r in results if r["device"] == device]
    if not rows:
        return
    sizes = sorted({r["n"] for r in rows})
    keys = list(dict.fromkeys((r["method"], r["op"]) for r in rows))
    cell = {(r["method"], r["op"], r["n"]): r for r in rows}
    w_m = max(len(k[0]) for k in keys)
    w_o = max(len("op"), *(len(k[1]) for k in keys))
    big = sizes[-1]
    head = (
        f"{'method':<{w_m}}  {'op':<{w_o}}"
        + "".join(f"  {'n=' + size_label(n):>17}" for n in sizes)
        + f"  {'ms/call @' + size_label(big):>14}"
    )
    print(f"\n== {device.upper()}: GB/s (6 B/element) and % of the same-size floor ==")
    print(head)
    print("-" * len(head))
    marked = False
    for method, op in keys:
        line = f"{method:<{w_m}}  {op:<{w_o}}"
        for n in sizes:
            r = cell.get((method, op, n))
            if r is None:
                line += f"  {'-':>17}"
                continue
            busy = device == "cpu" and (r.get("others_busy_cpus") or 0) > BUSY_MARK
            marked = marked or busy
            line += f"  {r['gbps']:8.2f} {100 * r['frac_of_floor']:5.0f}%{'*' if busy else ' '}"
        r = cell.get((method, op, big))
        print(line + (f"  {r['median_s'] * 1e3:14.3f}" if r else f"  {'-':>14}"))
    if marked:
        print(
            f"* other processes used more than {BUSY_MARK} CPU while this cell was timed "
            "(others_busy_cpus in the JSON): treat it as noisy"
        )


LATENCY_SNIPPET = r"""
import json, time
import numpy as np
t0 = time.perf_counter()
import srround
t1 = time.perf_counter()
x = np.linspace(-3, 3, 4096, dtype=np.float32)
t2 = time.perf_counter()
srround.stochastic_round(x, seed=0)
t3 = time.perf_counter()
srround.stochastic_round(x, seed=1)
t4 = time.perf_counter()
stats = getattr(srround._cpu.stochastic_round, "stats", None)  # numba's cache bookkeeping
hits = None if stats is None else sum(stats.cache_hits.values())
print(json.dumps({"import_s": t1 - t0, "first_call_s": t3 - t2, "second_call_s": t4 - t3,
                  "cache_hits": hits}))
"""


def first_call_latency(notes: list[str]) -> dict | None:
    """Cold (empty NUMBA_CACHE_DIR) vs warm (same dir, second process) import + first call."""
    import srround

    out = {}
    src_before = source_fingerprint(srround)["kernel_src_sha256"]
    with tempfile.TemporaryDirectory(prefix="srround-numba-cache-") as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache}
        for case in ("cold", "warm"):
            t0 = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, "-c", LATENCY_SNIPPET],
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
            )
            wall = time.perf_counter() - t0
            if proc.returncode != 0:
                notes.append(f"latency {case} subprocess failed: {proc.stderr.strip()[-300:]}")
                return None
            out[case] = {**json.loads(proc.stdout.strip().splitlines()[-1]), "process_wall_s": wall}
    if source_fingerprint(srround)["kernel_src_sha256"] != src_before:
        notes.append(
            "srround's kernel sources changed on disk during the latency runs: the warm"
            " process may have recompiled (see its cache hits)"
        )
    if out["warm"]["cache_hits"] == 0:
        notes.append("the warm process found no cached kernel and compiled again")
    return out


def print_latency(lat: dict) -> None:
    print("\n== first-call latency of srround.stochastic_round (fresh process, 4096 elements) ==")
    print(
        f"{'case':<34}{'import srround':>16}{'first call':>14}{'second call':>14}"
        f"{'process wall':>15}{'cache hits':>12}"
    )
    for case, desc in (
        ("cold", "cold (empty NUMBA_CACHE_DIR)"),
        ("warm", "warm (same cache dir, new proc)"),
    ):
        r = lat[case]
        print(
            f"{desc:<34}{r['import_s'] * 1e3:13.0f} ms{r['first_call_s'] * 1e3:11.0f} ms"
            f"{r['second_call_s'] * 1e3:11.2f} ms{r['process_wall_s']:13.2f} s"
            f"{'?' if r['cache_hits'] is None else r['cache_hits']:>12}"
        )


def source_fingerprint(srround) -> dict:
    """Which kernels were measured: the git commit (read-only lookup) and a hash of the kernel
    sources as they are on disk (they may differ from the commit while being worked on)."""
    import hashlib

    pkg = os.path.dirname(srround.__file__)
    h = hashlib.sha256()
    for name in ("_cpu.py", "_cuda.py", "_elements.py", "_scalar.py", "_rng.py"):
        with contextlib.suppress(OSError), open(os.path.join(pkg, name), "rb") as f:
            h.update(f.read())
    out = {"kernel_src_sha256": h.hexdigest()[:12]}
    with contextlib.suppress(Exception):
        out["git_head"] = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                cwd=pkg,
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
            or None
        )
    return out


def parse_size(token: str) -> int:
    """'24', '2^24', '2**24' -> 2**24 (a bare number below 64 is an exponent); '5000000' -> n."""
    t = token.replace("**", "^")
    if t.startswith("2^"):
        return 1 << int(t[2:])
    v = int(float(t))
    return 1 << v if v < 64 else v


def main(argv=None) -> int:
    p = bench_parser(
        __doc__,
        "CPU 2^20..2^22, GPU 2^20..2^24, 0.1 s per cell",
        "'all' = CPU, plus CUDA when numba.cuda.is_available()",
    )
    p.add_argument(
        "--sizes",
        nargs="+",
        type=parse_size,
        metavar="N",
        help="element counts for every device: 24, 2^24 or 16777216",
    )
    p.add_argument(
        "--cell-time",
        type=float,
        default=None,
        help="seconds of timed calls per cell (default 0.2, 0.1 with --quick)",
    )
    p.add_argument(
        "--retries",
        type=int,
        default=1,
        help="re-time a CPU cell up to this many times while other processes use more"
        f" than {BUSY_MARK} CPU during it, keeping the quietest attempt (default 1)",
    )
    p.add_argument("--no-latency", action="store_true", help="skip the cold/warm subprocesses")
    p.add_argument(
        "--lowbit-log2n",
        type=int,
        default=22,
        help="size (log2) of the below-bf16 rows (fp8/fp4, block formats); 0 skips them",
    )
    add_json_argument(p)
    args = p.parse_args(argv)
    started = utc_now()
    cell_time = args.cell_time or (0.1 if args.quick else 0.2)

    import numba

    import srround

    devices = ["cpu"] if args.device in ("cpu", "all") else []
    notes: list[str] = []
    if args.device in ("cuda", "all"):
        from srround._numba_cuda_compat import import_numba_cuda

        cuda = import_numba_cuda()
        if cuda.is_available() and not numba.config.ENABLE_CUDASIM:
            devices.append("cuda")
            gpu_name = cuda.get_current_device().name
            gpu_name = gpu_name.decode() if isinstance(gpu_name, bytes) else gpu_name
        else:
            notes.append(
                "CUDA: numba.cuda.is_available() is False (or the simulator is on); "
                "GPU rows skipped"
            )

    sizes_for = {
        "cpu": args.sizes or [1 << k for k in range(20, (22 if args.quick else 26) + 1)],
        "cuda": args.sizes or [1 << k for k in range(20, (24 if args.quick else 28) + 1)],
    }

    meta = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "numba": numba.__version__,
        "numba_threads": numba.get_num_threads(),
        "numpy": np.__version__,
        "srround": srround.__version__,
        "cell_time_s": cell_time,
        "quick": args.quick,
        "bytes_per_element": BYTES_PER_ELEMENT,
        "others_busy_cpus_at_start": busy_cpus(),
    }
    meta.update(source_fingerprint(srround))
    with contextlib.suppress(Exception):
        torch = torch_module()
        meta["torch"], meta["torch_threads"] = torch.__version__, torch.get_num_threads()
    with contextlib.suppress(Exception):
        meta["torchao"] = _quiet_import("torchao").__version__
    with contextlib.suppress(Exception):
        meta["jax"] = _quiet_import("jax").__version__
    if "cuda" in devices:
        meta["gpu"] = gpu_name
    print("srround rounding benchmark | " + ", ".join(f"{k}={v}" for k, v in meta.items()))

    t_start = time.perf_counter()
    results = []
    for device in devices:
        results += run_device(device, sizes_for[device], cell_time, notes, args.retries)
        print_table(results, device)
        if args.lowbit_log2n:
            results += run_lowbit(device, 1 << args.lowbit_log2n, cell_time, notes)
            print_lowbit(results, device)

    meta["others_busy_cpus_at_end"] = busy = busy_cpus()
    if busy is not None and max(busy, meta["others_busy_cpus_at_start"]) > 0.25:
        notes.append(
            f"other processes kept {meta['others_busy_cpus_at_start']} CPUs busy before"
            f" the run and {busy} after it (of {os.cpu_count()}): they share the cores"
            " and memory bandwidth, so CPU numbers are noisy - rerun on a quiet machine"
        )
    latency = None if args.no_latency else first_call_latency(notes)
    if latency:
        print_latency(latency)
    print_notes(notes, t_start)

    write_json(
        args.json,
        "bench_round",
        results=results,
        columns=COLUMNS,
        baseline="per device and size, the first row is the floor (CPU: a Numba prange"
        " x>>16 truncation; GPU: a numba.cuda word copy of the same bytes); frac_of_floor"
        " divides by it; the 'below bf16' rows by their own first row (CPU: a Numba prange"
        " x>>24, uint32 -> uint8; GPU: a torch copy_ of 5 B per element)",
        notes=notes,
        meta=meta,
        gpu=meta.get("gpu"),
        started=started,
        latency=latency,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
