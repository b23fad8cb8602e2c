"""``srround.audit`` against exact arithmetic, and ``srround audit`` through the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import srround
from srround import audit


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
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    return subprocess.run(
        [sys.executable, "-m", "srround", *args], capture_output=True, text=True, env=env
    )


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
