"""The JAX native path on a GPU (issue item: >= 80 % of copy bandwidth for ``stochastic_round``
and the fused step, bits equal to the Numba CUDA kernels). Run by ``gpu_session.sh``::

    python benchmarks/jax_gpu_check.py [--params 268] [--json PATH] [--probe DIR]

Prints per row the time, the bandwidth and the fraction of the bandwidth of a copy
(``x.astype(bfloat16)``, 6 B per element), the fused step's bandwidth over that of
``optax.adamw`` + ``optax.apply_updates`` on the same bf16 params, then whether the JAX bits
equal srround's Numba CUDA kernels on the same inputs. ``stochastic_round`` and the fused step
run as shipped: on one GPU they are Pallas kernels (``adapters/jax/_pallas.py``); the rows "XLA
path only" time them without, and the fused step's bits of both are compared
(``_fused_bits_equal``; ``stochastic_round``'s kernels against the Numba CUDA kernels). A
row's bytes are those of its program's input and output arrays (``_traffic``: the step with
float32 gradients and states, 24 B per element), and its time is per call with calls dispatched
back to back, as a training loop issues them (``_time``).

``--probe DIR``: where the XLA path's fused step's time goes. The same step again with one part
of its work swapped for a cheaper stand-in (not srround's bits: a measurement only): no random
bits, float32 conversions for the exact roundings (``_lax.narrow``), float32 arithmetic for the
exact fma/division/square root, several at once. Then ``optax.adamw`` + srround
``apply_updates`` the same way (no random bits, a plain float32 sum for the exact one: what
ships on CUDA, where XLA adds as IEEE does). Each row says whether its parameters' bits equal
the shipped version's (random inputs, subnormal weights and gradients among them), its count of
fusions and its compile time. Writes each variant's optimized HLO to DIR."""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import time

from _harness import add_json_argument, utc_now, write_json


def _time(fn, *args, reps=20, warmup_s=0.3):
    """Median seconds per call over ``reps`` batches of calls dispatched back to back, one wait
    at the end of a batch (a batch lasts about 20 ms): the device's time per call. A call
    followed by a wait of its own also times the dispatch and the wait, which on an H100 are a
    large part of a 67M-element copy's 0.25 ms (and a small one of a 1.5 ms step), so a ratio
    of two such times is biased toward the longer call. Calls after ``warmup_s`` of warm-up
    (an idle GPU's clocks ramp up over tens of milliseconds: a first row timed cold read 4.5x
    slow on an H100)."""
    import jax

    jax.block_until_ready(fn(*args))  # compiled
    calls, started = 0, time.perf_counter()
    while calls == 0 or time.perf_counter() - started < warmup_s:  # at least one warm call
        jax.block_until_ready(fn(*args))
        calls += 1
    each = (time.perf_counter() - started) / calls
    batch = max(1, min(1000, int(0.02 / max(each, 1e-6))))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(batch):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / batch)
    return statistics.median(samples)


def _traffic(fn, *args) -> int:
    """Bytes a call of ``fn`` moves at least: its input arrays read and its output arrays
    written, each once."""
    import jax

    outs = jax.eval_shape(fn, *args)
    leaves = jax.tree_util.tree_leaves((args, outs))
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves if hasattr(x, "dtype"))


