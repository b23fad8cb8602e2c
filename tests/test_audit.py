"""``srround.audit`` against exact arithmetic, and ``srround audit`` through the command line."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import types

import ml_dtypes
import numpy as np
import pytest

import srround
from srround import audit

from .reference import run_python


def test_spacing_is_the_format_ulp():
    bf16, fp16 = srround.FORMATS["bfloat16"], srround.FORMATS["float16"]
    w = np.array([1.0, 1.5, 0.01, -3.0, 0.0, 2.0**-130, 65504.0, 2.0**-20])
    assert list(audit.spacing(w[:4], bf16)) == [2.0**-7, 2.0**-7, 2.0**-14, 2.0**-6]
    assert audit.spacing(w[4:6], bf16).tolist() == [2.0**-133, 2.0**-133]  # subnormal spacing
    assert audit.spacing(w[6:], fp16).tolist() == [32.0, 2.0**-24]
    # matches the distance to the next representable value, as ml_dtypes computes it
    x = np.float32([0.3, 7.0, 1e-3]).astype(ml_dtypes.bfloat16)
    nxt = np.nextafter(x, np.array(np.inf, ml_dtypes.bfloat16)).astype(np.float64)
    assert np.array_equal(audit.spacing(x.astype(np.float64), bf16), nxt - x.astype(np.float64))


def test_stagnation_counts_exactly():
    # weights at 1.0 (half spacing 2**-8) and 0.01 (half spacing 2**-15 ~ 3.05e-5)
    w = np.array([1.0] * 3 + [0.01] * 1, np.float32).astype(ml_dtypes.bfloat16)
    s = audit.stagnation(w, lr=1e-4)
    assert s.lost_fraction == 0.75  # 1e-4 < 2**-8 lost at 1.0; > 2**-15 kept at ~0.01
    assert s.min_update_percentiles[50] == 2.0**-8
    assert s.lr_scale_half == pytest.approx(2.0**-8 / 1e-4)
    # an exact half-spacing tie is lost on an even pattern (1.0 = 0x3F80) and kept on an odd one
    w = np.float32([1.0, 1.0 + 2**-7]).astype(ml_dtypes.bfloat16)
    s = audit.stagnation(w, np.full(2, 2.0**-8))
    assert s.lost_fraction == 0.5
    # agrees with what round-to-nearest really does to w + u
    rng = np.random.default_rng(0)
    w = (rng.standard_normal(10_000) * 0.05).astype(ml_dtypes.bfloat16)
    u = (rng.standard_normal(10_000) * 3e-5).astype(np.float32)
    moved = srround.round_nearest(w.astype(np.float32) + u) != w
    assert audit.stagnation(w, u).lost_fraction == pytest.approx(1 - moved.mean(), abs=1e-12)


def test_read_only_and_writable_arrays_run_one_compiled_kernel():
    """Numba types read-only and writable arrays apart: an audit of a frozen array (a
    checkpoint's mapped tensors, JAX's host buffers) compiled each audit kernel again. The
    audit's inputs now reach the kernels read-only, as the API's do."""
    from srround import _audit_kernels

    rng = np.random.default_rng(1)
    w32 = rng.standard_normal(64).astype(np.float32)
    cases = [
        (w32.astype(ml_dtypes.bfloat16), w32 * 1e-3),
        (w32, None),
        (w32.astype(np.float64), None),
    ]

    def audit_all(freeze):
        for w, u in cases:
            w, u = w.copy(), None if u is None else u.copy()
            for a in (w, u):
                if a is not None:
                    a.flags.writeable = not freeze
            audit.audit_tensor(w, u)
            audit.stagnation(w, u, lr=None if u is not None else 1e-3)

    kernels = (_audit_kernels.pattern_counts, _audit_kernels.value_stats)
    audit_all(freeze=False)
    compiled = [len(k.signatures) for k in kernels]
    audit_all(freeze=True)
    assert [len(k.signatures) for k in kernels] == compiled


def test_fp16_range_exact():
    r = audit.fp16_range(np.array([65519.0, 65520.0, 1.0, 2.0**-25, 2.0**-24, 2.0**-15, 0.0]))
    assert r.count == 7 and r.max_abs == 65520.0
    assert r.overflow_fraction == pytest.approx(1 / 7)  # 65520 rounds to inf, 65519 does not
    assert r.zero_fraction == pytest.approx(1 / 7)  # 2**-25 ties to 0
    assert r.subnormal_fraction == pytest.approx(2 / 7)
    assert r.rescale is None  # 65520 / 2**-25 exceeds fp16's normal range ratio
    fits = audit.fp16_range(np.array([1e5, 1.0]))
    assert fits.rescale == 0.5 and fits.overflow_fraction == 0.5
    assert audit.fp16_range(np.array([1.0, -2.0])).safe


def test_audit_accepts_torch_tensors():
    torch = pytest.importorskip("torch")
    w = torch.full((8,), 1.0, dtype=torch.bfloat16, requires_grad=True)
    assert audit.stagnation(w, lr=1e-4).lost_fraction == 1.0
    assert audit.fp16_range(w).safe


@pytest.fixture
def checkpoints(tmp_path):
    w = {
        "layer.weight": np.float32([1.0, 1.0, 0.01, 0.01]).astype(ml_dtypes.bfloat16),
        "layer.bias": np.float32([7e4, 0.5]).astype(ml_dtypes.bfloat16),
    }
    paths = {"npz": tmp_path / "ck.npz"}
    np.savez(paths["npz"], **{k: v.astype(np.float32) for k, v in w.items()})
    try:
        from safetensors.numpy import save_file

        paths["safetensors"] = tmp_path / "ck.safetensors"
        save_file(w, str(paths["safetensors"]))
    except ImportError:
        pass
    try:
        import torch

        paths["pt"] = tmp_path / "ck.pt"
        state = {k: torch.from_numpy(v.astype(np.float32)).bfloat16() for k, v in w.items()}
        torch.save({"model": state, "step": 10}, paths["pt"])
    except ImportError:
        pass
    return paths


def _cli(*args):
    """``srround *args`` in this process (a fresh interpreter costs seconds of imports per
    call): returncode, stdout and stderr as a finished process would give them."""
    from srround import _cli as cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(args))
        except SystemExit as e:  # argparse's usage errors
            code = e.code
    return types.SimpleNamespace(returncode=code or 0, stdout=out.getvalue(), stderr=err.getvalue())


def test_python_m_srround_audit_runs_in_a_fresh_process(checkpoints):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    args = ["audit", str(checkpoints["npz"]), "--lr", "1e-4", "--json"]
    result = run_python(["-m", "srround", *args], env=env, cwd=None)
    fresh, here = json.loads(result.stdout), json.loads(_cli(*args).stdout)
    assert fresh.pop("seconds") > 0 and here.pop("seconds") > 0
    assert fresh == here


@pytest.mark.parametrize("kind", ["npz", "safetensors", "pt"])
def test_audit_cli_json(checkpoints, kind):
    if kind not in checkpoints:
        pytest.skip(f"{kind} writer not installed")
    result = _cli("audit", str(checkpoints[kind]), "--lr", "1e-4", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    by_name = {r["name"].split("model.")[-1]: r for r in report["tensors"]}
    assert by_name["layer.weight"]["stagnation"]["lost_fraction"] == 0.5
    assert by_name["layer.bias"]["fp16"]["overflow_fraction"] == 0.5
    assert report["overall"]["stagnation"]["count"] == 6
    assert report["tensors"][0]["stagnation"]["lost_fraction"] >= 0.5  # worst first


def test_audit_cli_table_and_errors(checkpoints, tmp_path):
    result = _cli("audit", str(checkpoints["npz"]))
    assert result.returncode == 0 and "recommend" not in result.stderr
    assert "layer.weight" in result.stdout and "stochastic rounding" in result.stdout
    missing = _cli("audit", str(tmp_path / "nope.safetensors"))
    assert missing.returncode == 2 and "no such file" in missing.stderr
    unknown = tmp_path / "weights.h5"
    unknown.write_bytes(b"x")
    assert "unknown checkpoint format" in _cli("audit", str(unknown)).stderr
    corrupt = tmp_path / "bad.npz"
    corrupt.write_bytes(b"not a zip")
    bad = _cli("audit", str(corrupt))
    assert bad.returncode == 2 and "not a readable npz file" in bad.stderr


def _oracle_lost(w, lr, fmt_dtype):
    """Lost fraction of an update of size ``lr`` in both directions, by casting in float64."""
    q = np.asarray(w, np.float64).astype(fmt_dtype).astype(np.float64)
    up = (q + np.sign(q + (q == 0)) * lr).astype(fmt_dtype).astype(np.float64) == q
    down = (q - np.sign(q + (q == 0)) * lr).astype(fmt_dtype).astype(np.float64) == q
    return (up.sum() + down.sum()) / (2 * q.size)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_lr_counts_both_directions_exactly(dtype):
    np_dtype = srround.FORMATS[dtype].numpy_dtype
    rng = np.random.default_rng(1)
    w = np.concatenate(
        [
            rng.standard_normal(20_000) * 0.05,
            [1.0, -1.0, 2.0, -0.5, 0.0, 2.0**-20],  # binade starts, zero, fp16 subnormal
            rng.standard_normal(1000).astype(np_dtype).astype(np.float64),  # exact patterns
        ]
    ).astype(np.float32)
    for lr in (1e-4, 3e-3, 2.0**-9):  # 2**-9: exact ties at 1.0 / 2.0
        s = audit.stagnation(w, lr=lr, dtype=dtype)
        assert s.directions == "both" and s.updates == w.size
        assert s.lost_fraction == pytest.approx(_oracle_lost(w, lr, np_dtype), abs=1e-12)


def test_lr_verdict_does_not_depend_on_the_weights_sign():
    up = audit.stagnation(np.full(10, 1.0), lr=0.003)
    down = audit.stagnation(np.full(10, -1.0), lr=0.003)
    # at 1.0 (bf16) 0.003 is below half the spacing above (2**-8), above half the one below
    assert up.lost_fraction == down.lost_fraction == 0.5


@pytest.mark.parametrize("lr", [float("nan"), float("inf"), 0.0, -1e-3])
def test_bad_lr_is_an_error(lr):
    with pytest.raises(ValueError, match="lr"):
        audit.stagnation(np.ones(4, np.float32), lr=lr)


def test_lr_with_update_is_an_error():
    with pytest.raises(ValueError, match="not both"):
        audit.stagnation(np.ones(4), np.ones(4), lr=1e-3)


def test_zero_and_nonfinite_updates_are_not_lost():
    w = np.ones(6, np.float32)
    s = audit.stagnation(w, np.zeros(6, np.float32))
    assert s.updates == 0 and s.zero_updates == 6 and s.lost_fraction == 0.0
    assert s.lr_scale_half == 1.0 and "no nonzero" in s.recommendation()
    s = audit.stagnation(w, np.float32([0, np.nan, np.inf, 1e-5, 1.0, 0]))
    assert (s.updates, s.zero_updates, s.nonfinite_updates, s.lost_updates) == (2, 2, 2, 1)


def test_update_size_mismatch_names_both_shapes():
    with pytest.raises(ValueError, match=r"update: shape \(3,\).*\(4,\)"):
        audit.stagnation(np.ones(4), np.ones(3))


def test_cli_update_of_another_dtype_says_so(tmp_path):
    """An integer update of the weight's own shape was reported as a shape mismatch
    ('has shape [4] (int32) ..., the weight has [4]')."""
    np.savez(tmp_path / "w.npz", w=np.ones(4, np.float32))
    np.savez(tmp_path / "u.npz", w=np.ones(4, np.int32))
    result = _cli("audit", str(tmp_path / "w.npz"), "--update", str(tmp_path / "u.npz"))
    assert result.returncode == 2
    assert "error: update: w is int32 in " in result.stderr and "shape" not in result.stderr


def test_stored_16bit_format_is_the_default():
    w = np.float16([1.0, 0.5, 0.25])
    s = audit.stagnation(w, lr=2e-4)  # fp16 at 1.0: half spacing 2**-11 ~ 4.9e-4
    assert s.dtype == "float16"
    assert s.lost_fraction == audit.stagnation(w, lr=2e-4, dtype="float16").lost_fraction
    assert audit.stagnation(w, lr=2e-4, dtype="bfloat16").lost_fraction == 1.0
    assert audit.stagnation(np.float32([1.0]), lr=1e-3).dtype == "bfloat16"


def test_fp16_range_counts_and_nonfinite():
    w = np.full(1000, 0.5, np.float32)
    w[:3] = [2.0**-26, np.nan, np.inf]
    r = audit.fp16_range(w)
    assert (r.flushed, r.overflow, r.nan, r.inf, r.count) == (1, 0, 1, 1, 998)
    assert not r.safe and "1 flush to zero" in audit.fp16_verdict(r)
    s = audit.stagnation(w, lr=1e-3)
    assert s.nonfinite_weights == 2 and s.updates == 998


def test_percentiles_are_nearest_rank_of_the_spacings():
    w = np.float32([1.0] * 9 + [2.0**-10])
    s = audit.stagnation(w, lr=1.0)
    assert s.min_update_percentiles == {10: 2.0**-18, 50: 2.0**-8, 90: 2.0**-8}
    u = np.full(10, 2.0**-12, np.float32)
    s = audit.stagnation(w, u)  # half spacing / |u| = 16 at 1.0
    assert s.lr_scale_half == pytest.approx(16, rel=2**-10)


@pytest.fixture
def minilm_like(tmp_path):
    """A safetensors checkpoint with long names, an int buffer, NaN and fp16 flushes."""
    save_file = pytest.importorskip("safetensors.numpy").save_file
    rng = np.random.default_rng(0)
    long = "encoder.layer.0.attention.output.LayerNorm.weight.with.a.very.long.name"
    w = {
        long: np.ones(64, np.float32),
        "encoder.layer.0.attention.output.dense.weight": (
            rng.standard_normal((64, 64)) * 0.02
        ).astype(np.float32),
        "embeddings.position_ids": np.arange(16, dtype=np.int64)[None],
        "bad.weight": np.float32([1.0, np.nan, np.inf, 0.0]),
    }
    w["encoder.layer.0.attention.output.dense.weight"][0, 0] = 2.0**-27  # flushes in fp16
    path = tmp_path / "model.safetensors"
    save_file(w, str(path))
    return path, w, long


def test_cli_table_real_model_output(minilm_like):
    path, w, long = minilm_like
    result = _cli("audit", str(path))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert long in out  # full names
    lines = out.splitlines()
    warn = next(i for i, line in enumerate(lines) if line.startswith("WARNING"))
    header = next(i for i, line in enumerate(lines) if line.startswith("tensor"))
    assert warn < header and "bad.weight: 1 NaN, 1 inf" in out  # NaN/inf flagged first
    assert "embeddings.position_ids int64 [1, 16]: not floating point" in out
    assert "1 flush to zero" in out  # the verdict carries its count
    assert "Warning" not in result.stderr


def test_cli_csv_and_json_list_every_tensor(minilm_like):
    import csv
    import io

    path, w, long = minilm_like
    result = _cli("audit", str(path), "--format", "csv")
    assert result.returncode == 0, result.stderr
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert {r["name"] for r in rows} == set(w)
    by = {r["name"]: r for r in rows}
    assert by["embeddings.position_ids"]["status"] == "not audited: not floating point"
    assert by["encoder.layer.0.attention.output.dense.weight"]["fp16_flushed"] == "1"
    report = json.loads(_cli("audit", str(path), "--format", "json").stdout)
    assert len(report["tensors"]) == 3 and report["nonfinite"][0]["name"] == "bad.weight"


def test_cli_rejects_bad_lr_and_lr_with_update(checkpoints):
    for lr in ("nan", "0", "-1e-5"):
        bad = _cli("audit", str(checkpoints["npz"]), "--lr", lr)
        assert bad.returncode == 2 and "lr" in bad.stderr and "Traceback" not in bad.stderr
    both = _cli("audit", str(checkpoints["npz"]), "--lr", "1e-4", "--update", "x.npz")
    assert both.returncode == 2 and "--lr and --update" in both.stderr


def test_cli_update_files(checkpoints, tmp_path):
    zero = tmp_path / "zero.npz"
    np.savez(zero, **{"layer.weight": np.zeros(4, np.float32), "layer.bias": np.zeros(2)})
    result = _cli("audit", str(checkpoints["npz"]), "--update", str(zero))
    assert result.returncode == 0, result.stderr
    # no "100.0%" lost: zero updates are no evidence (a bare "100" also matched the tmp path
    # of pytest's 100th run, pytest-of-<user>/pytest-100)
    assert "no nonzero, finite updates" in result.stdout
    assert not re.search(r"\b100(\.0+)?\s*%", result.stdout), result.stdout
    partial = tmp_path / "partial.npz"
    np.savez(partial, **{"layer.weight": np.full(4, 1e-4, np.float32)})
    result = _cli("audit", str(checkpoints["npz"]), "--update", str(partial), "--json")
    report = json.loads(result.stdout)
    assert report["missing_updates"] == ["layer.bias"]
    assert report["overall"]["stagnation"]["updates"] == 4
    text = _cli("audit", str(checkpoints["npz"]), "--update", str(partial)).stdout
    assert "no update for 1 weight tensors (fp16 range only): layer.bias" in text
    wrong = tmp_path / "wrong.npz"
    np.savez(wrong, **{"layer.weight": np.ones(3, np.float32)})
    bad = _cli("audit", str(checkpoints["npz"]), "--update", str(wrong))
    assert bad.returncode == 2 and "layer.weight" in bad.stderr and bad.stdout == ""
    transposed = tmp_path / "transposed.npz"
    np.savez(transposed, **{"layer.weight": np.ones((4, 1), np.float32)})  # same size
    bad = _cli("audit", str(checkpoints["npz"]), "--update", str(transposed))
    assert bad.returncode == 2 and "[4, 1]" in bad.stderr


def test_cli_fp16_checkpoint_is_audited_as_fp16(tmp_path):
    path = tmp_path / "half.npz"
    np.savez(path, w=np.float16([1.0, 0.5, 0.25]))
    report = json.loads(_cli("audit", str(path), "--lr", "2e-4", "--json").stdout)
    assert report["tensors"][0]["dtype"] == "float16"
    forced = _cli("audit", str(path), "--lr", "2e-4", "--json", "--dtype", "bfloat16").stdout
    assert json.loads(forced)["tensors"][0]["dtype"] == "bfloat16"


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_stored_weights_are_audited_in_their_own_format(fmt, tmp_path):
    """Before: fp8 tensors of a checkpoint were listed as "not floating point" and skipped
    (safetensors F8_E4M3/F8_E5M2, torch float8), and audit_tensor refused ml_dtypes' fp8
    arrays. Now an fp8-stored weight is audited as trained in its own format (the counts of its
    exact float32 widening with ``dtype=`` that format), its range against fp16 as every
    other tensor's in a default audit."""
    torch = pytest.importorskip("torch")
    save_file = pytest.importorskip("safetensors.torch").save_file
    rng = np.random.default_rng(3)
    w8 = rng.standard_normal((32, 16)).astype(np.float32).astype(getattr(ml_dtypes, fmt))
    wide = w8.astype(np.float32)
    expected = audit.audit_tensor(wide, lr=1e-3, dtype=fmt)
    got = audit.audit_tensor(w8, lr=1e-3)
    assert got.stored == fmt and got.stagnation == expected.stagnation
    assert got.fp16.dtype == "float16"
    t8 = torch.from_numpy(w8.view(np.uint8)).view(getattr(torch, fmt))
    assert audit.audit_tensor(t8, lr=1e-3).stagnation == expected.stagnation
    files = {"safetensors": tmp_path / "w.safetensors", "pt": tmp_path / "w.pt"}
    save_file({"w": t8, "b": torch.ones(4)}, str(files["safetensors"]))
    torch.save({"w": t8, "b": torch.ones(4)}, files["pt"])
    for path in files.values():
        report = json.loads(_cli("audit", str(path), "--lr", "1e-3", "--json").stdout)
        rows = {r["name"]: r for r in report["tensors"]}
        assert report["not_audited"] == [] and rows["w"]["stored"] == fmt
        assert rows["w"]["dtype"] == fmt
        stag = rows["w"]["stagnation"]
        assert stag["lost_fraction"] == expected.stagnation.lost_fraction


