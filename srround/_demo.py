"""``srround demo``: the problem and the fix, on this machine, in about a minute.

A linear model (teacher-student regression on generated data, no downloads) is trained with Adam
at a small learning rate, its weights stored four ways:

* ``fp32``              - the reference trajectory;
* ``bf16 nearest``      - bf16 weights, each fp32 update rounded to nearest: updates below half
                          a bf16 ulp are lost, so training stalls;
* ``bf16 stochastic``   - bf16 weights updated with ``srround.stochastic_add``: the expected
                          weight follows the fp32 trajectory at bf16 memory cost;
* ``bf16 kahan``        - bf16 weights plus a bf16 compensation buffer that carries what
                          rounding dropped into the next step (optimi's Kahan summation);
* ``bf16 + remainder``  - bf16 weights plus the 16 low bits of the fp32 value (int16): together
                          exactly the fp32 weight, 2 extra bytes per weight; the forward pass
                          uses the bf16 half;
* ``bf16 + fp32 master``- fp32 master weights, a bf16 copy for the forward pass (apex/AMP).

It prints final losses and how far each method got relative to fp32,
``(L - L_fp32) / (L_0 - L_fp32)`` (0: as far as fp32; 1: no progress at all), and writes a PNG
of the loss curves when matplotlib is installed.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

import srround

METHODS = (
    "fp32",
    "bf16 nearest",
    "bf16 stochastic",
    "bf16 kahan",
    "bf16 + remainder",
    "bf16 + fp32 master",
)


@dataclasses.dataclass
class DemoResult:
    losses: dict  # method -> float64[k], full-data loss at ``evaluated_at`` steps
    evaluated_at: np.ndarray  # int64[k]: 0, eval_every, 2 * eval_every, ..., steps
    lr: float
    steps: int

    def progress(self, method: str) -> float:
        """(L - L_fp32) / (L_0 - L_fp32) at the end of training."""
        ref = self.losses["fp32"]
        curve = self.losses[method]
        return float((curve[-1] - ref[-1]) / (curve[0] - ref[-1]))


def _problem(features: int, samples: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((samples, features)).astype(np.float32)
    teacher = rng.normal(0.0, 0.05, features).astype(np.float32)
    y = x @ teacher + 0.01 * rng.standard_normal(samples).astype(np.float32)
    start = rng.normal(0.0, 0.05, features).astype(np.float32)
    return x, y, start


def run_demo(
    steps=1500, lr=3e-5, features=512, samples=4096, batch=256, seed=0, eval_every=10,
    progress=None,
):
    """Train the four variants; returns a ``DemoResult``. ``progress(i)`` is called per step."""
    x, y, start = _problem(features, samples, seed)
    bf16 = ml_dtypes.bfloat16
    weights = {
        "fp32": start.copy(),
        "bf16 nearest": start.astype(bf16),
        "bf16 stochastic": start.astype(bf16),
        "bf16 kahan": start.astype(bf16),
        "bf16 + remainder": start.copy(),  # stored as its two 16-bit halves, see forward_weights
        "bf16 + fp32 master": start.copy(),  # master; the forward pass uses its bf16 copy
    }
    kahan_compensation = np.zeros(features, bf16)
    adam = {m: (np.zeros(features, np.float32), np.zeros(features, np.float32)) for m in METHODS}
    losses = {m: [] for m in METHODS}
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    batches = np.random.default_rng(seed + 1)

    def forward_weights(method):
        w = weights[method]
        if method == "bf16 + fp32 master":
            return w.astype(bf16).astype(np.float32)
        if method == "bf16 + remainder":  # the high (bf16) half of the pattern
            return (w.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
        return w.astype(np.float32)

    def full_loss(method):
        r = x @ forward_weights(method) - y
        return float(np.mean(r.astype(np.float64) ** 2))

    evaluated_at = []
    for step in range(1, steps + 1):
        rows = batches.integers(0, samples, batch)
        xb, yb = x[rows], y[rows]
        if (step - 1) % eval_every == 0:
            evaluated_at.append(step - 1)
            for method in METHODS:
                losses[method].append(full_loss(method))
        for method in METHODS:
            w32 = forward_weights(method)
            grad = (2.0 / batch) * (xb.T @ (xb @ w32 - yb))
            m, v = adam[method]
            m[:] = beta1 * m + (1 - beta1) * grad
            v[:] = beta2 * v + (1 - beta2) * grad * grad
            m_hat = m / (1 - beta1**step)
            v_hat = v / (1 - beta2**step)
            update = (-lr * m_hat / (np.sqrt(v_hat) + eps)).astype(np.float32)
            if method == "bf16 nearest":
                weights[method] = srround.round_nearest(weights[method].astype(np.float32) + update)
            elif method == "bf16 stochastic":
                srround.stochastic_add(weights[method], update, seed=seed, offset=step * features)
            elif method == "bf16 kahan":
                exact = weights[method].astype(np.float32) + (
                    kahan_compensation.astype(np.float32) + update
                )
                weights[method] = srround.round_nearest(exact)
                kahan_compensation = srround.round_nearest(
                    exact - weights[method].astype(np.float32)
                )
            else:  # fp32 arithmetic on the full value (remainder: the two halves together)
                weights[method] += update
        if progress is not None:
            progress(step)
    evaluated_at.append(steps)
    for method in METHODS:
        losses[method].append(full_loss(method))
    curves = {m: np.array(v) for m, v in losses.items()}
    return DemoResult(curves, np.array(evaluated_at), lr, steps)


def format_table(result: DemoResult) -> str:
    lines = [
        f"Adam, lr={result.lr:g}, {result.steps} steps; progress = (L - L_fp32) / (L_0 - L_fp32):"
        " 0 is as far as fp32 got, 1 is no progress",
        f"{'method':<20} {'final loss':>12} {'progress':>10}",
    ]
    for method in METHODS:
        lines.append(
            f"{method:<20} {result.losses[method][-1]:>12.6f} {result.progress(method):>10.3f}"
        )
    return "\n".join(lines)


def plot(result: DemoResult, path: str) -> bool:
    """Write the loss curves to ``path`` (PNG); False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = {"fp32": dict(color="black", ls="--", zorder=3)}
    for method in METHODS:
        ax.plot(
            result.evaluated_at, result.losses[method], label=method, lw=1.5,
            **styles.get(method, {}),
        )
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (MSE)")
    ax.set_yscale("log")
    ax.set_title(f"bf16 weights, Adam lr={result.lr:g}: nearest stalls, stochastic tracks fp32")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
