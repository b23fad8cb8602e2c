"""optax conventions of the JAX optimizers: ``adamw`` and ``sgd`` are optax
``GradientTransformation`` s with optax's signatures and defaults (optax's own update tests,
adapted), the stochastic write-back is reachable through ``update`` + ``optax.apply_updates``,
``apply_updates`` broadcasts like optax, and bad input gets clear errors."""

from __future__ import annotations

import functools
import inspect

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

import srround  # noqa: E402
from srround.adapters import jax as sj  # noqa: E402

from .reference import assert_same_bits, normal_params  # noqa: E402

SHAPES = [(33,), (7, 5), (3,)]
SEED = 0x1234_5678_9ABC


def _grads(t):
    rng = np.random.default_rng(100 + t)
    return [(rng.standard_normal(s) * 1e-1).astype(np.float32) for s in SHAPES]


def test_signatures_and_defaults_are_optax():
    for ours, theirs in ((sj.adamw, optax.adamw), (sj.sgd, optax.sgd)):
        a, b = inspect.signature(ours).parameters, inspect.signature(theirs).parameters
        for name, param in b.items():
            assert name in a, name
            assert a[name].default == param.default, name
            assert a[name].kind == param.kind or param.kind == param.KEYWORD_ONLY, name
        assert list(a)[: len(b)] == [n for n in b if b[n].kind != b[n].KEYWORD_ONLY] + [
            n for n in b if b[n].kind == b[n].KEYWORD_ONLY
        ]
    tx = sj.adamw(1e-3)
    assert isinstance(tx, optax.GradientTransformation)
    assert tx.config["wd"] == 1e-4
    state = tx.init([jnp.zeros(3)])
    assert isinstance(state, tuple) and state._fields == ("count", "exp_avg", "exp_avg_sq", "aux")


@pytest.mark.parametrize("kw", [{}, {"nesterov": True}, {"eps_root": 1e-8}])
def test_adamw_float32_tracks_optax_adamw(kw):
    """optax's own adamw test idea (optax/_src/alias_test.py): float32 params follow
    optax.adamw within float32 rounding of the same math (another operation order), with
    mask, nesterov and eps_root."""
    params = {"w": jnp.asarray(normal_params(SHAPES, [np.float32] * 3)[1]), "b": jnp.ones(3)}
    mask = {"w": True, "b": False}
    otx = optax.adamw(1e-2, weight_decay=0.1, mask=mask, **kw)
    tx = sj.adamw(1e-2, weight_decay=0.1, mask=mask, **kw)
    ostate, state = otx.init(params), tx.init(params)
    ref, ours = params, params
    for t in range(5):
        g = {"w": jnp.asarray(_grads(t)[1]), "b": jnp.full(3, 0.5)}
        u, ostate = otx.update(g, ostate, ref)
        ref = optax.apply_updates(ref, u)
        ours, state = tx.step(g, state, ours)
    for k in params:
        np.testing.assert_allclose(ours[k], ref[k], rtol=1e-5, atol=1e-6)
    # the mask: "b" decays only through its gradient; without the mask it would differ
    assert float(jnp.abs(ours["b"] - ref["b"]).max()) < 1e-6


def test_mask_may_be_a_prefix_of_params_as_in_optax():
    """optax's ``mask`` is a pytree like params *or a prefix of it*: one bool for a subtree
    (before: "mask: expected a pytree of bools like params: Expected dict, got True")."""
    params = {
        "enc": {"w": jnp.ones((2, 3)), "b": jnp.ones(3)},
        "dec": {"w": jnp.full((3, 2), 2.0)},
    }
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.1), params)
    full = {"enc": {"w": True, "b": True}, "dec": {"w": False}}
    results = []
    for mask in ({"enc": True, "dec": False}, full):
        tx = sj.adamw(1e-2, weight_decay=0.5, mask=mask, seed=SEED)
        results.append(tx.step(grads, tx.init(params), params)[0])
    for a, b in zip(*map(jax.tree.leaves, results)):
        assert_same_bits(a, b)
    decayed = optax.adamw(1e-2, weight_decay=0.5, mask={"enc": True, "dec": False})
    ref = optax.apply_updates(params, decayed.update(grads, decayed.init(params), params)[0])
    for a, b in zip(*map(jax.tree.leaves, (results[0], ref))):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_adamw_update_then_optax_apply_updates_is_the_fused_step():
    params = [
        jnp.asarray(p)
        for p in normal_params(SHAPES, [ml_dtypes.bfloat16, np.float16, ml_dtypes.bfloat16])
    ]
    tx = sj.adamw(1e-2, seed=SEED)
    state = tx.init(params)
    grads = [jnp.asarray(g) for g in _grads(0)]
    fused, _ = tx.step(grads, state, params)
    chain = optax.chain(optax.clip_by_global_norm(1e9), tx)  # last in a chain
    updates, _ = jax.jit(chain.update)(grads, chain.init(params), params)
    for a, b in zip(optax.apply_updates(params, updates), fused):
        assert_same_bits(a, b)


