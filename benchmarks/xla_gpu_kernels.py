"""What XLA's GPU compiler makes of srround's JAX native path, without a GPU: each case is compiled
for a GPU (the first one, or a compile-only device described by a ``GpuTargetConfigProto`` text
file: ``benchmarks/h100_sxm.txtpb``, from XLA's specs), and the largest kernel
of its program is assembled with ``ptxas`` and disassembled with ``cuobjdump``::

    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python benchmarks/xla_gpu_kernels.py \
        --target benchmarks/h100_sxm.txtpb

Needs JAX's CUDA plugin (``jax-cuda12-plugin`` or ``jax-cuda13-plugin``) and ``ptxas`` (on
``PATH`` or in an ``nvidia-*`` wheel: the CUDA toolkit, or the ``nvidia-cuda-nvcc`` wheel JAX's
CUDA install brings); ``cuobjdump`` and ``nvdisasm`` (the ``nvidia-cuda-cuobjdump`` and
``nvidia-cuda-nvdisasm`` wheels) for the SASS counts, which are left out without them. Per
case: the kernels of the program, the largest one's registers a thread and spilled bytes, its
SASS (and PTX) instructions, how many elements a thread computes (the widest vector load:
XLA's vectorization), its Threefry rotations (``shf.l.wrap.b32``: 20 per block), and per
element: all SASS instructions, those of the main path (up to the kernel's unpredicated
``EXIT``: without ptxas's slow-path subroutines for float64 division and square root, which
run only for extreme operands), and of these the float32 <-> float64 conversions (``F2F``, a
quarter of the float32 rate on an H100) and float64 ops. Same-program baselines:
``astype(bf16)`` and ``optax.adamw`` + ``optax.apply_updates``. A static proxy, not a timing:
what a kernel issues per element, which a GPU run then shows.

With ``--target`` the cases are compiled for that compile-only device even where a GPU is
present. The counts need a JAX whose XLA writes the kernels' PTX to its dump (``--xla_dump_to``):
JAX 0.10.2 does for the compile-only H100 on a CPU machine; JAX 0.11.2 on an H200 (2026-11-28)
wrote none for the real GPU, only HLO and MLIR. Where the dump holds no PTX the script says so,
with JAX's version and what the dump held, and exits with status 1: no counts, no JSON.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from _harness import add_json_argument, utc_now, write_json

N = 8_372_224  # elements per case: an 8th of jax_gpu_check's 67M (2044 x 4096)
CASES = [  # slug, what
    ("copy_astype_bf16", "x.astype(bf16) of a float32 matrix, 4096 columns (baseline)"),
    ("sr_vector", "stochastic_round of a float32 vector"),
    ("sr_4096_columns", "stochastic_round of a float32 matrix, 4096 columns"),
    ("sr_11008_columns", "stochastic_round of a float32 matrix, 11008 columns"),
    ("optax_adamw_apply_updates", "optax.adamw + optax.apply_updates, bf16 (baseline)"),
    ("optax_adamw_srround_apply_updates", "optax.adamw + srround apply_updates, bf16"),
    ("adamw_fp32_states", "fused adamw, bf16 params, fp32 states, 4096 columns"),
    ("adamw_bf16_states", "fused adamw, bf16 params, bf16 states, 4096 columns"),
    ("adamw_fp32_states_11008", "fused adamw, bf16 params, fp32 states, 11008 columns"),
]


def _compile_cases(target: str | None) -> str:
    """Compile every case for the GPU (child process: XLA_FLAGS dumps its PTX). Returns the
    device's description and JAX's version, a line each."""
    import jax
    import jax.numpy as jnp
    import optax

    from srround.adapters import jax as sj
    from srround.adapters.jax import _leaves

    if not target:
        try:
            device = jax.devices("gpu")[0]
        except RuntimeError:
            raise SystemExit("no GPU: pass --target FILE (a GpuTargetConfigProto text file)")
    else:  # the compile-only device, also where a GPU is present
        from jax.experimental import topologies

        config = Path(target).read_text()
        topology = topologies.get_topology_desc(
            platform="cuda", topology="1x1x1", target_config=config
        )
        device = topology.devices[0]
        # the GPU's program where JAX's default backend is the CPU
        _leaves._on_one_cpu = lambda leaves: False
    sharding = jax.sharding.SingleDeviceSharding(device)

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    def matrix(width, dtype=jnp.float32):
        return spec((N // width, width), dtype)

    key = spec((), jax.random.key(0).dtype)

    def adamw(width, state_dtype):
        tx = sj.adamw(1e-4, weight_decay=1e-2, seed=0, impl="native", state_dtype=state_dtype)
        params = [matrix(width, jnp.bfloat16)]
        state = jax.tree_util.tree_map(
            lambda a: spec(a.shape, a.dtype), jax.eval_shape(tx.init, params)
        )
        return tx.step, ([matrix(width)], state, params)

    otx = optax.adamw(1e-4, weight_decay=1e-2)
    params = [matrix(4096, jnp.bfloat16)]
    ostate = jax.tree_util.tree_map(
        lambda a: spec(a.shape, a.dtype), jax.eval_shape(otx.init, params)
    )

    def optax_step(p, s, g):
        u, s = otx.update(g, s, p)
        return optax.apply_updates(p, u), s

    def srround_apply(p, s, g):
        u, s = otx.update(g, s, p)
        return sj.apply_updates(p, u, jax.random.key(0), step=1), s

    def round_with(x, k):
        return sj.stochastic_round(x, seed=k)

    programs = {
        "copy_astype_bf16": (lambda x: x.astype(jnp.bfloat16), (matrix(4096),)),
        "sr_vector": (round_with, (spec((N,), jnp.float32), key)),
        "sr_4096_columns": (round_with, (matrix(4096), key)),
        "sr_11008_columns": (round_with, (matrix(11008), key)),
        "optax_adamw_apply_updates": (optax_step, (params, ostate, [matrix(4096)])),
        "optax_adamw_srround_apply_updates": (srround_apply, (params, ostate, [matrix(4096)])),
        "adamw_fp32_states": adamw(4096, jnp.float32),
        "adamw_bf16_states": adamw(4096, jnp.bfloat16),
        "adamw_fp32_states_11008": adamw(11008, jnp.float32),
    }
    for slug, (fn, args) in programs.items():

        def named(*a, fn=fn):
            return fn(*a)

        named.__name__ = slug  # the dump's module name: jit_<slug>
        jax.jit(named).trace(*args).lower().compile()
    return f"{device.device_kind}\n{jax.__version__}"


def _tool(name: str) -> str | None:
    """``name`` on ``PATH``, else in an ``nvidia-*`` wheel's ``bin`` (JAX's CUDA wheels bring
    ``ptxas``); ``None`` where neither has it."""
    path = shutil.which(name)
    if path is None:
        import site

        wheels = [Path(d) / "nvidia" for d in site.getsitepackages()]
        found = [p for w in wheels for p in sorted(w.glob(f"*/bin/{name}"))]
        path = str(found[0]) if found else None
    return path


_SASS_LINE = re.compile(r"^\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", re.M)
_UNPREDICATED_EXIT = re.compile(r"^\s+/\*[0-9a-f]{4}\*/\s+EXIT\b", re.M)
_FP64_OPS = {"DADD", "DMUL", "DFMA", "DSETP", "DMNMX"}


def sass_counts(listing: str) -> dict:
    """Instruction counts of one kernel's ``cuobjdump -sass`` listing: all of them (``sass``),
    the main path's (``sass_main``: up to the first unpredicated ``EXIT``; after it come
    ptxas's slow-path subroutines, e.g. float64 division and square root of extreme operands),
    and on the main path the float32 <-> float64 conversions (``f2f``) and float64 ops."""
    main = _SASS_LINE.findall(_UNPREDICATED_EXIT.split(listing)[0])
    return {
        "sass": len(_SASS_LINE.findall(listing)),
        "sass_main": len(main),
        "f2f": sum(op.startswith("F2F.F") and "F64" in op for op in main),
        "fp64": sum(op.split(".")[0] in _FP64_OPS for op in main),
    }


def _kernel_stats(ptx: Path, arch: str, work: Path) -> dict:
    """Registers, spills and SASS of one PTX module (one kernel)."""
    cubin = work / (ptx.stem + ".cubin")
    ptxas, cuobjdump = _tool("ptxas"), _tool("cuobjdump")
    if ptxas is None:
        raise SystemExit("ptxas not found (the CUDA toolkit, or the nvidia-cuda-nvcc wheel)")
    info = subprocess.run(
        [ptxas, f"-arch={arch}", "-O3", "-v", str(ptx), "-o", str(cubin)],
        capture_output=True,
        text=True,
        check=True,
    ).stderr
    counts = dict.fromkeys(("sass", "sass_main", "f2f", "fp64"))  # without cuobjdump: None
    if cuobjdump is not None:
        listing = subprocess.run(
            [cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True
        ).stdout
        counts = sass_counts(listing)
    text = ptx.read_text()
    # the widest vector load: the float32 input's, whose N elements the thread computes
    widths = [int(w) for w in re.findall(r"ld\.global(?:\.nc)?\.v(\d)\.", text)] or [1]
    return {
        "kernel": re.search(r"\.entry\s+(\w+)", text).group(1),
        "registers": int(re.search(r"Used (\d+) registers", info).group(1)),
        "spill_bytes": sum(int(b) for b in re.findall(r"(\d+) bytes spill", info)),
        **counts,
        "ptx": len(re.findall(r"^\s+[a-z@]", text, re.M)),
        "per_thread": max(widths),
        "rotations": text.count("shf.l.wrap.b32"),
    }


class NoPtx(Exception):
    """XLA's dump holds no PTX kernel of a case (JAX 0.11.2 on an H200: HLO and MLIR only)."""


