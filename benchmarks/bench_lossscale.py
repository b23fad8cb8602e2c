#!/usr/bin/env python
"""The fused unscale-and-check pass against torch's ``_amp_foreach_non_finite_check_and_unscale_``
(what ``torch.amp.GradScaler.unscale_`` calls), on a transformer-like list of gradients.

Usage::

    python benchmarks/bench_lossscale.py [--quick] [--device cpu|cuda|all] [--json PATH]
                                         [--plot PATH]

CPU: ~25M gradients in ~200 tensors (``--quick``: ~6M); GPU: 268M in 200. Every row reads and
writes each gradient once (fp32: 8 B per element, bf16: 4 B), except srround's check-only row
(``inv_scale=1``: reads only, what its GradScaler runs before a fused srround step). GB/s and ``%
floor`` divide by the same run's floor: an in-place ``flat.mul_(s)`` on one flat tensor of the same
bytes (the same traffic with no tensor list and no check). ``host µs`` is one call on a 200-tensor
list of 1-element gradients: pure per-call overhead. ``step:`` rows time a whole loss-scaled AdamW
step (``scaled_steps``) against torch's GradScaler with torch's fused AdamW. Medians of timed
repetitions after a warm-up.


``--plot PATH`` also trains a small fp16 model whose gradients underflow to zero without
scaling, with and without ``srround.adapters.torch.GradScaler``, and plots both loss curves.
"""

from __future__ import annotations

import itertools

from _harness import add_json_argument, bench_parser, repo_on_path, time_steps, utc_now, write_json


