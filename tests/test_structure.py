"""The shape of the code base: imports go one way, codes and columns are named once, one
planner serves every optimizer front end, contracts live in the repository."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import srround
from srround import _elements, _plan
from srround._formats import (
    CODE_DTYPES,
    CODE_EXPONENT_BITS,
    CODE_MANTISSA_BITS,
    CODE_WIDTH,
    DTYPE_CODES,
    FORMATS,
    BufferCode,
)

from .reference import run_python

ROOT = Path(__file__).resolve().parents[1]

_LINT = """
import sys
from importlinter.cli import lint_imports_command
sys.argv = ["lint-imports", "--no-cache"]
lint_imports_command()
"""


def test_imports_go_one_way(tmp_path):
    """``lint-imports`` keeps the layers contracts of ``pyproject.toml`` on an installed layout
    (``srround.adapters`` inside ``srround``), lazy imports included."""
    pytest.importorskip("importlinter")
    package = tmp_path / "srround"
    package.mkdir()
    for source in (ROOT / "srround").glob("*.py"):
        (package / source.name).symlink_to(source)
    (package / "adapters").symlink_to(ROOT / "adapters")
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    done = run_python(["-c", _LINT], env=env, cwd=tmp_path, timeout=300)
    assert "0 broken" in done.stdout
    analyzed = int(re.search(r"Analyzed (\d+) files", done.stdout).group(1))
    assert analyzed > len(list((ROOT / "srround").glob("*.py")))  # the adapters were seen


def test_buffer_codes_are_one_table():
    """One enum of buffer codes; dtypes, field widths and element widths derive from it."""
    assert sorted(CODE_DTYPES) == sorted(BufferCode)
    assert [int(c) for c in sorted(BufferCode)] == list(range(len(BufferCode)))
    for code, dtype in CODE_DTYPES.items():
        assert DTYPE_CODES[dtype] is code
        assert CODE_WIDTH[code] == dtype.itemsize
    for fmt in FORMATS.values():
        assert CODE_DTYPES[fmt.code] == fmt.numpy_dtype
        assert (CODE_MANTISSA_BITS[fmt.code], CODE_EXPONENT_BITS[fmt.code]) == (
            fmt.mantissa_bits,
            fmt.exponent_bits,
        )
    assert (CODE_MANTISSA_BITS[BufferCode.FLOAT32], CODE_EXPONENT_BITS[BufferCode.FLOAT32]) == (
        23,
        8,
    )


def test_torch_codes_follow_the_enum():
    torch = pytest.importorskip("torch")
    from srround.adapters.torch import _views

    assert _views._BUFFER_CODES == {
        torch.float32: BufferCode.FLOAT32,
        torch.bfloat16: BufferCode.BFLOAT16,
        torch.float16: BufferCode.FLOAT16,
        torch.int16: BufferCode.INT16,
        torch.float8_e4m3fn: BufferCode.FLOAT8_E4M3FN,
        torch.float8_e5m2: BufferCode.FLOAT8_E5M2,
    }  # torch has no one-value-per-byte fp4 dtype


def test_views_follow_the_element_width():
    """A one-byte format gets ``uint8`` views: nothing hard-codes ``uint16``."""
    from srround.adapters import numpy as numpy_adapter

    one_byte = dataclasses.replace(
        FORMATS["bfloat16"], name="fake8", numpy_dtype=np.dtype(ml_dtypes.float8_e4m3fn)
    )
    assert one_byte.width == 1 and one_byte.bits_dtype == np.uint8
    like, _ = numpy_adapter.source(np.zeros(3, np.float32), "x")
    view = numpy_adapter.target(None, "out", like, one_byte)
    assert view.bits.dtype == np.uint8 and view.bits.size == 3
    assert numpy_adapter.target(None, "out", like, FORMATS["float16"]).bits.dtype == np.uint16
    assert numpy_adapter.target(None, "out", like, None).bits.dtype == np.uint32


def test_table_columns_are_named():
    assert [c.name for c in _elements.Column][:8] == [
        "P_ADDR",
        "P_FMT",
        "G_ADDR",
        "G_FMT",
        "S1_ADDR",
        "S2_ADDR",
        "AUX_ADDR",
        "GROUP",
    ]
    assert [int(c) for c in _elements.Column] == list(range(len(_elements.Column)))
    assert _elements.TABLE_COLUMNS == len(_elements.Column)
    assert _elements.MODES == {m.name.lower(): int(m) for m in _elements.Mode}


def _problem(dtype=ml_dtypes.bfloat16):
    rng = np.random.default_rng(0)
    params = [rng.standard_normal(n).astype(dtype) for n in (5, 3)]
    grads = [rng.standard_normal(n).astype(np.float32) for n in (5, 3)]
    states = [[np.zeros(n, np.float32) for n in (5, 3)] for _ in range(2)]
    return params, grads, *states


def test_bad_rounding_is_one_error_everywhere():
    """The functional API and the torch optimizers share one planner: the same error class for
    an unknown mode and for a mode the parameters cannot use, raised before anything runs."""
    params, grads, m, v = _problem()
    with pytest.raises(_plan.RoundingError, match="rounding: expected one of"):
        srround.adamw_step(params, grads, m, v, lr=0.1, step=1, rounding="up")
    fp16, grads, m, v = _problem(np.float16)
    aux = [np.zeros(p.size, np.int16) for p in fp16]
    with pytest.raises(_plan.RoundingError, match=r"params\[0\]: rounding='remainder'"):
        srround.adamw_step(fp16, grads, m, v, lr=0.1, step=1, rounding="remainder", aux=aux)
    assert issubclass(_plan.RoundingError, ValueError) and issubclass(
        _plan.RoundingError, TypeError
    )
    torch = pytest.importorskip("torch")
    from srround.adapters.torch import AdamW

    with pytest.raises(_plan.RoundingError, match="rounding: expected one of"):
        AdamW([torch.nn.Parameter(torch.zeros(2))], rounding="up")
    with pytest.raises(_plan.RoundingError, match="rounding='remainder'"):
        AdamW([torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))], rounding="remainder")


def test_plan_builds_the_table():
    """``plan_step`` validates and fills every column of the pointer table."""
    from srround.adapters import numpy as numpy_adapter

    params, grads, m, v = _problem()
    aux = [np.zeros(p.size, ml_dtypes.bfloat16) for p in params]
    plan = _plan.plan_step(
        numpy_adapter, "kahan", params, grads, (("m", m), ("v", v)), aux, groups=[0, 1]
    )
    table = plan.table
    C = _elements.Column
    assert table.shape == (2, len(C))
    assert list(table[:, C.P_FMT]) == [BufferCode.BFLOAT16] * 2
    assert list(table[:, C.G_FMT]) == [BufferCode.FLOAT32] * 2
    assert list(table[:, C.GROUP]) == [0, 1]
    for column, arrays in ((C.P_ADDR, params), (C.S1_ADDR, m), (C.S2_ADDR, v), (C.AUX_ADDR, aux)):
        assert list(table[:, column]) == [a.__array_interface__["data"][0] for a in arrays]
    assert plan.sizes == [5, 3] and plan.state_fmt == BufferCode.FLOAT32
    with pytest.raises(TypeError, match=r"aux\[1\]: expected the parameter's dtype"):
        _plan.plan_step(
            numpy_adapter,
            "kahan",
            params,
            grads,
            (("m", m), ("v", v)),
            [aux[0], np.zeros(3, np.float32)],
        )


def test_contracts_live_in_the_repository():
    """Code refers to docs/contracts.md, never to a document outside the repository."""
    contracts = ROOT / "docs" / "contracts.md"
    assert contracts.is_file()
    sources = [*(ROOT / "srround").glob("*.py"), *(ROOT / "adapters").rglob("*.py")]
    for source in sources:
        text = source.read_text()
        assert "design §" not in text and "design.md" not in text, source
    assert "docs/contracts.md" in (ROOT / "srround" / "_rng.py").read_text()
    assert "docs/contracts.md" in (ROOT / "README.md").read_text()


def test_gpu_session_runs_every_gpu_benchmark():
    """``benchmarks/gpu_session.sh`` (the one call a lent GPU gets) runs every benchmark that
    has GPU rows (a ``--device`` option), and the JAX GPU check: a new benchmark cannot be
    missed there."""
    script = (ROOT / "benchmarks" / "gpu_session.sh").read_text()
    gpu_benchmarks = [
        path.stem
        for path in sorted((ROOT / "benchmarks").glob("bench_*.py"))
        if "--device" in path.read_text() or "bench_parser(" in path.read_text()
    ]
    assert gpu_benchmarks, "no benchmark with a --device option found"
    missing = [name for name in [*gpu_benchmarks, "jax_gpu_check"] if name not in script]
    assert not missing, f"benchmarks/gpu_session.sh does not run {missing}"


def test_top_level_is_the_design_card():
    """The repository's top level holds the design card's entries and nothing else: a
    benchmark's stray output or a scratch script cannot be committed there unnoticed."""
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(
        [git, "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    top_level = {line.split("/", 1)[0] for line in listed.splitlines() if line}
    expected = {".ci", ".gitignore", "README.md", "pyproject.toml", "docs"}
    expected |= {"srround", "adapters", "tests", "benchmarks"}
    assert top_level <= expected, f"unexpected top-level entries: {sorted(top_level - expected)}"
