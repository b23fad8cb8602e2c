#!/usr/bin/env python
"""Step time of srround's fused AdamW and SGD against what users run today (torch.optim,
torchao, optimi, optax), with bf16 parameters and gradients, on a transformer-like list of
tensors.

Usage::

    python benchmarks/bench_optim.py                  # CPU 24.6M params / 196 tensors (+ GPU)
    python benchmarks/bench_optim.py --quick          # CPU ~2M params, GPU 67M, few steps
    python benchmarks/bench_optim.py --device cpu --sections torch --json out.json
    python benchmarks/bench_optim.py --device cpu --sections compile   # torch.compile rows

What is measured
----------------
One ``optimizer.step()`` over all parameters (gradients fixed, already in ``p.grad``). On a
CPU the rows are timed in turns (every round times one step of each row, all rows' buffers
kept meanwhile), so a shared machine's drifting load falls on every row alike; the rows with
a cap on their samples (the slow compiled torchao ones) and GPU rows are timed one after the
other. Every row is labelled with the bytes per parameter its step must move at least (read +
write):

* srround, fp32 states: 22 B (bf16 param 2+2, bf16 grad 2, fp32 m 4+4, fp32 v 4+4);
  bf16 states: 14 B. The rounding mode adds its per-parameter buffer: ``kahan`` +4 (bf16
  compensation read and written), ``remainder`` +4 (int16), ``master`` +8 (fp32 master).
* torch.optim.AdamW (``fused=True`` / ``foreach=True``): states have the parameter's dtype, so
  bf16 params = 14 B (no stochastic rounding: the bf16 baseline that stalls), fp32 params =
  28 B (the fp32 reference).
* torchao ``_AdamW(bf16_stochastic_round=True)``: bf16 params and states, 14 B. Its first step
  compiles ``single_param_adam`` with ``torch.compile`` per parameter shape; that time is printed
  as ``first step`` and kept out of the median.
* optimi ``AdamW(kahan_sum=True)``: bf16 params, states and compensation, 18 B.
* SGD, momentum 0.9: srround ``SGD`` with float32 momentum 14 B (bf16 param 2+2, grad 2,
  momentum 4+4) or bf16 momentum written back with SR 10 B; torch ``SGD`` (fused / foreach)
  keeps it in the parameter dtype: 10 B.
* fp8 states: srround ``state_dtype=torch.float8_e4m3fn`` (1-byte moments, a float32 scale per
  128 elements: 10.125 B) and torchao ``AdamWFp8(bf16_stochastic_round=True)`` (a float32
  scale per 256: 10.03 B).

``GB/s`` = bytes/param x params / median step time; ``% copy`` divides it by a copy of the same
number of bytes measured in the same run (half read, half written): CPU: a Numba ``prange``
in-place ``buf[i] += 1`` over 8-byte words (srround's thread pool, the in-place access pattern
of an optimizer step; a copy into a separate buffer would also pay write-allocate reads and give
a floor ~1.5x too low), GPU: ``torch`` device-to-device ``copy_``. A row near 100 % is memory
bound. ``host ms``: CPU: the wall time of the step (nothing is asynchronous);
GPU: the time until ``step()`` returns, without a synchronize (launch overhead the host pays).
``first step`` includes state allocation, Numba/JAX/Inductor compilation and first touch;
JAX rows also record how much of it Numba spent compiling (``numba_compile_s``: kernels not yet
in Numba's on-disk cache, which is kept per machine and srround version, so only a first run
after an install or an upgrade pays it) and their ratio to optax's first call without it.

The JAX section (CPU, or the GPU when JAX sees one) times ``jit``-compiled steps with donated
parameter and state buffers: srround's fused ``srround.adapters.jax.adamw`` (its default
``impl``: on a CPU the Numba step through srround's FFI target; and, on a CPU, ``impl="native"``
too), ``optax.adamw`` followed by ``srround.adapters.jax.apply_updates`` (stochastic rounding
of the sum; its default, and on a CPU ``impl="native"`` and ``"callback"`` too), plain
``optax.adamw`` on fp32 and on bf16 params, ``optax.adamw`` with a hand-written
``jax.random.bits`` stochastic-rounding apply (what a user writes), and srround's fused ``sgd``
(momentum 0.9, float32 momentum, and bf16 momentum written back with SR) next to ``optax.sgd``
on bf16 params. Bytes/param there are the same nominal counts (optax keeps states in the
parameter dtype: 14 B bf16, 28 B fp32; SGD 10 B, srround's 14 B with float32 momentum, 10 B
with bf16). On a CPU its
rows are timed in turns (every round times one step of each row), so on a shared machine they
see the same load and their ratios to optax hold; each row's first call is timed on its own.


Sections that cannot run (no CUDA, no torchao/optimi/JAX, adapters not yet present) print why.
Numbers depend on the machine and on what else runs on it; only compare rows of one run.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import sys
import time
import warnings

from _harness import (
    BUSY_MARK,
    Unavailable,
    add_json_argument,
    bench_parser,
    machine,
    numba_compile_timer,
    print_notes,
    time_in_turns,
    time_steps,
    utc_now,
    write_json,
)
from _harness import quiet_import as _quiet_import

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

LR = 1e-3
SEED = 1234
CPU_TARGET_MS = 15.0  # srround AdamW, fp32 states, 24.6M params, CPU
GPU_TARGET_FRAC = 0.80  # of the same-run copy bandwidth, 200 tensors


# --------------------------------------------------------------------------------------------
# shapes
# --------------------------------------------------------------------------------------------


def shapes(total: int, tensors: int) -> list[tuple[int, ...]]:
    """A transformer-like mix cycled to ``tensors`` tensors: per layer 4 d x d attention matrices,
    d x 4d and 4d x d MLP matrices and 4 vectors of d (two norms' weight and bias), with d chosen
    so the total is close to ``total``. One tensor: a flat vector of ``total``."""
    if tensors == 1:
        return [(total,)]
    layer = [("dd",)] * 4 + [("4d", "d"), ("d", "4d")] + [("d",)] * 4
    kinds = (layer * (tensors // len(layer) + 1))[:tensors]
    # total = a d^2 + b d
    a = sum(1 for k in kinds if k == ("dd",)) + 4 * sum(1 for k in kinds if len(k) == 2)
    b = sum(1 for k in kinds if k == ("d",))
    d = max(1, round((-b + math.sqrt(b * b + 4 * a * total)) / (2 * a)))
    table = {("dd",): (d, d), ("4d", "d"): (4 * d, d), ("d", "4d"): (d, 4 * d), ("d",): (d,)}
    return [table[k] for k in kinds]


def numel(shape_list) -> int:
    return sum(math.prod(s) for s in shape_list)


# --------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------


_FLOORS: dict = {}


def copy_floor(device: str, nbytes: int, reps: int) -> float:
    """Seconds to move nbytes of traffic: CPU: read and write back nbytes / 2 bytes in place (a
    Numba prange ``buf[i] += 1`` on 8-byte words: an optimizer step updates its buffers in place,
    and a copy into a separate buffer would also pay the write-allocate reads of the target);
    GPU: ``dst.copy_(src)`` of nbytes / 2 bytes."""
    key = (device, nbytes)
    if key in _FLOORS:
        return _FLOORS[key]
    words = max(1, nbytes // 16)
    if device == "cpu":
        import numpy as np
        from numba import njit, prange

        @njit(parallel=True, cache=False)
        def bump(buf):
            for i in prange(buf.size):
                buf[i] += np.uint64(1)

        buf = np.ones(words, np.uint64)
        r = time_steps(lambda: bump(buf), lambda: None, reps)
    else:
        import torch

        src = torch.ones(words, dtype=torch.int64, device=device)
        dst = torch.empty_like(src)
        r = time_steps(lambda: dst.copy_(src), torch.cuda.synchronize, reps, batch=5)
        del src, dst
        torch.cuda.empty_cache()
    _FLOORS[key] = r["median_s"]
    return _FLOORS[key]


def release(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------
# torch rows
# --------------------------------------------------------------------------------------------


def make_params(torch, shape_list, dtype, device):
    gen = torch.Generator(device=device).manual_seed(SEED)
    params = []
    for s in shape_list:
        p = torch.nn.Parameter((torch.randn(s, generator=gen, device=device) * 0.02).to(dtype))
        p.grad = (torch.randn(s, generator=gen, device=device) * 1e-3).to(dtype)
        params.append(p)
    return params


class _FunctionalAdamW:
    """Stand-in for ``srround.adapters.torch.AdamW`` built on ``srround.adamw_step`` (used only
    while the adapter is missing): same buffers, same single fused call per step."""

    def __init__(self, params, lr, *, rounding, state_dtype, seed):
        import torch

        self.params, self.lr, self.rounding, self.seed, self.t = list(params), lr, rounding, seed, 0
        self.m = [torch.zeros_like(p, dtype=state_dtype) for p in self.params]
        self.v = [torch.zeros_like(p, dtype=state_dtype) for p in self.params]
        self.aux = {
            "kahan": lambda: [torch.zeros_like(p) for p in self.params],
            "master": lambda: [p.detach().float() for p in self.params],
            "remainder": lambda: [torch.zeros_like(p, dtype=torch.int16) for p in self.params],
        }.get(rounding, lambda: None)()

    def step(self):
        import srround

        self.t += 1
        srround.adamw_step(
            [p.detach() for p in self.params],
            [p.grad for p in self.params],
            self.m,
            self.v,
            lr=self.lr,
            step=self.t,
            rounding=self.rounding,
            aux=self.aux,
            seed=self.seed,
        )


class _NewGrads:
    """``opt.step()`` with every gradient another tensor than at the last step (two sets,
    swapped): what backward hands the step after ``zero_grad()`` (torch's default)."""

    def __init__(self, opt, params):
        self.opt, self.params = opt, params
        self.other = [p.grad.clone() for p in params]

    def step(self):
        for i, p in enumerate(self.params):
            p.grad, self.other[i] = self.other[i], p.grad
        self.opt.step()


def srround_adamw(torch):
    """(factory, label note): the adapter's AdamW, or the functional stand-in."""
    try:
        mod = _quiet_import("srround.adapters.torch")
        cls = getattr(mod, "AdamW", None)
    except Unavailable:
        cls = None
    if cls is not None:
        return (lambda params, **kw: cls(params, lr=LR, **kw)), "adapters.torch.AdamW"
    return (lambda params, **kw: _FunctionalAdamW(params, LR, **kw)), "adamw_step (functional)"


EXTRA_BYTES = {"stochastic": 0, "nearest": 0, "kahan": 4, "remainder": 4, "master": 8}


def torch_rows(torch, device: str, quick: bool):
    """[(label, bytes/param, param dtype, factory(params) -> optimizer, max reps or None)]."""
    rows = []
    factory, how = srround_adamw(torch)
    for state_dtype, base in ((torch.float32, 22), (torch.bfloat16, 14)):
        sname = "fp32" if state_dtype == torch.float32 else "bf16"
        for mode in ("stochastic", "kahan", "master", "remainder"):
            rows.append(
                (
                    f"srround AdamW {mode:<10} {sname} states",
                    base + EXTRA_BYTES[mode],
                    torch.bfloat16,
                    (
                        lambda params, mode=mode, sd=state_dtype: factory(
                            params, rounding=mode, state_dtype=sd, seed=SEED
                        )
                    ),
                    None,
                )
            )
    for fp8 in ("float8_e4m3fn",):  # 1-byte moments + float32 scales per 128 (2 x 8 B / 128)
        rows.append(
            (
                f"srround AdamW stochastic fp8 {fp8[7:]} states",
                10.125,
                torch.bfloat16,
                lambda params, sd=getattr(torch, fp8): factory(
                    params, rounding="stochastic", state_dtype=sd, seed=SEED
                ),
                None,
            )
        )

    def torchao_fp8(params):
        mod = _quiet_import("torchao.optim")
        return mod.AdamWFp8(params, lr=LR, bf16_stochastic_round=True)

    rows.append(
        (
            "torchao AdamWFp8 bf16 SR (compiled)",
            10.03,
            torch.bfloat16,
            torchao_fp8,
            3 if quick else 10,
        )
    )
    for impl in ("fused", "foreach"):
        for dtype, nb in ((torch.bfloat16, 14), (torch.float32, 28)):
            dname = "bf16" if dtype == torch.bfloat16 else "fp32"
            rows.append(
                (
                    f"torch AdamW {impl:<7} {dname} params (RNE)",
                    nb,
                    dtype,
                    (lambda params, impl=impl: torch.optim.AdamW(params, lr=LR, **{impl: True})),
                    None,
                )
            )

    rows.append(
        (
            "srround AdamW stochastic fp32 states, new grads",
            22,
            torch.bfloat16,
            lambda params: _NewGrads(
                factory(params, rounding="stochastic", state_dtype=torch.float32, seed=SEED),
                params,
            ),
            None,
        )
    )
    rows.append(
        (
            "torch AdamW fused   bf16 params, new grads",
            14,
            torch.bfloat16,
            lambda params: _NewGrads(torch.optim.AdamW(params, lr=LR, fused=True), params),
            None,
        )
    )

    def torchao(params):
        mod = _quiet_import("torchao.optim")
        return mod._AdamW(params, lr=LR, bf16_stochastic_round=True)

    rows.append(
        ("torchao _AdamW bf16 SR (compiled)", 14, torch.bfloat16, torchao, 3 if quick else 10)
    )

    def optimi(params):
        mod = _quiet_import("optimi")
        return mod.AdamW(params, lr=LR, kahan_sum=True)

    rows.append(("optimi AdamW kahan_sum bf16", 18, torch.bfloat16, optimi, None))
    rows += sgd_rows(torch)
    return rows, how


def sgd_rows(torch):
    """SGD with momentum 0.9 on bf16 params: srround's (float32 momentum, 14 B; bf16 momentum
    written back with SR, 10 B) and torch's (momentum in the parameter dtype, 10 B)."""
    try:
        cls = getattr(_quiet_import("srround.adapters.torch"), "SGD", None)
    except Unavailable:
        cls = None
    rows = []
    if cls is not None:
        for state_dtype, sname, nb in ((torch.float32, "fp32", 14), (torch.bfloat16, "bf16", 10)):
            rows.append(
                (
                    f"srround SGD stochastic {sname} momentum",
                    nb,
                    torch.bfloat16,
                    lambda params, sd=state_dtype: cls(
                        params, lr=LR, momentum=0.9, state_dtype=sd, seed=SEED
                    ),
                    None,
                )
            )
    for impl in ("fused", "foreach"):
        rows.append(
            (
                f"torch SGD {impl:<7} bf16 params (RNE)",
                10,
                torch.bfloat16,
                lambda params, impl=impl: torch.optim.SGD(
                    params, lr=LR, momentum=0.9, **{impl: True}
                ),
                None,
            )
        )
    return rows


def run_torch(
    device: str, total: int, tensors: int, reps: int, quick: bool, notes: list, only=None
) -> list[dict]:
    torch = _quiet_import("torch")
    shape_list = shapes(total, tensors)
    n = numel(shape_list)
    gpu = device != "cpu"
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    batch = 5 if gpu else 1
    rows, how = torch_rows(torch, device, quick)
    print(
        f"\n-- torch on {device}: {n:,} params in {len(shape_list)} tensors (srround via {how}) --",
        flush=True,
    )
    # on a CPU the rows are timed in turns (each keeps its buffers meanwhile), as the JAX rows:
    # a shared machine's load drifts over a minute, and rows timed one after the other would
    # see different machines. Rows with a cap on their samples (slow compiled ones) and GPU
    # rows (memory) are timed on their own.
    in_turns = not gpu
    timed: dict[int, dict] = {}
    turns = []  # (index, step, sync, first_s, keep-alive)
    kept = [(i, row) for i, row in enumerate(rows) if not only or any(o in row[0] for o in only)]
    for i, (label, nbytes, dtype, factory, max_reps) in kept:
        params = opt = None
        try:
            params = make_params(torch, shape_list, dtype, device)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                opt = factory(params)
                if in_turns and max_reps is None:
                    t0 = time.perf_counter()
                    opt.step()
                    turns.append((i, opt.step, sync, time.perf_counter() - t0, (params, opt)))
                else:
                    timed[i] = time_steps(opt.step, sync, min(reps, max_reps or reps), batch)
        except Unavailable as exc:
            notes.append(f"{device} {tensors} tensors: {label}: skipped: {exc}")
        except Exception as exc:  # noqa: BLE001 - a row that fails here is reported, not fatal
            msg = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
            notes.append(
                f"{device} {tensors} tensors: {label}: failed: {type(exc).__name__}: {msg}"
            )
        finally:
            del params, opt
            if not turns or turns[-1][0] != i:
                release(device)
    if turns:
        in_turn = time_in_turns([(step, sync) for _, step, sync, _, _ in turns], reps)
        for (i, _step, _sync, first_s, _alive), r in zip(turns, in_turn):
            timed[i] = {**r, "first_s": first_s}
        turns.clear()
        release(device)
    results = []
    for i, (label, nbytes, *_) in kept:
        if i not in timed:
            continue
        r = timed[i]
        floor = copy_floor(device, int(nbytes * n), reps)
        gbps = nbytes * n / r["median_s"] / 1e9
        row = {
            "section": "torch",
            "device": device,
            "tensors": len(shape_list),
            "params": n,
            "method": label,
            "bytes_per_param": nbytes,
            "gbps": gbps,
            "frac_copy": floor / r["median_s"],
            "copy_gbps": nbytes * n / floor / 1e9,
            **r,
        }
        results.append(row)
        print_row(row, gpu)
    return results


# --------------------------------------------------------------------------------------------
# JAX rows
# --------------------------------------------------------------------------------------------


def run_jax(total: int, tensors: int, reps: int, notes: list, floor_device: str | None):
    jax = _quiet_import("jax")
    import jax.numpy as jnp

    try:
        optax = _quiet_import("optax")
    except Unavailable as exc:
        optax = None
        notes.append(f"jax: optax rows skipped: {exc}")
    backend = jax.default_backend()
    dev = jax.devices()[0]
    shape_list = shapes(total, tensors)
    n = numel(shape_list)
    print(
        f"\n-- jax on {backend} ({dev.device_kind}): {n:,} params in {len(shape_list)} tensors"
        " (jit, donated params and states) --",
        flush=True,
    )
    try:
        sj = _quiet_import("srround.adapters.jax")
    except Unavailable as exc:
        sj = None
        notes.append(f"jax: srround rows skipped: {exc}")

    def make(dtype):
        key = jax.random.key(SEED)
        params, grads = [], []
        for i, s in enumerate(shape_list):
            k1, k2 = jax.random.split(jax.random.fold_in(key, i))
            params.append((0.02 * jax.random.normal(k1, s, jnp.float32)).astype(dtype))
            grads.append((1e-3 * jax.random.normal(k2, s, jnp.float32)).astype(dtype))
        return params, grads

    def user_sr_apply(params, updates, key):
        """optax.apply_updates with a user-level SR: fp32 sum, 16 random bits added below the
        bf16 mantissa, truncated (no care for inf/NaN/overflow)."""
        out = []
        for i, (p, u) in enumerate(zip(params, updates)):
            s = p.astype(jnp.float32) + u.astype(jnp.float32)
            bits = jax.random.bits(jax.random.fold_in(key, i), s.shape, jnp.uint32)
            sb = jax.lax.bitcast_convert_type(s, jnp.uint32)
            sb = (sb + (bits & jnp.uint32(0xFFFF))) & jnp.uint32(0xFFFF0000)
            out.append(jax.lax.bitcast_convert_type(sb, jnp.float32).astype(p.dtype))
        return out

    def optax_row(apply, dtype, kind="adamw"):
        def build():
            if optax is None:
                raise Unavailable("optax not importable")
            if kind == "sgd":
                tx = optax.sgd(LR, momentum=0.9)
            else:
                tx = optax.adamw(LR, b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-2)
            params, grads = make(dtype)
            state = tx.init(params)

            def step(params, state, grads, t):
                updates, state = tx.update(grads, state, params)
                key = jax.random.fold_in(jax.random.key(SEED), t)
                return apply(params, updates, key), state

            return jax.jit(step, donate_argnums=(0, 1)), params, state, grads

        return build

    def fused_row(state_dtype, impl=None, masked=False, grad_dtype=jnp.bfloat16):
        def build():
            if sj is None or not hasattr(sj, "adamw"):
                raise Unavailable("srround.adapters.jax.adamw not present")
            params, grads = make(jnp.bfloat16)
            grads = [g.astype(grad_dtype) for g in grads]
            # optax's mask, as commonly used: no weight decay on the vectors (biases, norms)
            mask = [p.ndim > 1 for p in params] if masked else None
            opt = sj.adamw(
                LR,
                b1=0.9,
                b2=0.999,
                eps=1e-8,
                weight_decay=1e-2,
                seed=SEED,
                rounding="stochastic",
                state_dtype=state_dtype,
                impl=impl,
                mask=mask,
            )
            state = opt.init(params)

            def step(params, state, grads, t):
                params, state = opt.step(grads, state, params)
                return params, state

            return jax.jit(step, donate_argnums=(0, 1)), params, state, grads

        return build

    def fused_sgd_row(impl=None, accumulator_dtype=None):
        def build():
            if sj is None or not hasattr(sj, "sgd"):
                raise Unavailable("srround.adapters.jax.sgd not present")
            opt = sj.sgd(
                LR,
                momentum=0.9,
                seed=SEED,
                rounding="stochastic",
                accumulator_dtype=accumulator_dtype,
                impl=impl,
            )
            params, grads = make(jnp.bfloat16)
            state = opt.init(params)

            def step(params, state, grads, t):
                return opt.step(grads, state, params)

            return jax.jit(step, donate_argnums=(0, 1)), params, state, grads

        return build

    def srround_apply(impl=None):
        def apply(params, updates, key):
            if sj is None or not hasattr(sj, "apply_updates"):
                raise Unavailable("srround.adapters.jax.apply_updates not present")
            return sj.apply_updates(params, updates, key, impl=impl)

        return apply

    plain = (lambda p, u, k: optax.apply_updates(p, u)) if optax else None
    rows = [
        ("srround jax.adamw fp32 states", 22, fused_row(jnp.float32)),
        ("srround jax.adamw bf16 states", 14, fused_row(jnp.bfloat16)),
        ("srround jax.adamw fp32 states, optax mask", 22, fused_row(jnp.float32, masked=True)),
        # float32 gradients: what a loss scale's unscale gives (it promotes, as jmp's does)
        (
            "srround jax.adamw fp32 states, fp32 grads",
            24,
            fused_row(jnp.float32, grad_dtype=jnp.float32),
        ),
        ("optax.adamw + srround apply_updates", 14, optax_row(srround_apply(), jnp.bfloat16)),
        ("optax.adamw + user jax.random.bits SR", 14, optax_row(user_sr_apply, jnp.bfloat16)),
        ("optax.adamw bf16 params (RNE)", 14, optax_row(plain, jnp.bfloat16)),
        ("optax.adamw fp32 params", 28, optax_row(plain, jnp.float32)),
        ("srround jax.sgd fp32 momentum", 14, fused_sgd_row()),
        # optax's bytes: its momentum takes the params' dtype (here written back with SR)
        ("srround jax.sgd bf16 momentum", 10, fused_sgd_row(accumulator_dtype=jnp.bfloat16)),
        ("optax.sgd bf16 params (RNE)", 10, optax_row(plain, jnp.bfloat16, "sgd")),
    ]
    if backend == "cpu":  # the default there is the host step; elsewhere it is native
        rows[4:4] = [
            ("srround jax.adamw native fp32 states", 22, fused_row(jnp.float32, "native")),
            ("srround jax.adamw native bf16 states", 14, fused_row(jnp.bfloat16, "native")),
        ]
        rows.insert(-1, ("srround jax.sgd native fp32 momentum", 14, fused_sgd_row("native")))
        native_apply = optax_row(srround_apply("native"), jnp.bfloat16)
        rows.insert(7, ("optax.adamw + srround apply_updates native", 14, native_apply))
        callback_apply = optax_row(srround_apply("callback"), jnp.bfloat16)
        rows.insert(8, ("optax.adamw + srround apply_updates callback", 14, callback_apply))
    # on a CPU the rows are timed in turns (each keeps its buffers meanwhile): a shared machine's
    # load moves between rows timed one after the other, and so would their ratios to optax
    in_turns = backend == "cpu"
    results, turns = [], []

    def add_row(label, nbytes, r):
        row = {
            "section": "jax",
            "device": f"jax-{backend}",
            "tensors": len(shape_list),
            "params": n,
            "method": label,
            "bytes_per_param": nbytes,
            "gbps": nbytes * n / r["median_s"] / 1e9,
            **r,
        }
        if floor_device:
            floor = copy_floor(floor_device, nbytes * n, reps)
            row["frac_copy"] = floor / r["median_s"]
            row["copy_gbps"] = nbytes * n / floor / 1e9
        results.append(row)
        print_row(row, backend != "cpu")

    for label, nbytes, build in rows:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fn, params, state, grads = build()
                # the inputs are made by asynchronous ops: finished before the first call is
                # timed, which would otherwise wait for them too
                jax.block_until_ready((params, state, grads))
                box = {"p": params, "s": state, "t": 0}

                def step(box=box, fn=fn, grads=grads):
                    box["t"] += 1
                    box["p"], box["s"] = fn(box["p"], box["s"], grads, box["t"])

                def sync(box=box):
                    jax.block_until_ready(box["p"])

                if in_turns:
                    with numba_compile_timer() as numba_timer:
                        t0 = time.perf_counter()
                        step()
                        sync()
                        first = time.perf_counter() - t0
                    turns.append((label, nbytes, step, sync, (first, numba_timer.seconds)))
                    continue
                with numba_compile_timer() as numba_timer:
                    r = time_steps(step, sync, reps)
                r["numba_compile_s"] = numba_timer.seconds
        except Unavailable as exc:
            notes.append(f"jax: {label}: skipped: {exc}")
            continue
        except Exception as exc:  # noqa: BLE001
            msg = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
            notes.append(f"jax: {label}: failed: {type(exc).__name__}: {msg}")
            continue
        finally:
            box = params = state = grads = None
            gc.collect()
        add_row(label, nbytes, r)
    if turns:
        timed = time_in_turns([(step, sync) for _, _, step, sync, _ in turns], reps)
        for (label, nbytes, *_, (first, numba_s)), r in zip(turns, timed):
            add_row(label, nbytes, {"first_s": first, "numba_compile_s": numba_s, **r})
        turns.clear()
        gc.collect()
    by_method = {r["method"]: r for r in results}
    for kind in ("adamw", "sgd"):
        base = by_method.get(f"optax.{kind} bf16 params (RNE)")
        if not base:
            continue
        print(
            f"   vs optax.{kind} + optax.apply_updates on the same bf16 params, this run"
            " (targets: first call <= 3x, step <= 1.2x):"
        )
        for r in results:
            if "srround" in r["method"] and f".{kind}" in r["method"]:
                r["first_vs_optax"] = r["first_s"] / base["first_s"]
                # Numba compiles a kernel once per machine and srround version (on-disk cache)
                warm = r["first_s"] - r.get("numba_compile_s", 0.0)
                r["first_cached_vs_optax"] = warm / base["first_s"]
                r["step_vs_optax"] = r["median_s"] / base["median_s"]
                print(
                    f"   {r['method']:<46} first call {r['first_vs_optax']:5.2f}x"
                    f" ({r['first_cached_vs_optax']:5.2f}x with Numba's disk cache)"
                    f"   step {r['step_vs_optax']:5.2f}x"
                )
    return results


# --------------------------------------------------------------------------------------------
# torch.compile rows
# --------------------------------------------------------------------------------------------


def run_compile(torch, device: str, quick: bool, reps: int, notes: list) -> list[dict]:
    """A compiled training step (an MLP of bf16 weights: compiled forward, eager backward -
    Dynamo does not trace ``backward()`` by default - and ``opt.step()`` compiled with
    ``fullgraph=True``; torch's fused step breaks the graph, so it is compiled without), srround
    AdamW (stochastic) vs torch fused AdamW, each also eager.
    ``first_s`` of a compiled row is its first step: Dynamo + Inductor compile included."""
    import srround.adapters.torch as sat

    width, depth, batch = (512, 2, 16) if quick else (1024, 4, 32)
    rows = []
    for label, make in (
        ("srround AdamW stochastic", lambda ps: sat.AdamW(ps, lr=LR, seed=SEED)),
        ("torch AdamW fused", lambda ps: torch.optim.AdamW(ps, lr=LR, fused=True)),
    ):
        for compiled in (False, True):
            torch.manual_seed(0)
            layers = []
            for _ in range(depth):
                layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
            model = torch.nn.Sequential(*layers).to(device=device, dtype=torch.bfloat16)
            opt = make(list(model.parameters()))
            x = torch.randn(batch, width, device=device, dtype=torch.bfloat16)
            forward, step = model, opt.step
            if compiled:
                torch._dynamo.reset()
                forward = torch.compile(model)
                # torch's fused AdamW breaks the graph under Dynamo (torch inserts
                # graph_break() for fused=True): fullgraph only for srround's step
                step = torch.compile(opt.step, fullgraph=label.startswith("srround"))

            def train_step(forward=forward, step=step, model=model, x=x):
                forward(x).float().square().mean().backward()
                step()
                model.zero_grad(set_to_none=False)

            sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
            try:
                r = time_steps(train_step, sync, reps)
            except Exception as exc:  # report, keep the other rows
                notes.append(f"compile: {label} compiled={compiled} failed: {exc!r:.200}")
                continue
            params = sum(p.numel() for p in model.parameters())
            rows.append(
                dict(
                    r,
                    section="compile",
                    device=device,
                    method=f"{label} {'compiled' if compiled else 'eager'}",
                    params=params,
                    tensors=2 * depth,
                )
            )
            print(
                f"{rows[-1]['method']:<46} {r['median_s'] * 1e3:9.3f} ms/step"
                f" first step {r['first_s']:7.2f} s",
                flush=True,
            )
            release(device)
    by = {r["method"]: r["median_s"] for r in rows}
    for mode in ("eager", "compiled"):
        ours = by.get(f"srround AdamW stochastic {mode}")
        theirs = by.get(f"torch AdamW fused {mode}")
        if ours and theirs:
            print(f"{mode}: srround / torch fused step-time ratio {ours / theirs:.2f}")
    return rows


# --------------------------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------------------------

COLUMNS = [
    ("device", "device", ""),
    ("tensors", "tensors", "d"),
    ("params", "params", ",d"),
    ("method", "method", ""),
    ("bytes_per_param", "B/param", "d"),
    ("median_s", "ms/step", "ms"),
    ("gbps", "GB/s", ".2f"),
    ("frac_copy", "% copy", "%"),
    ("host_s", "host ms", "ms"),
    ("first_s", "first step s", ".2f"),
    ("numba_compile_s", "of it Numba compile s", ".2f"),
    ("first_vs_optax", "first step / optax's", ".2f"),
    ("first_cached_vs_optax", "first step less Numba compile / optax's", ".2f"),
    ("step_vs_optax", "ms/step / optax's", ".2f"),
    ("others_busy_cpus", "others busy CPUs", ".2f"),
]

HEADER = (
    f"{'method':<46} {'B/par':>5} {'ms/step':>9} {'GB/s':>8} {'% copy':>7} "
    f"{'host ms':>8} {'first step':>11}"
)


def print_row(r: dict, gpu: bool) -> None:
    if getattr(print_row, "_header_for", None) != (r["section"], r["device"], r["tensors"]):
        print(HEADER)
        print("-" * len(HEADER))
        print_row._header_for = (r["section"], r["device"], r["tensors"])
    frac = f"{100 * r['frac_copy']:6.0f}%" if "frac_copy" in r else f"{'-':>7}"
    busy = not gpu and (r.get("others_busy_cpus") or 0) > BUSY_MARK
    print(
        f"{r['method']:<46} {r['bytes_per_param']:>5} {r['median_s'] * 1e3:9.3f} "
        f"{r['gbps']:8.2f} {frac} {r['host_s'] * 1e3:8.3f} {r['first_s']:10.2f}s"
        f"{'  *busy {:.1f}'.format(r['others_busy_cpus']) if busy else ''}",
        flush=True,
    )


def print_targets(results: list[dict]) -> None:
    print("\n== targets ==")
    ref = [
        r
        for r in results
        if r["section"] == "torch"
        and r["device"] == "cpu"
        and r["method"].startswith("srround AdamW stochastic")
        and r["method"].endswith("fp32 states")  # (not its "new grads" row)
    ]
    for r in ref:
        ok = r["median_s"] * 1e3 <= CPU_TARGET_MS
        verdict = (
            ("met" if ok else "NOT met")
            if r["params"] > 20e6
            else "n/a: the target is for 24.6M params"
        )
        print(
            f"CPU: srround AdamW (stochastic, fp32 states) <= {CPU_TARGET_MS:g} ms/step at "
            f"{r['params'] / 1e6:.1f}M params: {r['median_s'] * 1e3:.2f} ms "
            f"({verdict})"
        )
    gpu = [
        r
        for r in results
        if r["section"] == "torch"
        and r["device"].startswith("cuda")
        and r["method"].startswith("srround AdamW")
        and r["tensors"] == 200
    ]
    for r in gpu:
        ok = r["frac_copy"] >= GPU_TARGET_FRAC
        print(
            f"GPU 200 tensors: {r['method']:<40} {100 * r['frac_copy']:5.0f}% of copy "
            f"(target >= {100 * GPU_TARGET_FRAC:.0f}%: {'met' if ok else 'NOT met'})"
        )
    if not ref and not gpu:
        print("(no srround row measured)")


def main(argv=None) -> int:
    p = bench_parser(
        __doc__,
        "CPU ~2M params, GPU 67M params, fewer steps",
        "'all' = CPU, plus CUDA when torch.cuda.is_available()",
    )
    p.add_argument(
        "--sections",
        nargs="+",
        choices=("torch", "jax", "compile", "dist"),
        default=["torch", "jax"],
        help="compile: a torch.compile'd training step, srround vs torch fused AdamW; dist: FSDP2"
        " on 2 gloo processes, srround vs torch fused AdamW (_dist_rows.py)",
    )
    p.add_argument(
        "--jax",
        action="store_true",
        help="only the JAX section (--sections jax), 196 tensors unless --jax-tensors is given",
    )
    p.add_argument(
        "--params",
        type=float,
        default=None,
        help="parameters per device in millions (default CPU 24.6, GPU 268)",
    )
    p.add_argument("--gpu-tensors", type=int, nargs="+", default=[1, 200, 2000])
    p.add_argument(
        "--jax-tensors",
        type=int,
        default=24,
        help="tensors in the JAX section (default 24: compiling srround's native JAX"
        " adamw and apply_updates grows with the tensor count)",
    )
    p.add_argument("--reps", type=int, default=None, help="timed samples per row")
    p.add_argument(
        "--only",
        nargs="+",
        metavar="TEXT",
        help="only torch rows whose label contains one of these",
    )
    add_json_argument(p)
    args = p.parse_args(argv)
    if args.jax:
        args.sections = ["jax"]
        if "--jax-tensors" not in (argv if argv is not None else sys.argv):
            args.jax_tensors = 196
    started = utc_now()

    notes: list[str] = []
    meta = {**machine(), "quick": args.quick}
    devices = ["cpu"] if args.device in ("cpu", "all") else []
    torch = None
    try:
        torch = _quiet_import("torch")
        meta["torch"], meta["torch_threads"] = torch.__version__, torch.get_num_threads()
        if args.device in ("cuda", "all"):
            if torch.cuda.is_available():
                devices.append("cuda")
                meta["gpu"] = torch.cuda.get_device_name()
            else:
                notes.append("CUDA: torch.cuda.is_available() is False: GPU rows skipped")
    except Unavailable as exc:
        notes.append(f"torch section skipped: {exc}")
    for name in ("torchao", "optimi", "jax", "optax"):
        with contextlib.suppress(Exception):
            meta[name] = getattr(_quiet_import(name), "__version__", "?")
    print(
        "srround optimizer benchmark | " + ", ".join(f"{k}={v}" for k, v in meta.items()),
        flush=True,
    )

    t_start = time.perf_counter()
    results: list[dict] = []
    cpu_total = int((args.params or (2.0 if args.quick else 24.6)) * 1e6)
    gpu_total = int((args.params or (67.0 if args.quick else 268.0)) * 1e6)
    if "torch" in args.sections and torch is not None:
        for device in devices:
            if device == "cpu":
                reps = args.reps or (5 if args.quick else 10)
                results += run_torch("cpu", cpu_total, 196, reps, args.quick, notes, args.only)
            else:
                reps = args.reps or (5 if args.quick else 10)
                for tensors in args.gpu_tensors:
                    results += run_torch(
                        "cuda", gpu_total, tensors, reps, args.quick, notes, args.only
                    )
    if "compile" in args.sections and torch is not None:
        for device in devices:
            results += run_compile(torch, device, args.quick, args.reps or 10, notes)
    if "jax" in args.sections:
        try:
            jax = _quiet_import("jax")
            on_gpu = jax.default_backend() == "gpu"
            floor_device = "cuda" if on_gpu and "cuda" in devices else None if on_gpu else "cpu"
            total = gpu_total if on_gpu else cpu_total
            reps = args.reps or (3 if args.quick else 5)
            results += run_jax(total, args.jax_tensors, reps, notes, floor_device)
        except Unavailable as exc:
            notes.append(f"jax section skipped: {exc}")
    if "dist" in args.sections and torch is not None:
        try:
            import _dist_rows

            dist_total = int((args.params or (1.0 if args.quick else 8.0)) * 1e6)
            shape_list = shapes(dist_total, 98)
            print(
                f"\n-- FSDP2, {_dist_rows.WORLD} gloo processes on CPU:"
                f" {numel(shape_list):,} params in {len(shape_list)} tensors (params: per rank)--",
                flush=True,
            )
            dist_rows = _dist_rows.run_dist(shape_list, args.reps or 5, notes)
            for row in dist_rows:
                print_row(row, False)
            for line in _dist_rows.ratios(dist_rows):
                print(line)
            results += dist_rows
        except Exception as exc:  # noqa: BLE001 - a section that fails is reported, not fatal
            notes.append(f"dist section failed: {type(exc).__name__}: {exc}")
    print_targets(results)
    if any(
        (r.get("others_busy_cpus") or 0) > BUSY_MARK
        for r in results
        if not r["device"].startswith("cuda")
    ):
        notes.append(
            f"*busy: other processes used more than {BUSY_MARK} CPU while the row was"
            " timed (shared cores and memory bandwidth): treat it as noisy"
        )
    print_notes(notes, t_start)
    write_json(
        args.json,
        "bench_optim",
        results=results,
        columns=COLUMNS,
        baseline="per device and tensor count: torch.optim.AdamW (fused/foreach, bf16 and"
        " fp32 params) and torch.optim.SGD (fused/foreach, bf16), torchao and optimi rows,"
        " plain optax rows (JAX); CPU rows timed in turns; frac_copy divides"
        " by a same-run copy of the same bytes (CPU: Numba prange in-place word bump; GPU:"
        " torch copy_)",
        notes=notes,
        meta=meta,
        gpu=meta.get("gpu"),
        started=started,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