def no_ptx_message(slug: str, dump: Path, jax_version: str, device: str, target) -> str:
    """Why there are no counts: the case, the JAX, the device, what the dump held."""
    held = sorted({"".join(p.suffixes[-1:]) or p.name for p in dump.rglob("*") if p.is_file()})
    where = f"the compile-only {device} of {target}" if target else f"this GPU ({device})"
    return (
        f"xla_gpu_kernels: no counts: XLA (JAX {jax_version}) wrote no PTX kernel of {slug}"
        f" to its dump, compiling for {where}; the dump held {', '.join(held) or 'nothing'}."
        " The static counts need a JAX whose XLA dumps PTX: JAX 0.10.2 does, on a CPU machine"
        " with the compile-only target (JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python"
        " benchmarks/xla_gpu_kernels.py --target benchmarks/h100_sxm.txtpb)."
    )


def _report(dump: Path) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for slug, what in CASES:
            ptxs = [
                path
                for path in sorted(dump.glob(f"module_*.jit_{slug}.*.ptx"))
                if ".entry" in path.read_text()  # XLA also dumps empty modules
            ]
            if not ptxs:
                raise NoPtx(slug)
            arch = re.search(r"\.target\s+(sm_\w+)", ptxs[0].read_text()).group(1)
            kernels = [_kernel_stats(p, arch, Path(tmp)) for p in ptxs]
            big = max(kernels, key=lambda k: k["ptx"])
            sass, per = big["sass"], big["per_thread"]
            rows.append(
                {
                    "case": slug,
                    "what": what,
                    "kernels": len(kernels),
                    **big,
                    "sass_per_element": None if sass is None else sass / per,
                    **{
                        f"{k}_per_element": None if big[k] is None else big[k] / per
                        for k in ("sass_main", "f2f", "fp64")
                    },
                    "rotations_per_element": big["rotations"] / per,
                }
            )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", help="GpuTargetConfigProto text file (without a GPU)")
    p.add_argument("--child", metavar="DIR", help=argparse.SUPPRESS)
    add_json_argument(p)
    args = p.parse_args(argv)
    if args.child:  # compile with XLA's dump into DIR; print the device
        print(_compile_cases(args.target))
        return 0
    started = utc_now()
    with tempfile.TemporaryDirectory() as dump:
        env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={dump}")
        child = [sys.executable, __file__, "--child", dump]
        child += ["--target", args.target] if args.target else []
        done = subprocess.run(child, env=env, capture_output=True, text=True)
        if done.returncode:
            print(done.stderr[-4000:], file=sys.stderr)
            return done.returncode
        device, jax_version = done.stdout.strip().splitlines()[-2:]
        try:
            rows = _report(Path(dump))
        except NoPtx as e:
            print(
                no_ptx_message(str(e), Path(dump), jax_version, device, args.target),
                file=sys.stderr,
            )
            return 1  # a missing measurement: the GPU session's step shows rc=1
    print(f"compiled for {device} ({'compile-only' if args.target else 'this GPU'})")
    print(
        f"{'case':<36} {'kernels':>7} {'regs':>5} {'spill':>5} {'SASS':>6} {'elts':>4}"
        f" {'SASS/elt':>8} {'main/elt':>8} {'F2F/elt':>7} {'fp64/elt':>8} {'rot/elt':>7}"
    )

    def per_element(value):
        return f"{'-' if value is None else f'{value:.1f}':>8}"

    for r in rows:
        print(
            f"{r['case']:<36} {r['kernels']:>7} {r['registers']:>5} {r['spill_bytes']:>5}"
            f" {'-' if r['sass'] is None else r['sass']:>6} {r['per_thread']:>4}"
            + "".join(
                per_element(r[f"{k}_per_element"]) for k in ("sass", "sass_main", "f2f", "fp64")
            )
            + f" {r['rotations_per_element']:>7.1f}"
        )
    write_json(
        args.json,
        "xla_gpu_kernels",
        results=rows,
        columns=[
            ("case", "case", ""),
            ("kernels", "kernels", "d"),
            ("registers", "registers", "d"),
            ("spill_bytes", "spilled B", "d"),
            ("sass", "SASS", "d"),
            ("ptx", "PTX", "d"),
            ("per_thread", "elements a thread", "d"),
            ("sass_per_element", "SASS / element", ".1f"),
            ("sass_main_per_element", "main-path SASS / element", ".1f"),
            ("f2f_per_element", "float64 conversions / element", ".1f"),
            ("fp64_per_element", "float64 ops / element", ".1f"),
            ("rotations_per_element", "rotations / element", ".1f"),
        ],
        baseline="astype(bf16) and optax.adamw + optax.apply_updates, compiled alike",
        meta={"elements": N, "compile_only": bool(args.target), "jax": jax_version},
        gpu=f"{device} (compile-only: no GPU)" if args.target else device,
        started=started,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
