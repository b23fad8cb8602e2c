"""The ``srround`` command line (also ``python -m srround``)."""

from __future__ import annotations

import argparse
import os
import sys


def _demo(args) -> int:
    from ._demo import METHODS, format_table, plot, run_demo

    try:
        from tqdm import tqdm
    except ImportError:  # the progress bar is optional (pip install "srround[demo]")
        tqdm = None
    label = f"training {len(METHODS)} variants"
    bar = tqdm(total=args.steps, desc=label, unit="step") if tqdm else None
    result = run_demo(
        steps=args.steps,
        lr=args.lr,
        seed=args.seed,
        framework=args.framework,
        device=args.device,
        progress=(lambda _step: bar.update()) if bar else None,
    )
    if bar:
        bar.close()
    print(format_table(result))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "demo_loss.png")
    if plot(result, path):
        print(f"loss curves: {path}")
    else:
        print("(install matplotlib for the loss-curve plot: pip install 'srround[demo]')")
    return 0


def _audit(args) -> int:
    import json

    import numpy as np

    from . import audit
    from ._checkpoint import CheckpointError, load

    try:
        tensors = load(args.checkpoint)
        updates = load(args.update) if args.update else {}
    except CheckpointError as error:
        print(f"srround audit: error: {error}", file=sys.stderr)
        return 2
    if not tensors:
        print(
            f"srround audit: error: {args.checkpoint}: no floating-point tensors", file=sys.stderr
        )
        return 2
    rows = []
    for name, tensor in tensors.items():
        update = updates.get(name)
        stag = audit.stagnation(
            tensor, update, lr=None if update is not None else args.lr, dtype=args.dtype
        )
        rows.append(
            {
                "name": name,
                "shape": list(np.shape(tensor)),
                "stagnation": stag.__dict__,
                "fp16": audit.fp16_range(tensor).__dict__,
            }
        )
    rows.sort(key=lambda r: (-r["stagnation"]["lost_fraction"], -r["stagnation"]["count"]))
    flat = np.concatenate([audit.to_float64(t).ravel() for t in tensors.values()])
    flat_update = None
    if updates:
        flat_update = np.concatenate(
            [
                audit.to_float64(updates[n]).ravel()
                if n in updates
                else np.full(np.size(tensors[n]), args.lr)
                for n in tensors
            ]
        )
    overall = audit.stagnation(flat, flat_update, lr=args.lr, dtype=args.dtype)
    fp16_all = audit.fp16_range(flat)
    summary = {
        "checkpoint": args.checkpoint,
        "dtype": args.dtype,
        "lr": args.lr,
        "overall": {
            "stagnation": overall.__dict__,
            "fp16": fp16_all.__dict__,
            "recommendation": overall.recommendation(),
        },
        "tensors": rows,
    }
    if args.json:
        print(json.dumps(summary, indent=2, default=float))
        return 0
    print(
        f"{args.checkpoint}: {len(rows)} tensors, {overall.count:,} weights; updates of"
        f" {'--update file' if updates else f'lr={args.lr:g}'} stored in {args.dtype}"
    )
    header = (
        f"{'tensor':<36} {'weights':>10} {'lost':>7} {'min upd p50':>12} {'lr x50%':>8}"
        f" {'max|w|':>9} {'fp16 inf':>8} {'fp16 0':>7} {'rescale':>8}"
    )
    print(header)
    print("-" * len(header))
    shown = rows if args.all else rows[:20]
    for r in shown:
        s, f = r["stagnation"], r["fp16"]
        rescale = "none" if f["rescale"] is None else f"{f['rescale']:g}"
        print(
            f"{r['name'][:36]:<36} {s['count']:>10,} {s['lost_fraction']:>7.1%}"
            f" {s['min_update_percentiles'][50]:>12.3g} {s['lr_scale_half']:>8.3g}"
            f" {f['max_abs']:>9.3g} {f['overflow_fraction']:>8.2%} {f['zero_fraction']:>7.2%}"
            f" {rescale:>8}"
        )
    if len(shown) < len(rows):
        print(f"... {len(rows) - len(shown)} more (--all shows every tensor)")
    print("-" * len(header))
    print(
        f"{'all':<36} {overall.count:>10,} {overall.lost_fraction:>7.1%}"
        f" {overall.min_update_percentiles[50]:>12.3g} {overall.lr_scale_half:>8.3g}"
        f" {fp16_all.max_abs:>9.3g} {fp16_all.overflow_fraction:>8.2%}"
        f" {fp16_all.zero_fraction:>7.2%}"
    )
    print(f"90% of weights move at lr x{overall.lr_scale_90:.3g}.")
    print(overall.recommendation())
    if fp16_all.safe:
        print("fp16: every weight fits fp16 (no overflow, none flushed to zero)")
    else:
        print("fp16: not safe as is - see the fp16 inf / fp16 0 / rescale columns")
    return 0


def _benchmarks_dir():
    """The repository's ``benchmarks/`` folder (a source checkout or an editable install)."""
    import pathlib

    here = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
    return here if here.is_dir() else None


def _bench(args) -> int:
    import subprocess

    folder = _benchmarks_dir()
    if folder is None:
        print(
            "srround bench: error: the benchmark scripts live in the repository's benchmarks/"
            " folder, which this installation does not have; run it from a source checkout"
            " (pip install -e .)",
            file=sys.stderr,
        )
        return 2
    scripts = sorted(folder.glob("bench_*.py"))
    if args.only:
        scripts = [p for p in scripts if any(name in p.stem for name in args.only)]
    status = 0
    for script in scripts:
        print(f"== {script.name} ==", flush=True)
        command = [sys.executable, str(script)] + (["--quick"] if args.quick else [])
        status |= subprocess.run(command).returncode
    return status


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="srround", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="train a small model with bf16 weights: nearest stalls, stochastic tracks fp32"
    )
    demo.add_argument("--steps", type=int, default=1500, help="optimizer steps (default 1500)")
    demo.add_argument("--lr", type=float, default=3e-5, help="AdamW learning rate (default 3e-5)")
    demo.add_argument("--seed", type=int, default=0, help="data and rounding seed (default 0)")
    demo.add_argument("--out", default="srround-demo", help="folder for the plot")
    demo.add_argument(
        "--framework",
        default="numpy",
        choices=["numpy", "torch", "jax"],
        help="where the weights live (default numpy)",
    )
    demo.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cpu (default) or cuda (torch/jax on a GPU)",
    )
    demo.set_defaults(run=_demo)
    audit = commands.add_parser(
        "audit", help="check a checkpoint for bf16/fp16 update stagnation and fp16 range"
    )
    audit.add_argument("checkpoint", help=".safetensors, .pt/.pth/.bin (torch) or .npz")
    audit.add_argument(
        "--lr",
        type=float,
        default=1e-5,
        help="update magnitude per weight, Adam-like (default 1e-5)",
    )
    audit.add_argument("--update", help="a checkpoint of real per-weight updates (same names)")
    audit.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float16"],
        help="storage format of the weights (default bfloat16)",
    )
    audit.add_argument("--json", action="store_true", help="machine-readable output")
    audit.add_argument("--all", action="store_true", help="list every tensor, not the top 20")
    audit.set_defaults(run=_audit)
    bench = commands.add_parser(
        "bench", help="run the benchmarks (CPU; GPU when present), each with same-run baselines"
    )
    bench.add_argument("--quick", action="store_true", help="small sizes, about a minute each")
    bench.add_argument("--only", nargs="*", help="run only scripts whose name contains these")
    bench.set_defaults(run=_bench)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
