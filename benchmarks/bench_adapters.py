#!/usr/bin/env python
"""Framework adapters: per-call overhead and large-array throughput against the core kernels on
raw buffers, for every framework available here.

Usage::

    python benchmarks/bench_adapters.py                    # CPU; the GPU too if present
    python benchmarks/bench_adapters.py --device cpu --large 20 --json out.json
    python benchmarks/bench_adapters.py --quick            # smoke run, seconds

Each row calls one srround function through one framework's arrays; the baseline row of its
device ("core, raw buffers") calls the backend kernel itself (``srround._cpu`` /
``srround._cuda``) on the same bytes as NumPy ``uint32``/``uint16`` arrays or Numba device
arrays - no adapter, no validation, no seed handling. Ops: ``stochastic_round`` (fp32 -> bf16,
into a preallocated ``out=`` where the framework has one; JAX returns a new array) and
``stochastic_add`` (bf16 ``w`` in place, fp32 ``u``; JAX returns a new array). JAX runs under
``jax.jit`` with the seed passed as a PRNG key argument; ``jax user SR`` is the
``jax.random.bits`` cast users write by hand (stochastic_round only, no special-value care).

Columns: ``us@1024``: median microseconds per call on 1024 elements (GPU: calls issued back to
back, one synchronisation per batch - the host cost when it exceeds the kernel's);
``+us``: that minus the core's (the adapter's overhead; targets <= 10 us on CPU, <= 30 us on
GPU); ``ms@large``, ``GB/s`` at 6 bytes per element (4 read + 2 written; stochastic_add: 8), and
``x core``: throughput relative to the core's (target >= 0.95). The device's copy bandwidth of
the same bytes (CPU: a Numba prange word copy; GPU: a Numba device copy) is printed with each
table. Compare rows of one run only.
"""

from __future__ import annotations

import os
import sys

import ml_dtypes
import numpy as np
from _harness import Unavailable, add_json_argument, bench_parser, measure, utc_now, write_json
from _harness import quiet_import as _quiet_import
from bench_round import _cuda_reference_kernels, jax_sr_fn

SEED = 7
BF16 = np.dtype(ml_dtypes.bfloat16)
BYTES = {"stochastic_round": 6, "stochastic_add": 8}
# bf16's format arguments of the backend kernels, as the API passes them (mantissa bits,
# exponent bits, saturate, specials): calls with other argument types compile other versions
_BF16_ARGS = (7, 8, False, 0)


def _on_gpu(cuda, arrays):
    """The arrays on the GPU; bf16 ones travel as uint16 (NumPy 2.5 refuses ml_dtypes' types
    in the buffer protocol that ``cuda.to_device`` copies through)."""
    return [
        cuda.to_device(a.view(np.uint16)).view(BF16) if a.dtype == BF16 else cuda.to_device(a)
        for a in arrays
    ]


def _data(n: int):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(n).astype(np.float32)
    return x, (x * np.float32(1e-3)), x.astype(BF16)


# --------------------------------------------------------------------------------------------
# rows: name -> setup(n) -> {op: (call, sync)}
# --------------------------------------------------------------------------------------------


def _core_cpu(n):
    from srround import _cpu
    from srround._rng import split_seed

    x, u, w = _data(n)
    k0, k1 = split_seed(SEED)
    # the inputs read-only, as the API passes them: the kernels users run, no second compile
    xb, ub = _cpu.read_only(x.view(np.uint32)), _cpu.read_only(u.view(np.uint32))
    wb, out = w.view(np.uint16), np.empty(n, np.uint16)
    return {
        "stochastic_round": (
            lambda: _cpu.stochastic_round(xb, out, np.float32(1.0), k0, k1, 0, *_BF16_ARGS),
            None,
        ),
        "stochastic_add": (
            lambda: _cpu.stochastic_add(ub, wb, np.float32(1.0), k0, k1, 0, *_BF16_ARGS),
            None,
        ),
    }


def _api_calls(x, u, w, out, sync=None):
    import srround

    return {
        "stochastic_round": (lambda: srround.stochastic_round(x, seed=SEED, out=out), sync),
        "stochastic_add": (lambda: srround.stochastic_add(w, u, seed=SEED), sync),
    }


def _numpy(n):
    x, u, w = _data(n)
    return _api_calls(x, u, w, np.empty(n, BF16))


def _torch(device):
    def setup(n):
        try:
            torch = _quiet_import("torch")
        except ImportError as exc:
            raise Unavailable(f"torch not importable ({exc})") from None
        if device == "cuda" and not torch.cuda.is_available():
            raise Unavailable("torch has no CUDA device")
        x, u, w = _data(n)
        wt = torch.from_numpy(w.view(np.int16)).view(torch.bfloat16).to(device)
        sync = torch.cuda.synchronize if device == "cuda" else None
        return _api_calls(
            torch.from_numpy(x).to(device),
            torch.from_numpy(u).to(device),
            wt,
            torch.empty(n, dtype=torch.bfloat16, device=device),
            sync and (lambda _: sync()),
        )

    return setup