def _probe(directory, tx, otx, params, row, key):
    """The ``--probe`` rows (see the module docstring); ``otx``: the ``optax.adamw`` of the
    ``apply_updates`` rows."""
    import os

    import jax
    import jax.numpy as jnp
    import numpy as np

    from srround.adapters import jax as sj
    from srround.adapters.jax import _lax, _leaves, optim

    os.makedirs(directory, exist_ok=True)
    # random inputs, a few subnormal weights and gradients among them, so that bits can differ
    keys = jax.random.split(jax.random.key(7), 2 * len(params))
    params = [(0.02 * jax.random.normal(k, p.shape)).astype(p.dtype) for k, p in zip(keys, params)]
    grads = [1e-3 * jax.random.normal(k, p.shape) for k, p in zip(keys[len(params) :], params)]
    params[0] = params[0].at[0, :64].set(jnp.asarray(1e-39, params[0].dtype))  # subnormal
    grads[0] = grads[0].at[0, 64:128].set(jnp.float32(1e-40))
    saved = {
        (m, name): getattr(m, name)
        for m, name in [
            (_leaves, "_random16"),
            (_lax, "_random16"),
            (optim, "narrow"),
            (_lax, "narrow"),
            (optim, "_fma"),
            (optim, "div"),
            (optim, "sqrt"),
            (optim, "_add"),
        ]
    }

    def no_bits(k0, k1, first_lo, first_hi, lane0, index):
        return jnp.zeros(index if isinstance(index, int) else index.shape, jnp.uint32)

    def converted(v):
        with jax.enable_x64(True):
            return jnp.asarray(v, jnp.float64).astype(jnp.float32)

    def fma32(a, b, c, exact=None):
        return jnp.asarray(a, jnp.float32) * b + c

    def apply_step(p, s, g):  # optax.adamw + srround apply_updates
        u, s = otx.update(g, s, p)
        return sj.apply_updates(p, u, key, step=1), s

    f32_math = {"_fma": fma32, "div": jnp.divide, "sqrt": jnp.sqrt}
    fused = {
        "no random bits": {"_random16": no_bits},
        "narrow by conversion": {"narrow": converted},
        "float32 fma, div, sqrt": f32_math,
        "all but the bits": {"narrow": converted, **f32_math},
        "none of the three": {"_random16": no_bits, "narrow": converted, **f32_math},
    }
    applied = {
        "no random bits": {"_random16": no_bits},
        "float32 sum (u + w)": {"_add": lambda u, w: u + w},
    }
    runs = [
        ("fused step", tx.step, (grads, tx.init(params), params), fused),
        ("optax + apply_updates", apply_step, (params, otx.init(params), grads), applied),
    ]
    for what, fn_of, step_args, variants in runs:
        nbytes, reference = _traffic(fn_of, *step_args), None
        for label, swap in [("as shipped", {})] + list(variants.items()):
            for (m, name), f in saved.items():
                setattr(m, name, swap.get(name, f))
            jax.clear_caches()
            try:
                fn = jax.jit(fn_of)
                started = time.perf_counter()
                text = fn.lower(*step_args).compile().as_text()
                compile_s = time.perf_counter() - started
                slug = "".join(c if c.isalnum() else "_" for c in f"{what} {label}")
                with open(os.path.join(directory, f"{slug}.hlo.txt"), "w") as f:
                    f.write(text)
                bits = [np.asarray(p).view(np.uint16) for p in fn(*step_args)[0]]
                reference = bits if reference is None else reference
                same = all(np.array_equal(r, b) for r, b in zip(reference, bits))
                note = (
                    f"{text.count(', kind=k')} fusions, compiled in {compile_s:.1f} s,"
                    f" bits as shipped: {same}"
                )
                row(f"{what}: {label} ({note})", _time(fn, *step_args, reps=10), nbytes)
            finally:
                for (m, name), f in saved.items():
                    setattr(m, name, f)
                jax.clear_caches()


@contextlib.contextmanager
def _pallas_mode(mode):
    """``srround.adapters.jax._pallas.MODE`` within (JAX's caches cleared on entry and exit)."""
    import jax

    from srround.adapters.jax import _pallas

    saved, _pallas.MODE = _pallas.MODE, mode
    jax.clear_caches()
    try:
        yield
    finally:
        _pallas.MODE = saved
        jax.clear_caches()


