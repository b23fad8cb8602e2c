"""The ``srround`` command line (also ``python -m srround``)."""

from __future__ import annotations

import argparse
import math
import os
import sys


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def _demo_lr(text: str) -> float:
    """``--lr``: a finite number > 0 that both demos' AdamW (betas[0] 0.9, weight decay 0.01)
    can take: its first step size ``lr / (1 - 0.9)`` within float32 (else the optimizer
    refuses it once training has started)."""
    from ._validate import adamw_coefficients

    value = _positive_float(text)
    try:
        adamw_coefficients(value, 0.9, 0.01)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("lr: ")) from None
    return value


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**64), got {text!r}")
    return value


def _check_demo_args(args) -> str | None:
    """What is wrong with the demo's arguments beyond their syntax (one line), or None; makes
    the ``--out`` folder."""
    framework = args.framework or ("torch" if args.model == "lm" else "numpy")
    if args.model == "lm" and framework != "torch":
        return f"--framework: the lm demo runs on torch, got {framework!r}"
    try:
        __import__(framework)
    except ImportError:
        extra = "demo" if args.model == "lm" else framework
        return f"--framework: {framework} is not installed (pip install 'srround[{extra}]')" + (
            "; or run --model linear, which needs NumPy only" if args.model == "lm" else ""
        )
    if args.device == "cuda":
        if framework == "numpy":
            return (
                "--device: the numpy framework runs on the cpu only; use --framework torch or jax"
            )
        if framework == "torch":
            import torch

            if not torch.cuda.is_available():
                return "--device: cuda requested, but torch sees no CUDA GPU here"
        else:
            import jax

            try:
                jax.devices("gpu")
            except RuntimeError:
                return "--device: cuda requested, but jax sees no GPU here"
    try:  # before training: a plot that cannot be written would end the run with a traceback
        os.makedirs(args.out, exist_ok=True)
    except OSError as error:
        return f"--out: {args.out!r} cannot be a folder ({error.strerror})"
    if not os.access(args.out, os.W_OK | os.X_OK):
        return f"--out: {args.out!r} is not a writable folder"
    args.framework = framework
    return None


def _demo(args) -> int:
    import json

    problem = _check_demo_args(args)
    if problem:
        args.parser.error(problem)  # usage and the one-line message on stderr, exit status 2
    try:
        from tqdm import tqdm
    except ImportError:  # the progress bar is optional (pip install "srround[demo]")
        tqdm = None
    if args.model == "lm":
        import dataclasses

        from . import _demo_lm as demo

        base = demo.CUDA_CONFIG if args.device == "cuda" else demo.CPU_CONFIG
        changes = {k: getattr(args, k) for k in ("steps", "lr") if getattr(args, k) is not None}
        config = dataclasses.replace(base, **changes)
        steps, label = config.steps, f"training {len(demo.VARIANTS)} transformer variants"
        png = "demo_lm_loss.png"
    else:
        from . import _demo as demo

        steps = args.steps or 1500
        label = f"training {len(demo.METHODS)} variants"
        png = "demo_loss.png"
    bar = tqdm(total=steps, desc=label, unit="step") if tqdm else None
    progress = (lambda _step: bar.update()) if bar else None
    if args.model == "lm":
        result = demo.run_lm_demo(config, seed=args.seed, device=args.device, progress=progress)
        rows = result.rows()
    else:
        result = demo.run_demo(
            steps=steps,
            lr=args.lr or 3e-5,
            seed=args.seed,
            framework=args.framework,
            device=args.device,
            progress=progress,
        )
        rows = [
            {
                "name": m,
                "train_loss": float(result.losses[m][-1]),
                "validation_loss": None,
                "progress": result.progress(m),
            }
            for m in demo.METHODS
        ]
    if bar:
        bar.close()
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(demo.format_table(result))
    notes = sys.stderr if args.json else sys.stdout
    path = os.path.join(args.out, png)
    if demo.plot(result, path):
        print(f"loss curves: {path}", file=notes)
    else:
        print(
            "(install matplotlib for the loss-curve plot: pip install 'srround[demo]')", file=notes
        )
    return 0


