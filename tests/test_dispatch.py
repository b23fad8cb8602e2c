"""Dispatch (``srround._dispatch``): detection by type, rejected array-likes, the adapter
protocol, and the first call from many threads."""

from __future__ import annotations

import importlib
import os
import tempfile
import textwrap
import warnings

import numpy as np
import pytest

import srround
from srround import _dispatch

from .reference import run_python


class Subclass(np.ndarray):
    """An ndarray subclass of another package (this module)."""


class ArrayLike:
    """Converts to an array, but is none."""

    def __array__(self, dtype=None, copy=None):
        return np.ones(4, np.float32)


def test_ndarray_subclass_of_another_package_is_accepted():
    x = np.linspace(-3, 3, 64, dtype=np.float32)
    out = np.empty(64, np.float16).view(Subclass)
    expected = srround.stochastic_round(x, dtype="float16", seed=3)
    got = srround.stochastic_round(x.view(Subclass), dtype="float16", seed=3, out=out)
    assert got is out
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), expected.view(np.uint16))


@pytest.mark.parametrize("name", ["x", "out"])
def test_masked_array_is_rejected_naming_the_argument(name):
    x = np.ones(4, np.float32)
    masked = np.ma.masked_array(np.ones(4, np.float16 if name == "out" else np.float32))
    kwargs = {"x": masked} if name == "x" else {"x": x, "out": masked}
    with pytest.raises(TypeError, match=rf"^{name}: numpy.ma.MaskedArray is not supported"):
        srround.stochastic_round(dtype="float16", seed=0, **kwargs)


def test_matrix_and_array_likes_are_rejected_naming_the_argument():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PendingDeprecationWarning)  # np.matrix itself
        matrix = np.matrix(np.ones(4, np.float32))
    with pytest.raises(TypeError, match=r"^x: numpy.matrix is not supported"):
        srround.stochastic_round(matrix, seed=0)
    with pytest.raises(TypeError, match=r"^u: unsupported array type .*ArrayLike"):
        srround.stochastic_add(np.zeros(4, np.float16), ArrayLike(), dtype="float16", seed=0)
    with pytest.raises(TypeError, match=r"^grads: unsupported array type .*ArrayLike"):
        srround.unscale_and_check([ArrayLike()], 0.5)


def test_torch_subclass_is_accepted():
    torch = pytest.importorskip("torch")

    class Tagged(torch.Tensor):
        pass

    x = torch.linspace(-3, 3, 64)
    expected = srround.stochastic_round(x, seed=5)
    got = srround.stochastic_round(x.as_subclass(Tagged), seed=5)
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))


def test_every_adapter_declares_whether_it_is_mutable():
    for name in ("numpy", "numba"):
        assert importlib.import_module(f"srround.adapters.{name}").MUTABLE is True
    if importlib.util.find_spec("torch"):
        assert importlib.import_module("srround.adapters.torch._views").MUTABLE is True
    if importlib.util.find_spec("jax"):
        assert importlib.import_module("srround.adapters.jax._api").MUTABLE is False


def test_detection_is_cached_per_type():
    x = np.ones(4, np.float32)
    assert _dispatch.adapter_for(x=x).__name__ == "srround.adapters.numpy"
    assert _dispatch._BY_TYPE[np.ndarray] == "numpy"
    assert _dispatch.adapter_for(x=x.view(Subclass)) is _dispatch.adapter_for(x=x)


def _run(code):
    """``code`` in a fresh interpreter (nothing imported before it), outside the source tree."""
    env = {k: v for k, v in os.environ.items()}
    return run_python(
        ["-c", textwrap.dedent(code)], env=env, cwd=tempfile.gettempdir(), check=False
    )


def test_import_srround_imports_no_adapter():
    result = _run(
        """
        import sys, numpy as np, srround
        before = [m for m in sys.modules if m.startswith("srround.adapters")]
        srround.stochastic_round(np.ones(8, np.float32), seed=0)
        after = [m for m in sys.modules if m.startswith("srround.adapters.")]
        print(before, "srround.adapters.numpy" in after, all("torch" not in m for m in after))
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["[]", "True", "True"]