@pytest.mark.parametrize("impl", ["native", "callback"])
@pytest.mark.parametrize("state", ["none", "fp32", "bf16", "nesterov"])
def test_sgd_is_sgd_step(impl, state):
    dtypes = [ml_dtypes.bfloat16, np.float32, np.float16]
    params = normal_params(SHAPES, dtypes)
    momentum = None if state == "none" else 0.9
    acc = jnp.bfloat16 if state == "bf16" else None
    nesterov = state == "nesterov"
    tx = sj.sgd(1e-1, momentum, nesterov, acc, seed=SEED, impl=impl)
    ps = [jnp.asarray(p) for p in params]
    st = tx.init(ps)
    step = jax.jit(tx.step)
    P = [p.copy() for p in params]
    npd = ml_dtypes.bfloat16 if state == "bf16" else np.float32
    B = None if momentum is None else [np.zeros(p.shape, npd) for p in P]
    for t in range(3):
        ps, st = step([jnp.asarray(g) for g in _grads(t)], st, ps)
        srround.sgd_step(
            P,
            _grads(t),
            B,
            lr=1e-1,
            momentum=momentum or 0.0,
            nesterov=nesterov,
            step=t + 1,
            seed=SEED,
        )
    for a, b in zip(ps, P):
        assert_same_bits(a, b)
    if B is not None:
        for a, b in zip(st.momentum_buffer, B):
            assert_same_bits(a, b)
    assert int(st.count) == 3


def test_sgd_float32_tracks_optax_sgd():
    params = [jnp.asarray(p) for p in normal_params(SHAPES, [np.float32] * 3)]
    otx, tx = optax.sgd(0.1, 0.9, True), sj.sgd(0.1, 0.9, True)
    ostate, state = otx.init(params), tx.init(params)
    ref, ours = params, params
    for t in range(4):
        g = [jnp.asarray(x) for x in _grads(t)]
        u, ostate = otx.update(g, ostate, ref)
        ref = optax.apply_updates(ref, u)
        ours, state = tx.step(g, state, ours)
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)  # fma vs multiply-add


@pytest.mark.parametrize("impl", ["native", "callback"])
def test_apply_updates_broadcasts_like_optax(impl):
    params = {"w": jnp.ones((2, 3), jnp.bfloat16), "f": jnp.ones(3), "z": None}
    updates = {"w": jnp.float32(1e-3), "f": jnp.float32(0.5), "z": None}  # scalars
    out = sj.apply_updates(params, updates, jax.random.key(0), impl=impl)
    ref = optax.apply_updates(params, updates)
    assert jax.tree.structure(out) == jax.tree.structure(ref)
    assert out["w"].shape == (2, 3) and out["w"].dtype == jnp.bfloat16
    assert_same_bits(out["f"], ref["f"])
    full = sj.apply_updates(params, {**updates, "w": jnp.full((2, 3), 1e-3)}, jax.random.key(0))
    assert_same_bits(out["w"], full["w"])  # a broadcast update is the full one
    row = sj.apply_updates(params, {**updates, "w": jnp.full((3,), 1e-3)}, jax.random.key(0))
    assert_same_bits(row["w"], full["w"])
    with pytest.raises(ValueError, match=r"updates\[1\]: shape \(4,\) does not broadcast"):
        sj.apply_updates(params, {**updates, "w": jnp.ones(4)}, 0)


@pytest.mark.parametrize("impl", [None, "native", "callback"])
def test_empty_trees_and_empty_leaves(impl):
    """An empty params tree and zero-size leaves (before: an IndexError on the default and
    native steps; optax takes both): the step counts, an empty leaf draws no noise, so the
    other leaves get the bits of the tree without it."""
    for tx in (sj.adamw(1e-2, seed=SEED, impl=impl), sj.sgd(1e-2, momentum=0.9, impl=impl)):
        state = tx.init({})
        _, state = jax.jit(tx.step)({}, state, {})
        assert int(state.count) == 1
        w = jnp.linspace(-1, 1, 12, dtype=jnp.float32).astype(jnp.bfloat16)
        params = {"a": jnp.ones((0, 3), jnp.bfloat16), "b": w}
        grads = {"a": jnp.ones((0, 3)), "b": jnp.full(12, 0.1)}
        got, _ = jax.jit(tx.step)(grads, tx.init(params), params)
        alone, _ = jax.jit(tx.step)({"b": grads["b"]}, tx.init({"b": w}), {"b": w})
        assert got["a"].shape == (0, 3)
        assert_same_bits(got["b"], alone["b"])