def test_cli_torch_state_reports_buffers_and_optimizer_state_apart(tmp_path):
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    path = tmp_path / "ck.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    report = json.loads(_cli("audit", str(path), "--json").stdout)
    weights = {r["name"] for r in report["tensors"]}
    assert weights == {"model.0.weight", "model.0.bias", "model.1.weight", "model.1.bias"}
    reasons = {r["name"]: r["reason"] for r in report["not_audited"]}
    assert reasons["model.1.running_mean"] == "buffer"
    assert reasons["model.1.num_batches_tracked"] == "not floating point"
    assert reasons["optimizer.state.0.exp_avg"] == "optimizer state"
    assert report["weights"] == 4 * 4 + 4 + 4 + 4


def test_safetensors_entries_are_memory_mapped(minilm_like):
    from srround._checkpoint import open_checkpoint

    path, w, _ = minilm_like
    entries = {e.name: e for e in open_checkpoint(str(path))}
    a = entries["encoder.layer.0.attention.output.dense.weight"].read()
    assert isinstance(a, np.memmap)
    assert np.array_equal(a, w["encoder.layer.0.attention.output.dense.weight"].ravel())


def test_torch_entries_read_again_after_their_pages_are_dropped(tmp_path):
    torch = pytest.importorskip("torch")
    from srround._checkpoint import open_checkpoint

    w = (torch.arange(3 * 4096, dtype=torch.float32) * 0.5).bfloat16()
    torch.save({"w": w, "b": torch.ones(3)}, tmp_path / "ck.pt")
    (entry,) = [e for e in open_checkpoint(str(tmp_path / "ck.pt")) if e.name == "w"]
    first = np.array(entry.read(), copy=True)
    entry.release()  # drops the mapped pages; the file still backs them
    again = entry.read()
    assert np.array_equal(first.view(np.uint16), again.view(np.uint16))
    assert np.array_equal(first.view(np.uint16), w.view(torch.int16).numpy().view(np.uint16))