def _jax(impl, platform):
    def setup(n):
        try:
            jax = _quiet_import("jax")
        except ImportError as exc:
            raise Unavailable(f"jax not importable ({exc})") from None
        from srround.adapters import jax as sj

        try:
            device = jax.devices(platform)[0]
        except RuntimeError:
            raise Unavailable(f"JAX has no {platform} device") from None
        x, u, w = (jax.device_put(a, device) for a in _data(n))
        key = jax.random.key(SEED)
        sr = jax.jit(lambda a, k: sj.stochastic_round(a, seed=k, impl=impl))
        add = jax.jit(lambda a, b, k: sj.stochastic_add(a, b, seed=k, impl=impl))
        ready = lambda r: r.block_until_ready()  # noqa: E731
        return {
            "stochastic_round": (lambda: sr(x, key), ready),
            "stochastic_add": (lambda: add(w, u, key), ready),
        }

    return setup


def _jax_user_sr(platform):
    def setup(n):
        jax, jax_sr = jax_sr_fn()
        try:
            device = jax.devices(platform)[0]
        except RuntimeError:
            raise Unavailable(f"JAX has no {platform} device") from None
        x = jax.device_put(_data(n)[0], device)
        key = jax.random.key(SEED)
        return {"stochastic_round": (lambda: jax_sr(key, x), lambda r: r.block_until_ready())}

    return setup


def _cuda():
    from srround._numba_cuda_compat import import_numba_cuda

    cuda = import_numba_cuda()
    if not cuda.is_available():
        raise Unavailable("no CUDA device")
    return cuda


def _core_cuda(n):
    from srround import _cuda as backend
    from srround._rng import split_seed

    cuda = _cuda()
    x, u, w = _on_gpu(cuda, _data(n))
    xb, ub, wb = x.view(np.uint32), u.view(np.uint32), w.view(np.uint16)
    out = cuda.device_array(n, np.uint16)
    k0, k1 = split_seed(SEED)
    stream = cuda.default_stream()
    sync = lambda _: cuda.synchronize()  # noqa: E731
    return {
        "stochastic_round": (
            lambda: backend.stochastic_round(
                xb, out, np.float32(1.0), k0, k1, 0, *_BF16_ARGS, stream=stream
            ),
            sync,
        ),
        "stochastic_add": (
            lambda: backend.stochastic_add(
                ub, wb, np.float32(1.0), k0, k1, 0, *_BF16_ARGS, stream=stream
            ),
            sync,
        ),
    }


def _numba_cuda(n):
    cuda = _cuda()
    x, u, w = _on_gpu(cuda, _data(n))
    return _api_calls(x, u, w, cuda.device_array(n, BF16), lambda _: cuda.synchronize())


def _cupy(n):
    try:
        cp = _quiet_import("cupy")
    except ImportError as exc:
        raise Unavailable(f"cupy not importable ({exc})") from None
    from srround._formats import get_format
    from srround.adapters.cupy import _result_dtype

    bf16 = _result_dtype(get_format(BF16))
    if bf16 == np.uint16:
        raise Unavailable("this CuPy has no bfloat16 dtype")
    x, u, w = _data(n)
    # bf16 travels as uint16 (NumPy 2.5 refuses ml_dtypes' types in the buffer protocol)
    x, u, w = cp.asarray(x), cp.asarray(u), cp.asarray(w.view(np.uint16)).view(bf16)
    out = cp.empty(n, bf16)
    return _api_calls(x, u, w, out, lambda _: cp.cuda.get_current_stream().synchronize())


ROWS = {
    "cpu": [
        ("core, raw buffers", _core_cpu),
        ("numpy", _numpy),
        ("torch cpu", _torch("cpu")),
        ("jax native (jit)", _jax("native", "cpu")),
        ("jax callback (jit)", _jax("callback", "cpu")),
        ("jax user SR (jit)", _jax_user_sr("cpu")),
    ],
    "cuda": [
        ("core, raw buffers", _core_cuda),
        ("numba device arrays", _numba_cuda),
        ("torch cuda", _torch("cuda")),
        ("cupy", _cupy),
        ("jax native (jit)", _jax("native", "gpu")),
        ("jax user SR (jit)", _jax_user_sr("gpu")),
    ],
}