def test_optax_wrappers_take_the_fused_optimizers():
    """chain (a clip that does not bite), MultiSteps (two equal micro-batches), masked,
    multi_transform and apply_if_finite around ``sj.adamw``: under jit, the bits of the plain
    fused step on the tree it is handed."""
    params = {
        "w": (0.1 * jax.random.normal(jax.random.key(0), (4, 8))).astype(jnp.bfloat16),
        "b": jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32),
    }
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.1, jnp.float32), params)
    tx = sj.adamw(1e-2, seed=SEED)
    expected, _ = jax.jit(tx.step)(grads, tx.init(params), params)

    def run(wrapped, steps=1):
        @jax.jit
        def step(p, s):
            updates, s = wrapped.update(grads, s, p)
            return optax.apply_updates(p, updates), s

        p, s = params, wrapped.init(params)
        for _ in range(steps):
            p, s = step(p, s)
        return p

    for got in (
        run(optax.chain(optax.clip_by_global_norm(1e3), tx)),
        run(optax.MultiSteps(tx, every_k_schedule=2), steps=2),
        run(optax.apply_if_finite(tx, 3)),
    ):
        for k in params:
            assert_same_bits(got[k], expected[k])
    # masked and multi_transform hand the optimizer its part of the tree: the stream positions
    # are counted in that part (README: one seed per srround optimizer of a multi_transform)
    alone, _ = jax.jit(tx.step)({"w": grads["w"]}, tx.init({"w": params["w"]}), {"w": params["w"]})
    labels = {"w": "fused", "b": "plain"}
    mixed = run(optax.multi_transform({"fused": tx, "plain": optax.sgd(1e-2)}, labels))
    masked = run(optax.masked(tx, {"w": True, "b": False}))
    assert_same_bits(mixed["w"], alone["w"])
    assert_same_bits(masked["w"], alone["w"])
    np.testing.assert_array_equal(mixed["b"], params["b"] - jnp.float32(1e-2) * grads["b"])
    np.testing.assert_array_equal(masked["b"], params["b"] + grads["b"])  # masked out: as is


@pytest.mark.parametrize("impl", [None, "native"])
def test_inject_hyperparams_with_static_args(impl):
    """optax.inject_hyperparams (before: a TypeError for every use - it makes every number an
    array, traced under jit, and calls dtypes as schedules): with ``static_args`` =
    ``ADAMW_STATIC_ARGS`` / ``SGD_STATIC_ARGS`` the learning rate is injected and can change
    between steps; the bits are those of the float32 schedule of the same value."""
    params = {
        "w": (0.1 * jax.random.normal(jax.random.key(0), (4, 8))).astype(jnp.bfloat16),
        "b": jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32),
    }
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.1, jnp.float32), params)
    for factory, static, kw in (
        (sj.adamw, sj.ADAMW_STATIC_ARGS, {"state_dtype": jnp.bfloat16}),
        (sj.sgd, sj.SGD_STATIC_ARGS, {"momentum": 0.9}),
    ):
        injected = optax.inject_hyperparams(factory, static_args=static)
        tx = injected(learning_rate=1e-2, seed=SEED, impl=impl, **kw)
        ref = factory(lambda count: jnp.float32(1e-2), seed=SEED, impl=impl, **kw)

        @jax.jit
        def step(p, s, g, tx=tx):
            updates, s = tx.update(g, s, p)
            return optax.apply_updates(p, updates), s

        p, s, rp, rs = params, tx.init(params), params, ref.init(params)
        for _ in range(3):
            p, s = step(p, s, grads)
            rp, rs = jax.jit(ref.step)(grads, rs, rp)
        for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(rp)):
            assert_same_bits(a, b)
        s.hyperparams["learning_rate"] = jnp.zeros_like(s.hyperparams["learning_rate"])
        stopped, _ = step(p, s, grads)
        for a, b in zip(jax.tree.leaves(stopped), jax.tree.leaves(p)):
            assert_same_bits(a, b)  # lr 0: nothing moves
    # without static_args: errors that say what to do
    with pytest.raises(TypeError, match="^state_dtype: expected a dtype, got an array"):
        optax.inject_hyperparams(sj.adamw)(learning_rate=1e-2).init(params)
    # bf16 params: optax casts the hyperparameters to bf16 (b1 0.8984, b2 1.0: "b2: expected a
    # value in [0.0, 1.0)" before)
    with pytest.raises(TypeError, match="^b1: a bfloat16 array.*ADAMW_STATIC_ARGS"):
        optax.inject_hyperparams(sj.adamw)(learning_rate=1e-2).init({"w": params["w"]})
    tx = optax.inject_hyperparams(sj.adamw, static_args=("seed", "mask", "state_dtype", "mu_dtype"))
    tx = tx(learning_rate=1e-2)
    with pytest.raises(TypeError, match="^b1: a traced value.*ADAMW_STATIC_ARGS"):
        jax.jit(tx.update)(grads, tx.init(params), params)
    tx = optax.inject_hyperparams(sj.sgd, static_args=("momentum", "accumulator_dtype"))
    tx = tx(learning_rate=1e-2, momentum=0.9)
    with pytest.raises(TypeError, match="^seed: a traced int.*SGD_STATIC_ARGS"):
        jax.jit(tx.update)(grads, tx.init(params), params)


