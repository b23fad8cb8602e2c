#!/usr/bin/env python
"""What each part of srround's JAX ``apply_updates`` costs in an ``optax.adamw`` step on bf16
params: the step with ``optax.apply_updates`` (the baseline), with srround's ``apply_updates``
(default), and with write-backs made of its parts alone.

Usage::

    python benchmarks/apply_updates_parts.py [--quick] [--params MILLIONS] [--tensors N]
                                             [--json PATH]

Rows (each an ``optax.adamw`` update, then the write-back; jitted with donated params and
states; timed in turns, so a shared machine's load falls on every row alike):

- ``plain jnp SR``: float32 add, a constant added below the bf16 mantissa, truncated (the
  floor: what a write-back with free random bits and no care for subnormals costs);
- ``SR encoding``: the float32 add, srround's SR encoding (``_lax._encode``) with constant bits;
- ``exact sum``: srround's exact sum (``optim._add``: subnormals kept where XLA's CPU backend
  flushes them), truncated as the floor;
- ``exact sum + SR encoding``: both, constant bits (srround's write-back without the random
  lanes);
- ``srround apply_updates``: the default (random lanes from the host on one CPU device).

Each row is traced afresh (``jax.clear_caches``): the write-back's inner jitted functions would
otherwise reuse the first row's trace. CPU: 24.6M params in 196 tensors (``--quick``: 0.5M in
24); ``first_s`` is a first call (tracing and XLA's compile). Medians of timed steps.
"""

from __future__ import annotations

import time

import ml_dtypes
import numpy as np
from _harness import (
    add_json_argument,
    bench_parser,
    print_notes,
    time_in_turns,
    utc_now,
    write_json,
)
from bench_optim import numel, shapes

LR = 1e-3


def write_backs(jax, jnp, optax):
    """``{row: fn(params, updates, key) -> params}``."""
    from srround._formats import FORMATS
    from srround.adapters.jax import apply_updates, optim
    from srround.adapters.jax._lax import _encode

    bf16 = FORMATS["bfloat16"]

    def per_leaf(exact_sum: bool, encode: bool):
        def write_back(params, updates, key):
            del key
            out = []
            for p, u in zip(params, updates):
                w = optim._f32(optim._widen_bits(p))
                if exact_sum:
                    s = optim._b32(optim._add(u, w))
                else:
                    s = jax.lax.bitcast_convert_type(w + u, jnp.uint32)
                if encode:
                    bits = jnp.full(p.shape, 0x7FFF, jnp.uint32)
                    out.append(optim._narrow_out(_encode(s, bf16, False, bits), p.dtype))
                else:
                    h = ((s + jnp.uint32(0x7FFF)) >> 16).astype(jnp.uint16)
                    out.append(jax.lax.bitcast_convert_type(h, jnp.bfloat16))
            return out

        return write_back

    return {
        "optax.apply_updates (RNE)": lambda p, u, k: optax.apply_updates(p, u),
        "plain jnp SR": per_leaf(False, False),
        "SR encoding": per_leaf(False, True),
        "exact sum": per_leaf(True, False),
        "exact sum + SR encoding": per_leaf(True, True),
        "srround apply_updates": apply_updates,
    }


def run(total: int, tensors: int, reps: int) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import optax

    shape_list = shapes(total, tensors)
    n = numel(shape_list)
    print(f"-- jax on {jax.default_backend()}: {n:,} bf16 params in {len(shape_list)} tensors --")
    key = jax.random.key(0)
    # the data from NumPy: made with jax.random after each clear_caches, it compiled a
    # program per shape and row
    rng = np.random.default_rng(0)
    host_params = [(0.02 * rng.standard_normal(s)).astype(ml_dtypes.bfloat16) for s in shape_list]
    host_grads = [(1e-3 * rng.standard_normal(s)).astype(ml_dtypes.bfloat16) for s in shape_list]
    turns = []
    for label, write_back in write_backs(jax, jnp, optax).items():
        jax.clear_caches()
        tx = optax.adamw(LR, weight_decay=1e-2)
        params = [jnp.array(p) for p in host_params]  # its own buffers: they are donated
        grads = [jnp.array(g) for g in host_grads]

        def step(p, s, g, t, tx=tx, write_back=write_back):
            u, s = tx.update(g, s, p)
            return write_back(p, u, jax.random.fold_in(key, t)), s

        fn = jax.jit(step, donate_argnums=(0, 1))
        box = {"p": params, "s": tx.init(params), "t": 0}
        jax.block_until_ready((box, grads))  # made by asynchronous ops: not in the first call

        def call(box=box, fn=fn, grads=grads):
            box["t"] += 1
            box["p"], box["s"] = fn(box["p"], box["s"], grads, box["t"])

        def sync(box=box):
            jax.block_until_ready(box["p"])

        t0 = time.perf_counter()
        call()
        sync()
        turns.append((label, call, sync, time.perf_counter() - t0))
    timed = time_in_turns([(call, sync) for _, call, sync, _ in turns], reps)
    base = timed[0]["median_s"]
    base_first = turns[0][3]
    rows = []
    for (label, _, _, first), r in zip(turns, timed):
        row = {
            "row": label,
            "params": n,
            "tensors": len(shape_list),
            **r,
            "first_s": first,
            "step_vs_optax": r["median_s"] / base,
            "first_vs_optax": first / base_first,
        }
        rows.append(row)
        print(
            f"  {label:<28} step {r['median_s'] * 1e3:8.2f} ms ({row['step_vs_optax']:5.2f}x)"
            f"   first call {first:6.2f} s ({row['first_vs_optax']:5.2f}x)"
        )
    return rows


def main(argv=None) -> int:
    p = bench_parser(__doc__, "0.5M params in 24 tensors, fewer steps", "cpu only")
    p.add_argument("--params", type=float, default=None, help="millions of params (24.6)")
    p.add_argument("--tensors", type=int, default=None, help="tensors (196; --quick: 24)")
    add_json_argument(p)
    args = p.parse_args(argv)
    started, t0 = utc_now(), time.perf_counter()
    total = int((args.params or (0.5 if args.quick else 24.6)) * 1e6)
    tensors = args.tensors or (24 if args.quick else 196)
    reps = 5 if args.quick else 15
    rows = run(total, tensors, reps)
    notes: list[str] = []
    print_notes(notes, t0)
    write_json(
        args.json,
        "apply_updates_parts",
        results=rows,
        columns=[
            ["row", "write-back", ""],
            ["median_s", "step s", ".4f"],
            ["step_vs_optax", "step vs optax", ".2f"],
            ["first_s", "first call s", ".2f"],
            ["first_vs_optax", "first vs optax", ".2f"],
        ],
        baseline="optax.apply_updates (RNE): the same optax.adamw step, same run",
        notes=notes,
        meta={"reps": reps},
        started=started,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
