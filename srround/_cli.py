"""The ``srround`` command line (also ``python -m srround``)."""

from __future__ import annotations

import argparse
import os
import sys


def _demo(args) -> int:
    from ._demo import format_table, plot, run_demo

    try:
        from tqdm import tqdm
    except ImportError:  # the progress bar is optional (pip install "srround[demo]")
        tqdm = None
    bar = tqdm(total=args.steps, desc="training 4 variants", unit="step") if tqdm else None
    result = run_demo(
        steps=args.steps, lr=args.lr, seed=args.seed,
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="srround", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="train a small model with bf16 weights: nearest stalls, stochastic tracks fp32"
    )
    demo.add_argument("--steps", type=int, default=1500, help="optimizer steps (default 1500)")
    demo.add_argument("--lr", type=float, default=3e-5, help="Adam learning rate (default 3e-5)")
    demo.add_argument("--seed", type=int, default=0, help="data and rounding seed (default 0)")
    demo.add_argument("--out", default="srround-demo", help="folder for the plot")
    demo.set_defaults(run=_demo)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
