"""The JAX native path on a GPU (issue item: >= 80 % of copy bandwidth for ``stochastic_round``
and the fused step, bits equal to the Numba CUDA kernels). Run by ``gpu_session.sh``::

    python benchmarks/jax_gpu_check.py [--params 268] [--json PATH]

Prints per row the time, the bandwidth and the fraction of a same-bytes copy (``x.astype``
to the output dtype, and ``optax.adamw`` + ``optax.apply_updates`` on the same bf16 params),
then whether the JAX bits equal srround's Numba CUDA kernels on the same inputs."""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from _harness import add_json_argument, utc_now, write_json


def _time(fn, *args, reps=20):
    import jax

    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--params", type=float, default=268.0, help="millions of elements")
    add_json_argument(p)
    args = p.parse_args(argv)
    started = utc_now()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from srround.adapters import jax as sj

    n = int(args.params * 1e6)
    backend = jax.default_backend()
    print(f"jax {jax.__version__} on {backend}: {jax.devices()[0].device_kind}, {n:,} elements")
    key = jax.random.key(0)
    x = jax.random.normal(key, (n,), jnp.float32)
    rows = []

    def row(label, seconds, nbytes, floor):
        r = {
            "method": label,
            "ms": seconds * 1e3,
            "gbps": nbytes / seconds / 1e9,
            "frac_copy": floor / seconds,
        }
        rows.append(r)
        pct = 100 * r["frac_copy"]
        print(f"{label:<44} {r['ms']:9.3f} ms {r['gbps']:8.1f} GB/s {pct:5.0f} % copy")

    cast = _time(jax.jit(lambda a: a.astype(jnp.bfloat16)), x)
    row("copy floor: astype(bf16)", cast, 6 * n, cast)
    sr = jax.jit(lambda a, k: sj.stochastic_round(a, seed=k))
    row("stochastic_round native (bf16)", _time(sr, x, key), 6 * n, cast)
    try:
        import optax

        shapes = [(n // 8 // 4096, 4096)] * 8
        params = [jnp.zeros(s, jnp.bfloat16) + 0.01 for s in shapes]
        grads = [jnp.zeros(s, jnp.float32) + 1e-3 for s in shapes]
        otx = optax.adamw(1e-4, weight_decay=1e-2)
        ostate = otx.init(params)

        def optax_step(p, s, g):
            u, s = otx.update(g, s, p)
            return optax.apply_updates(p, u), s

        base = _time(jax.jit(optax_step), params, ostate, grads, reps=10)
        row("optax.adamw + optax.apply_updates (bf16)", base, 14 * n, base)
        tx = sj.adamw(1e-4, weight_decay=1e-2, seed=0)
        state = tx.init(params)
        row(
            "srround adamw native fused (fp32 states)",
            _time(jax.jit(tx.step), grads, state, params, reps=10),
            22 * n,
            base * 22 / 14,
        )
    except ImportError as exc:
        print(f"optax rows skipped: {exc}")
    same = None
    try:
        from numba import cuda

        import srround

        if cuda.is_available():
            small = np.asarray(x[: 1 << 20])
            ours = np.asarray(sj.stochastic_round(jnp.asarray(small), seed=123, offset=5))
            dev = srround.stochastic_round(cuda.to_device(small), seed=123, offset=5)
            kernel = dev.copy_to_host() if hasattr(dev, "copy_to_host") else np.asarray(dev)
            same = bool(np.array_equal(ours.view(np.uint16), np.asarray(kernel).view(np.uint16)))
            print(f"bits equal to the Numba CUDA kernel: {same}")
    except Exception as exc:  # noqa: BLE001 - a report, not a test
        print(f"bit check skipped: {type(exc).__name__}: {exc}")
    write_json(
        args.json,
        "jax_gpu_check",
        results=rows,
        columns=[
            ["method", "method", ""],
            ["ms", "ms", ".3f"],
            ["gbps", "GB/s", ".1f"],
            ["frac_copy", "of copy", "%"],
        ],
        baseline="astype(bf16) (a copy of the same bytes); optax.adamw + optax.apply_updates",
        notes=[f"bits equal to the Numba CUDA kernel: {same}"],
        meta={"backend": backend, "elements": n, "bits_equal": same},
        gpu=jax.devices()[0].device_kind,
        started=started,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