def test_inject_hyperparams_eager_updates_reuse_one_compiled_step():
    """An eager ``update`` of ``optax.inject_hyperparams`` makes the optimizer again from
    concrete arrays at every call: the learning rate is an argument of one compiled step
    (before: a new optimizer traced and compiled per call, 0.3 s a step against optax.adamw's
    15 ms), with the bits of the jitted update, a changed value included."""
    import jax.monitoring

    params = {"w": (0.1 * jax.random.normal(jax.random.key(0), (4, 8))).astype(jnp.bfloat16)}
    grads = {"w": jnp.full((4, 8), 0.1, jnp.float32)}
    for factory, static in ((sj.adamw, sj.ADAMW_STATIC_ARGS), (sj.sgd, sj.SGD_STATIC_ARGS)):
        inject = functools.partial(optax.inject_hyperparams, hyperparam_dtype=jnp.float32)
        tx = inject(factory, static_args=static)(learning_rate=1e-2, seed=SEED)
        jitted = jax.jit(tx.update)
        s, rs = tx.init(params), tx.init(params)
        compiles = []

        def count(name, secs, **kw):
            if name.endswith("backend_compile_duration"):
                compiles.append(name)

        def eager_update(lr):
            nonlocal s
            s.hyperparams["learning_rate"] = jnp.float32(lr)
            updates, s = tx.update(grads, s, params)
            return updates

        try:
            for lr in (1e-2, 1e-2, 3e-3, 5e-2):  # the first calls compile, later ones reuse it
                if lr == 3e-3:
                    jax.monitoring.register_event_duration_secs_listener(count)
                updates = eager_update(lr)
                rs.hyperparams["learning_rate"] = jnp.float32(lr)
                r_updates, rs = jitted(grads, rs, params)
                assert_same_bits(updates["w"], r_updates["w"])
        finally:
            jax.monitoring.unregister_event_duration_listener(count)
        assert compiles == [], f"{factory.__name__}: {len(compiles)} compiles after the first"


def test_bad_input_errors():
    p = [jnp.ones(4, jnp.bfloat16)]
    with pytest.raises(TypeError, match="seed: expected a single threefry PRNG key"):
        sj.apply_updates(p, [jnp.ones(4)], jax.random.key(0, impl="rbg"))
    with pytest.raises(TypeError, match="seed: expected a single threefry PRNG key"):
        sj.stochastic_round(jnp.ones(4), seed=jax.random.split(jax.random.key(0)))
    with pytest.raises(TypeError, match="seed: expected a PRNG key"):
        sj.stochastic_round(jnp.ones(4), seed=jnp.zeros(4, jnp.uint32))
    dead = jnp.ones(4, jnp.bfloat16)
    dead.delete()
    with pytest.raises(ValueError, match=r"params\[0\]: the array was deleted"):
        sj.apply_updates([dead], [jnp.ones(4)], 0)
    with pytest.raises(ValueError, match=r"params\[0\]: the array was deleted"):
        sj.adamw(1e-3).init([dead])
    gone = jnp.ones(4)
    gone.delete()
    with pytest.raises(ValueError, match="x: the array was deleted"):
        sj.stochastic_round(gone)
    tx = sj.adamw(1e-3)
    state = tx.init(p)
    with pytest.raises(ValueError, match=r"grads\[0\]: the array was deleted"):
        tx.step([gone], state, p)
    with jax.enable_x64(True):
        with pytest.raises(TypeError, match="float64"):
            sj.stochastic_round(jnp.ones(4, jnp.float64))
        with pytest.raises(TypeError, match=r"updates\[0\]: .*float64"):
            sj.apply_updates(p, [jnp.ones(4, jnp.float64)], 0)
        with pytest.raises(TypeError, match=r"params\[0\]: .*float64"):
            sj.adamw(1e-3).init([jnp.ones(4, jnp.float64)])
    with pytest.raises(ValueError, match="need impl='native'"):
        sj.adamw(1e-3, nesterov=True, impl="callback")
    with pytest.raises(ValueError, match="mask"):
        sj.adamw(1e-3, mask={"a": True}).step([jnp.ones(4)], tx.init(p), p)
    with pytest.raises(ValueError, match="nesterov"):
        sj.sgd(1e-3, nesterov=True)