_CSV_COLUMNS = (
    "name shape stored dtype status weights lost_fraction lost_updates updates zero_updates"
    " nonfinite_updates min_update_p10 min_update_p50 min_update_p90 lr_scale_half lr_scale_90"
    " max_abs min_nonzero fp16_overflow fp16_flushed fp16_subnormal fp16_rescale nan inf"
).split()


def _csv_rows(report):
    for r in report["tensors"]:
        s, f = r["stagnation"] or {}, r["fp16"]
        p = s.get("min_update_percentiles", {})
        yield {
            "name": r["name"],
            "shape": "x".join(map(str, r["shape"])),
            "stored": r["stored"],
            "dtype": r["dtype"],
            "status": "weight" if s else "weight (no update)",
            "weights": f["count"] + f["nan"] + f["inf"],
            "lost_fraction": s.get("lost_fraction"),
            "lost_updates": s.get("lost_updates"),
            "updates": s.get("updates"),
            "zero_updates": s.get("zero_updates"),
            "nonfinite_updates": s.get("nonfinite_updates"),
            "min_update_p10": p.get(10),
            "min_update_p50": p.get(50),
            "min_update_p90": p.get(90),
            "lr_scale_half": s.get("lr_scale_half"),
            "lr_scale_90": s.get("lr_scale_90"),
            "max_abs": f["max_abs"],
            "min_nonzero": f["min_nonzero"],
            "fp16_overflow": f["overflow"],
            "fp16_flushed": f["flushed"],
            "fp16_subnormal": f["subnormal"],
            "fp16_rescale": "none" if f["rescale"] is None else f["rescale"],
            "nan": f["nan"],
            "inf": f["inf"],
        }
    for r in report["not_audited"]:
        yield {
            "name": r["name"],
            "shape": "x".join(map(str, r["shape"])),
            "stored": r["dtype"],
            "status": f"not audited: {r['reason']}",
        }


def _size(shape):
    import math

    return math.prod(shape)


def _short(dtype):
    return {
        "bfloat16": "bf16",
        "float16": "fp16",
        "float32": "fp32",
        "float64": "fp64",
        "float8_e4m3fn": "e4m3",
        "float8_e5m2": "e5m2",
    }.get(dtype, dtype)


