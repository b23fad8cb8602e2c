"""The README's Python examples run as written, each given the names it assumes (small
tensors, a tiny model), and do what their comments say where that is cheap to check. The
multi-device examples run where the devices are: the sharded JAX step in
``tests/jax_sharded_cases.py`` (case ``readme``), FSDP2 and ZeroRedundancyOptimizer on two gloo
ranks in ``tests/test_torch_dist.py`` (scenario ``readme``)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import srround

from . import readme

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
jnp = jax.numpy
import srround.adapters.jax  # noqa: E402
import srround.adapters.torch  # noqa: E402

BF16 = ml_dtypes.bfloat16
# the examples that run elsewhere (several devices) and the test that runs each
ELSEWHERE = {
    "from jax.sharding import NamedSharding, PartitionSpec as P": "test_jax_sharding.py",
    "from torch.distributed.fsdp import fully_shard": "test_torch_dist.py",
    "from torch.distributed.optim import ZeroRedundancyOptimizer": "test_torch_dist.py",
    "from torch.distributed.device_mesh import init_device_mesh": "test_torch_dist.py",
}


def _imports():
    return {"np": np, "torch": torch, "jax": jax, "jnp": jnp, "optax": optax, "srround": srround}


def _model():
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)]
    return torch.nn.Sequential(*layers).to(torch.bfloat16)


def _loss(model):
    return model(torch.ones(4, 8, dtype=torch.bfloat16)).float().square().mean()


def _numpy_tree(dtype=np.float32, sizes=(5, 12)):
    rng = np.random.default_rng(0)
    return [(0.1 * rng.standard_normal(n)).astype(np.float32).astype(dtype) for n in sizes]


def test_every_example_has_a_test():
    """A new README example needs a test here (or in a multi-device test, ``ELSEWHERE``)."""
    here = {name for name in globals() if name.startswith("test_example_")}
    assert len(here) + len(ELSEWHERE) == len(readme.examples()), sorted(readme.examples())
    for start in ELSEWHERE:
        assert any(k.startswith(start) for k in readme.examples()), start


def test_example_quickstart():
    ns = readme.run("import numpy as np, srround", {})
    assert ns["y"].dtype == BF16 and ns["h"].dtype == np.float16
    np.testing.assert_array_equal(ns["n"].view(np.uint16), ns["x"].astype(BF16).view(np.uint16))
    np.testing.assert_array_equal(ns["back"], ns["y"].astype(np.float32))
    assert (ns["w"] != np.float32(0.01).astype(BF16)).any()  # some SR(w - 1e-5) moved


def test_example_frameworks():
    ns = readme.run("import torch, jax, jax.numpy as jnp", {"srround": srround})
    assert ns["t"].dtype == torch.bfloat16 and ns["j"].dtype == jnp.bfloat16
    p = ns["p"]  # updated in place, outside autograd: still a leaf parameter
    assert isinstance(p, torch.nn.Parameter) and p.requires_grad and p.grad_fn is None


def test_example_loss_scaling():
    model = _model()
    given = {
        **_imports(),
        "grads": _numpy_tree(),
        "inv_scale": np.full(1, 0.5, np.float32),
        "scale": np.full(1, 2.0**16, np.float32),
        "growth_tracker": np.zeros(1, np.int32),
        "model": model,
        "opt": srround.adapters.torch.AdamW(model.parameters(), lr=1e-3, seed=0),
        "loss": _loss(model),
    }
    ns = readme.run("found_inf = srround.unscale_and_check(grads, inv_scale)", given)
    assert not bool(ns["found_inf"][0])
    assert float(ns["ls"].loss_scale) == 2.0**15  # finite: the growth counter moved only


def test_example_per_layer_scales():
    model = _model()
    given = {
        "srround": srround,
        "model": model,
        "opt": srround.adapters.torch.AdamW(model.parameters(), lr=1e-3, seed=0),
        "loss": _loss(model),
    }
    ns = readme.run("scaler = srround.adapters.torch.GradScaler(init_scale=2.0**12", given)
    assert ns["scaler"].tensor_scales.dtype == torch.float32


def test_example_fp8():
    ns = readme.run("g = np.random.randn(4096).astype(np.float32)", _imports())
    g, e4m3 = ns["g"], ml_dtypes.float8_e4m3fn
    np.testing.assert_array_equal(ns["n8"].view(np.uint8), g.astype(e4m3).view(np.uint8))
    expected = torch.from_numpy(g).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(ns["t8"].view(torch.uint8), expected)


def test_example_nvfp4():
    ns = readme.run(
        "grad = torch.randn(4096, 4096)  # a float32 gradient (CPU or CUDA)",
        {
            **_imports(),
            "step": 3,
        },
    )
    q = ns["q"]
    assert q.data.dtype == torch.uint8 and tuple(q.data.shape) == (4096, 2048)
    assert q.scales.dtype == torch.float8_e4m3fn and tuple(q.scales.shape) == (4096, 256)
    assert q.tensor_scale.dtype == torch.float32 and tuple(q.tensor_scale.shape) == (1,)
    assert ns["g_hat"].shape == ns["grad"].shape


def test_example_fp8_states():
    params = [torch.nn.Parameter(torch.full((300,), 0.5, dtype=torch.bfloat16))]
    blocks = -(-300 // srround.STATE_BLOCK)
    given = {
        **_imports(),
        "params": params,
        "grads": [torch.full((300,), 1e-2)],
        "m8": [torch.zeros(300, dtype=torch.float8_e4m3fn)],
        "s8": [torch.zeros(300, dtype=torch.float8_e4m3fn)],
        "m_scales": [torch.zeros(blocks)],
        "s_scales": [torch.zeros(blocks)],
        "t": torch.zeros(1, dtype=torch.int32),
    }
    ns = readme.run(
        "opt = srround.adapters.torch.AdamW(params, lr=1e-3, state_dtype=torch.float8_e4m3fn",
        given,
    )
    assert int(ns["t"][0]) == 1
    assert (params[0] <= 0.5).all() and (params[0] < 0.5).any()  # SR of 0.5 - ~1e-3
    assert ns["tx"].config["state_dtype"] == jnp.float8_e4m3fn


def test_example_fused_optimizers():
    params = _numpy_tree(BF16)
    tx = srround.adapters.jax.adamw(1e-4, seed=0, rounding="stochastic")
    given = {
        **_imports(),
        "params": params,
        "grads": _numpy_tree(np.float32, (5, 12)),
        "exp_avgs": [np.zeros(p.shape, np.float32) for p in params],
        "exp_avg_sqs": [np.zeros(p.shape, np.float32) for p in params],
        "momentum_buffers": [np.zeros(p.shape, np.float32) for p in params],
        "steps": np.zeros(len(params), np.int32),
        "model": _model(),
        "opt_state": optax.adamw(1e-4).init(params),
        "key": jax.random.key(0),
        "count": 1,
        "state": tx.init(params),
    }
    ns = readme.run("srround.adamw_step(", given)
    assert list(ns["steps"]) == [2, 2]  # adamw_step, then sgd_step
    assert all(p.dtype == jnp.bfloat16 for p in ns["params"])
    assert int(ns["state"].count) == 2  # update, then step


def test_example_stochastic_write_back():
    params = [jnp.asarray(p) for p in _numpy_tree(BF16)]
    grads = [jnp.asarray(g) for g in _numpy_tree(BF16, (5, 12))]
    given = {"optax": optax, "sj": srround.adapters.jax, "params": params, "grads": grads}
    ns = readme.run("tx = optax.chain(optax.adamw(1e-4), sj.stochastic_write_back", given)
    inner = optax.adamw(1e-4)
    updates, _ = inner.update(grads, inner.init(params), params)
    want = srround.adapters.jax.apply_updates(params, updates, 0, step=1)
    for got, expected in zip(ns["params"], want):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(got.view(jnp.uint16), expected.view(jnp.uint16))


def test_example_torch_checkpoints():
    model = _model()
    torch_adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _loss(model).backward()
    torch_adamw.step()
    ns = readme.run(
        "opt = srround.adapters.torch.AdamW(model.parameters(), lr=1e-4, maximize=False",
        {**_imports(), "model": model, "torch_adamw": torch_adamw},
    )
    assert int(ns["opt"].state_dict()["state"][0]["step"]) == 1


def test_example_torch_compile():
    """The compiled step of the example, then its ``unscale_and_clip`` in a scaled step."""
    model = _model()
    batches = [torch.randn(4, 8, dtype=torch.bfloat16) for _ in range(2)]
    given = {
        **_imports(),
        "model": model,
        "batches": batches,
        "scaler": srround.adapters.torch.GradScaler("cpu", init_scale=2.0**4),
        "update": torch.randn(16),  # float32
        "k": 7,
    }
    ns = readme.run(
        "opt = srround.adapters.torch.AdamW(model.parameters(), lr=1e-4, seed=0)", given
    )
    opt, scaler = ns["opt"], ns["scaler"]
    assert int(opt.state_dict()["state"][0]["step"]) == len(batches)
    assert ns["y"].dtype == torch.bfloat16
    scaler.scale(ns["model"](batches[0]).float().square().mean()).backward()
    ns["unscale_and_clip"](opt)
    scaler.step(opt)
    scaler.update()
    assert int(opt.state_dict()["state"][0]["step"]) == len(batches) + 1


def test_example_inject_hyperparams():
    import functools

    given = {"functools": functools, "jnp": jnp, "optax": optax, "sj": srround.adapters.jax}
    ns = readme.run("inject = functools.partial(optax.inject_hyperparams", given)
    params = [jnp.ones(8, jnp.bfloat16)]  # all bf16: hyperparam_dtype keeps float32 values
    state = ns["tx"].init(params)
    _, state = jax.jit(ns["tx"].update)([jnp.ones(8)], state, params)
    assert state.hyperparams["learning_rate"].dtype == jnp.float32
    assert float(state.hyperparams["learning_rate"]) == np.float32(1e-2)  # the sgd one
