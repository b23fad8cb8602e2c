"""Install-level contracts: what ``import srround`` pulls in, the NumPy 2.5 shim for
numba-cuda, and real CUDA code generation (PTX) where the CUDA compilers are installed."""

from __future__ import annotations

import os
import tempfile
import textwrap

import pytest

from .reference import run_python


def _run(code, **env):
    """Run ``code`` in a fresh interpreter, outside the source tree (so only the installed
    package is importable) and without the CUDA simulator."""
    environment = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    environment.update(env)
    return run_python(
        ["-c", textwrap.dedent(code)], env=environment, cwd=tempfile.gettempdir(), check=False
    )


def test_import_srround_imports_no_framework_and_no_cuda():
    result = _run(
        """
        import sys, numpy as np, srround
        srround.stochastic_round(np.ones(8, np.float32), seed=0)
        bad = [m for m in ("torch", "jax", "cupy", "tensorflow", "numba.cuda") if m in sys.modules]
        print(bad)
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_adapters_installed_under_srround_only():
    result = _run(
        "import srround.adapters, importlib.util; print(importlib.util.find_spec('adapters'))"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "None"


def test_adapters_reachable_from_import_srround():
    """The README's ``import srround`` then ``srround.adapters.torch.GradScaler()``: the
    adapters are an attribute of the package, imported on first use (not by ``import srround``)."""
    pytest.importorskip("torch")
    result = _run(
        """
        import sys, srround
        print("srround.adapters" in sys.modules)
        print(srround.adapters.numpy.__name__, srround.adapters.torch.GradScaler.__name__)
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "srround.adapters.numpy", "GradScaler"]


_WITHOUT_ROW_STACK = """
import numpy as np
if hasattr(np, "row_stack"):
    del np.row_stack            # what NumPy 2.5 looks like
{import_line}
import numba.cuda.np.arrayobj   # the module that registers np.row_stack's overload
print("ok")
"""


def test_numpy_25_shim_makes_numba_cuda_importable():
    fixed = _run(
        _WITHOUT_ROW_STACK.format(
            import_line="from srround._numba_cuda_compat import import_numba_cuda; import_numba_cuda()"
        )
    )
    assert fixed.returncode == 0 and fixed.stdout.strip() == "ok", fixed.stderr
    unfixed = _run(_WITHOUT_ROW_STACK.format(import_line="from numba import cuda"))
    if unfixed.returncode == 0:
        pytest.skip("this numba-cuda no longer needs np.row_stack: the shim can go")
    assert "row_stack" in unfixed.stderr


