#!/usr/bin/env python
"""Cold compile time of srround's CPU kernels: what a first call costs in a fresh process with
an empty Numba cache (CI, a new install, any edit to srround's sources), and what a later
process pays to load them from the cache.

Each row runs in a fresh interpreter with its own empty ``NUMBA_CACHE_DIR`` and reports the
CPU seconds of the calls (process time, so a busy machine changes it less than wall time) and
their wall time. Rows named "then ..." run in the same process after the row above them, so
they show what one more configuration costs once the shared bodies are compiled. Baseline: a
``prange`` copy loop compiled in the same way (the fixed cost of any parallel Numba kernel).

    python benchmarks/bench_compile.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

from _harness import add_json_argument, repo_on_path, utc_now, write_json

_SETUP = """
import json, os, sys, time
import numpy as np, ml_dtypes
bf16 = ml_dtypes.bfloat16
x = np.linspace(-1, 1, 1000, dtype=np.float32)
def adamw(mode, state=np.float32):
    import srround
    p = [x.astype(bf16)]; g = [(x * 1e-3).astype(bf16)]
    m = [np.zeros(x.size, state)]; v = [np.zeros(x.size, state)]
    srround.adamw_step(p, g, m, v, lr=1e-3, step=1, rounding=mode, seed=0)
def sgd(mode):
    import srround
    p = [x.astype(bf16)]; g = [(x * 1e-3).astype(bf16)]; b = [np.zeros(x.size, np.float32)]
    srround.sgd_step(p, g, b, lr=1e-3, momentum=0.9, step=1, rounding=mode, seed=0)
def baseline():
    from numba import njit, prange
    @njit(parallel=True)
    def copy(a, b):
        for i in prange(a.size):
            b[i] = a[i]
    copy(x, np.empty_like(x))
rows = []
def timed(name, call):
    c0, w0 = time.process_time(), time.perf_counter()
    call()
    rows.append({"case": name, "cpu_s": time.process_time() - c0,
                 "wall_s": time.perf_counter() - w0})
"""

# (row names, code run after _SETUP in one fresh process with an empty cache)
_CASES = [
    (["prange copy loop (baseline)"], 'timed("prange copy loop (baseline)", baseline)'),
    (["import srround"], 'timed("import srround", lambda: __import__("srround"))'),
    (
        ["stochastic_round bf16", "then stochastic_add bf16", "then round_nearest bf16"],
        """
        import srround
        timed("stochastic_round bf16", lambda: srround.stochastic_round(x, seed=0))
        w = x.astype(bf16)
        timed("then stochastic_add bf16", lambda: srround.stochastic_add(w, x, seed=0))
        timed("then round_nearest bf16", lambda: srround.round_nearest(x))
        """,
    ),
    (
        [
            "adamw_step stochastic, fp32 states",
            "then adamw_step nearest",
            "then adamw_step stochastic, bf16 states",
            "then sgd_step stochastic, momentum",
        ],
        """
        import srround
        timed("adamw_step stochastic, fp32 states", lambda: adamw("stochastic"))
        timed("then adamw_step nearest", lambda: adamw("nearest"))
        timed("then adamw_step stochastic, bf16 states", lambda: adamw("stochastic", bf16))
        timed("then sgd_step stochastic, momentum", lambda: sgd("stochastic"))
        """,
    ),
]

_WARM = """
import srround
timed("warm cache: stochastic_round + adamw_step", lambda: (srround.stochastic_round(x, seed=0),
      adamw("stochastic")))
"""


def _run(code: str, cache: str) -> list:
    script = _SETUP + textwrap.dedent(code) + "\nprint(json.dumps(rows))\n"
    env = dict(os.environ, NUMBA_CACHE_DIR=cache)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=False
    )
    if out.returncode != 0:
        raise SystemExit(f"case failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="accepted: the run is short anyway")
    add_json_argument(parser)
    args = parser.parse_args(argv)
    repo_on_path()
    started = utc_now()
    rows = []
    with tempfile.TemporaryDirectory() as shared:
        for _, code in _CASES:
            with tempfile.TemporaryDirectory() as cache:
                rows += _run(code, cache)
        # a warm cache: compile once into ``shared``, then time a fresh process loading it
        _run(_WARM, shared)
        rows += _run(_WARM, shared)
    base = rows[0]["cpu_s"]
    print(f"{'case':<44} {'CPU s':>7} {'wall s':>7} {'x baseline':>10}")
    for r in rows:
        r["of_baseline"] = r["cpu_s"] / base
        print(f"{r['case']:<44} {r['cpu_s']:7.2f} {r['wall_s']:7.2f} {r['of_baseline']:10.1f}")
    write_json(
        args.json,
        "bench_compile",
        results=rows,
        columns=[
            ["case", "case", ""],
            ["cpu_s", "CPU s", ".2f"],
            ["wall_s", "wall s", ".2f"],
            ["of_baseline", "x baseline", ".1f"],
        ],
        baseline="prange copy loop (baseline): a one-line parallel Numba kernel compiled cold",
        started=started,
        meta={"cache": "empty NUMBA_CACHE_DIR per case; 'warm cache' loads a filled one"},
    )


if __name__ == "__main__":
    main()