def shapes(total: int, tensors: int = 196):
    """A transformer-like mix: per layer 4 square matrices, 2 wide, 4 vectors, scaled to total."""
    d = 1
    while 12 * (2 * d) ** 2 * (tensors // 10) <= total:
        d *= 2
    layer = [(d, d)] * 4 + [(4 * d, d), (d, 4 * d)] + [(d,)] * 4
    out = (layer * (tensors // len(layer) + 1))[:tensors]
    return out


def timeit(fn, sync, reps):
    """Median seconds per call of ``fn`` (then ``sync()``) over ``reps`` timed calls."""
    return time_steps(fn, sync, reps)["median_s"]


def run(device: str, total: int, reps: int):
    import torch

    import srround

    rows = []
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    # fp16 too on CUDA (GradScaler's case); torch has no CUDA bf16 unscale kernel
    dtypes = (torch.float32, torch.bfloat16) + ((torch.float16,) if device == "cuda" else ())
    for dtype in dtypes:
        grads = [torch.randn(s, device=device).to(dtype) for s in shapes(total)]
        n = sum(g.numel() for g in grads)
        nbytes = 2 * n * grads[0].element_size()
        # x2 and x0.5 in turn: exact, so the values stay the same from call to call (1.0 would
        # let srround skip its stores: that is the check-only row)
        invs = itertools.cycle([torch.tensor([v], device=device) for v in (2.0, 0.5)])
        factors = itertools.cycle((2.0, 0.5))  # the floor's (a Python float keeps bf16 math)
        one = torch.tensor([1.0], device=device)
        found = torch.zeros(1, device=device)
        flat = torch.randn(n, device=device).to(dtype)
        cases = {
            "floor: flat.mul_(s)": lambda: flat.mul_(next(factors)),
            "torch _amp_foreach_...unscale_": lambda: (
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found, next(invs))
            ),
            "srround unscale_and_check": lambda: srround.unscale_and_check(
                grads, next(invs), found_inf=found
            ),
            "srround check only (inv_scale=1)": lambda: srround.unscale_and_check(
                grads, one, found_inf=found
            ),
        }
        if device == "cuda" and dtype == torch.bfloat16:
            del cases["torch _amp_foreach_...unscale_"]  # not implemented for bf16 on CUDA
        floor = None
        for name, fn in cases.items():
            seconds = timeit(fn, sync, reps)
            gbs = nbytes / seconds / 1e9
            floor = floor or gbs
            rows.append(
                {
                    "device": device,
                    "dtype": str(dtype).split(".")[-1],
                    "method": name,
                    "elements": n,
                    "tensors": len(grads),
                    "ms": seconds * 1e3,
                    "GB/s": gbs,
                    "floor": gbs / floor,
                }
            )
    rows += scaled_steps(device, total, reps, sync)
    tiny = [torch.ones(1, device=device) for _ in range(200)]
    inv = torch.tensor([1.0], device=device)
    found = torch.zeros(1, device=device)
    for name, fn in {
        "torch _amp_foreach_...unscale_": lambda: torch._amp_foreach_non_finite_check_and_unscale_(
            tiny, found, inv
        ),
        "srround unscale_and_check": lambda: srround.unscale_and_check(tiny, inv, found_inf=found),
    }.items():
        rows.append(
            {
                "device": device,
                "dtype": "float32",
                "method": name,
                "elements": 200,
                "tensors": 200,
                "host_us": timeit(fn, sync, 200) * 1e6,
            }
        )
    return rows


def scaled_steps(device: str, total: int, reps: int, sync):
    """One loss-scaled AdamW step (``scaler.step(opt); scaler.update()``) over the same
    gradient list, bf16 or fp32 parameters and gradients: torch's GradScaler unscales the
    gradients in place (read + write) before the fused step reads them again; srround's checks
    them through the optimizer's cached table (read only) and multiplies by 1/scale inside the
    fused step. Scale 1 and growth disabled keep every step alike; ``ms`` per step."""
    import torch

    from srround.adapters.torch import AdamW, GradScaler

    def scaler(cls):
        return lambda: cls(device, init_scale=1.0, growth_interval=1 << 30)

    rows = []
    # fp16 too on CUDA (GradScaler's case); torch has no CUDA bf16 unscale kernel
    dtypes = (torch.float32, torch.bfloat16) + ((torch.float16,) if device == "cuda" else ())
    for dtype in dtypes:
        cases = {
            "srround AdamW + srround GradScaler": (
                lambda ps: AdamW(ps, lr=1e-3, seed=0),
                scaler(GradScaler),
            ),
            "srround AdamW, no scaler": (lambda ps: AdamW(ps, lr=1e-3, seed=0), None),
            "torch AdamW fused + torch GradScaler": (
                lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
                scaler(torch.amp.GradScaler),
            ),
            "torch AdamW fused, no scaler": (
                lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
                None,
            ),
        }
        for name, (make_opt, make_scaler) in cases.items():
            params = [
                torch.nn.Parameter((torch.randn(s, device=device) * 0.02).to(dtype))
                for s in shapes(total)
            ]
            for p in params:
                p.grad = torch.randn_like(p)
            opt = make_opt(params)
            if make_scaler is None:
                step = opt.step
            else:
                grad_scaler = make_scaler()
                grad_scaler.scale(torch.ones((), device=device))  # creates the scale

                def step(opt=opt, grad_scaler=grad_scaler):
                    grad_scaler.step(opt)
                    grad_scaler.update()

            try:
                seconds = timeit(step, sync, reps)
            except (RuntimeError, NotImplementedError) as exc:
                print(f"{device} {dtype}: {name}: skipped ({type(exc).__name__}: {exc})")
                continue
            rows.append(
                {
                    "device": device,
                    "dtype": str(dtype).split(".")[-1],
                    "method": f"step: {name}",
                    "elements": sum(p.numel() for p in params),
                    "tensors": len(params),
                    "ms": seconds * 1e3,
                }
            )
    return rows


def fp16_training(steps: int = 60):
    """Loss curves of a linear model with fp16 weights on a loss scaled down so far (1e-8) that
    every fp16 gradient underflows to zero: ``{"no scaling": [...], "dynamic scaling": [...]}``.
    SGD forms the update in fp32 from the fp16 gradient (lr 3e7 compensates the tiny loss)."""
    import torch

    from srround.adapters.torch import GradScaler

    repo_on_path()
    from tests.reference import half_sgd

    torch.manual_seed(1)
    x = torch.randn(256, 8)
    y = x @ torch.randn(8, 1)
    curves = {}
    for name in ("no scaling", "dynamic scaling"):
        torch.manual_seed(2)
        model = torch.nn.Linear(8, 1).half()
        opt = half_sgd(model.parameters(), lr=3e7)
        scaler = GradScaler(
            "cpu", init_scale=2.0**24, growth_interval=10, enabled=name == "dynamic scaling"
        )
        curve = []
        for _ in range(steps):
            opt.zero_grad()
            loss = 1e-8 * torch.nn.functional.mse_loss(model(x.half()).float(), y)
            curve.append(loss.item())
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        curves[name] = curve
    return curves


def plot_fp16_training(path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = fp16_training()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, curve in curves.items():
        ax.plot(curve, label=f"{name} (final {curve[-1]:.2e})")
        print(f"fp16 training, {name}: loss {curve[0]:.3e} -> {curve[-1]:.3e}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (x1e-8 scale)")
    ax.set_title("fp16 weights: gradients underflow without loss scaling")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None):
    parser = bench_parser(__doc__, "a quarter of the elements, 5 steps")
    add_json_argument(parser)
    parser.add_argument("--plot", metavar="PATH", help="also plot fp16 training to PATH (PNG)")
    args = parser.parse_args(argv)
    started = utc_now()
    import torch

    devices = (
        ["cpu"]
        if args.device == "cpu"
        else ["cuda"]
        if args.device == "cuda"
        else (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
    )
    rows = []
    for device in devices:
        total = (268 << 20) if device == "cuda" else (25 << 20)
        rows += run(device, total // 4 if args.quick else total, 5 if args.quick else 15)
    print(
        f"{'device':<6} {'dtype':<9} {'method':<42} {'elements':>11} {'tensors':>7}"
        f" {'ms':>8} {'GB/s':>7} {'% floor':>8} {'host µs':>8}"
    )
    for r in rows:
        if "host_us" in r:
            print(
                f"{r['device']:<6} {r['dtype']:<9} {r['method']:<42} {r['elements']:>11,}"
                f" {r['tensors']:>7} {'':>8} {'':>7} {'':>8} {r['host_us']:>8.1f}"
            )
        elif "GB/s" in r:
            print(
                f"{r['device']:<6} {r['dtype']:<9} {r['method']:<42} {r['elements']:>11,}"
                f" {r['tensors']:>7} {r['ms']:>8.2f} {r['GB/s']:>7.2f} {r['floor']:>8.0%}"
            )
        else:
            print(
                f"{r['device']:<6} {r['dtype']:<9} {r['method']:<42} {r['elements']:>11,}"
                f" {r['tensors']:>7} {r['ms']:>8.2f}"
            )
    write_json(
        args.json,
        "bench_lossscale",
        results=rows,
        columns=[
            ("device", "device", ""),
            ("dtype", "dtype", ""),
            ("method", "method", ""),
            ("elements", "elements", ",d"),
            ("tensors", "tensors", "d"),
            ("ms", "ms", ".3f"),
            ("GB/s", "GB/s", ".2f"),
            ("floor", "% floor", "%"),
            ("host_us", "host us", ".1f"),
        ],
        baseline="per device and dtype: 'floor: flat.mul_(s)' (the same bytes in place, one flat"
        " tensor) and torch's _amp_foreach_non_finite_check_and_unscale_; step rows: torch's"
        " GradScaler with torch's fused AdamW",
        meta={"quick": args.quick},
        gpu=torch.cuda.get_device_name() if "cuda" in devices else None,
        started=started,
    )
    if args.plot:
        plot_fp16_training(args.plot)


if __name__ == "__main__":
    main()
