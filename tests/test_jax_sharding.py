"""The JAX adapter on sharded arrays (8 forced CPU devices, in a subprocess: ``XLA_FLAGS`` must
be set before jax is imported): ``jit`` with ``NamedSharding`` and ``shard_map`` give the bits of
the unsharded call on 1, 2, 4 and 8 devices, 1-D and 2-D meshes, uneven splits, replicated and
split leaves mixed; output shardings equal input shardings and nothing is gathered. The cases
are in ``tests/jax_sharded_cases.py``."""

from __future__ import annotations

import os
import pathlib

import pytest

from .reference import run_python

pytest.importorskip("jax")

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "case",
    [
        "functional",
        "shard_map",
        "optim",
        "loss_scale",
        "errors",
        "explicit",
        "readme",
        "missing_specs",
    ],
)
def test_sharded_equals_unsharded(case):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    run = run_python(["-m", "tests.jax_sharded_cases", case], env=env, cwd=ROOT)
    assert f"{case} ok" in run.stdout


def test_flax_nnx_sharded():
    """flax.nnx's sharded training (``tests/jax_sharded_cases.py`` case ``flax``)."""
    pytest.importorskip("flax")
    test_sharded_equals_unsharded("flax")
