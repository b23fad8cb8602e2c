"""Smoke tests: benchmarks/bench_optim.py, convergence.py and bench_adapters.py run end to end
at tiny sizes (subprocesses, seconds each)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from .reference import run_python

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"

pytest.importorskip("torch")


def _run(args, tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return run_python(args, env=env, cwd=tmp_path, timeout=300).stdout


def test_bench_optim_and_convergence_smoke(tmp_path):
    import srround.adapters.torch as sat

    if not hasattr(sat, "AdamW"):
        pytest.skip("srround.adapters.torch.AdamW not present")
    out = _run(
        [
            str(BENCH / "bench_optim.py"),
            "--quick",
            "--device",
            "cpu",
            "--sections",
            "torch",
            "--params",
            "0.02",
            "--reps",
            "1",
            "--only",
            "srround AdamW stochastic",
        ],
        tmp_path,
    )
    assert "srround AdamW stochastic" in out and "fp32 states" in out
    assert "== targets ==" in out

    png = tmp_path / "conv.png"
    out = _run(
        [str(BENCH / "convergence.py"), "--steps", "20", "--lrs", "1e-5", "--out", str(png)],
        tmp_path,
    )
    assert "bf16 stochastic" in out and "progress" in out
    if "wrote" in out:
        assert png.stat().st_size > 0


@pytest.mark.cuda
def test_bench_adapters_cuda_smoke(tmp_path):
    """The CUDA rows run (the simulator on CPU-only machines, 2^8 elements): the raw-buffer row
    called the CUDA kernels with a stale signature and only a GPU run found it."""
    out = _run(
        [str(BENCH / "bench_adapters.py"), "--quick", "--device", "cuda", "--large", "8"],
        tmp_path,
    )
    assert "core, raw buffers" in out and "numba device arrays" in out, out


def test_gpu_call_profile_smoke(tmp_path):
    """The call-cost profiler of gpu_session.sh runs (the simulator on CPU-only machines, its
    torch rows skipped there) and writes its JSON."""
    out = _run(
        [str(BENCH / "gpu_call_profile.py"), "--calls", "4", "--json", str(tmp_path / "p.json")],
        tmp_path,
    )
    assert "srround.stochastic_round, numba arrays" in out and "cProfile" in out, out
    assert (tmp_path / "p.json").exists()


def test_bench_adapters_smoke(tmp_path):
    """Every CPU row of bench_adapters runs and lands in the table and the JSON."""
    out = _run(
        [
            str(BENCH / "bench_adapters.py"),
            "--quick",
            "--device",
            "cpu",
            "--large",
            "14",
            "--json",
            str(tmp_path / "a.json"),
        ],
        tmp_path,
    )
    assert "core, raw buffers" in out and "torch cpu" in out
    doc = json.loads((tmp_path / "a.json").read_text())
    assert doc["schema"] == 1 and doc["benchmark"] == "bench_adapters"
    assert doc["machine"]["cpu_model"] and doc["machine"]["cores"] >= 1 and doc["date"]
    rows = doc["results"]
    assert {r["row"] for r in rows} >= {"core, raw buffers", "numpy", "torch cpu", "copy"}


def test_apply_updates_parts_smoke(tmp_path):
    """Every write-back row of apply_updates_parts runs, traced afresh, and lands in the JSON."""
    pytest.importorskip("optax")
    out = _run(
        [
            str(BENCH / "apply_updates_parts.py"),
            "--quick",
            "--params",
            "0.02",
            "--tensors",
            "10",
            "--json",
            str(tmp_path / "p.json"),
        ],
        tmp_path,
    )
    doc = json.loads((tmp_path / "p.json").read_text())
    rows = {r["row"]: r for r in doc["results"]}
    assert set(rows) == {
        "optax.apply_updates (RNE)",
        "plain jnp SR",
        "SR encoding",
        "exact sum",
        "exact sum + SR encoding",
        "srround apply_updates",
    }, out
    assert rows["optax.apply_updates (RNE)"]["step_vs_optax"] == 1.0
    assert all(r["median_s"] > 0 and r["first_s"] > 0 for r in rows.values())


def test_numba_compile_timer_counts_compiles_in_any_thread():
    """bench_optim's first calls record Numba's compile time: a compile in another thread
    (as XLA runs srround's host step) counts; a call of a compiled function does not."""
    import threading

    from numba import njit

    sys.path.insert(0, str(BENCH))
    try:
        import _harness
    finally:
        sys.path.remove(str(BENCH))

    @njit
    def twice(x):
        return 2 * x

    with _harness.numba_compile_timer() as timer:
        thread = threading.Thread(target=twice, args=(1.5,))
        thread.start()
        thread.join()
    assert timer.seconds > 0
    with _harness.numba_compile_timer() as again:
        assert twice(2.5) == 5.0
    assert again.seconds == 0


def test_results_page_from_envelopes(tmp_path):
    """benchmarks/results.py turns --json envelopes into a page naming machine, date and
    baseline, and refuses a file without them."""
    sys.path.insert(0, str(BENCH))
    try:
        import _harness
        import results
    finally:
        sys.path.remove(str(BENCH))
    folder = tmp_path / "results"
    _harness.write_json(
        str(folder / "bench_x.json"),
        "bench_x",
        results=[{"method": "ours", "median_s": 0.002, "frac": 0.5}, {"method": "floor"}],
        columns=[("method", "method", ""), ("median_s", "ms", "ms"), ("frac", "% floor", "%")],
        baseline="the floor row",
        started="2026-01-02T03:04:05Z",
    )
    out = tmp_path / "RESULTS.md"
    assert results.main([str(folder), "--out", str(out)]) == 0
    page = out.read_text()
    assert "## bench_x — 2026-01-02T03:04:05Z" in page
    assert _harness.cpu_model() in page and "baseline (same run): the floor row" in page
    assert "| ours | 2.000 | 50 % |" in page

    (folder / "old.json").write_text(json.dumps([{"row": "numpy", "s": 1.0}]))
    assert results.main([str(folder), "--out", str(out)]) == 1
    bad = json.loads((folder / "bench_x.json").read_text())
    del bad["machine"]["cpu_model"]
    with pytest.raises(ValueError, match="machine.cpu_model"):
        (folder / "old.json").write_text(json.dumps(bad))
        results.load(folder / "old.json")


def test_bench_only_that_matches_nothing_is_an_error(capsys):
    """`srround bench --only typo` ran no script and exited 0, as if every benchmark passed."""
    from srround._cli import main

    assert main(["bench", "--only", "no_such_bench"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("srround bench: error: --only: no benchmark matches 'no_such_bench'")
    assert "bench_optim" in err  # the names to choose from


def test_xla_gpu_kernels_counts_the_main_path_apart_from_slow_path_subroutines():
    sys.path.insert(0, str(BENCH))
    try:
        from xla_gpu_kernels import sass_counts
    finally:
        sys.path.remove(str(BENCH))
    listing = """
        /*0000*/                   LDG.E.64 R4, desc[UR4][R8.64] ;
        /*0010*/                   F2F.F64.F32 R6, R4 ;
        /*0020*/               @P0 EXIT ;
        /*0030*/                   DFMA R10, -R6, R2, 1 ;
        /*0040*/                   F2F.F32.F64 R3, R10 ;
        /*0050*/                   F2FP.BF16.F32.PACK_AB R3, RZ, R3 ;
        /*0060*/              @!P1 CALL.REL.NOINC 0x90 ;
        /*0070*/                   EXIT ;
        /*0080*/                   BRA 0x80;
        /*0090*/                   DMUL R2, R6, 8.98846567431157953865e+307 ;
        /*00a0*/                   RET.REL.NODEC R10 0x0 ;
"""
    counts = sass_counts(listing)
    assert counts == {"sass": 11, "sass_main": 7, "f2f": 2, "fp64": 1}


def test_xla_gpu_kernels_without_ptx_in_the_dump_names_jax_and_what_the_dump_held(tmp_path):
    """JAX 0.11.2 on an H200 wrote HLO and MLIR to XLA's dump, no PTX: the script's message
    names the case, JAX's version, the device and the dump's file kinds."""
    sys.path.insert(0, str(BENCH))
    try:
        from xla_gpu_kernels import NoPtx, _report, no_ptx_message
    finally:
        sys.path.remove(str(BENCH))
    (tmp_path / "module_0001.jit_copy_astype_bf16.sm_9.0_gpu_after_optimizations.txt").touch()
    (tmp_path / "module_0001.jit_copy_astype_bf16.mlir").touch()
    with pytest.raises(NoPtx) as raised:
        _report(tmp_path)
    message = no_ptx_message(str(raised.value), tmp_path, "0.11.2", "NVIDIA H200", None)
    assert "JAX 0.11.2" in message and "copy_astype_bf16" in message
    assert "this GPU (NVIDIA H200)" in message and ".mlir, .txt" in message


def test_dist_ratios_pair_each_layouts_rows():
    """``_dist_rows.ratios``: the FSDP2 and the tensor-parallel (``TP ...``) rows each divide
    srround's time by torch's of the same layout."""
    sys.path.insert(0, str(BENCH))
    try:
        import _dist_rows
    finally:
        sys.path.remove(str(BENCH))
    rows = [
        {"method": "srround AdamW stochastic fp32: opt step", "median_s": 1.0},
        {"method": "torch AdamW fused bf16 (RNE): opt step", "median_s": 2.0},
        {"method": "TP srround AdamW stochastic fp32: opt step", "median_s": 3.0},
        {"method": "TP torch AdamW fused bf16 (RNE): opt step", "median_s": 4.0},
    ]
    assert _dist_rows.ratios(rows) == [
        "FSDP2 x2 (gloo, CPU) opt step: srround / torch fused = 0.50",
        "TP Shard(1) x2 (gloo, CPU) opt step: srround / torch fused = 0.75",
    ]