def test_float32_pattern_path_matches_the_general_kernel():
    # float32 weights with a scalar lr go through a bf16-pattern histogram; float64 weights
    # through the per-value kernel: every count must agree (both large: parallel kernels)
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((1 << 20) + 3) * 0.05).astype(np.float32)
    w[:6] = [np.nan, np.inf, -np.inf, 0.0, 7e4, 2.0**-130]
    fast = audit.audit_tensor(w, lr=3e-4)
    slow = audit.audit_tensor(w.astype(np.float64), lr=3e-4)
    assert fast.stagnation == dataclasses.replace(slow.stagnation)
    assert fast.fp16 == slow.fp16
    assert (fast.fp16.nan, fast.fp16.inf, fast.fp16.overflow) == (1, 2, 1)


def _specials(n, dtype, seed):
    """``n`` weights or updates of ``dtype``: normal values over many binades, with zeros of
    both signs, NaN, inf, binade starts, exact ties and subnormals in front."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n) * 10.0 ** rng.integers(-6, 1, n)
    head = [0.0, -0.0, np.nan, np.inf, -np.inf, 1.0, -1.0, 2.0, 2.0**-8, 2.0**-9, 2.0**-20]
    x[: len(head)] = head
    return x.astype(dtype)


@pytest.mark.parametrize("n", [5000, (1 << 20) + 7], ids=["serial", "parallel"])
@pytest.mark.parametrize(
    "stored, target, u_dtype",
    [
        ("float32", "bfloat16", "float32"),
        ("bfloat16", "bfloat16", "bfloat16"),
        ("float16", "float16", "float32"),
        ("float32", "float16", "bfloat16"),
        ("bfloat16", "float16", "float32"),
    ],
)
def test_pattern_update_path_matches_the_general_kernel(n, stored, target, u_dtype):
    """With an update array, a 16-bit target is counted per pattern (a table of each
    pattern's loss thresholds); every count, histogram and verdict equals the per-value
    kernel's on the same weights as float64 (weights that round to inf in the target have no
    stagnation statistics in either)."""
    np_dtype = {k: srround.FORMATS[k].numpy_dtype for k in ("bfloat16", "float16")}
    np_dtype["float32"] = np.float32
    w = _specials(n, np_dtype[stored], 3)
    u = np.roll(_specials(n, np_dtype[u_dtype], 4), 20)  # special updates on normal weights
    w[11:13] = [70000.0, -1e5] if stored == "float32" else w[11:13]  # overflow fp16
    fast = audit.audit_tensor(w, u, dtype=target)
    slow = audit.audit_tensor(w.astype(np.float64), u.astype(np.float64), dtype=target)
    assert fast.stagnation == slow.stagnation
    assert fast.fp16 == slow.fp16
    assert fast.stagnation.nonfinite_updates > 0 and fast.stagnation.zero_updates > 0
    lr = audit.audit_tensor(w, lr=3e-4, dtype=target)
    assert (
        lr.stagnation == audit.audit_tensor(w.astype(np.float64), lr=3e-4, dtype=target).stagnation
    )


def test_bench_audit_smoke(tmp_path, minilm_like):
    """benchmarks/bench_audit.py writes, audits and deletes a checkpoint, reports memory."""
    path, _, _ = minilm_like
    bench = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_audit.py")
    out = tmp_path / "bench.json"
    args = ["--params", "200000", "--dtypes", "bfloat16", "--minilm", str(path)]
    args += ["--update-params", "100000", "--kernel-size", "4096", "--json"]
    run_python([bench, *args, str(out)], env=None, cwd=None)
    rows = json.loads(out.read_text())["results"]
    names = [r["checkpoint"] for r in rows]
    assert names[:3] == [
        "synthetic bfloat16",
        "synthetic bfloat16, --update float32",
        "model.safetensors",
    ]
    assert len(names) == 10 and all(n.startswith("in memory: ") for n in names[3:])
    assert rows[0]["weights"] > 100_000 and rows[0]["peak_rss_bytes"] > 0
    assert all(r["weights_per_s"] > 0 for r in rows)
    assert all(r["copy_GBps"] > 0 for r in rows[3:])


def test_cli_directory_is_named_as_one(tmp_path):
    """A model folder was 'an unknown checkpoint format' (a `.safetensors` one 'not a readable
    safetensors file ([Errno 21] ...)'); the error says it is a folder and names its files."""
    model = tmp_path / "model.safetensors"  # a folder named like a file, as some tools write
    model.mkdir()
    np.save(model / "b.npy", np.ones(2, np.float32))
    np.save(model / "a.npy", np.ones(2, np.float32))
    (model / "notes.txt").write_text("")
    for path in (model, tmp_path):
        result = _cli("audit", str(path))
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert f"error: {path}: is a folder; pass one checkpoint file" in result.stderr
    assert "a.npy, b.npy" in _cli("audit", str(model)).stderr


def test_cli_torch_file_with_python_objects_says_what_to_do(tmp_path):
    """A training checkpoint with an argparse.Namespace beside the weights: the error was
    torch's many-line advice on ``torch.load`` options (with terminal escape codes) that
    `srround audit` does not take."""
    import argparse

    torch = pytest.importorskip("torch")
    path = tmp_path / "train.pt"
    torch.save({"args": argparse.Namespace(lr=1e-3), "model": {"w": torch.ones(4)}}, path)
    result = _cli("audit", str(path))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "GLOBAL argparse.Namespace" in result.stderr and "\x1b" not in result.stderr
    assert "torch.save(model.state_dict(), path)" in result.stderr


def test_meta_and_sparse_tensors_are_listed_not_audited(tmp_path):
    """A .pt with a meta tensor (a model saved before materialization) or a sparse one beside
    the weights: the audit stopped at it ("m: cannot be read (Cannot copy out of meta
    tensor; no data!)"), auditing none. Now they are listed under not_audited, with why."""
    torch = pytest.importorskip("torch")
    path = tmp_path / "odd.pt"
    tensors = {
        "w": torch.ones(4, 4),
        "m": torch.empty(3, device="meta"),
        "s": torch.eye(3).to_sparse(),
    }
    torch.save(tensors, path)
    report = audit.audit_checkpoint(str(path))
    assert [r["name"] for r in report["tensors"]] == ["w"]
    reasons = {r["name"]: r["reason"] for r in report["not_audited"]}
    assert reasons == {"m": "meta tensor (no data)", "s": "sparse_coo tensor"}


@pytest.mark.parametrize("suffix", [".safetensors", ".pt", ".npz", ".npy"])
def test_cli_empty_file_is_named_as_such(tmp_path, suffix):
    """An empty .pt was 'not a readable torch file ()' (EOFError has no message)."""
    path = tmp_path / f"empty{suffix}"
    path.write_bytes(b"")
    result = _cli("audit", str(path))
    assert result.returncode == 2 and f"error: {path}: empty file\n" in result.stderr


def test_audit_checkpoint_takes_paths_and_stays_json_ready(checkpoints):
    """A pathlib.Path was echoed into the report, which json.dumps then refused."""
    report = audit.audit_checkpoint(checkpoints["npz"], update=checkpoints["npz"])
    assert json.loads(json.dumps(report))["checkpoint"] == str(checkpoints["npz"])


def test_cli_npy_and_corrupt_safetensors(tmp_path):
    np.save(tmp_path / "emb.npy", np.full((3, 5), 0.5, np.float16))
    report = json.loads(_cli("audit", str(tmp_path / "emb.npy"), "--json").stdout)
    assert [(r["name"], r["shape"], r["stored"]) for r in report["tensors"]] == [
        ("emb", [3, 5], "float16")
    ]
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 16)
    result = _cli("audit", str(bad))
    assert result.returncode == 2 and "not a readable safetensors file" in result.stderr


