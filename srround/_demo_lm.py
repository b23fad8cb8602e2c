"""``srround demo --model lm``: pure-bf16 training of a small transformer language model.

A decoder-only, byte-level transformer (pre-norm RMSNorm blocks without biases, as LLaMA) learns
to predict the next byte of real text that every Python installation has: the standard
library's own ``.py`` files, read at run time (a fixed sorted selection; every tenth file is
held out for validation). Every variant starts from the same initialisation, sees the same
batches and steps with ``srround.adapters.torch.AdamW``:

* ``fp32``              - fp32 weights and compute: the reference;
* ``bf16 + fp32 master``- bf16 weights in the forward and backward pass, fp32 master weights
                          in the optimizer (``rounding="master"``, 6 B per weight): bf16 mixed
                          precision ("bf16 AMP") as apex O2 / DeepSpeed keep it;
* ``bf16 nearest``      - pure bf16 weights and gradients, each fp32 update rounded to nearest
                          (``rounding="nearest"``, 2 B): updates below half a bf16 ulp of the
                          weight are lost, so training stalls;
* ``bf16 stochastic``   - pure bf16 with srround's stochastic rounding (``"stochastic"``, 2 B):
                          the expected weight follows the fp32 trajectory;
* ``bf16 kahan``        - pure bf16 plus a bf16 Kahan compensation buffer (``"kahan"``, 4 B).

The bf16 variants compute their activations in ``LMConfig.compute_dtype``: float32 on the CPU
(from the bf16 weights, exactly: CPUs without native bf16 arithmetic run bf16 matrix products
many times slower than fp32 ones), bfloat16 in the CUDA configuration. The weights, their
gradients and the rounding of every update - where the stall happens - are bf16 either way.

The learning rate is small on purpose (torchao's pure-bf16 LLaMA runs used 1e-5): with weights
initialised at std 0.02, Adam's updates of about ``lr`` are below half a bf16 ulp for most
weights (ulp/2 is ``|w| * 2**-9`` to ``|w| * 2**-8``: 1e-5 already for ``|w|`` near 0.004) and
for every RMSNorm gain (1.0, ulp/2 = 2**-8).

Progress is ``(L - L_fp32) / (L_0 - L_fp32)`` on the validation loss (0: as far as fp32 got,
1: no progress at all). Application layer: torch is imported inside the functions only.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

import numpy as np

VARIANTS = ("fp32", "bf16 + fp32 master", "bf16 nearest", "bf16 stochastic", "bf16 kahan")
# variant -> AdamW rounding mode (fp32 weights are updated exactly in every mode)
_ROUNDING = {
    "fp32": "stochastic",
    "bf16 + fp32 master": "master",
    "bf16 nearest": "nearest",
    "bf16 stochastic": "stochastic",
    "bf16 kahan": "kahan",
}


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """Model, data and training sizes of one demo run.

    Attributes:
        steps: optimizer steps (each variant).
        lr: AdamW learning rate.
        d_model, n_layers, n_heads: transformer width, depth and attention heads
            (``d_model`` divisible by ``n_heads``).
        seq_len: bytes per training sequence (context length).
        batch: sequences per step.
        init_std: standard deviation of the initial weights (residual projections:
            ``init_std / sqrt(2 * n_layers)``); RMSNorm gains start at 1.
        weight_decay: AdamW's decoupled weight decay.
        evals: number of loss evaluations along the run (plus step 0).
        eval_sequences: sequences in each fixed evaluation set (train and validation).
        max_bytes: cap on the training text read (the validation text: a tenth of it).
        compute_dtype: activations of the bf16 variants, ``"float32"`` or ``"bfloat16"``
            (the fp32 variant always computes in float32).
    """

    steps: int = 400
    lr: float = 1e-5
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    seq_len: int = 64
    batch: int = 16
    init_std: float = 0.02
    weight_decay: float = 0.01
    evals: int = 20
    eval_sequences: int = 32
    max_bytes: int = 4_000_000
    compute_dtype: str = "float32"


# the CPU default fits 2 cores in a few minutes; the GPU one is a larger model, longer context
CPU_CONFIG = LMConfig()
CUDA_CONFIG = LMConfig(
    steps=3000,
    d_model=256,
    n_layers=4,
    n_heads=4,
    seq_len=256,
    batch=32,
    max_bytes=20_000_000,
    compute_dtype="bfloat16",
)


@dataclasses.dataclass
class LMResult:
    """Loss curves of every variant (float64 arrays at ``evaluated_at`` steps)."""

    train: dict  # variant -> fixed training-set loss, nats per byte
    validation: dict  # variant -> held-out loss, nats per byte
    evaluated_at: np.ndarray  # int64: 0, ..., steps
    config: LMConfig
    seconds: float
    where: str

    def progress(self, variant: str) -> float:
        """``(L - L_fp32) / (L_0 - L_fp32)`` of the final validation loss."""
        ref = self.validation["fp32"][-1]
        curve = self.validation[variant]
        return float((curve[-1] - ref) / (curve[0] - ref))

    def rows(self) -> list:
        """The table: one dict per variant (name, train_loss, validation_loss, progress)."""
        return [
            {
                "name": v,
                "train_loss": float(self.train[v][-1]),
                "validation_loss": float(self.validation[v][-1]),
                "progress": self.progress(v),
            }
            for v in VARIANTS
        ]


def stdlib_text(max_bytes: int = 4_000_000) -> tuple[bytes, bytes]:
    """The Python standard library's top-level ``.py`` files as ``(train, validation)`` bytes.

    Files are taken in sorted name order; every tenth (the 10th, 20th, ...) goes to validation.
    Reading stops once ``max_bytes`` of training text and ``max_bytes // 10`` of validation
    text are collected.

    Raises:
        RuntimeError: the standard library's sources are not on disk (a frozen or
            sources-stripped Python) or hold too little text.
    """
    root = os.path.dirname(os.__file__)
    try:
        names = sorted(n for n in os.listdir(root) if n.endswith(".py"))
    except OSError:
        names = []
    train, validation = bytearray(), bytearray()
    for i, name in enumerate(names):
        part, cap = (validation, max_bytes // 10) if i % 10 == 9 else (train, max_bytes)
        if len(part) >= cap:
            if len(train) >= max_bytes and len(validation) >= max_bytes // 10:
                break
            continue
        try:
            with open(os.path.join(root, name), "rb") as f:
                part.extend(f.read())
        except OSError:
            continue
    if len(train) < 100_000 or len(validation) < 10_000:
        raise RuntimeError(
            f"the lm demo trains on the Python standard library's .py files, but {root} holds"
            f" only {len(train) + len(validation)} bytes of them; use --model linear"
        )
    return bytes(train), bytes(validation)


def _make_model(config: LMConfig, compute_dtype: str = "float32"):
    """The transformer, fp32, initialised from torch's current random state.

    Every layer computes in its input's dtype, whatever its parameters' dtype (weights are
    cast with ``.to(x.dtype)``): bf16 weights give bf16 gradients, and the activations' dtype
    is chosen once, by the embedding output (``compute_dtype``).
    """
    import torch
    from torch import nn
    from torch.nn import functional as F

    compute = getattr(torch, compute_dtype)

    class Linear(nn.Module):
        def __init__(self, d_in, d_out, std):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(d_out, d_in) * std)

        def forward(self, x):
            return F.linear(x, self.weight.to(x.dtype))

    class RMSNorm(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x):
            x32 = x.float()
            x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)
            return x32.to(x.dtype) * self.weight.to(x.dtype)

    class Block(nn.Module):
        def __init__(self, c):
            super().__init__()
            d, std = c.d_model, c.init_std
            residual_std = std / math.sqrt(2 * c.n_layers)
            self.heads = c.n_heads
            self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
            self.qkv = Linear(d, 3 * d, std)
            self.proj = Linear(d, d, residual_std)
            self.up = Linear(d, 4 * d, std)
            self.down = Linear(4 * d, d, residual_std)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
            q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            return x + self.down(F.gelu(self.up(self.norm2(x))))

    class ByteLM(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.embed = nn.Parameter(torch.randn(256, c.d_model) * c.init_std)
            self.position = nn.Parameter(torch.randn(c.seq_len, c.d_model) * c.init_std)
            self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layers))
            self.norm = RMSNorm(c.d_model)
            self.head = Linear(c.d_model, 256, c.init_std)

        def forward(self, tokens):
            x = F.embedding(tokens, self.embed).to(compute)
            x = x + self.position[: tokens.shape[1]].to(compute)
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))

    return ByteLM(config)


def _check_config(config: LMConfig) -> None:
    for name in ("steps", "d_model", "n_layers", "n_heads", "seq_len", "batch", "evals"):
        value = getattr(config, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    if config.d_model % config.n_heads:
        raise ValueError(f"d_model: {config.d_model} is not divisible by n_heads={config.n_heads}")
    if config.compute_dtype not in ("float32", "bfloat16"):
        raise ValueError(
            f"compute_dtype: expected 'float32' or 'bfloat16', got {config.compute_dtype!r}"
        )
    for name in ("lr", "init_std"):
        value = getattr(config, name)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name}: expected a finite number > 0, got {value!r}")
    if not (math.isfinite(config.weight_decay) and config.weight_decay >= 0):
        raise ValueError(
            f"weight_decay: expected a finite number >= 0, got {config.weight_decay!r}"
        )


def run_lm_demo(
    config: LMConfig = CPU_CONFIG, seed: int = 0, device: str = "cpu", progress=None, cpu_threads=1
):
    """Train every variant of ``VARIANTS`` on the standard-library text; returns an ``LMResult``.

    Args:
        config: sizes and hyperparameters (``CPU_CONFIG``, ``CUDA_CONFIG`` or your own).
        seed: initialisation, batch order and stochastic-rounding seed (int >= 0).
        device: ``"cpu"`` or ``"cuda"`` (a torch device string).
        progress: called with the step number after each step of all variants, or None.
        cpu_threads: threads of torch's operations and of srround's (Numba's) optimizer step
            during a CPU run (both restored afterwards), or None to leave both settings. 1 by
            default: the CPU model's tensors are too small for threads to pay, and on a busy
            machine threads that spin-wait between operations make a run many times slower.

    Raises:
        ValueError: a config field out of range, or ``device="cuda"`` without a GPU.
        RuntimeError: no standard-library text on disk (see ``stdlib_text``).
    """
    import numba
    import torch

    _check_config(config)
    target = torch.device(device)
    if target.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' requested but torch sees no CUDA GPU")
    previous = torch.get_num_threads(), numba.get_num_threads()
    if target.type == "cpu" and cpu_threads is not None:
        torch.set_num_threads(cpu_threads)
        numba.set_num_threads(min(cpu_threads, numba.config.NUMBA_NUM_THREADS))
    try:
        return _train(config, seed, target, progress)
    finally:
        torch.set_num_threads(previous[0])
        numba.set_num_threads(previous[1])


def _train(config, seed, target, progress):
    import torch
    from torch.nn import functional as F

    from srround.adapters.torch import AdamW

    started = time.perf_counter()
    train_text, val_text = stdlib_text(config.max_bytes)
    train_data = torch.from_numpy(np.frombuffer(train_text, np.uint8).astype(np.int64))
    val_data = torch.from_numpy(np.frombuffer(val_text, np.uint8).astype(np.int64))
    span = config.seq_len + 1

    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(train_data) - span, (config.steps, config.batch))
    train_eval = rng.integers(0, len(train_data) - span, config.eval_sequences)
    val_eval = np.linspace(0, len(val_data) - span, config.eval_sequences).astype(np.int64)
    offsets = torch.arange(span)

    def sequences(data, rows):
        return data[torch.from_numpy(np.asarray(rows))[:, None] + offsets].to(target)

    eval_sets = {
        "train": sequences(train_data, train_eval),
        "validation": sequences(val_data, val_eval),
    }

    torch.manual_seed(seed)
    initial = _make_model(config).state_dict()
    models, optimizers = {}, {}
    for variant in VARIANTS:
        bf16 = variant != "fp32"
        model = _make_model(config, config.compute_dtype if bf16 else "float32")
        model.load_state_dict(initial)
        model.to(device=target, dtype=torch.bfloat16 if bf16 else torch.float32)
        models[variant] = model
        optimizers[variant] = AdamW(
            model.parameters(),
            lr=config.lr,
            weight_decay=config.weight_decay,
            rounding=_ROUNDING[variant],
            seed=seed,
        )

    def loss_of(variant, batch):
        logits = models[variant](batch[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, 256), batch[:, 1:].reshape(-1))

    curves = {name: {v: [] for v in VARIANTS} for name in eval_sets}
    evaluated_at = []

    @torch.no_grad()
    def evaluate(step):
        evaluated_at.append(step)
        for variant in VARIANTS:
            models[variant].eval()
            for name, data in eval_sets.items():
                losses = [loss_of(variant, chunk).item() for chunk in data.split(config.batch)]
                curves[name][variant].append(float(np.mean(losses)))
            models[variant].train()

    eval_every = max(1, config.steps // config.evals)
    evaluate(0)
    for step in range(1, config.steps + 1):
        batch = sequences(train_data, starts[step - 1])
        for variant in VARIANTS:
            loss = loss_of(variant, batch)
            loss.backward()
            optimizers[variant].step()
            optimizers[variant].zero_grad(set_to_none=False)
        if step % eval_every == 0 or step == config.steps:
            evaluate(step)
        if progress is not None:
            progress(step)
    if target.type == "cuda":
        torch.cuda.synchronize(target)
    return LMResult(
        train={v: np.array(c) for v, c in curves["train"].items()},
        validation={v: np.array(c) for v, c in curves["validation"].items()},
        evaluated_at=np.array(evaluated_at),
        config=config,
        seconds=time.perf_counter() - started,
        where=f"torch {torch.__version__} on {target}",
    )


def format_table(result: LMResult) -> str:
    """The result as a text table (one row per variant)."""
    c = result.config
    lines = [
        f"byte-level transformer ({c.n_layers} layers, d={c.d_model}, context {c.seq_len}) on the"
        f" Python standard library's source, {result.where}, {result.seconds:.0f} s",
        f"AdamW lr={c.lr:g}, {c.steps} steps of {c.batch} sequences; loss in nats per byte;"
        " progress = (L - L_fp32) / (L_0 - L_fp32) on validation: 0 is as far as fp32 got,"
        " 1 is no progress",
        f"{'variant':<18} {'train loss':>11} {'val loss':>9} {'progress':>9}",
    ]
    for row in result.rows():
        lines.append(
            f"{row['name']:<18} {row['train_loss']:>11.4f} {row['validation_loss']:>9.4f}"
            f" {row['progress']:>9.3f}"
        )
    return "\n".join(lines)


def plot(result: LMResult, path: str) -> bool:
    """Write the train and validation loss curves to ``path`` (PNG); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    styles = {"fp32": dict(color="black", ls="--", zorder=3)}
    for ax, (title, curves) in zip(
        axes, (("training set", result.train), ("held-out validation", result.validation))
    ):
        for variant in VARIANTS:
            ax.plot(
                result.evaluated_at,
                curves[variant],
                label=variant,
                lw=1.5,
                **styles.get(variant, {}),
            )
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("loss (nats per byte)")
    axes[1].legend()
    fig.suptitle(
        f"byte-level transformer, AdamW lr={result.config.lr:g}: bf16 nearest stalls,"
        " stochastic rounding tracks fp32"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True
