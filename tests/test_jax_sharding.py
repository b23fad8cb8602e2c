"""The JAX adapter on sharded arrays (8 forced CPU devices, in a subprocess: ``XLA_FLAGS`` must
be set before jax is imported): ``jit`` with ``NamedSharding`` and ``shard_map`` give the bits of
the unsharded call on 1, 2, 4 and 8 devices, 1-D and 2-D meshes, uneven splits, replicated and
split leaves mixed; output shardings equal input shardings and nothing is gathered. The cases
are in ``tests/jax_sharded_cases.py``."""

from __future__ import annotations

import os
import pathlib
import re

import pytest

from .reference import run_python

pytest.importorskip("jax")

ROOT = pathlib.Path(__file__).resolve().parent.parent


CASES = [
    "functional",
    "shard_map",
    "optim",
    "loss_scale",
    "errors",
    "explicit",
    "readme",
    "missing_specs",
    "pallas",
]


def _run_cases(cases) -> dict[str, str]:
    """``cases`` in one subprocess (its imports and compilations shared); each case's output
    by name (a case that did not finish: what it printed), with the exit status and stderr."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    # about 250 s on a quiet 2-core machine: room for a busy one (a hang still ends)
    args = ["-m", "tests.jax_sharded_cases", *cases]
    run = run_python(args, env=env, cwd=ROOT, check=False, timeout=1500)
    parts = re.split(r"^=== (\w+)\n", run.stdout, flags=re.M)
    outputs = dict(zip(parts[1::2], parts[2::2]))
    tail = f"\nexit status {run.returncode}; stderr:\n{run.stderr[-4000:]}"
    return {case: outputs.get(case, "(not reached)") + tail for case in cases}


@pytest.fixture(scope="module")
def case_outputs():
    return _run_cases(CASES)


@pytest.mark.parametrize("case", CASES)
def test_sharded_equals_unsharded(case, case_outputs):
    output = case_outputs[case]
    assert f"{case} ok" in output, output


def test_flax_nnx_sharded():
    """flax.nnx's sharded training (``tests/jax_sharded_cases.py`` case ``flax``)."""
    pytest.importorskip("flax")
    output = _run_cases(["flax"])["flax"]
    assert "flax ok" in output, output
