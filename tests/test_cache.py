"""Numba's on-disk cache is keyed on srround's own sources: an edited scalar body never runs
stale from a kernel cached in another module (srround/_cache.py)."""

from __future__ import annotations

import ast
import json
import os
import shutil
from pathlib import Path

import srround

from .reference import run_python

PACKAGE = Path(srround.__file__).resolve().parent

RUN = """
import json, sys
import ml_dtypes, numpy as np
import srround
y = srround.to_float32(np.array([1.5, -2.0], ml_dtypes.bfloat16))
print(json.dumps({"file": srround.__file__, "y": [float(v) for v in y],
                  "root": str(srround._cache.cache_root())}))
"""


def _run(folder: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "PYTHONPATH")}
    env.update(PYTHONPATH=str(folder), NUMBA_NUM_THREADS="1")
    proc = run_python(["-c", RUN], env=env, cwd=folder)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _edit_decode(package: Path) -> None:
    """Make the scalar body ``decode`` keep only the sign bit (every value widens to +-0)."""
    for path in package.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name == "decode":
                lines = path.read_text().splitlines(keepends=True)
                first = node.body[0]
                at = first.end_lineno if isinstance(first, ast.Expr) else first.lineno - 1
                indent = " " * node.body[-1].col_offset
                lines.insert(at, f"{indent}h = h & 0x8000  # edited by test_cache\n")
                path.write_text("".join(lines))
                return
    raise AssertionError("no scalar body named decode in srround")


def test_edited_body_in_another_module_never_runs_stale(tmp_path):
    copy = tmp_path / "src" / "srround"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))

    first = _run(copy.parent)
    assert Path(first["file"]).resolve().parent == copy  # the copy, not the checkout
    assert first["y"] == [1.5, -2.0]
    assert Path(first["root"]).is_relative_to(copy / "__pycache__")
    assert any(Path(first["root"]).rglob("*.nbi"))  # compiled and cached

    assert _run(copy.parent) == first  # same sources: the same cache

    _edit_decode(copy)  # the kernel's own module (the loop) is unchanged
    edited = _run(copy.parent)
    assert edited["y"] == [0.0, -0.0] and str(edited["y"][1]) == "-0.0"
    assert edited["root"] != first["root"]
    # the other sources' cache stays until unused for a day (a process may still run them)
    assert Path(first["root"]).exists()


def test_numba_cuda_is_set_up_once_per_process(monkeypatch):
    """Every CUDA call asks for ``numba.cuda`` (three times a ``stochastic_round``); setting it
    up - the NumPy shim and the cache locator, which builds a class - happens once: it had
    cost 23 us a time, 80 -> 25 us of host time per call with the launch stubbed out."""
    from srround import _cache
    from srround._numba_cuda_compat import import_numba_cuda

    first = import_numba_cuda()
    calls = []
    monkeypatch.setattr(_cache, "install_cuda", lambda: calls.append(1))
    assert all(import_numba_cuda() is first for _ in range(10))
    assert calls == []


def test_another_sources_cache_is_removed_only_once_stale(tmp_path):
    """The in-tree cache of other sources was removed by the first process of new sources:
    a process still running the old ones (a training job while srround was upgraded or
    edited) failed when it next compiled (FileNotFoundError on its index). Now only a cache
    nothing was written to for a day goes."""
    from srround import _cache

    keep, recent, stale = (tmp_path / f"numba-{name}" for name in ("new", "recent", "stale"))
    for folder in (keep, recent, stale):
        (folder / "sub").mkdir(parents=True)
        (folder / "sub" / "kernel.nbi").write_bytes(b"")
    now = (tmp_path / "numba-stale" / "sub" / "kernel.nbi").stat().st_mtime
    day_ago = now - _cache._STALE_AFTER_S - 60
    for path in (stale, stale / "sub", stale / "sub" / "kernel.nbi"):
        os.utime(path, (day_ago, day_ago))
    _cache._prune(tmp_path, keep.name, now=now)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["numba-new", "numba-recent"]
