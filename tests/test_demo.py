"""The main job: the demo shows nearest stalling and stochastic rounding tracking fp32."""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest

from srround._demo import run_demo

from .reference import run_python


def test_demo_numbers():
    result = run_demo(steps=300, features=256, samples=2048, eval_every=50)
    assert result.progress("bf16 nearest") > 0.5  # most of fp32's progress is lost
    assert abs(result.progress("bf16 stochastic")) < 0.05
    for method in ("bf16 kahan", "bf16 + remainder", "bf16 + fp32 master"):
        assert abs(result.progress(method)) < 0.02, method


def test_demo_command_writes_table_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    argv = ["-m", "srround", "demo", "--model", "linear", "--steps", "40", "--out", str(tmp_path)]
    result = run_python(argv, env=env, cwd=None)
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


# -- argument validation: one argparse line naming the option, no traceback, nothing run --------


def _cli_error(capsys, argv):
    from srround._cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "argv, option",
    [
        (["--steps", "-5"], "--steps"),
        (["--steps", "0"], "--steps"),
        (["--steps", "2.5"], "--steps"),
        (["--lr", "nan"], "--lr"),
        (["--lr", "inf"], "--lr"),
        (["--lr", "0"], "--lr"),
        (["--lr", "-0.001"], "--lr"),
        (["--lr=-1e-3"], "--lr"),
        (["--lr", "1e38"], "--lr"),  # lr / (1 - 0.9) overflows float32: AdamW refuses it
        (["--lr", "1e40"], "--lr"),
        (["--seed", "-1"], "--seed"),
    ],
)
def test_demo_rejects_bad_numbers(capsys, tmp_path, argv, option):
    line = _cli_error(capsys, ["demo", *argv, "--out", str(tmp_path)])
    assert line.startswith("srround demo: error: argument " + option), line
    assert not any(tmp_path.iterdir())


def _has_cuda():
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(_has_cuda(), reason="a CUDA GPU is present")
@pytest.mark.parametrize(
    "argv",
    [
        [],  # the default model (lm, torch)
        ["--model", "linear"],  # numpy: cpu only
        ["--model", "linear", "--framework", "torch"],
    ],
)
def test_demo_device_cuda_without_gpu_is_a_clear_error(capsys, tmp_path, argv):
    pytest.importorskip("torch")
    line = _cli_error(capsys, ["demo", *argv, "--device", "cuda", "--out", str(tmp_path)])
    assert line.startswith("srround demo: error: --device: "), line
    assert not any(tmp_path.iterdir())


def test_demo_lm_runs_on_torch_only(capsys, tmp_path):
    line = _cli_error(
        capsys, ["demo", "--model", "lm", "--framework", "jax", "--out", str(tmp_path)]
    )
    assert line.startswith("srround demo: error: --framework: the lm demo runs on torch"), line


@pytest.mark.parametrize("model", ["lm", "linear"])
def test_demo_out_that_cannot_be_a_folder_is_refused_before_training(
    capsys, tmp_path, monkeypatch, model
):
    """--out was created only after training (minutes for lm): a file there, or a folder
    below a file, ended the run with a FileExistsError / NotADirectoryError traceback."""
    if model == "lm":
        pytest.importorskip("torch")  # without it the missing framework is the error
    from srround import _demo, _demo_lm

    def trained(*args, **kwargs):
        raise AssertionError("the demo ran")

    monkeypatch.setattr(_demo, "run_demo", trained)
    monkeypatch.setattr(_demo_lm, "run_lm_demo", trained)
    taken = tmp_path / "taken"
    taken.write_text("")
    for out in (taken, taken / "plots"):
        line = _cli_error(capsys, ["demo", "--model", model, "--out", str(out)])
        assert line.startswith(f"srround demo: error: --out: {str(out)!r} "), line


def test_ctrl_c_ends_the_demo_without_a_traceback(capsys, tmp_path, monkeypatch):
    """Ctrl-C in a minutes-long run printed a traceback through torch and srround internals."""
    from srround import _demo
    from srround._cli import main

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(_demo, "run_demo", interrupted)
    try:
        code = main(["demo", "--model", "linear", "--out", str(tmp_path)])
    except KeyboardInterrupt:  # (escaping, it would end the test session)
        code = "KeyboardInterrupt escaped"
    assert code == 130
    err = capsys.readouterr().err
    assert "\nsrround: interrupted\n" in err and "Traceback" not in err


# -- the language-model demo ---------------------------------------------------------------------


def test_demo_modules_do_not_import_torch():
    code = "import sys, srround._cli, srround._demo_lm; print('torch' in sys.modules)"
    result = run_python(["-c", code], env=None, cwd=None)
    assert result.stdout.strip() == "False"


def test_stdlib_text_is_fixed_and_split():
    from srround._demo_lm import stdlib_text

    train, validation = stdlib_text(300_000)
    assert 300_000 <= len(train) and 10_000 <= len(validation)
    assert stdlib_text(300_000) == (train, validation)
    assert validation[:200] not in train


def _tiny(**changes):
    import dataclasses

    from srround._demo_lm import LMConfig

    tiny = LMConfig(
        steps=40,
        lr=1e-4,
        d_model=32,
        n_layers=1,
        n_heads=2,
        seq_len=32,
        batch=8,
        init_std=0.1,
        evals=2,
        eval_sequences=16,
        max_bytes=300_000,
    )
    return dataclasses.replace(tiny, **changes)


def test_lm_demo_nearest_stalls_stochastic_tracks_fp32():
    pytest.importorskip("torch")
    from srround._demo_lm import VARIANTS, run_lm_demo

    result = run_lm_demo(_tiny())
    progress = {row["name"]: row["progress"] for row in result.rows()}
    assert list(progress) == list(VARIANTS)
    assert result.validation["fp32"][-1] < result.validation["fp32"][0] - 0.1  # it learns
    assert progress["bf16 nearest"] >= 0.5, progress
    for variant in ("bf16 stochastic", "bf16 kahan", "bf16 + fp32 master"):
        assert abs(progress[variant]) < 0.05, (variant, progress)


def test_lm_demo_bf16_activations_run():
    """The CUDA configuration's bf16 compute path, on the CPU, two steps."""
    pytest.importorskip("torch")
    from srround._demo_lm import run_lm_demo

    result = run_lm_demo(_tiny(steps=2, compute_dtype="bfloat16"))
    assert all(np.isfinite(row["validation_loss"]) for row in result.rows())


def test_lm_demo_command_json(capsys, tmp_path):
    pytest.importorskip("torch")
    from srround._cli import main

    assert main(["demo", "--steps", "2", "--json", "--out", str(tmp_path)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["name"] for row in rows] == [
        "fp32",
        "bf16 + fp32 master",
        "bf16 nearest",
        "bf16 stochastic",
        "bf16 kahan",
    ]
    for row in rows:
        assert set(row) == {"name", "train_loss", "validation_loss", "progress"}
        assert all(isinstance(row[k], float) for k in ("train_loss", "validation_loss"))
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "demo_lm_loss.png").stat().st_size > 10_000


def test_linear_demo_command_json(capsys, tmp_path):
    from srround._cli import main

    argv = ["demo", "--model", "linear", "--steps", "5", "--json", "--out", str(tmp_path)]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["name"] for row in rows][:3] == ["fp32", "bf16 nearest", "bf16 stochastic"]
    assert all(row["validation_loss"] is None for row in rows)
    assert all(isinstance(row["train_loss"], float) for row in rows)