@pytest.mark.parametrize(
    "kw, name",
    [
        ({"learning_rate": -1e-3}, "learning_rate"),
        ({"learning_rate": float("nan")}, "learning_rate"),
        ({"learning_rate": float("inf")}, "learning_rate"),
        ({"b1": 1.5}, "b1"),
        ({"b2": 1.0}, "b2"),
        ({"eps": -1e-8}, "eps"),
        ({"eps_root": -1.0}, "eps_root"),
        ({"weight_decay": -0.1}, "weight_decay"),
    ],
)
def test_adamw_rejects_bad_hyperparameters(kw, name):
    """A hyperparameter out of range is a ``ValueError`` naming it when the optimizer is made.
    Before, the default step on a CPU failed at run time inside its host call (a
    ``JaxRuntimeError`` carrying a traceback) and the native step computed with it (``b2=1``:
    NaN weights)."""
    kw = {"learning_rate": 1e-3, **kw}
    with pytest.raises(ValueError, match=f"^{name}: "):
        sj.adamw(**kw)


def test_a_state_init_did_not_make_is_a_clear_error():
    """A state of another optimizer, of other settings or of other params (before: an SGD step
    read AdamW's moments as its momentum and a Kahan state's aux was dropped, silently; fp8,
    bf16 and shape mismatches failed deep inside with an AttributeError or JAX's branch-type
    and broadcasting errors), and a found_inf or inv_scale of several elements (JAX's reshape
    error), are errors naming the argument - eagerly and under jit."""
    p = [jnp.ones((8,), jnp.bfloat16), jnp.ones((3,), jnp.float32)]
    g = [jnp.ones((8,)), jnp.ones((3,))]
    tx = sj.adamw(1e-3, seed=1)
    other = {
        r"^state: expected the AdamWState of this optimizer's init\(params\), got SGDState": (
            sj.sgd(1e-2, momentum=0.9).init(p)
        ),
        r"^state\.aux: not the structure": sj.adamw(1e-3, rounding="kahan").init(p),
        r"^state\.exp_avg\[0\]: expected float32\[8\] .* got bfloat16\[8\]": (
            sj.adamw(1e-3, state_dtype=jnp.bfloat16).init(p)
        ),
        r"^state\.exp_avg: not the structure": (
            sj.adamw(1e-3, state_dtype=jnp.float8_e4m3fn).init(p)
        ),
        r"^state\.exp_avg_sq\[1\]: expected float32\[3\] .* got float32\[4\]": (
            tx.init(p)._replace(exp_avg_sq=[jnp.zeros(8), jnp.zeros(4)])
        ),
    }
    for message, state in other.items():
        exc = TypeError if "SGDState" in message else ValueError
        with pytest.raises(exc, match=message):
            tx.step(g, state, p)
        with pytest.raises(exc, match=message):
            jax.jit(tx.step)(g, state, p)
        with pytest.raises(exc, match=message):
            tx.update(g, state, p)
    sgd = sj.sgd(1e-2, momentum=0.9)
    with pytest.raises(TypeError, match="^state: expected the SGDState .* got AdamWState"):
        sgd.step(g, tx.init(p), p)
    with pytest.raises(ValueError, match=r"^state\.momentum_buffer: not the structure"):
        sgd.step(g, sj.sgd(1e-2).init(p), p)  # no momentum: no buffers
    state = tx.init(p)
    with pytest.raises(ValueError, match=r"^found_inf: expected a scalar, got shape \(2,\)"):
        tx.step(g, state, p, found_inf=jnp.array([False, True]))
    with pytest.raises(ValueError, match=r"^inv_scale: expected a scalar, got shape \(2,\)"):
        tx.step(g, state, p, inv_scale=jnp.ones(2))
    tx.step(g, state, p, found_inf=jnp.zeros(1, bool), inv_scale=jnp.ones(1))  # one element
    _, counted = tx.step(g, state._replace(count=0), p)  # any integer count (a Python int too)
    assert int(counted.count) == 1