_PTX = """
import re
from numba import types as t
from types import SimpleNamespace
from numba import cuda
from numba.cuda import compile_ptx, dispatcher
from srround import _cuda
if not cuda.is_available():
    # numba-cuda compiles a called device function for the current device's compute capability,
    # which needs a driver; without one, compile them for the target below (sm_90)
    dispatcher.get_current_device = lambda: SimpleNamespace(compute_capability=(9, 0))
u64, u32, u16, i64, f32, b = t.uint64[::1], t.uint32[::1], t.uint16[::1], t.int64, t.float32, t.boolean
kernels = {
    # (src, dst, alpha, k0, k1, offset, mantissa_bits, exponent_bits, saturate[, specials])
    "_stochastic_round_vec4": (u64, u64, f32, i64, i64, i64, i64, i64, b),
    "_stochastic_add_vec4": (u64, u64, f32, i64, i64, i64, i64, i64, b),
    "_stochastic_round_general": (u32, u16, f32, i64, i64, i64, i64, i64, b, i64),
    "_stochastic_add_general": (u32, u16, f32, i64, i64, i64, i64, i64, b, i64),
    "_round_nearest_vec4": (u64, u64, f32, i64, i64, i64, i64, i64, b),
    "_round_nearest_general": (u32, u16, f32, i64, i64, i64, i64, i64, b, i64),
    "_to_float32_vec4": (u64, u64, f32, i64, i64, i64, i64, i64, b),
    "_to_float32_general": (u16, u32, f32, i64, i64, i64, i64, i64, b, i64),
    "_update_scale": (u32, u32, u32, u32, t.Tuple((t.float64, t.float64, i64, i64, f32, f32))),
}
i64a, f64a, f32a, i32 = t.int64[:, ::1], t.float64[:, ::1], t.float32[:, ::1], t.int32[::1]
# (mode, state_fmt, table, starts, bstarts, hyper, steps, coefs, inv_scale, found, k0, k1)
kernels["_optim_step8"] = (i64, i64, i64a, t.int64[::1], t.int64[::1], f64a, i32, f32a, u32, u32, i64, i64)
mx = t.Tuple((i64, i64, i64, b, i64, i64, i64, b, b, b))  # _blocks._element_params + 2 flags
blocks = {  # addresses, block count, tensor scale word, layout, key, offset, params
    "_quantize": (i64, i64, i64, i64, u32, i64, i64, i64, i64, i64, i64, mx),
    "_dequantize": (i64, i64, i64, u32, i64, i64, i64, i64, t.Tuple((i64, i64, i64, b, b))),
}
from srround import _blocks_cuda, _elements as E
# the fused step's kernels are built per configuration (_cuda.optim_step_kernel)
step_sig = (i64a, t.int64[::1], f64a, i32, f32a, u32, u32, i64, i64)
steps = {
    "_optim_step_adamw": (E.ADAMW, E.STOCHASTIC, E.F32, E.STATE1_ALL, (E.BF16, E.BF16)),
    "_optim_step_sgd_mixed": (E.SGD, E.KAHAN, E.BF16, E.STATE1_SOME, (-1, -1)),
}
# and the unscale kernel per gradient format (-1: mixed)
unscale_sig = (t.int64[::1], t.int64[::1], t.int64[::1], u32, u32, b)
unscales = {"_unscale_and_check": -1, "_unscale_and_check_fp32": E.F32}
for name, sig in [*kernels.items(), *blocks.items(), *steps.items(), *unscales.items()]:
    if name in steps:
        kernel, sig = _cuda._make_step(*sig), step_sig
    elif name in unscales:
        kernel, sig = _cuda._make_unscale(sig), unscale_sig
    else:
        kernel = getattr(_blocks_cuda if name in blocks else _cuda, name)
    ptx, _ = compile_ptx(kernel.py_func, sig, cc=(9, 0))
    ops = sorted(set(re.findall(r"(ld\\.global\\S*|st\\.global\\S*|fma\\.\\S*|\\.local)", ptx)))
    print(name, " ".join(ops) or "-")
"""


def test_cuda_kernels_compile_to_ptx_with_8_byte_accesses():
    """Compiles every CUDA kernel for sm_90 (needs libnvvm and NVRTC, no GPU): the fast kernels
    move 8 bytes per load and store, no kernel spills to local memory, and the fused add is one
    ``fma.rn.f32`` (the same single rounding as the CPU's llvm.fma)."""
    result = _run(_PTX)
    if result.returncode != 0:
        if "nvvm" in result.stderr.lower() or "nvrtc" in result.stderr.lower():
            pytest.skip("CUDA compilers (libnvvm, NVRTC) not installed")
        pytest.fail(result.stderr)
    lines = dict(line.split(" ", 1) for line in result.stdout.strip().splitlines())
    assert lines["_stochastic_round_vec4"] == "ld.global.u64 st.global.u64"
    assert lines["_stochastic_add_vec4"] == "fma.rn.f32 ld.global.u64 st.global.u64"
    assert lines["_round_nearest_vec4"] == "ld.global.u64 st.global.u64"
    assert lines["_to_float32_vec4"] == "ld.global.u64 st.global.u64"
    assert "fma.rn.f32" in lines["_stochastic_add_general"]
    assert not any(".local" in ops for ops in lines.values())
    assert len(lines) == 16 and lines["_unscale_and_check"] and lines["_update_scale"]  # all built
