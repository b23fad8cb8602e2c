"""``srround demo``: the problem and the fix, on this machine, in about a minute.

A linear model (teacher-student regression on generated data, no downloads) is trained with AdamW
at a small learning rate, its weights stored six ways:

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
    where: str = "numpy on cpu"

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


class _Framework:
    """The few framework-specific pieces of the demo: the array namespace, moving NumPy data
    in, and the bf16 half of an fp32 pattern (for the remainder variant). Everything else is
    written once with operators, ``xp.sqrt``/``xp.mean`` and srround calls."""

    def __init__(self, name: str, device: str):
        self.name = name
        if name == "numpy":
            if device != "cpu":
                raise ValueError("device: the numpy framework runs on the cpu only")
            self.xp, self.put = np, np.asarray
            self.high_half = lambda w: (w.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
        elif name == "torch":
            import torch

            target = torch.device(device)
            self.xp = torch
            self.put = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(target)
            self.high_half = lambda w: (w.view(torch.int32) & -65536).view(torch.float32)
        elif name == "jax":
            import jax
            import jax.numpy as jnp

            backend = "gpu" if device == "cuda" else device
            target = jax.devices(backend)[0]
            self.xp = jnp
            self.put = lambda a: jax.device_put(a, target)
            self.high_half = lambda w: jax.lax.bitcast_convert_type(
                jax.lax.bitcast_convert_type(w, jnp.uint32) & jnp.uint32(0xFFFF0000), jnp.float32
            )
        else:
            raise ValueError(f"framework: expected one of numpy, torch, jax; got {name!r}")


def run_demo(
    steps=1500,
    lr=3e-5,
    weight_decay=0.01,
    features=512,
    samples=4096,
    batch=256,
    seed=0,
    eval_every=10,
    framework="numpy",
    device="cpu",
    progress=None,
):
    """Train every variant; returns a ``DemoResult``. ``progress(step)`` is called per step.

    ``framework`` (``"numpy"``, ``"torch"``, ``"jax"``) and ``device`` (``"cpu"``, ``"cuda"``)
    choose where the weights live; the srround calls are the same for all of them.
    """
    fw = _Framework(framework, device)
    xp = fw.xp
    x_host, y_host, start_host = _problem(features, samples, seed)
    x, y, start = fw.put(x_host), fw.put(y_host), fw.put(start_host)
    bf16_start = srround.round_nearest(start)
    weights = {
        "fp32": start,
        "bf16 nearest": bf16_start,
        "bf16 stochastic": srround.round_nearest(start),
        "bf16 kahan": bf16_start,
        "bf16 + remainder": start,  # fp32 kept as its bf16 half and 16 low bits (high_half)
        "bf16 + fp32 master": start,  # master; the forward pass uses its bf16 copy
    }
    kahan_compensation = srround.round_nearest(start * 0.0)
    zeros = fw.put(np.zeros(features, np.float32))
    adam = {m: (zeros, zeros) for m in METHODS}
    losses = {m: [] for m in METHODS}
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    batches = np.random.default_rng(seed + 1)

    def forward_weights(method):
        w = weights[method]
        if method == "bf16 + fp32 master":
            return srround.to_float32(srround.round_nearest(w))
        if method == "bf16 + remainder":
            return fw.high_half(w)
        if method in ("fp32",):
            return w
        return srround.to_float32(w)

    def full_loss(method):
        r = x @ forward_weights(method) - y
        return float(xp.mean(r * r))

    evaluated_at = []
    for step in range(1, steps + 1):
        rows = batches.integers(0, samples, batch)
        xb, yb = fw.put(x_host[rows]), fw.put(y_host[rows])
        if (step - 1) % eval_every == 0:
            evaluated_at.append(step - 1)
            for method in METHODS:
                losses[method].append(full_loss(method))
        for method in METHODS:
            w32 = forward_weights(method)
            grad = (2.0 / batch) * (xb.T @ (xb @ w32 - yb))
            m, v = adam[method]
            m = beta1 * m + (1 - beta1) * grad
            v = beta2 * v + (1 - beta2) * grad * grad
            adam[method] = (m, v)
            m_hat = m / (1 - beta1**step)
            v_hat = v / (1 - beta2**step)
            # AdamW (torch.optim.AdamW's math): decoupled weight decay on the forward weights
            update = -lr * (m_hat / (xp.sqrt(v_hat) + eps) + weight_decay * w32)
            w = weights[method]
            if method == "bf16 nearest":
                w = srround.round_nearest(srround.to_float32(w) + update)
            elif method == "bf16 stochastic":
                w = srround.stochastic_add(w, update, seed=seed, offset=step * features)
            elif method == "bf16 kahan":
                exact = srround.to_float32(w) + (srround.to_float32(kahan_compensation) + update)
                w = srround.round_nearest(exact)
                kahan_compensation = srround.round_nearest(exact - srround.to_float32(w))
            else:  # fp32 arithmetic on the full value (remainder: the two halves together)
                w = w + update
            weights[method] = w
        if progress is not None:
            progress(step)
    evaluated_at.append(steps)
    for method in METHODS:
        losses[method].append(full_loss(method))
    curves = {m: np.array(v) for m, v in losses.items()}
    return DemoResult(curves, np.array(evaluated_at), lr, steps, f"{framework} on {device}")


def format_table(result: DemoResult) -> str:
    lines = [
        f"{result.where}: AdamW, lr={result.lr:g}, {result.steps} steps;"
        " progress = (L - L_fp32) / (L_0 - L_fp32): 0 is as far as fp32 got, 1 is no progress",
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
            result.evaluated_at,
            result.losses[method],
            label=method,
            lw=1.5,
            **styles.get(method, {}),
        )
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (MSE)")
    ax.set_yscale("log")
    ax.set_title(f"bf16 weights, AdamW lr={result.lr:g}: nearest stalls, stochastic tracks fp32")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
