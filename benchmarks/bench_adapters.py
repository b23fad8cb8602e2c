#!/usr/bin/env python
"""Framework adapters: throughput and per-call overhead against srround's NumPy path.

Usage::

    python benchmarks/bench_adapters.py               # sizes 2^20 and 2^22, plus 1024 elements
    python benchmarks/bench_adapters.py --sizes 20 24 --cell-time 0.5

JAX section (CPU, or whatever ``jax.default_backend()`` is): ``srround.adapters.jax`` with
``impl="native"`` (jax.lax integer ops) and ``impl="callback"`` (``jax.pure_callback`` into the
Numba kernels), both under ``jax.jit`` with the seed passed as a PRNG key argument, timed with
``block_until_ready``; the baseline is ``srround.stochastic_round`` / ``stochastic_add`` on NumPy
arrays of the same data (preallocated ``out=`` for rounding; in place for the add). Rows:
``stochastic_round`` (fp32 -> bf16) and ``stochastic_add`` (bf16 w, fp32 u, alpha=0.1). Cells:
median milliseconds per call and ``x NumPy`` (time / NumPy path time of the same size, same run;
below 1 is faster). The ``1024`` column is the per-call overhead regime (microseconds).

Only compare rows of one run; numbers depend on cores and on what else runs on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def _time(fn, cell_time: float) -> float:
    """Median seconds per call of ``fn`` (warmed up first)."""
    for _ in range(3):
        fn()
    samples = []
    start = time.perf_counter()
    while len(samples) < 5 or time.perf_counter() - start < cell_time:
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _jax_rows(sizes, cell_time):
    import jax
    import jax.numpy as jnp
    import ml_dtypes

    import srround
    from srround.adapters import jax as sj

    key = jax.random.key(7)
    rows = {}
    for n in sizes:
        rng = np.random.default_rng(0)
        x = rng.standard_normal(n).astype(np.float32)
        u = (rng.standard_normal(n) * 1e-3).astype(np.float32)
        w = x.astype(ml_dtypes.bfloat16)
        xj, uj, wj = jnp.asarray(x), jnp.asarray(u), jnp.asarray(w)
        out = np.empty(n, ml_dtypes.bfloat16)
        w_np = w.copy()

        cells = {
            ("stochastic_round", "NumPy path"): lambda: srround.stochastic_round(
                x, seed=7, out=out),
            ("stochastic_add", "NumPy path"): lambda: srround.stochastic_add(
                w_np, u, alpha=0.1, seed=7),
        }
        for impl in sj.IMPLS:
            sr = jax.jit(lambda a, k, impl=impl: sj.stochastic_round(a, seed=k, impl=impl))
            add = jax.jit(lambda a, b, k, impl=impl: sj.stochastic_add(
                a, b, alpha=0.1, seed=k, impl=impl))
            cells[("stochastic_round", f"jax {impl} (jit)")] = (
                lambda sr=sr: sr(xj, key).block_until_ready())
            cells[("stochastic_add", f"jax {impl} (jit)")] = (
                lambda add=add: add(wj, uj, key).block_until_ready())
        for (op, name), fn in cells.items():
            rows.setdefault((op, name), {})[n] = _time(fn, cell_time)
    return rows, jax.default_backend()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[20, 22],
                        help="log2 of the array sizes (default: 20 22)")
    parser.add_argument("--cell-time", type=float, default=0.3, help="seconds per cell")
    args = parser.parse_args(argv)
    sizes = [1024] + [1 << s for s in args.sizes]
    try:
        rows, backend = _jax_rows(sizes, args.cell_time)
    except ImportError as exc:
        print(f"JAX section skipped: {exc}")
        return
    import os

    print(f"## JAX adapter (backend: {backend}, {os.cpu_count()} CPUs)")
    head = f"{'op':<17} {'implementation':<22}" + "".join(
        f" {('n=1024 (us)' if n == 1024 else f'n=2^{n.bit_length() - 1} (ms)'):>22}"
        for n in sizes)
    print(head)
    print("-" * len(head))
    ordered = sorted(rows.items(), key=lambda item: item[0][0] != "stochastic_round")
    for (op, name), cells in ordered:
        base = rows[(op, "NumPy path")]
        line = f"{op:<17} {name:<22}"
        for n in sizes:
            t = cells[n]
            value = t * 1e6 if n == 1024 else t * 1e3
            line += f" {value:>10.2f} {t / base[n]:>6.2f}x NP"
        print(line)


if __name__ == "__main__":
    main()
