#!/usr/bin/env python
"""Does training with bf16 weights keep up with fp32? srround's fused AdamW against the fp32
reference, on a small teacher-student MLP with generated data (no downloads).

Usage::

    python benchmarks/convergence.py                     # 1500 steps
    python benchmarks/convergence.py --quick --out /tmp/conv.png
    python benchmarks/convergence.py --steps 4000 --lrs 1e-5 3e-5 1e-4
    python benchmarks/convergence.py --states              # optimizer-state precision

Setup: inputs x ~ N(0, 1)^32; a teacher MLP 32 -> 128 (tanh) -> 1 produces the targets (plus
1 % noise); the student has the teacher's shapes and starts at the teacher plus N(0, 0.03)
noise on every weight, rounded to bf16 (so every variant starts from the same values, and the
loss falls as the weights drift back towards the teacher). Mini-batches of 256 of 4096 samples,
the same sequence for every variant. AdamW (betas 0.9/0.999, weight decay 0.01) at small
learning rates: the per-step update (~lr) is far below half a bf16 ulp of the weights
(|w| ~ 0.1-0.3: half an ulp is 2.4e-4 - 9.8e-4), which is where round-to-nearest stalls.

Variants (bf16 parameters and bf16 gradients, fp32 optimizer states, forward/backward in fp32
on the upcast weights):

* ``fp32``            - ``torch.optim.AdamW`` on fp32 parameters (fp32 gradients): the
                        reference;
* ``bf16 nearest``    - ``srround.adapters.torch.AdamW(rounding="nearest")``: what plain bf16
                        training does (torch's own AdamW on bf16 params behaves the same);
* ``bf16 stochastic`` - ``rounding="stochastic"``: no extra memory;
* ``bf16 kahan``      - ``rounding="kahan"``: + bf16 compensation (2 B/param);
* ``bf16 remainder``  - ``rounding="remainder"``: + int16 low bits (2 B/param, fp32-exact);
* ``bf16 master``     - ``rounding="master"``: + fp32 master weights (4 B/param).

``--states`` compares the optimizer states instead (bf16 parameters, ``rounding="stochastic"``):
fp32, bf16 (stochastically rounded) and fp8 moments (``float8_e4m3fn`` / ``float8_e5m2``, a
float32 scale per block of 128 elements, sqrt-domain second moment) against fp32 AdamW, with the
bytes per parameter each keeps (weights + states + scales), at a typical learning rate (1e-3;
``--lrs`` for others).

The table gives the final full-data loss and the progress ratio
``(L - L_fp32) / (L_0 - L_fp32)`` at the end (0: as far as fp32 got; 1: no progress). The PNG
(``--out``) shows the loss curves, one panel per learning rate. Target: stochastic within 0.02
of fp32 on that ratio at the learning rates where nearest is above 0.5.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

VARIANTS = (
    "fp32",
    "bf16 nearest",
    "bf16 stochastic",
    "bf16 kahan",
    "bf16 remainder",
    "bf16 master",
)
TARGET = 0.02
# --states: variant -> (state dtype name, bytes per parameter: bf16 weight + states + scales)
STATE_VARIANTS = {
    "fp32": (None, 4 + 8),
    "states fp32": ("float32", 2 + 8),
    "states bf16": ("bfloat16", 2 + 4),
    "states fp8 e4m3": ("float8_e4m3fn", 2 + 2 + 8 / 128),
    "states fp8 e5m2": ("float8_e5m2", 2 + 2 + 8 / 128),
}

D_IN, HIDDEN, SAMPLES, BATCH = 32, 128, 4096, 256


def problem(seed: int):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((SAMPLES, D_IN)).astype(np.float32)
    teacher = [
        rng.normal(0.0, 1 / np.sqrt(D_IN), (HIDDEN, D_IN)),
        rng.normal(0.0, 0.1, HIDDEN),
        rng.normal(0.0, 1 / np.sqrt(HIDDEN), (1, HIDDEN)),
    ]
    teacher = [t.astype(np.float32) for t in teacher]
    y = forward_np(teacher, x)
    y = y + 0.01 * y.std() * rng.standard_normal(y.shape).astype(np.float32)
    start = [(t + rng.normal(0.0, 0.03, t.shape)).astype(np.float32) for t in teacher]
    return x, y.astype(np.float32), start


def forward_np(w, x):
    return np.tanh(x @ w[0].T + w[1]) @ w[2].T


def train(variant: str, lr: float, steps: int, eval_every: int, data, seed: int):
    """Returns (steps evaluated at, full-data losses) for one variant."""
    import torch

    import srround.adapters.torch as sat

    x, y, start = data
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    # every variant starts from the same (bf16-representable) values
    start_bf16 = [torch.from_numpy(s).to(torch.bfloat16) for s in start]
    if variant == "fp32":
        params = [torch.nn.Parameter(s.float()) for s in start_bf16]
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    else:
        params = [torch.nn.Parameter(s.clone()) for s in start_bf16]
        states = variant.startswith("states")
        opt = sat.AdamW(
            params,
            lr=lr,
            weight_decay=0.01,
            rounding="stochastic" if states else variant.split()[1],
            state_dtype=getattr(torch, STATE_VARIANTS[variant][0]) if states else torch.float32,
            seed=seed,
        )

    def loss_of(xb, yb):
        w1, b1, w2 = (p.float() for p in params)  # bf16 -> fp32 upcast; grads come back bf16
        return torch.mean((torch.tanh(xb @ w1.T + b1) @ w2.T - yb) ** 2)

    batches = np.random.default_rng(seed + 1)
    at, losses = [], []
    for step in range(steps + 1):
        if step % eval_every == 0 or step == steps:
            with torch.no_grad():
                at.append(step)
                losses.append(float(loss_of(xt, yt)))
        if step == steps:
            break
        rows = torch.from_numpy(batches.integers(0, SAMPLES, BATCH))
        opt.zero_grad(set_to_none=False)
        loss_of(xt[rows], yt[rows]).backward()
        opt.step()
    return np.array(at), np.array(losses)


def progress(curve, ref) -> float:
    return float((curve[-1] - ref[-1]) / (curve[0] - ref[-1]))


def plot(results: dict, lrs, path: str, variants=VARIANTS) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(lrs), figsize=(6 * len(lrs), 4.5), squeeze=False)
    for ax, lr in zip(axes[0], lrs):
        for v in variants:
            at, loss = results[(lr, v)]
            style = {"color": "black", "ls": "--", "zorder": 3} if v == "fp32" else {}
            ax.plot(at, loss, label=v, lw=1.5, **style)
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (MSE, full data)")
        ax.set_title(f"AdamW lr={lr:g}, bf16 weights")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--steps", type=int, default=None, help="steps per run (default 1500, --quick 400)"
    )
    p.add_argument("--lrs", type=float, nargs="+", default=None, help="default 1e-5 3e-5")
    p.add_argument(
        "--states",
        action="store_true",
        help="compare optimizer-state dtypes (fp32, bf16, fp8) instead (default lr 1e-3)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="400 steps (smoke run; the effect is smaller at so few steps)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="convergence.png", help="PNG of the loss curves")
    args = p.parse_args(argv)
    steps = args.steps or (400 if args.quick else 1500)
    if args.lrs is None:
        args.lrs = [1e-3] if args.states else [1e-5, 3e-5]
    variants = tuple(STATE_VARIANTS) if args.states else VARIANTS
    eval_every = max(1, steps // 100)

    import torch

    torch.manual_seed(args.seed)
    data = problem(args.seed)
    t0 = time.perf_counter()
    results = {}
    for lr in args.lrs:
        for v in variants:
            results[(lr, v)] = train(v, lr, steps, eval_every, data, args.seed)
    elapsed = time.perf_counter() - t0

    print(
        f"teacher-student MLP {D_IN}->{HIDDEN}->1 ({D_IN * HIDDEN + 2 * HIDDEN} weights), "
        f"{steps} steps, batch {BATCH}, AdamW wd 0.01; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    print(
        "progress = (L - L_fp32) / (L_0 - L_fp32) at the end: 0 = as far as fp32, 1 = no progress"
    )
    if args.states:
        return _report_states(results, args, variants, elapsed)
    _print_progress(results, args.lrs, VARIANTS, f"{'L_0':>10}", lambda v, c: f"{c[0]:>10.6f}")
    verdicts = []
    for lr in args.lrs:
        ref = results[(lr, "fp32")][1]
        near = progress(results[(lr, "bf16 nearest")][1], ref)
        sr = progress(results[(lr, "bf16 stochastic")][1], ref)
        if near > 0.5:
            verdicts.append((lr, near, sr, abs(sr) <= TARGET))
    print(
        f"\ntarget: stochastic within {TARGET} of fp32 (|progress| <= {TARGET}) where nearest"
        " is above 0.5"
    )
    for lr, near, sr, ok in verdicts:
        print(
            f"  lr={lr:g}: nearest {near:.3f}, stochastic {sr:+.3f} -> {'met' if ok else 'NOT met'}"
        )
    if not verdicts:
        print("  (nearest is not above 0.5 at any of these learning rates: no stall to fix here)")
    print(f"training time {elapsed:.1f} s")
    if plot(results, args.lrs, args.out):
        print(f"wrote {args.out}")
    else:
        print("matplotlib not installed: no plot")
    return 0


def _print_progress(results, lrs, variants, header: str, cell) -> None:
    """A row per lr and variant: ``cell(variant, curve)`` under ``header``, final loss, progress."""
    print(f"{'lr':>8}  {'variant':<17} {header} {'final loss':>11} {'progress':>9}")
    for lr in lrs:
        ref = results[(lr, "fp32")][1]
        for v in variants:
            curve = results[(lr, v)][1]
            print(
                f"{lr:>8g}  {v:<17} {cell(v, curve)} {curve[-1]:>11.6f} "
                f"{progress(curve, ref):>9.3f}"
            )


def _report_states(results, args, variants, elapsed) -> int:
    _print_progress(
        results, args.lrs, variants, f"{'B/param':>8}", lambda v, c: f"{STATE_VARIANTS[v][1]:>8.3f}"
    )
    print("(fp32: torch.optim.AdamW, fp32 weights; the others: bf16 weights, stochastic rounding)")
    print(f"training time {elapsed:.1f} s")
    if plot(results, args.lrs, args.out, variants):
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