def test_bad_optimizer_input_names_the_argument():
    """SGD's hyperparameters, gradients of another shape or dtype than their params, and a
    schedule that gives an array, and an ``apply_updates`` step that is not an integer are
    errors naming the argument, before anything runs (before: a host-call failure at run time,
    JAX's broadcasting error, an error without the argument's name, or a float step taken). A
    concrete 0-d array is a learning rate like a float. A leaf that is not an array (an
    unfiltered equinox model's activation function) is named."""
    p = [jnp.ones((4,), jnp.bfloat16), jnp.ones((3,), jnp.float32)]
    g = [jnp.ones((4,)), jnp.ones((3,))]
    with pytest.raises(ValueError, match="^learning_rate: "):
        sj.sgd(-1e-2)
    with pytest.raises(ValueError, match="^momentum: "):
        sj.sgd(1e-2, momentum=-0.5)
    for impl in (None, "native"):
        tx = sj.adamw(1e-3, impl=impl)
        state = tx.init(p)
        with pytest.raises(ValueError, match=r"^grads\[0\]: shape \(5,\) does not match"):
            tx.step([jnp.ones((5,)), g[1]], state, p)
        with pytest.raises(TypeError, match=r"^grads\[1\]: expected float32"):
            tx.step([g[0], jnp.ones((3,), jnp.int32)], state, p)
        # a None gradient (a frozen leaf) was "shape () does not match"
        with pytest.raises(TypeError, match=r"^grads\[0\]: expected an array like params\[0\]"):
            tx.step([None, g[1]], state, p)
        bad = sj.sgd(lambda count: jnp.full(3, 1e-2), momentum=0.9, impl=impl)
        with pytest.raises(ValueError, match="^learning_rate: the schedule gave an array"):
            bad.step(g, bad.init(p), p)
    for step in (1.5, True, jnp.float32(2.0), jnp.array([1, 2])):  # before: 1.5 was taken
        with pytest.raises(TypeError, match="^step: expected None, an int or an integer"):
            sj.apply_updates(p, g, 0, step=step)
    model = {"w": p[0], "act": jax.nn.relu}  # an unfiltered equinox model: before, a bare
    for tx in (sj.adamw(1e-3), sj.sgd(1e-2)):  # AttributeError() from the function's .dtype
        with pytest.raises(TypeError, match=r"^params\[0\]: expected an array, got custom_jvp"):
            tx.init(model)
        with pytest.raises(TypeError, match=r"^params\[0\]: expected an array, got custom_jvp"):
            tx.step({"w": g[0], "act": None}, tx.init({"w": p[0]}), model)
    one = sj.adamw(jnp.float32(1e-3), seed=1)
    two = sj.adamw(1e-3, seed=1)
    for a, b in zip(one.step(g, one.init(p), p)[0], two.step(g, two.init(p), p)[0]):
        assert_same_bits(a, b)


@pytest.mark.parametrize("impl", [None, "native"])
def test_stochastic_write_back_through_optax_apply_updates(impl):
    """``flax.nnx.Optimizer.update`` and flax's ``TrainState.apply_gradients`` call
    ``optax.apply_updates`` themselves, so ``apply_updates``' stochastic write-back was out
    of reach there for any optax optimizer: ``optax.chain(optimizer, stochastic_write_back(
    seed))`` gives updates that ``optax.apply_updates`` writes back as ``apply_updates(...,
    seed, step=t)``, bit for bit, jitted, over steps (fresh noise each), with float32 and
    ``None`` leaves passing through."""
    params = {
        "w": (0.1 * jax.random.normal(jax.random.key(0), (4, 8))).astype(jnp.bfloat16),
        "h": jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32).astype(jnp.float16),
        "b": jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32),
        "none": None,
    }
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.1, p.dtype), params)
    inner = optax.adamw(1e-3)
    tx = optax.chain(inner, sj.stochastic_write_back(SEED, impl=impl))

    @jax.jit
    def step(p, s):
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    @jax.jit
    def reference(p, s, t):
        updates, s = inner.update(grads, s, p)
        return sj.apply_updates(p, updates, SEED, step=t, impl=impl), s

    p, s, rp, rs = params, tx.init(params), params, inner.init(params)
    for t in range(1, 4):
        p, s = step(p, s)
        rp, rs = reference(rp, rs, t)
        assert int(s[1].count) == t and p["none"] is None
        for k in ("w", "h", "b"):
            assert p[k].dtype == params[k].dtype
            assert_same_bits(p[k], rp[k])
    assert not np.array_equal(np.asarray(p["w"]), np.asarray(params["w"]))
    alone = sj.stochastic_write_back(SEED)
    with pytest.raises(ValueError, match="^stochastic_write_back: update needs params"):
        alone.update(grads, alone.init(params))