def test_no_numpy_warnings(monkeypatch):
    import warnings

    monkeypatch.setattr(audit, "_TABLES", {})  # the decode tables are built again
    w = np.float32([1.0, np.nan, np.inf, 0.0, 7e4]).astype(ml_dtypes.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        audit.audit_tensor(w, w)
        audit.audit_tensor(w.astype(np.float16), lr=1e-3)
        audit.fp16_range(np.zeros(3))
        audit.stagnation(np.float32([np.nan]), lr=1e-3)


def test_cli_torch_update_lacking_tensors(checkpoints, tmp_path):
    torch = pytest.importorskip("torch")
    update = tmp_path / "update.pt"
    torch.save({"model": {"layer.weight": torch.full((4,), 1e-4)}}, update)
    result = _cli("audit", str(checkpoints["pt"]), "--update", str(update), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["missing_updates"] == ["model.layer.bias"]
    assert report["overall"]["stagnation"]["updates"] == 4


def test_cli_safetensors_shape_must_match_its_data(tmp_path):
    """A header whose shape disagrees with its byte range (a negative dimension, or more
    elements than bytes) was audited as -4 or 10,000 weights from the 4 stored values."""
    import struct

    for shape in ([-4], [100, 100], [3]):
        header = json.dumps({"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 16]}})
        path = tmp_path / "lie.safetensors"
        path.write_bytes(struct.pack("<Q", len(header)) + header.encode() + bytes(16))
        result = _cli("audit", str(path), "--json")
        assert result.returncode == 2 and not result.stdout, shape
        assert f"w: shape {shape} of float32" in result.stderr


@pytest.mark.parametrize("kind", ["npy", "npz"])
def test_cli_big_endian_arrays_are_audited(tmp_path, kind):
    """NumPy files written big-endian hold valid weights: they are audited as the native ones
    (they were refused as 'weights: expected a float32 ... array, got >f4')."""
    w = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    reports = []
    for order in ("<", ">"):
        path = tmp_path / f"w{order == '>'}.{kind}"
        data = w.astype(order + "f4")
        np.save(path, data) if kind == "npy" else np.savez(path, w=data)
        result = _cli("audit", str(path), "--json")
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout)
        reports.append([(r["shape"], r["stored"], r["stagnation"]) for r in report["tensors"]])
    assert reports[0] == reports[1]


def test_npz_archive_is_opened_once(tmp_path, monkeypatch):
    """Each member was read through a new ZipFile, which parses the whole central directory:
    quadratic in the members (a 3000-member .npz took 40 s, its safetensors twin 1 s)."""
    import zipfile

    np.savez(tmp_path / "many.npz", **{f"l{i}.weight": np.ones(4, np.float32) for i in range(50)})
    opened = []

    class Counting(zipfile.ZipFile):
        def __init__(self, *args, **kwargs):
            opened.append(args[0])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(zipfile, "ZipFile", Counting)
    report = audit.audit_checkpoint(str(tmp_path / "many.npz"))
    assert len(report["tensors"]) == 50 and len(opened) == 1


def test_cli_output_into_a_closed_pipe_is_no_traceback(tmp_path):
    """`srround audit ... | head -1`: the reader goes away, and the next write of the report
    ended in a BrokenPipeError traceback."""
    import subprocess
    import sys

    np.savez(tmp_path / "many.npz", **{f"l{i}.weight": np.ones(4, np.float32) for i in range(3000)})
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    command = [sys.executable, "-m", "srround", "audit", str(tmp_path / "many.npz"), "--all"]
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as p:
        assert p.stdout.readline().startswith(str(tmp_path / "many.npz").encode())
        p.stdout.close()  # the report is far larger than the pipe's buffer
        err = p.stderr.read().decode()
    assert p.returncode == 1 and "Traceback" not in err, err


def test_fp16_range_errors_name_its_argument():
    """``fp16_range(tensor)``'s errors named ``weights``, an argument it does not have."""
    with pytest.raises(TypeError, match="^tensor: expected a float32"):
        audit.fp16_range(np.zeros(3, np.int32))
