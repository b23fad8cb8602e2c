#!/usr/bin/env python
"""fp8 / fp4 rounding and block quantization: srround against ml_dtypes, torch's casts and
torchao's ``to_mx`` / ``nvfp4_quantize``, in one run; plus the clipping of FLOOR block scales.
``bench_round.py`` runs the same rows (``rows``) as its "below bf16" section.

Usage::

    python benchmarks/bench_lowbit.py                     # CPU, 2^22 elements
    python benchmarks/bench_lowbit.py --log2n 20 --json out.json
    python benchmarks/bench_lowbit.py --device cuda       # torch CUDA tensors (GPU machines)

Throughput is GB/s of useful traffic: 4 B read per element plus the bytes written (1 B per fp8
element, 0.5 B per fp4 element, and the block scales: 1 B per 32 or 16 elements). ``% floor``
divides by a same-run floor: a Numba ``prange`` kernel ``out[i] = x[i] >> 24`` (uint32 ->
uint8, 5 B per element) on the CPU, a torch ``copy_`` of the same bytes on CUDA. Each cell is
the median of calls over about ``--cell-time`` seconds, after a warm-up call (JIT compiles).

The clipping table: ``--blocks`` blocks of standard-normal values (each block scaled by a
random power of ten), rounded to nearest with FLOOR and CEIL scales: the fraction of blocks
whose maximum FLOOR clips, the mean relative error of a clipped maximum, the relative RMS error
of all elements under each scale, and the mean of stochastic rounding of the block maxima
over their true value (FLOOR: biased low; CEIL: 1).
"""

from __future__ import annotations

import argparse
import platform
import sys

import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _harness import (  # noqa: E402
    Unavailable,
    add_json_argument,
    measure,
    utc_now,
    write_json,
)
from _harness import quiet_import as _quiet_import  # noqa: E402

import srround  # noqa: E402


def _floor_cpu():
    from numba import njit, prange

    @njit(parallel=True, cache=True)
    def truncate(x, out):
        for i in prange(x.size):
            out[i] = x[i] >> 24

    return truncate