def test_stochastic_write_back_in_flax():
    """The same inside flax (not a CI dependency): ``nnx.Optimizer`` with bf16 params under
    ``nnx.jit``, and linen's ``TrainState.apply_gradients``, both equal ``apply_updates``."""
    nnx = pytest.importorskip("flax.nnx")
    from flax.training import train_state

    x = jax.random.normal(jax.random.key(1), (3, 4))
    tx = optax.chain(optax.adamw(1e-3), sj.stochastic_write_back(SEED))
    model = nnx.Linear(4, 2, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    params = nnx.as_pure(params)  # arrays, not the model's variables (updated in place)
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

    def loss(m):
        return (m(x).astype(jnp.float32) ** 2).mean()

    @nnx.jit
    def step(model, opt):
        opt.update(model, nnx.grad(loss)(model))

    state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
    inner = optax.adamw(1e-3)
    ref, ref_state = params, inner.init(params)
    for t in range(1, 4):
        grads = jax.grad(lambda p: loss(nnx.merge(graphdef, p)))(ref)
        step(model, opt)
        state = jax.jit(lambda s, g: s.apply_gradients(grads=g))(state, grads)
        updates, ref_state = inner.update(grads, ref_state, ref)
        ref = sj.apply_updates(ref, updates, SEED, step=t)
        for a, b, c in zip(
            jax.tree.leaves(nnx.as_pure(nnx.state(model, nnx.Param))),
            jax.tree.leaves(state.params),
            jax.tree.leaves(ref),
        ):
            assert a.dtype == jnp.bfloat16
            assert_same_bits(a, c)
            assert_same_bits(b, c)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_update_takes_found_inf_and_inv_scale_as_extra_args(kind):
    """``flax.nnx.Optimizer.update(model, grads, **kwargs)`` hands its keyword arguments to
    ``tx.update`` (optax's extra arguments), also through ``optax.chain``: ``update`` reads
    ``inv_scale`` as ``step`` does (before: dropped silently - fp16 weights took the scaled
    gradients, SGD moved 0.5 to -0.52 instead of 0.499) and ``found_inf``."""
    params = {"w": jnp.full(8, 0.5, jnp.float16), "b": jnp.linspace(-1.0, 1.0, 8)}
    scaled = {"w": jnp.full(8, 10.24, jnp.float16), "b": jnp.full(8, 10.24)}
    tx = sj.adamw(1e-2, seed=SEED) if kind == "adamw" else sj.sgd(0.1, seed=SEED)
    state = tx.init(params)
    for extra in ({"inv_scale": jnp.float32(1 / 1024)}, {"found_inf": jnp.bool_(True)}):
        want, _ = tx.step(scaled, state, params, **extra)
        for wrapped in (tx, optax.chain(optax.identity(), tx)):
            s = wrapped.init(params)
            updates, _ = jax.jit(wrapped.update)(scaled, s, params, **extra)
            got = optax.apply_updates(params, updates)
            for k in params:
                assert_same_bits(got[k], want[k])


@jax.tree_util.register_pytree_node_class
class _Box:
    """A pytree node holding one value, as ``flax.nnx.Variable`` holds a parameter."""

    def __init__(self, value):
        self.value = value

    def tree_flatten(self):
        return (self.value,), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)


def _boxes(tree):
    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, _Box))