def _print_table(report, show_all):
    rows, other = report["tensors"], report["not_audited"]
    overall = report["overall"]
    source = (
        f"updates from {report['update']} (signed)"
        if report["update"]
        else f"updates of lr={report['lr']:g} in either direction"
    )
    stored = sorted({r["stored"] for r in rows})
    target = sorted({r["dtype"] for r in rows})
    print(
        f"{report['checkpoint']}: {len(rows)} weight tensors, {report['weights']:,} weights"
        f" (stored {'/'.join(stored)}, audited as {'/'.join(target)}); {source}"
    )
    if report["nonfinite"]:
        bad = report["nonfinite"]
        print(f"WARNING: {len(bad)} tensors hold NaN/inf weights (left out of the statistics):")
        for r in bad if show_all else bad[:10]:
            print(f"  {r['name']}: {r['nan']:,} NaN, {r['inf']:,} inf")
        if not show_all and len(bad) > 10:
            print(f"  ... {len(bad) - 10} more (--all)")
    shown = rows if show_all else rows[:20]
    width = max([6, *(len(r["name"]) for r in shown)])
    ranged = {r["fp16"].get("dtype", "float16") for r in shown} | {"float16"}
    fmt = "fp16" if ranged == {"float16"} else _short(sorted(ranged - {"float16"})[0])
    over = "NaN" if fmt == _short("float8_e4m3fn") else "inf"
    header = (
        f"{'tensor':<{width}} {'dtype':>5} {'weights':>11} {'lost':>7} {'min upd p50':>11}"
        f" {'lr x50%':>8} {'max|w|':>9} {fmt + ' ' + over:>9} {fmt + ' 0':>8}"
        f" {fmt + ' sub':>9} {'rescale':>8}"
    )

    def line(name, dtype, count, s, f):
        lost = "-" if s is None else f"{s['lost_fraction']:.1%}"
        p50 = "-" if s is None else f"{s['min_update_percentiles'][50]:.3g}"
        scale = "-" if s is None else f"{s['lr_scale_half']:.3g}"
        rescale = "none" if f["rescale"] is None else f"{f['rescale']:g}"
        return (
            f"{name:<{width}} {_short(dtype):>5} {count:>11,} {lost:>7} {p50:>11} {scale:>8}"
            f" {f['max_abs']:>9.3g} {f['overflow']:>9,} {f['flushed']:>8,} {f['subnormal']:>9,}"
            f" {rescale:>8}"
        )

    print(header)
    print("-" * len(header))
    for r in shown:
        count = _size(r["shape"])
        print(line(r["name"], r["dtype"], count, r["stagnation"], r["fp16"]))
    if len(shown) < len(rows):
        print(f"... {len(rows) - len(shown)} more (--all, or --format json|csv)")
    print("-" * len(header))
    dtype = target[0] if len(target) == 1 else "mixed"
    print(line("all", dtype, report["weights"], overall["stagnation"], overall["fp16"]))
    if report["missing_updates"]:
        missing = report["missing_updates"]
        print(
            f"no update for {len(missing)} weight tensors (fp16 range only):"
            f" {', '.join(missing if show_all else missing[:5])}"
            + ("" if show_all or len(missing) <= 5 else f", ... {len(missing) - 5} more")
        )
    if report["unused_updates"]:
        unused = report["unused_updates"]
        print(f"{len(unused)} update tensors match no weight (ignored): {', '.join(unused[:5])}")
    if other:
        print(f"not audited ({len(other)} tensors that are not trained weights):")
        for r in other if show_all else other[:10]:
            print(f"  {r['name']} {r['dtype']} {list(r['shape'])}: {r['reason']}")
        if not show_all and len(other) > 10:
            print(f"  ... {len(other) - 10} more (--all)")
    s = overall["stagnation"]
    if s is not None and s["updates"]:
        print(f"90% of weights move at lr x{s['lr_scale_90']:.3g}.")
    print(overall["recommendation"])
    print(overall["fp16_verdict"])