def _fused_bits_equal(*txs) -> bool:
    """Whether two steps of each fused optimizer give the same bits with the Pallas kernels as
    on the XLA path alone: random leaves (a partial last block among them; after the 13-element
    leaf, leaves from lane 1 of their Threefry blocks), subnormal weights and gradients,
    infinities and a NaN."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    shapes = [(37, 64), (13,), (4096, 256), (1000,)]  # after 13: leaves from lane 1
    params, grads = [], []
    for shape in shapes:
        p = (rng.normal(size=shape) * 0.02).astype(np.float32)
        g = (rng.normal(size=shape) * 1e-3).astype(np.float32)
        p.reshape(-1)[::89], g.reshape(-1)[::97] = 1e-39, 3e-39
        g.reshape(-1)[5:8] = [np.inf, np.nan, -np.inf]
        params.append(jnp.asarray(p, jnp.bfloat16))
        grads.append(jnp.asarray(g))

    def two_steps(tx):
        step = jax.jit(lambda g, s, p: tx.step(g, s, p))
        first = step(grads, tx.init(params), params)
        return jax.tree.leaves((first, step(grads, first[1], first[0])))

    for tx in txs:
        with _pallas_mode("on"):
            kernels = two_steps(tx)
        with _pallas_mode("off"):
            xla = two_steps(tx)
        for a, b in zip(kernels, xla):
            a, b = np.atleast_1d(np.asarray(a)), np.atleast_1d(np.asarray(b))
            if not np.array_equal(a.view(np.uint8), b.view(np.uint8)):
                return False
    return True


@contextlib.contextmanager
def _pallas_tiles(rows, warps):
    """The Pallas kernels' ``ROWS`` (rows of four elements a program) and ``WARPS`` within
    (JAX's caches cleared on entry and exit)."""
    import jax

    from srround.adapters.jax import _pallas

    saved = _pallas.ROWS, _pallas.WARPS
    _pallas.ROWS, _pallas.WARPS = rows, warps
    jax.clear_caches()
    try:
        yield
    finally:
        _pallas.ROWS, _pallas.WARPS = saved
        jax.clear_caches()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--params", type=float, default=268.0, help="millions of elements")
    p.add_argument("--probe", metavar="DIR", help="ablate the fused step, HLO into DIR")
    p.add_argument(
        "--tiles",
        metavar="R:W,...",
        help="also time the fused step's Pallas kernels with R rows of four a program and W"
        " warps (e.g. 128:4,256:8), each with its bits compared to the XLA path's",
    )
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
    fused_same = None

    copy_gbps = None  # the first row's: the copy

    def row(label, seconds, nbytes):
        nonlocal copy_gbps
        gbps = nbytes / seconds / 1e9
        copy_gbps = copy_gbps or gbps
        r = {"method": label, "ms": seconds * 1e3, "gbps": gbps, "frac_copy": gbps / copy_gbps}
        rows.append(r)
        pct = 100 * r["frac_copy"]
        print(f"{label:<44} {r['ms']:9.3f} ms {r['gbps']:8.1f} GB/s {pct:5.0f} % copy")
        return gbps

    def timed(label, fn, *args, reps=20):
        return row(label, _time(fn, *args, reps=reps), _traffic(fn, *args))

    timed("copy floor: astype(bf16)", jax.jit(lambda a: a.astype(jnp.bfloat16)), x)
    sr = jax.jit(lambda a, k: sj.stochastic_round(a, seed=k))
    timed("stochastic_round native (bf16)", sr, x, key)
    # matrices: a thread's four elements share their Threefry block where the last dimension
    # is a power of two (_lax._element_index); 11008 columns (a Llama MLP) is not one
    for width in (4096, 11008):
        m = x[: n // width * width].reshape(-1, width)
        timed(f"stochastic_round native (bf16), {width} columns", sr, m, key)
    w = x.astype(jnp.bfloat16)
    add = jax.jit(lambda a, b, k: sj.stochastic_add(a, b, alpha=0.5, seed=k))
    timed("stochastic_add native (bf16)", add, w, x, key)
    with _pallas_mode("off"):  # the XLA path's rounding, the same bits
        sr_xla = jax.jit(lambda a, k: sj.stochastic_round(a, seed=k))
        timed("stochastic_round, XLA path only", sr_xla, x, key)
        m = x[: n // 11008 * 11008].reshape(-1, 11008)
        timed("stochastic_round, XLA path only, 11008 columns", sr_xla, m, key)
        add_xla = jax.jit(lambda a, b, k: sj.stochastic_add(a, b, alpha=0.5, seed=k))
        timed("stochastic_add, XLA path only", add_xla, w, x, key)
    del w
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

        label = "optax.adamw + optax.apply_updates (bf16)"
        base = timed(label, jax.jit(optax_step), params, ostate, grads, reps=10)
        tx = sj.adamw(1e-4, weight_decay=1e-2, seed=0)
        step = jax.jit(tx.step)
        label = "srround adamw native fused (fp32 states)"
        fused = timed(label, step, grads, tx.init(params), params, reps=10)
        print(f"fused step bandwidth / optax step bandwidth: {fused / base:.2f}")
        wide = [(n // 8 // 11008, 11008)] * 8
        wide_p = [jnp.zeros(s, jnp.bfloat16) + 0.01 for s in wide]
        wide_g = [jnp.zeros(s, jnp.float32) + 1e-3 for s in wide]
        label = "srround adamw native fused, 11008 columns"
        timed(label, step, wide_g, tx.init(wide_p), wide_p, reps=10)
        tx16 = sj.adamw(1e-4, weight_decay=1e-2, seed=0, state_dtype=jnp.bfloat16)
        step16 = jax.jit(tx16.step)
        timed("srround adamw native fused (bf16 states)", step16, grads, tx16.init(params), params)
        with _pallas_mode("off"):  # the XLA path's kernels only, the same bits
            xla_step = jax.jit(lambda g, s, p: tx.step(g, s, p))
            timed("the same, XLA path only (fp32 states)", xla_step, grads, tx.init(params), params)
            xla_step16 = jax.jit(lambda g, s, p: tx16.step(g, s, p))
            label = "the same, XLA path only (bf16 states)"
            timed(label, xla_step16, grads, tx16.init(params), params)
        fused_same = _fused_bits_equal(tx, tx16)
        print(f"fused step bits equal to the XLA path's: {fused_same}")
        for tile in (args.tiles or "").split(",") if args.tiles else ():
            r, w = (int(v) for v in tile.split(":"))
            with _pallas_tiles(r, w):
                what = f"Pallas {r} rows, {w} warps"
                timed(f"{what}, fp32 states", jax.jit(tx.step), grads, tx.init(params), params)
                step16 = jax.jit(tx16.step)
                timed(f"{what}, bf16 states", step16, grads, tx16.init(params), params)
                print(f"{what}: bits equal to the XLA path's: {_fused_bits_equal(tx, tx16)}")
        if args.probe:
            with _pallas_mode("off"):  # the XLA path's work, part by part
                _probe(args.probe, tx, otx, params, row, key)
    except ImportError as exc:
        print(f"optax rows skipped: {exc}")
    same = None
    try:
        import ml_dtypes
        from numba import cuda

        import srround

        if cuda.is_available():
            same = True
            for small, offset in [  # from lane 1 of a Threefry block, and 11008 columns
                (np.asarray(x[: 1 << 20]), 5),
                (np.asarray(x[: 95 * 11008]).reshape(95, 11008), 0),
            ]:
                ours = np.asarray(sj.stochastic_round(jnp.asarray(small), seed=123, offset=offset))
                dev = srround.stochastic_round(cuda.to_device(small), seed=123, offset=offset)
                kernel = dev.copy_to_host() if hasattr(dev, "copy_to_host") else np.asarray(dev)
                same &= bool(
                    np.array_equal(ours.view(np.uint16), np.asarray(kernel).view(np.uint16))
                )
                w16 = small.astype(ml_dtypes.bfloat16)  # stochastic_add's kernels too
                ours = np.asarray(
                    sj.stochastic_add(
                        jnp.asarray(w16), jnp.asarray(small), alpha=0.5, seed=9, offset=offset
                    )
                )
                dev = cuda.to_device(w16)
                srround.stochastic_add(dev, cuda.to_device(small), alpha=0.5, seed=9, offset=offset)
                same &= bool(
                    np.array_equal(ours.view(np.uint16), dev.copy_to_host().view(np.uint16))
                )
            print(
                f"bits equal to the Numba CUDA kernels (stochastic_round, stochastic_add): {same}"
            )
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
        baseline="astype(bf16) (a copy: 6 B per element); optax.adamw + optax.apply_updates",
        notes=[
            f"bits equal to the Numba CUDA kernel: {same}",
            f"fused step (Pallas kernels) bits equal to the XLA path's: {fused_same}",
        ],
        meta={"backend": backend, "elements": n, "bits_equal": same, "fused_same": fused_same},
        gpu=jax.devices()[0].device_kind,
        started=started,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