def test_fp8_states_hold_arrays_where_params_do():
    """``nnx.Optimizer`` inits its optimizer on the model's ``Param`` variables and keeps each
    state leaf in a variable; the fp8 states were a tree of ``(codes, scales)`` pairs, so a
    variable held a tuple, which ``nnx.update`` turned into a mapping: the second step failed
    with ``state.exp_avg: not the structure this optimizer's init(params) gives``. The fp8
    states are now a pair of trees like params: every box holds an array."""
    params = {"w": _Box(jnp.ones((40,), jnp.bfloat16)), "b": _Box(jnp.ones((3,), jnp.float32))}
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.1, jnp.float32), params)
    tx = sj.adamw(1e-3, seed=SEED, state_dtype=jnp.float8_e4m3fn)
    state = tx.init(params)
    for _ in range(2):
        boxes = _boxes(state.exp_avg) + _boxes(state.exp_avg_sq)
        assert len(boxes) == 8 and all(isinstance(b.value, jax.Array) for b in boxes)
        params, state = tx.step(grads, state, params)
    codes, scales = state.exp_avg
    assert codes["w"].value.dtype == jnp.float8_e4m3fn and scales["w"].value.dtype == jnp.float32


def test_fp8_states_in_flax_nnx_optimizer():
    """The same with flax itself (not a CI dependency): steps of ``nnx.Optimizer`` with fp8
    states under ``nnx.jit`` are those of ``tx.step``."""
    nnx = pytest.importorskip("flax.nnx")
    tx = sj.adamw(1e-3, seed=SEED, state_dtype=jnp.float8_e4m3fn)
    model = nnx.Linear(4, 40, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    params = nnx.as_pure(params)
    state = tx.init(params)
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    x = jax.random.normal(jax.random.key(1), (3, 4))

    def loss(m):
        return (m(x).astype(jnp.float32) ** 2).mean()

    @nnx.jit
    def step(model, opt):
        opt.update(model, nnx.grad(loss)(model))

    for _ in range(3):
        step(model, opt)
        grads = jax.grad(lambda p: loss(nnx.merge(graphdef, p)))(params)
        params, state = tx.step(grads, state, params)
    for a, b in zip(
        jax.tree.leaves(nnx.as_pure(nnx.state(model, nnx.Param))), jax.tree.leaves(params)
    ):
        assert_same_bits(a, b)


def test_equinox_recipes_keep_bf16():
    """README's equinox recipes (not a CI dependency), under ``eqx.filter_jit`` with one
    compile: the fused ``tx.step`` on ``eqx.partition``'s params, and ``optax.adamw`` with
    ``apply_updates`` on the whole model (its function leaves get ``None`` updates); both
    keep bf16, and the second equals ``apply_updates`` on the filtered model. The fused
    ``update`` with ``eqx.apply_updates`` promotes to float32 (the documented difference)."""
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0), dtype=jnp.bfloat16)
    x = jax.random.normal(jax.random.key(1), (3, 4)).astype(jnp.bfloat16)

    def loss(m):
        return (jax.vmap(m)(x).astype(jnp.float32) ** 2).mean()

    tx, inner = sj.adamw(1e-3, seed=SEED), optax.adamw(1e-3)
    floats = eqx.filter(model, eqx.is_inexact_array)

    @eqx.filter_jit
    def fused(model, state):
        params, static = eqx.partition(model, eqx.is_inexact_array)
        params, state = tx.step(eqx.filter_grad(loss)(model), state, params)
        return eqx.combine(params, static), state

    @eqx.filter_jit
    def with_optax(model, state, t):
        grads = eqx.filter_grad(loss)(model)
        updates, state = inner.update(grads, state, eqx.filter(model, eqx.is_inexact_array))
        return sj.apply_updates(model, updates, SEED, step=t), state, updates

    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    m1, s1, m2, s2 = model, tx.init(floats), model, inner.init(floats)
    fused(m1, s1), with_optax(m2, s2, jnp.int32(1))  # compiled here
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        steps = []
        for t in range(1, 4):
            m1, s1 = fused(m1, s1)
            steps.append((m2, *with_optax(m2, s2, jnp.int32(t))))
            m2, s2 = steps[-1][1:3]
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert len(compiles) == 0  # an int32 array step: no compile per step
    for t, (before, after, _, updates) in enumerate(steps, 1):
        want = sj.apply_updates(eqx.filter(before, eqx.is_inexact_array), updates, SEED, step=t)
        for a, b in zip(jax.tree.leaves(eqx.filter(after, eqx.is_array)), jax.tree.leaves(want)):
            assert_same_bits(a, b)
    for leaf in jax.tree.leaves(eqx.filter((m1, m2), eqx.is_array)):
        assert leaf.dtype == jnp.bfloat16
    updates, _ = tx.update(eqx.filter_grad(loss)(model), tx.init(floats), floats)
    promoted = eqx.apply_updates(model, updates)
    assert promoted.layers[0].weight.dtype == jnp.float32