def _copy_floor(device: str, n: int, cell_time: float) -> float:
    """Seconds to copy the 6n bytes of one rounding call (3n read, 3n written) on ``device``."""
    words = n * 3 // 8
    if device == "cpu":
        import numba

        @numba.njit(parallel=True, cache=False)
        def copy(src, dst):
            for i in numba.prange(src.size):
                dst[i] = src[i]

        src, dst = np.ones(words, np.uint64), np.empty(words, np.uint64)
        return measure(lambda: copy(src, dst), cell_time=cell_time)["median_s"]
    cuda = _cuda()
    copy_words, _ = _cuda_reference_kernels()  # bench_round's GPU floor kernel
    src, dst = cuda.to_device(np.ones(words, np.uint64)), cuda.device_array(words, np.uint64)
    blocks = (words + 255) // 256
    return measure(
        lambda: copy_words[blocks, 256](src, dst),
        lambda _: cuda.synchronize(),
        cell_time=cell_time,
        batch_time=0.05,
    )["median_s"]


def run_device(device: str, large: int, cell_time: float) -> list[dict]:
    results = []
    batch = 0.05 if device == "cuda" else 0.0
    for name, setup in ROWS[device]:
        for n in (1024, large):
            try:
                calls = setup(n)
            except Unavailable as exc:
                print(f"  [{device}] {name}: skipped ({exc})", file=sys.stderr)
                break
            for op, (call, sync) in calls.items():
                t = measure(call, sync, cell_time=cell_time, batch_time=batch)["median_s"]
                results.append({"device": device, "row": name, "op": op, "n": n, "s": t})
    return results


def print_table(results: list[dict], device: str, large: int, floor_s: float) -> None:
    rows = [r for r in results if r["device"] == device]
    if not rows:
        return
    cell = {(r["row"], r["op"], r["n"]): r["s"] for r in rows}
    floor_gbs = 6 * large / floor_s / 1e9
    print(
        f"\n## {device} (n = 1024 and 2^{large.bit_length() - 1}; copy of the same bytes:"
        f" {floor_gbs:.1f} GB/s; {os.cpu_count()} CPUs)"
    )
    head = (
        f"{'op':<17} {'row':<22} {'us@1024':>9} {'+us':>7} {'ms@large':>9} {'GB/s':>7}"
        f" {'x core':>7} {'x copy':>7}"
    )
    print(head)
    print("-" * len(head))
    for op in BYTES:
        base_small = cell.get(("core, raw buffers", op, 1024))
        base_large = cell.get(("core, raw buffers", op, large))
        for name, _ in ROWS[device]:
            small, big = cell.get((name, op, 1024)), cell.get((name, op, large))
            if small is None or big is None:
                continue
            gbs = BYTES[op] * large / big / 1e9
            extra = (small - base_small) * 1e6 if base_small else float("nan")
            ratio = base_large / big if base_large else float("nan")
            print(
                f"{op:<17} {name:<22} {small * 1e6:>9.1f} {extra:>7.1f} {big * 1e3:>9.3f}"
                f" {gbs:>7.1f} {ratio:>7.2f} {gbs / floor_gbs:>7.2f}"
            )


def main(argv=None) -> None:
    parser = bench_parser(__doc__, "smoke run: large size 2^20 (CPU) / 2^24 (GPU), 0.05 s per cell")
    parser.add_argument(
        "--large",
        type=int,
        default=None,
        help="log2 of the large size (default: 24 on CPU, 26 on GPU)",
    )
    parser.add_argument("--cell-time", type=float, default=0.3, help="seconds per cell")
    add_json_argument(parser)
    args = parser.parse_args(argv)
    started = utc_now()
    devices = ["cpu", "cuda"] if args.device == "all" else [args.device]
    if args.quick:
        args.cell_time = min(args.cell_time, 0.05)
    everything = []
    for device in devices:
        default = (24 if args.quick else 26) if device == "cuda" else (20 if args.quick else 24)
        large = 1 << (args.large or default)
        try:
            floor_s = _copy_floor(device, large, args.cell_time)
        except Unavailable as exc:
            print(f"{device}: skipped ({exc})")
            continue
        results = run_device(device, large, args.cell_time)
        print_table(results, device, large, floor_s)
        everything += results + [{"device": device, "row": "copy", "n": large, "s": floor_s}]
    gpu = None
    if "cuda" in devices and any(r["device"] == "cuda" for r in everything):
        name = getattr(_cuda().get_current_device(), "name", "CUDA simulator")
        gpu = name.decode() if isinstance(name, bytes) else name
    write_json(
        args.json,
        "bench_adapters",
        results=everything,
        columns=[
            ("device", "device", ""),
            ("row", "row", ""),
            ("op", "op", ""),
            ("n", "n", ",d"),
            ("s", "us/call", "us"),
        ],
        baseline="per device and op: 'core, raw buffers' (the backend kernel on raw buffers, no"
        " adapter) and 'copy' (a Numba word copy of the same bytes)",
        meta={"cell_time_s": args.cell_time, "quick": args.quick},
        gpu=gpu,
        started=started,
    )


if __name__ == "__main__":
    main()
