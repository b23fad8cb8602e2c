"""The main job: the demo shows nearest stalling and stochastic rounding tracking fp32."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from srround._demo import run_demo


def test_demo_numbers():
    result = run_demo(steps=300, features=256, samples=2048, eval_every=50)
    assert result.progress("bf16 nearest") > 0.5  # most of fp32's progress is lost
    assert abs(result.progress("bf16 stochastic")) < 0.05
    for method in ("bf16 kahan", "bf16 + remainder", "bf16 + fp32 master"):
        assert abs(result.progress(method)) < 0.02, method


def test_demo_command_writes_table_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    result = subprocess.run(
        [sys.executable, "-m", "srround", "demo", "--steps", "40", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    assert "bf16 stochastic" in result.stdout
    assert (tmp_path / "demo_loss.png").stat().st_size > 10_000


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_demo_on_other_frameworks_matches_numpy(framework):
    pytest.importorskip(framework)
    kwargs = dict(steps=60, features=64, samples=512, eval_every=20)
    ours = run_demo(**kwargs)
    theirs = run_demo(framework=framework, **kwargs)
    for method, curve in ours.losses.items():
        assert curve == pytest.approx(theirs.losses[method], rel=1e-4), method