def _audit(args) -> int:
    import csv
    import json

    from . import audit
    from ._checkpoint import CheckpointError

    fmt = "json" if args.json else args.format
    if args.lr is not None and args.update:
        print(
            "srround audit: error: --lr and --update exclude each other (--update holds the real"
            " signed updates, --lr is one update magnitude for every weight)",
            file=sys.stderr,
        )
        return 2
    try:
        report = audit.audit_checkpoint(
            args.checkpoint,
            lr=args.lr,
            update=args.update,
            dtype=None if args.dtype == "auto" else args.dtype,
        )
    except (CheckpointError, ValueError, TypeError) as error:
        print(f"srround audit: error: {error}", file=sys.stderr)
        return 2
    if fmt == "json":
        print(json.dumps(report, indent=2))
    elif fmt == "csv":
        writer = csv.DictWriter(sys.stdout, _CSV_COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(_csv_rows(report))
    else:
        _print_table(report, args.all)
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
        chosen = [p for p in scripts if any(name in p.stem for name in args.only)]
        if not chosen:
            print(
                f"srround bench: error: --only: no benchmark matches"
                f" {', '.join(map(repr, args.only))}; the benchmarks are"
                f" {', '.join(p.stem for p in scripts)}",
                file=sys.stderr,
            )
            return 2
        scripts = chosen
    status = 0
    for script in scripts:
        print(f"== {script.name} ==", flush=True)
        command = [sys.executable, str(script)] + (["--quick"] if args.quick else [])
        status |= subprocess.run(command).returncode
    return status


def main(argv=None) -> int:
    from . import _demo_lm as lm  # NumPy only at import: its torch import is inside functions

    parser = argparse.ArgumentParser(prog="srround", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="train with bf16 weights: round-to-nearest stalls, stochastic rounding tracks fp32",
        description="Train the same model from the same start with fp32 weights, bf16 weights"
        " rounded to nearest, bf16 with srround's stochastic rounding and bf16 with Kahan"
        " compensation or fp32 master weights; print a table and write a PNG of the loss curves.",
    )
    demo.add_argument(
        "--model",
        default="lm",
        choices=["lm", "linear"],
        help="lm (default): a byte-level transformer language model on the Python standard"
        " library's source, a few minutes on 2 CPU cores, needs torch; linear: a 512-weight"
        " linear model on generated data, seconds, NumPy only",
    )
    demo.add_argument(
        "--steps",
        type=_positive_int,
        help=f"optimizer steps (default: lm {lm.CPU_CONFIG.steps}, {lm.CUDA_CONFIG.steps} with"
        " --device cuda; linear 1500)",
    )
    demo.add_argument(
        "--lr",
        type=_demo_lr,
        help=f"AdamW learning rate (default: lm {lm.CPU_CONFIG.lr:g}, {lm.CUDA_CONFIG.lr:g} with"
        " --device cuda; linear 3e-5)",
    )
    demo.add_argument(
        "--seed", type=_seed, default=0, help="initialisation, data and rounding seed (default 0)"
    )
    demo.add_argument("--out", default="srround-demo", help="folder for the plot")
    demo.add_argument(
        "--framework",
        choices=["numpy", "torch", "jax"],
        help="where the linear model's weights live (default numpy; the lm demo is torch)",
    )
    demo.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cpu (default) or cuda (a GPU through torch or jax; lm: a larger model)",
    )
    demo.add_argument(
        "--json",
        action="store_true",
        help="print the table as JSON: one object per variant (name, train_loss,"
        " validation_loss, progress)",
    )
    demo.set_defaults(run=_demo, parser=demo)
    audit = commands.add_parser(
        "audit", help="check a checkpoint for bf16/fp16 update stagnation and fp16 range"
    )
    audit.add_argument("checkpoint", help=".safetensors, .pt/.pth/.bin (torch), .npz or .npy")
    audit.add_argument(
        "--lr",
        type=float,
        default=None,
        help="update magnitude per weight, sign unknown (Adam-like; default 1e-5)",
    )
    audit.add_argument(
        "--update",
        help="a checkpoint of real signed per-weight updates (same names; not with --lr)",
    )
    audit.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"],
        help="training storage format (default auto: the stored 16-bit or fp8 format, bfloat16"
        " for fp32); fp8: lost updates and the range (overflow, flush, rescale) in that format",
    )
    audit.add_argument(
        "--format",
        default="table",
        choices=["table", "json", "csv"],
        help="table (default), or every tensor as JSON or CSV",
    )
    audit.add_argument("--json", action="store_true", help="same as --format json")
    audit.add_argument(
        "--all", action="store_true", help="table: list every tensor, not the top 20"
    )
    audit.set_defaults(run=_audit)
    bench = commands.add_parser(
        "bench", help="run the benchmarks (CPU; GPU when present), each with same-run baselines"
    )
    bench.add_argument("--quick", action="store_true", help="small sizes, about a minute each")
    bench.add_argument("--only", nargs="*", help="run only scripts whose name contains these")
    bench.set_defaults(run=_bench)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except BrokenPipeError:  # the reader went away (``srround audit ... | head``)
        # the interpreter flushes stdout at exit: into /dev/null, not the closed pipe
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:  # Ctrl-C: the shell's status for SIGINT, no traceback
        print("\nsrround: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