def rows(device, n):
    """(name, bytes written per element, callable, sync) of every row."""
    rng = np.random.default_rng(0)
    x_np = (rng.standard_normal(n) * 50).astype(np.float32)
    x2_np = x_np.reshape(-1, 512)
    out = []
    torch = None
    try:
        torch = _quiet_import("torch")
    except Unavailable:
        pass
    sync = None
    if device == "cuda":
        if torch is None or not torch.cuda.is_available():
            raise Unavailable("CUDA rows need torch with CUDA")
        x = torch.from_numpy(x_np).cuda()
        x2 = x.view(-1, 512)
        sync = lambda r: torch.cuda.synchronize()  # noqa: E731
        dst = torch.empty(n, dtype=torch.uint8, device="cuda")
        src = torch.empty(n * 5 // 2, dtype=torch.uint8, device="cuda")
        out.append(("floor: torch copy_ of 5 B/element", 1, lambda: dst.copy_(src[:n]), sync))
    else:
        x, x2 = x_np, x2_np
        bits, low = x_np.view(np.uint32), np.empty(n, np.uint8)
        trunc = _floor_cpu()
        out.append(("floor: Numba x >> 24", 1, lambda: trunc(bits, low), None))
    for name in ("float8_e4m3fn", "float8_e5m2", "float4_e2m1fn"):
        short = name.split("_", 1)[1]
        out.append(
            (
                f"srround stochastic_round {short}",
                1,
                lambda name=name: srround.stochastic_round(x, dtype=name, seed=1),
                sync,
            )
        )
        out.append(
            (
                f"srround round_nearest {short}",
                1,
                lambda name=name: srround.round_nearest(x, dtype=name),
                sync,
            )
        )
        if device == "cpu":
            import ml_dtypes

            dt = getattr(ml_dtypes, name)
            out.append((f"ml_dtypes astype {short}", 1, lambda dt=dt: x_np.astype(dt), None))
    if torch is not None:
        xt = x if device == "cuda" else torch.from_numpy(x_np)
        for name in ("float8_e4m3fn", "float8_e5m2"):
            dt = getattr(torch, name)
            out.append((f"torch .to({name})", 1, lambda dt=dt: xt.to(dt), sync))
    for fmt in ("mxfp8_e4m3", "mxfp4", "nvfp4"):
        per = (1.0 if fmt.startswith("mxfp8") else 0.5) + (1 / 16 if fmt == "nvfp4" else 1 / 32)
        for rounding in ("nearest", "stochastic"):
            out.append(
                (
                    f"srround quantize_blocks {fmt} {rounding}",
                    per,
                    lambda fmt=fmt, r=rounding: srround.quantize_blocks(
                        x2, fmt, rounding=r, seed=1
                    ),
                    sync,
                )
            )
    try:
        mx = _quiet_import("torchao.prototype.mx_formats.mx_tensor")
        nv = _quiet_import("torchao.prototype.mx_formats.nvfp4_tensor")
    except Unavailable:
        return out
    xt2 = x2 if device == "cuda" else torch.from_numpy(x2_np)
    out.append(
        (
            "torchao to_mx mxfp8_e4m3",
            1 + 1 / 32,
            lambda: mx.to_mx(xt2, torch.float8_e4m3fn, 32),
            sync,
        )
    )
    out.append(
        (
            "torchao to_mx mxfp4",
            0.5 + 1 / 32,
            lambda: mx.to_mx(xt2, torch.float4_e2m1fn_x2, 32),
            sync,
        )
    )

    def nvfp4():
        ts = nv.per_tensor_amax_to_scale(torch.max(torch.abs(xt2)))
        return nv.nvfp4_quantize(xt2, 16, per_tensor_scale=ts)

    out.append(("torchao nvfp4_quantize", 0.5 + 1 / 16, nvfp4, sync))
    return out


def clipping(blocks: int) -> list[dict]:
    rng = np.random.default_rng(1)
    result = []
    for fmt in ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp4"):
        x = rng.standard_normal((blocks, 32)) * 10.0 ** rng.uniform(-3, 3, (blocks, 1))
        x = x.astype(np.float32)
        amax_at = np.abs(x).argmax(axis=1)
        rows_ = np.arange(blocks)
        true_max = x[rows_, amax_at].astype(np.float64)
        cells = {"format": fmt}
        for scale in ("floor", "ceil"):
            y = srround.dequantize_blocks(
                srround.quantize_blocks(x, fmt, rounding="nearest", scale=scale)
            ).astype(np.float64)
            err = y - x
            cells[f"rel_rms_{scale}"] = float(
                np.sqrt((err**2).sum() / (x.astype(np.float64) ** 2).sum())
            )
            if scale == "floor":
                got = y[rows_, amax_at]
                bf = srround._blocks.BLOCK_FORMATS[fmt]
                q = srround.quantize_blocks(x, fmt, rounding="nearest", scale="floor")
                codes = np.asarray(q.scales).view(np.uint8).reshape(-1).astype(np.int64)
                limit = bf.element.max_finite * 2.0 ** (codes - 127)
                clip = np.abs(true_max) > limit
                cells["blocks_clipped"] = float(clip.mean())
                cells["clipped_max_rel_error"] = float(
                    np.mean((np.abs(got[clip]) - np.abs(true_max[clip])) / np.abs(true_max[clip]))
                )
            # stochastic rounding of the block maxima: mean over 64 draws / true value
            draws = []
            for s in range(64):
                yq = srround.dequantize_blocks(
                    srround.quantize_blocks(x, fmt, rounding="stochastic", scale=scale, seed=s)
                )
                draws.append(yq[rows_, amax_at].astype(np.float64))
            cells[f"sr_max_mean_ratio_{scale}"] = float(np.mean(np.mean(draws, axis=0) / true_max))
        result.append(cells)
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--log2n", type=int, default=22)
    p.add_argument("--cell-time", type=float, default=0.3)
    p.add_argument("--blocks", type=int, default=1 << 14)
    add_json_argument(p)
    args = p.parse_args(argv)
    started = utc_now()
    n = 1 << args.log2n
    table = []
    floor_gbs = None
    machine = platform.processor() or platform.machine()
    print(f"# bench_lowbit: {machine}, {args.device}, n = 2^{args.log2n}")
    print(f"{'op':44s} {'GB/s':>7s} {'% floor':>8s} {'ms':>8s}")
    for name, written, fn, sync in rows(args.device, n):
        m = measure(fn, sync, cell_time=args.cell_time, batch_time=0.05 if sync else 0.0)
        gbs = (4 + written) * n / m["median_s"] / 1e9
        if floor_gbs is None:
            floor_gbs = gbs
        pct = 100 * gbs / floor_gbs
        busy = m["others_busy_cpus"]
        star = "*" if busy is not None and busy > 0.3 else ""
        print(f"{name:44s} {gbs:7.2f} {pct:7.0f}% {m['median_s'] * 1e3:8.2f}{star}")
        table.append({"op": name, "gb_s": gbs, "pct_floor": pct, **m})
    clip = clipping(args.blocks) if args.device == "cpu" else []
    if clip:
        print("\n# FLOOR clipping, nearest rounding; SR mean of block maxima / true value")
        keys = list(clip[0])
        print(" ".join(f"{k:>22s}" for k in keys))
        for c in clip:
            print(
                " ".join(
                    f"{c[k]:>22.4g}" if isinstance(c[k], float) else f"{c[k]:>22s}" for k in keys
                )
            )
    write_json(
        args.json,
        "bench_lowbit",
        results=table,
        columns=[
            ["op", "op", ""],
            ["gb_s", "GB/s", ".2f"],
            ["pct_floor", "% floor", ".0f"],
            ["median_s", "ms", "ms"],
        ],
        baseline="the first row: a Numba prange x >> 24 (CPU) / torch copy_ (CUDA), 5 B/element",
        meta={"n": n, "device": args.device},
        started=started,
        clipping=clip,
    )


if __name__ == "__main__":
    main()
