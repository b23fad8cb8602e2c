"""Sharded checks of the JAX adapter on 8 forced CPU devices, run in a subprocess by
``tests/test_jax_sharding.py`` (``XLA_FLAGS`` must be set before jax is imported):
``python -m tests.jax_sharded_cases CASE [CASE ...]``. Each case compares the sharded results
(``jit`` with ``NamedSharding``, and ``shard_map``) bit for bit with the unsharded call and
checks that output shardings equal input shardings."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import traceback

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from srround.adapters import jax as sj  # noqa: E402

KEY = jax.random.key(11)

# (mesh shape, axis names, [(array shape, spec), ...]): 1, 2, 4, 8 devices, 1-D and 2-D
# meshes, uneven splits (10 rows over 4 or 8 devices), replicated and split dimensions
LAYOUTS = [
    ((1,), ("x",), [((6, 5), P("x"))]),
    ((2,), ("x",), [((6, 5), P("x")), ((4, 6), P(None, "x"))]),
    (
        (4,),
        ("x",),
        [((10, 3), P("x")), ((5, 8), P(None, "x")), ((7,), P()), ((3, 12), P(None, "x"))],
    ),
    ((8,), ("x",), [((10, 3), P("x")), ((16,), P("x"))]),
    ((2, 4), ("x", "y"), [((6, 8), P("x", "y")), ((10, 4), P("y", "x")), ((8, 2), P(("x", "y")))]),
    ((2, 2), ("x", "y"), [((2, 3, 12), P("x", None, "y"))]),
    ((4, 2), ("x", "y"), [((8, 6), P("x", None)), ((4, 4), P(None, ("y", "x")))]),
]
# shard_map needs even splits
EVEN = [
    ((1,), ("x",), [((6, 5), P("x"))]),
    ((2,), ("x",), [((6, 5), P("x")), ((4, 6), P(None, "x"))]),
    (
        (4,),
        ("x",),
        [((8, 3), P("x")), ((5, 8), P(None, "x")), ((7,), P()), ((3, 12), P(None, "x"))],
    ),
    ((2, 2), ("x", "y"), [((2, 3, 12), P("x", None, "y"))]),
    ((8,), ("x",), [((16,), P("x"))]),
    ((2, 4), ("x", "y"), [((6, 8), P("x", "y")), ((8, 4), P("y", "x")), ((8, 2), P(("x", "y")))]),
]


def _mesh(shape, names):
    """A mesh with automatic (not explicit) axes: uneven splits are allowed under jit."""
    devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return jax.sharding.Mesh(devices, names)


def _bits(a):
    a = np.asarray(a)
    return a.view({4: np.uint32, 2: np.uint16, 1: np.uint8}[a.dtype.itemsize])


def _same(got, expected, what):
    g, e = _bits(got), _bits(expected)
    if g.shape != e.shape or not np.array_equal(g, e):
        raise AssertionError(f"{what}: sharded bits differ from the unsharded call")


def _same_sharding(out, x, what):
    if not out.sharding.is_equivalent_to(x.sharding, x.ndim):
        raise AssertionError(f"{what}: output sharding {out.sharding} != input {x.sharding}")


_COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce")


def _collectives(compiled):
    text = compiled.as_text()
    return {op: text.count(op + "(") + text.count(op + "-start(") for op in _COLLECTIVES}


def _without_gather(fn, *args, what, reference=None):
    """``fn`` compiled for ``args`` (``jax.jit(fn).lower(*args).compile()``: call it to run
    the program checked) once it is checked that nothing is gathered: the program has no more
    collectives than ``reference`` (a plain cast under the same sharding constraints; none by
    default)."""
    compiled = jax.jit(fn).lower(*args).compile()
    got = _collectives(compiled)
    allowed = (
        _collectives(jax.jit(reference).lower(*args).compile())
        if reference
        else dict.fromkeys(_COLLECTIVES, 0)
    )
    if any(got[op] > allowed[op] for op in _COLLECTIVES):
        raise AssertionError(f"{what}: collectives {got}, a plain cast needs {allowed}")
    return compiled


def _uneven(shape, spec, mesh) -> bool:
    for n, entry in zip(shape, spec):
        if entry is None:
            continue
        names = (entry,) if isinstance(entry, str) else entry
        if n % int(np.prod([mesh.shape[a] for a in names])):
            return True
    return False


def _data(shape, seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 3, shape)).astype(np.float32)


def case_functional():
    for mesh_shape, names, arrays in LAYOUTS:
        mesh = _mesh(mesh_shape, names)
        for i, (shape, spec) in enumerate(arrays):
            what = f"mesh {mesh_shape} array {shape} {spec}"
            x = jnp.asarray(_data(shape, i))
            u = jnp.asarray(_data(shape, i + 50) * np.float32(1e-2))
            w = x.astype(jnp.bfloat16)
            # the unsharded bits: the unsharded call (each impl's equal to it,
            # tests/test_jax_adapter.py)
            expected = jax.jit(_functional(None))(x, w, u, KEY)
            sharding = NamedSharding(mesh, spec)
            check = _check_uneven if _uneven(shape, spec, mesh) else _check_functional
            for impl in ("native", "callback"):
                check((x, w, u), expected, sharding, f"{impl} {what}", impl)
    print("functional ok")


_FUNCTIONAL = ("stochastic_round", "round_nearest", "to_float32", "stochastic_add")


def _functional(impl):
    """The functional calls, one program: ``_FUNCTIONAL``'s results for ``(x, w, u, key)``
    (``x``, ``u``: float32, ``w``: bf16 of ``x``'s shape)."""

    def calls(x, w, u, k):
        return (
            sj.stochastic_round(x, seed=k, offset=5, impl=impl),
            sj.round_nearest(x, dtype="float16", impl=impl),
            sj.to_float32(x.astype(jnp.bfloat16), impl=impl),
            sj.stochastic_add(w, u, alpha=0.5, seed=k, offset=3, impl=impl),
        )

    return calls


def _check_functional(arrays, expected, sharding, what, impl):
    """The functional calls under jit on ``sharding`` (one program): the unsharded bits, the
    input's sharding, no collectives (the callback path too: it runs per shard)."""
    placed = [jax.device_put(a, sharding) for a in arrays]
    got = _without_gather(_functional(impl), *placed, KEY, what=what)(*placed, KEY)
    for name, g, e in zip(_FUNCTIONAL, got, expected):
        _same(g, e, f"{name} {what}")
        _same_sharding(g, placed[0], f"{name} {what}")


def _check_uneven(arrays, expected, sharding, what, impl):
    """An uneven split (padded shards) of intermediates inside jit: ``stochastic_round`` and
    ``stochastic_add`` give the same bits and gather nothing more than a cast and an add under
    the same constraints. The outputs keep the uneven split where this JAX can return one (JAX
    0.11 cannot: recovering such an output sharding raises ``IndivisibleError``, for a plain
    cast too); else they are left to XLA, which gathers them at the end, as for the cast.
    (Checked per call: in one program XLA merges the collectives of the calls and of their
    references differently.)"""

    def constrained(a):
        return jax.lax.with_sharding_constraint(a, sharding)

    def cast(a, constrain_output=True):
        out = constrained(a).astype(jnp.bfloat16)
        return constrained(out) if constrain_output else out

    try:
        jax.jit(cast)(arrays[0])
        constrain = True
    except Exception as exc:  # noqa: BLE001 - its class, IndivisibleError, is private to JAX
        if type(exc).__name__ != "IndivisibleError":
            raise
        constrain = False

    def output(a):
        return constrained(a) if constrain else a

    def rnd(x, k):
        return output(sj.stochastic_round(constrained(x), seed=k, offset=5, impl=impl))

    def add(w, u, k):
        w, u = constrained(w), constrained(u)
        return output(sj.stochastic_add(w, u, alpha=0.5, seed=k, offset=3, impl=impl))

    def plain_add(w, u, k):
        return cast(constrained(w).astype(jnp.float32) + constrained(u), constrain)

    x, w, u = arrays
    checked = _without_gather(
        rnd, x, KEY, what=f"uneven {what}", reference=lambda x, k: cast(x, constrain)
    )
    _same(checked(x, KEY), expected[0], f"uneven stochastic_round {what}")
    checked = _without_gather(add, w, u, KEY, what=f"uneven add {what}", reference=plain_add)
    _same(checked(w, u, KEY), expected[3], f"uneven stochastic_add {what}")


def case_shard_map():
    for mesh_shape, names, arrays in EVEN:
        mesh = _mesh(mesh_shape, names)
        for i, (shape, spec) in enumerate(arrays):
            what = f"mesh {mesh_shape} array {shape} {spec}"
            x = jnp.asarray(_data(shape, i))
            u = jnp.asarray(_data(shape, i + 50) * np.float32(1e-2))
            w = x.astype(jnp.bfloat16)
            for impl in ("native", "callback"):

                def rnd(a, k, spec=spec, impl=impl):
                    return sj.stochastic_round(a, seed=k, offset=5, shard_spec=spec, impl=impl)

                def add(w, u, k, spec=spec, impl=impl):
                    return sj.stochastic_add(
                        w, u, alpha=0.5, seed=k, offset=3, shard_spec=spec, impl=impl
                    )

                smap = jax.jit(jax.shard_map(rnd, mesh=mesh, in_specs=(spec, P()), out_specs=spec))
                _same(smap(x, KEY), sj.stochastic_round(x, seed=KEY, offset=5), f"round {what}")
                smap = jax.jit(
                    jax.shard_map(add, mesh=mesh, in_specs=(spec, spec, P()), out_specs=spec)
                )
                expected = sj.stochastic_add(w, u, alpha=0.5, seed=KEY, offset=3)
                _same(smap(w, u, KEY), expected, f"add {impl} {what}")
    print("shard_map ok")


def _tree(mesh_shape, names, arrays, seed=0):
    params = {f"p{i}": _data(s, seed + i).astype(jnp.bfloat16) for i, (s, _) in enumerate(arrays)}
    params["f32"] = _data((3,), seed + 9)  # a float32 leaf, replicated
    grads = {k: _data(np.shape(v), seed + 20 + i) for i, (k, v) in enumerate(params.items())}
    specs = {f"p{i}": spec for i, (_, spec) in enumerate(arrays)}
    specs["f32"] = P()
    return params, grads, specs


def _placed(mesh, specs, *trees):
    """Each tree's leaves put on ``mesh`` with their ``specs``."""
    put = {k: NamedSharding(mesh, s) for k, s in specs.items()}
    return [{k: jax.device_put(v, put[k]) for k, v in tree.items()} for tree in trees]


def _in_shard_map(step, mesh, specs, state_specs, **kw):
    """A fused ``step(grads, state, params)`` inside ``shard_map`` (params, grads: ``specs``)."""
    return jax.shard_map(
        step,
        mesh=mesh,
        in_specs=(specs, state_specs, specs),
        out_specs=(specs, state_specs),
        **kw,
    )


def case_optim():
    for index, (mesh_shape, names, arrays) in enumerate(EVEN):
        last = index == len(EVEN) - 1  # the 2-D mesh: every variant there, the basics elsewhere
        even = True
        mesh = _mesh(mesh_shape, names)
        params, grads, specs = _tree(mesh_shape, names, arrays)
        params = jax.tree.map(jnp.asarray, params)
        grads = jax.tree.map(jnp.asarray, grads)
        put = {k: NamedSharding(mesh, s) for k, s in specs.items()}
        ps = {k: jax.device_put(v, put[k]) for k, v in params.items()}
        gs = {k: jax.device_put(v, put[k]) for k, v in grads.items()}
        what = f"mesh {mesh_shape} {list(specs.values())}"
        updates = jax.tree.map(lambda g: g * jnp.float32(1e-2), grads)
        us = jax.tree.map(lambda g: g * jnp.float32(1e-2), gs)

        def apply(p, u, k):
            return sj.apply_updates(p, u, k, step=3)

        expected = jax.jit(apply)(params, updates, KEY)
        apply_checked = _without_gather(apply, ps, us, KEY, what=f"apply_updates {what}")
        got = apply_checked(ps, us, KEY)
        for k in params:
            _same(got[k], expected[k], f"apply_updates {k} {what}")
            _same_sharding(got[k], ps[k], f"apply_updates {k} {what}")
        if len(mesh.devices.flat) > 1:  # each device draws its own leaves' bits, not the tree's
            text = apply_checked.as_text()
            assert "u64[" not in text, f"apply_updates {what}: the whole tree's Threefry blocks"

        def apply_host(p, u, k):  # the callback path runs per shard too
            return sj.apply_updates(p, u, k, step=3, impl="callback")

        what_h = f"apply_updates callback {what}"
        got = _without_gather(apply_host, ps, us, KEY, what=what_h)(ps, us, KEY)
        for k in params:
            _same(got[k], expected[k], f"{what_h} {k}")
            _same_sharding(got[k], ps[k], f"{what_h} {k}")
        variants = [(jnp.float32, "native")]
        if last or index == 1:  # the callback path runs per shard too, and is the CPU default
            variants += [(jnp.float32, "callback"), (jnp.float32, None)]
        if last:
            variants += [(jnp.bfloat16, "native"), (jnp.bfloat16, "callback")]
        expected_steps = {}  # per state dtype: the unsharded step (every impl's bits equal)
        for state_dtype, impl in variants:
            what_s = f"{impl} {what}"
            tx = sj.adamw(1e-2, seed=KEY, state_dtype=state_dtype, impl=impl)
            state = tx.init(params)
            if state_dtype not in expected_steps:
                ref = sj.adamw(1e-2, seed=KEY, state_dtype=state_dtype, impl="callback")
                expected_steps[state_dtype] = jax.jit(ref.step)(grads, ref.init(params), params)
            e_params, e_state = expected_steps[state_dtype]
            s_state = tx.init(ps)  # the states take the params' shardings
            if last or impl != "native":
                step = _without_gather(tx.step, gs, s_state, ps, what=f"adamw {what_s}")
            else:
                step = jax.jit(tx.step)
            g_params, g_state = step(gs, s_state, ps)
            for k in params:
                _same(g_params[k], e_params[k], f"adamw {k} {what_s}")
                _same_sharding(g_params[k], ps[k], f"adamw {k} {what_s}")
                _same(g_state.exp_avg[k], e_state.exp_avg[k], f"adamw m {k} {what_s}")
                _same_sharding(g_state.exp_avg[k], ps[k], f"adamw m {k} {what_s}")
            if not even:
                continue
            # inside shard_map with shard_specs
            tx_s = sj.adamw(1e-2, seed=KEY, state_dtype=state_dtype, shard_specs=specs, impl=impl)
            state_specs = type(state)(P(), specs, specs, specs)
            fn = _in_shard_map(tx_s.step, mesh, specs, state_specs)
            m_params, m_state = jax.jit(fn)(gs, s_state, ps)
            for k in params:
                _same(m_params[k], e_params[k], f"adamw shard_map {k} {what_s}")
                _same(m_state.exp_avg_sq[k], e_state.exp_avg_sq[k], f"shard_map v {k} {what_s}")
            if last:  # a step that may skip (a schedule's lr, found_inf) is a lax.cond: its
                # branches typed alike (before: the callback step's results were not varying)
                tx_k = sj.adamw(
                    lambda count: 1e-2,
                    seed=KEY,
                    state_dtype=state_dtype,
                    shard_specs=specs,
                    impl=impl,
                )
                fn = jax.shard_map(
                    lambda g, s, p, skip, tx_k=tx_k: tx_k.step(g, s, p, found_inf=skip),
                    mesh=mesh,
                    in_specs=(specs, state_specs, specs, P()),
                    out_specs=(specs, state_specs),
                )
                for skip, want in ((False, e_params), (True, params)):
                    k_params, _ = jax.jit(fn)(gs, s_state, ps, jnp.bool_(skip))
                    for k in params:
                        _same(k_params[k], want[k], f"adamw shard_map skip={skip} {k} {what_s}")
        if last:  # optax's mask: on the CPU two host calls (inside it, outside), per shard
            mask = {k: i % 2 == 0 for i, k in enumerate(params)}
            steps = {
                impl: jax.jit(sj.adamw(1e-2, seed=KEY, mask=mask, weight_decay=0.5, impl=impl).step)
                for impl in (None, "native")
            }
            tx = sj.adamw(1e-2, seed=KEY, mask=mask)
            e_params, e_state = steps["native"](grads, tx.init(params), params)
            args = (gs, tx.init(ps), ps)
            g_params, g_state = _without_gather(steps[None], *args, what=f"adamw mask {what}")(
                *args
            )
            for k in params:
                _same(g_params[k], e_params[k], f"adamw mask {k} {what}")
                _same(g_state.exp_avg_sq[k], e_state.exp_avg_sq[k], f"adamw mask v {k} {what}")
                _same_sharding(g_params[k], ps[k], f"adamw mask {k} {what}")
        if even:
            for impl in ("native", "callback") if last or index == 1 else ("native",):

                def apply_s(p, u, k, impl=impl):
                    return sj.apply_updates(p, u, k, step=3, impl=impl, shard_specs=specs)

                fn = jax.shard_map(
                    apply_s, mesh=mesh, in_specs=(specs, specs, P()), out_specs=specs
                )
                got = jax.jit(fn)(ps, us, KEY)
                for k in params:
                    _same(got[k], expected[k], f"apply_updates shard_map {impl} {k} {what}")
    # an uneven split (padded shards) inside jit: the same bits as the unsharded update
    mesh = _mesh((4,), ("x",))
    shardings = {"a": NamedSharding(mesh, P("x")), "b": NamedSharding(mesh, P(None, "x"))}
    params = {"a": jnp.asarray(_data((10, 3), 1)).astype(jnp.bfloat16)}
    params["b"] = jnp.asarray(_data((3, 6), 2)).astype(jnp.bfloat16)
    updates = {k: jnp.asarray(_data(v.shape, 7)) * 1e-2 for k, v in params.items()}

    def apply_uneven(p, u, k, impl):
        p = jax.lax.with_sharding_constraint(p, shardings)
        u = jax.lax.with_sharding_constraint(u, shardings)
        new = sj.apply_updates(p, u, k, step=2, impl=impl)
        return jax.lax.with_sharding_constraint(new, shardings)

    expected = sj.apply_updates(params, updates, KEY, step=2)
    tx = sj.adamw(1e-2, seed=KEY)
    e_params, _ = tx.step(updates, tx.init(params), params)
    for impl in ("native", "callback", None):  # None: the default (the host step on the CPU)
        got = jax.jit(functools.partial(apply_uneven, impl=impl))(params, updates, KEY)
        for k in params:
            _same(got[k], expected[k], f"apply_updates uneven {impl} {k}")
        tx = sj.adamw(1e-2, seed=KEY, impl=impl)

        def adamw_uneven(g, p, tx=tx):
            g = jax.lax.with_sharding_constraint(g, shardings)
            p = jax.lax.with_sharding_constraint(p, shardings)
            new, _ = tx.step(g, tx.init(p), p)
            return jax.lax.with_sharding_constraint(new, shardings)

        got = jax.jit(adamw_uneven)(updates, params)
        for k in params:
            _same(got[k], e_params[k], f"adamw uneven {impl} {k}")
    print("optim ok")


def _pallas_rounds(mesh, arrays, what):
    """``stochastic_round``'s kernels: under ``jit`` each shard a kernel, inside ``shard_map``
    each block; the unsharded bits (the callback path's), from lane 0 and lane 1; and
    ``stochastic_add``'s under ``jit``."""
    for i, (shape, spec) in enumerate(arrays):
        x = jnp.asarray(_data(shape, 30 + i))
        xs = jax.device_put(x, NamedSharding(mesh, spec))
        for offset in (0, 5):
            expected = sj.stochastic_round(x, seed=KEY, offset=offset, impl="callback")

            def rnd(a, k, offset=offset):
                return sj.stochastic_round(a, seed=k, offset=offset)

            assert "pallas_call" in str(jax.make_jaxpr(rnd)(xs, KEY)), f"{what} round: no kernel"
            got = _without_gather(rnd, xs, KEY, what=f"{what} round")(xs, KEY)
            _same(got, expected, f"{what} round {shape} {spec} offset {offset}")
            _same_sharding(got, xs, f"{what} round {shape}")

            def block(a, k, spec=spec, offset=offset):
                return sj.stochastic_round(a, seed=k, offset=offset, shard_spec=spec)

            smap = jax.shard_map(
                block, mesh=mesh, in_specs=(spec, P()), out_specs=spec, check_vma=False
            )
            _same(jax.jit(smap)(xs, KEY), expected, f"{what} round shard_map {shape} {spec}")
        w, u = x.astype(jnp.bfloat16), jnp.asarray(_data(shape, 40 + i)) * np.float32(1e-2)
        ws, us = (jax.device_put(a, NamedSharding(mesh, spec)) for a in (w, u))
        expected = sj.stochastic_add(w, u, alpha=0.5, seed=KEY, offset=5, impl="callback")

        def add(w, u, k):
            return sj.stochastic_add(w, u, alpha=0.5, seed=k, offset=5)

        assert "pallas_call" in str(jax.make_jaxpr(add)(ws, us, KEY)), f"{what} add: no kernel"
        got = _without_gather(add, ws, us, KEY, what=f"{what} add")(ws, us, KEY)
        _same(got, expected, f"{what} add {shape} {spec}")
        _same_sharding(got, ws, f"{what} add {shape}")


def case_pallas():
    """The fused steps' Pallas kernels (``_pallas``, in Pallas' interpreter on the CPU
    devices) under ``jit`` over several devices: each shard a kernel of its own at its global
    position (``custom_partitioning``), a block split along another dimension on the XLA path;
    inside ``shard_map`` with ``shard_specs`` the same per block. Bits of the unsharded step,
    output shardings of the inputs, nothing gathered."""
    from srround.adapters.jax import _pallas

    _pallas.MODE = "interpret"
    jax.clear_caches()
    try:
        for mesh_shape, names, arrays in EVEN[1:]:
            mesh = _mesh(mesh_shape, names)
            arrays = [(shape, spec) for shape, spec in arrays if np.prod(shape) % 4 == 0]
            params, grads, specs = _tree(mesh_shape, names, arrays, seed=5)
            ps, gs = _placed(mesh, specs, params, grads)
            what = f"pallas mesh {mesh_shape} {list(specs.values())}"
            txs = [sj.adamw(1e-2, seed=KEY, impl="native")]
            if mesh_shape == (2, 4):
                txs.append(sj.sgd(1e-2, 0.9, nesterov=True, seed=KEY, impl="native"))
            for tx in txs:
                ref = (
                    sj.adamw(1e-2, seed=KEY, impl="callback")
                    if len(txs) == 1 or tx is txs[0]
                    else sj.sgd(1e-2, 0.9, nesterov=True, seed=KEY, impl="callback")
                )
                e_params, e_state = jax.jit(ref.step)(grads, ref.init(params), params)
                s_state = tx.init(ps)
                jaxpr = str(jax.make_jaxpr(tx.step)(gs, s_state, ps))
                assert "pallas_call" in jaxpr, f"{what}: no kernel"
                step = _without_gather(tx.step, gs, s_state, ps, what=what)
                g_params, g_state = step(gs, s_state, ps)
                for k in params:
                    _same(g_params[k], e_params[k], f"{what} {k}")
                    _same_sharding(g_params[k], ps[k], f"{what} {k}")
                for got, want in zip(jax.tree.leaves(g_state), jax.tree.leaves(e_state)):
                    _same(got, want, f"{what} state")
            _pallas_rounds(mesh, arrays, what)
        # an uneven split inside jit (10 rows over 4 devices: padded shards of 3 rows)
        mesh = _mesh((4,), ("x",))
        params, grads, _ = _tree((4,), ("x",), [((10, 4), P("x"))], seed=6)
        uneven = NamedSharding(mesh, P("x"))
        tx = sj.adamw(1e-2, seed=KEY, impl="native")
        ref = sj.adamw(1e-2, seed=KEY, impl="callback")
        e_params, _ = jax.jit(ref.step)(grads, ref.init(params), params)

        def constrained(g, p):
            g, p = (
                jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, uneven), t)
                for t in (g, p)
            )
            return tx.step(g, tx.init(p), p)[0]

        got = jax.jit(constrained)(grads, params)
        assert "pallas_call" in str(jax.make_jaxpr(constrained)(grads, params)), "uneven: no kernel"
        for k in params:
            _same(got[k], e_params[k], f"pallas uneven {k}")
        # inside shard_map with shard_specs: a block per device; a kernel where the block is a
        # run of the leaf or the whole leaf, the XLA path where the columns are split
        mesh_shape, names = (2, 4), ("x", "y")
        arrays = [((16, 8), P(("x", "y"))), ((8, 8), P("x", "y")), ((4, 6), P())]
        mesh = _mesh(mesh_shape, names)
        params, grads, specs = _tree(mesh_shape, names, arrays, seed=5)
        ps, gs = _placed(mesh, specs, params, grads)
        ref = sj.adamw(1e-2, seed=KEY, impl="callback")
        e_params, e_state = jax.jit(ref.step)(grads, ref.init(params), params)
        tx = sj.adamw(1e-2, seed=KEY, shard_specs=specs, impl="native")
        state_specs = type(e_state)(P(), specs, specs, specs)
        # check_vma=False: Pallas' interpreter (JAX 0.10) evaluates a kernel's indexing with
        # the blocks' varying axes and rejects it ("requires varying manual axes to match");
        # a compiled kernel is lowered without that check
        fn = _in_shard_map(tx.step, mesh, specs, state_specs, check_vma=False)
        s_state = tx.init(ps)
        assert "pallas_call" in str(jax.make_jaxpr(fn)(gs, s_state, ps)), "shard_map: no kernel"
        m_params, m_state = jax.jit(fn)(gs, s_state, ps)
        for k in params:
            _same(m_params[k], e_params[k], f"pallas shard_map {k}")
            _same(m_state.exp_avg_sq[k], e_state.exp_avg_sq[k], f"pallas shard_map v {k}")
    finally:
        _pallas.MODE = "auto"
        jax.clear_caches()
    print("pallas ok")


def case_loss_scale():
    mesh = _mesh((4,), ("x",))
    grads = {"a": jnp.ones((8, 2)), "b": jnp.ones(8).at[5].set(jnp.inf)}
    spec = {"a": P("x"), "b": P("x")}
    ls = sj.DynamicLossScale(jnp.float32(2.0**10))

    def step(grads, ls):
        finite = sj.all_finite(grads, axis_name="x")
        return finite, ls.adjust(finite)

    fn = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(spec, P()), out_specs=(P(), P()), check_vma=False)
    )
    finite, new = fn(grads, ls)
    assert not bool(finite) and float(new.loss_scale) == 2.0**9, (finite, new)
    gs = jax.device_put(grads, {k: NamedSharding(mesh, s) for k, s in spec.items()})
    finite = jax.jit(sj.all_finite)(gs)
    assert not bool(finite)
    # axis_name missing an axis the leaves vary over: a ValueError naming the leaf and
    # axis_name (before: each "model" block had its own flag, [False, True] here - the
    # devices skipped different steps and adjusted different loss scales)
    mesh = _mesh((2, 2), ("data", "model"))
    grads = {"a": jnp.ones(2), "w": jnp.ones((4, 4)).at[0, 3].set(jnp.inf)}
    spec = {"a": P(), "w": P("data", "model")}

    def flags(grads):
        return sj.all_finite(grads, axis_name="data")[None]

    fn = jax.jit(jax.shard_map(flags, mesh=mesh, in_specs=(spec,), out_specs=P("model")))
    try:
        fn.lower(grads)
    except ValueError as exc:
        message = "tree[1]: varies over mesh axes ['model'] that axis_name='data' does not"
        assert message in str(exc), exc
    else:
        raise AssertionError(f"no error for an axis_name without 'model': {fn(grads)}")
    # no axis_name inside shard_map, and adjust with a per-device flag: a ValueError each
    # (before: each "x" block had its own flag and its own next scale, with check_vma too)
    mesh = _mesh((4,), ("x",))
    grads = {"b": jnp.ones(8).at[5].set(jnp.inf)}

    def local_flag(grads):
        return sj.all_finite(grads)[None]

    def local_adjust(grads, ls):
        return ls.adjust(jnp.isfinite(grads["b"]).all())

    checks = {
        "tree[0]: varies over mesh axes ['x'] that axis_name=None": (
            local_flag,
            (grads,),
            (P("x"),),
            P("x"),
        ),
        "grads_finite: varies over mesh axes ['x'] that the loss scale does not": (
            local_adjust,
            (grads, ls),
            (P("x"), P()),
            P(),
        ),
    }
    for message, (body, args, in_specs, out_specs) in checks.items():
        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs))
        try:
            fn.lower(*args)
        except ValueError as exc:
            assert message in str(exc), exc
        else:
            raise AssertionError(f"no error ({message})")
    print("loss_scale ok")


def case_errors():
    """Leaves on different meshes: a clear error naming both, before anything runs."""
    a = jax.device_put(jnp.ones(8, jnp.bfloat16), NamedSharding(_mesh((4,), ("x",)), P("x")))
    devices = np.array(jax.devices()[4:]).reshape(4)
    b = jax.device_put(
        jnp.ones(8, jnp.bfloat16), NamedSharding(jax.sharding.Mesh(devices, ("x",)), P("x"))
    )
    try:
        sj.apply_updates([a, b], [jnp.ones(8), jnp.ones(8)], 0)
    except ValueError as exc:
        assert "params[1]: on mesh" in str(exc) and "params[0]" in str(exc), exc
    else:
        raise AssertionError("no error for leaves on different meshes")
    tx = sj.adamw(1e-3)
    try:
        tx.step([a, b], tx.init([a, a]), [a, a])
    except ValueError as exc:
        assert "grads[1]: on mesh" in str(exc), exc
    else:
        raise AssertionError("no error for grads on different meshes")
    # across the arguments of one call: before, jit's own error naming srround's internals
    u = b.astype(jnp.float32)
    calls = {
        "u: on mesh": lambda: sj.stochastic_add(a, u, seed=KEY),
        "updates[0]: on mesh": lambda: sj.apply_updates([a], [u], KEY),
        "grads[0]: on mesh": lambda: tx.step([b], tx.init([a]), [a]),
        "tree[1]: on mesh": lambda: sj.all_finite([a, b]),
    }
    # a key, found_inf or inv_scale committed elsewhere: before, jit's error naming srround's
    # internals (_native_stochastic_round, _apply_narrow, fused_step)
    key_b, flag_b = (jax.device_put(v, b.sharding.mesh.devices.flat[0]) for v in (KEY, 0.0))
    f32 = a.astype(jnp.float32)
    calls = list(calls.items()) + [
        ("seed: on devices [4]", lambda: sj.stochastic_round(f32, seed=key_b)),
        ("seed: on devices [4]", lambda: sj.stochastic_add(a, f32, seed=key_b)),
        ("seed: on devices [4]", lambda: sj.apply_updates([a], [f32], key_b)),
        ("found_inf: on devices [4]", lambda: tx.step([a], tx.init([a]), [a], found_inf=flag_b)),
        ("inv_scale: on devices [4]", lambda: tx.step([a], tx.init([a]), [a], inv_scale=flag_b)),
    ]
    for message, call in calls:
        try:
            call()
        except ValueError as exc:
            assert message in str(exc) and "devices [0, 1, 2, 3]" in str(exc), exc
        else:
            raise AssertionError(f"no error for {message!r}")
    # the same devices in another order: jit refuses them too
    flipped = jax.sharding.Mesh(np.array(jax.devices()[:4])[::-1], ("x",))
    c = jax.device_put(jnp.ones(8, jnp.bfloat16), NamedSharding(flipped, P("x")))
    try:
        sj.apply_updates([a, c], [jnp.ones(8), jnp.ones(8)], 0)
    except ValueError as exc:
        assert "params[1]: on mesh {'x': 4} of devices [3, 2, 1, 0]" in str(exc), exc
    else:
        raise AssertionError("no error for the same devices in another order")
    # the same devices under other axis names: the per-shard host calls take one mesh
    named = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("y",))
    d = jax.device_put(jnp.ones(8, jnp.bfloat16), NamedSharding(named, P("y")))
    try:
        sj.apply_updates([a, d], [jnp.ones(8), jnp.ones(8)], 0, impl="callback")
    except ValueError as exc:
        assert "params[1]: on mesh {'y': 4} of devices [0, 1, 2, 3]" in str(exc), exc
    else:
        raise AssertionError("no error for meshes of other axis names")
    # an uncommitted array goes where the others are; a committed one on a device of a mesh
    # is not on the mesh
    s = sj.apply_updates([a], [jnp.full(8, 1e-3)], KEY, step=1)
    _same(
        s[0],
        sj.apply_updates([jnp.ones(8, jnp.bfloat16)], [jnp.full(8, 1e-3)], KEY, step=1)[0],
        "uncommitted",
    )
    one = jax.device_put(jnp.ones(8), jax.devices()[0])
    try:
        sj.stochastic_add(a, one, seed=KEY)
    except ValueError as exc:
        assert "u: on devices [0], but w is on mesh {'x': 4}" in str(exc), exc
    else:
        raise AssertionError("no error for a committed array on one device of the mesh")
    print("errors ok")


def case_explicit():
    """Meshes with explicit axes (shardings in the types): both paths keep each input's spec
    and give the unsharded bits (the callback path runs per shard through ``shard_map``)."""
    from jax.sharding import AxisType

    mesh = jax.make_mesh((2, 2), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
    x = jnp.asarray(_data((8, 4), 1))
    w = x.astype(jnp.bfloat16)
    params = {"a": w, "b": jnp.asarray(_data((6,), 2)).astype(jnp.bfloat16)}
    updates = {"a": x * 1e-2, "b": jnp.asarray(_data((6,), 3)) * 1e-2}
    specs = {"a": P("x", "y"), "b": P()}
    tx = sj.adamw(1e-2, seed=KEY)
    e_params, _ = tx.step(updates, tx.init(params), params)
    expected = {
        "round": sj.stochastic_round(x, seed=KEY, offset=5),
        "add": sj.stochastic_add(w, x, alpha=0.1, seed=KEY),
        "apply": sj.apply_updates(params, updates, KEY, step=2),
    }
    with jax.set_mesh(mesh):
        for spec in (P("x", "y"), P(None, "x"), P(("x", "y"))):
            xs, ws = (jax.device_put(a, NamedSharding(mesh, spec)) for a in (x, w))
            for impl in ("native", "callback"):
                what = f"explicit {spec} {impl}"
                got = jax.jit(lambda a, i=impl: sj.stochastic_round(a, seed=KEY, offset=5, impl=i))(
                    xs
                )
                _same(got, expected["round"], f"round {what}")
                _same_sharding(got, xs, f"round {what}")
                got = jax.jit(
                    lambda a, b, i=impl: sj.stochastic_add(a, b, alpha=0.1, seed=KEY, impl=i)
                )(ws, xs)
                _same(got, expected["add"], f"add {what}")
                _same_sharding(got, ws, f"add {what}")
        ps = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
        us = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in updates.items()}
        for impl in ("native", "callback", None):  # None: the defaults
            got = jax.jit(lambda p, u, i=impl: sj.apply_updates(p, u, KEY, step=2, impl=i))(ps, us)
            tx = sj.adamw(1e-2, seed=KEY, impl=impl)
            new, _ = jax.jit(lambda g, p, tx=tx: tx.step(g, tx.init(p), p))(us, ps)
            for k in params:
                _same(got[k], expected["apply"][k], f"apply_updates explicit {impl} {k}")
                _same_sharding(got[k], ps[k], f"apply_updates explicit {impl} {k}")
                _same(new[k], e_params[k], f"adamw explicit {impl} {k}")
                _same_sharding(new[k], ps[k], f"adamw explicit {impl} {k}")
        # the loss scale: unscale, all_finite and adjust on sharded gradients
        ls = sj.DynamicLossScale(jnp.float32(2**15))

        def scale_step(grads, ls):
            grads = ls.unscale(grads)
            finite = sj.all_finite(grads)
            return grads, finite, ls.adjust(finite)

        grads, finite, new_ls = jax.jit(scale_step)(us, ls)
        e_grads, e_finite, e_ls = scale_step(updates, ls)
        assert bool(finite) == bool(e_finite) and float(new_ls.loss_scale) == float(e_ls.loss_scale)
        for k in params:
            _same(grads[k], e_grads[k], f"unscale explicit {k}")
            _same_sharding(grads[k], us[k], f"unscale explicit {k}")
    # a 1 x 1 mesh (the script of a 2 x 4 mesh run on one device): small leaves of different
    # specs (before: a ShardingTypeError from concatenating them into one loop)
    one = jax.make_mesh((1, 1), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
    specs = {"a": P("x", "y"), "b": P("y")}
    with jax.set_mesh(one):
        ps = {k: jax.device_put(v, NamedSharding(one, specs[k])) for k, v in params.items()}
        us = {k: jax.device_put(v, NamedSharding(one, specs[k])) for k, v in updates.items()}
        for impl in ("native", "callback", None):
            got = jax.jit(lambda p, u, i=impl: sj.apply_updates(p, u, KEY, step=2, impl=i))(ps, us)
            tx = sj.adamw(1e-2, seed=KEY, impl=impl)
            new, _ = jax.jit(lambda g, p, tx=tx: tx.step(g, tx.init(p), p))(us, ps)
            for k in params:
                _same(got[k], expected["apply"][k], f"apply_updates 1 x 1 {impl} {k}")
                _same_sharding(got[k], ps[k], f"apply_updates 1 x 1 {impl} {k}")
                _same(new[k], e_params[k], f"adamw 1 x 1 {impl} {k}")
                _same_sharding(new[k], ps[k], f"adamw 1 x 1 {impl} {k}")
    # fp8 states (the native path, their default): a state block spans the pieces of a split
    # leaf; explicit axes refuse the reshapes into blocks (before: a ShardingTypeError), with
    # and without the mesh set
    w8 = jnp.asarray(_data((36, 20), 4)).astype(jnp.bfloat16)
    g8 = jnp.asarray(_data((36, 20), 5)).astype(jnp.bfloat16)
    tx8 = sj.adamw(1e-2, seed=KEY, state_dtype=jnp.float8_e4m3fn)
    e_p8, e_s8 = tx8.step({"w": g8}, tx8.init({"w": w8}), {"w": w8})
    for in_context in (False, True):
        what = f"fp8 states explicit, mesh set: {in_context}"
        with jax.set_mesh(mesh) if in_context else contextlib.nullcontext():
            p8 = {"w": jax.device_put(w8, NamedSharding(mesh, P("x", "y")))}
            g8s = {"w": jax.device_put(g8, NamedSharding(mesh, P("x", "y")))}
            got_p, got_s = jax.jit(tx8.step)(g8s, tx8.init(p8), p8)
        _same(got_p["w"], e_p8["w"], what)
        _same_sharding(got_p["w"], p8["w"], what)
        for field in ("exp_avg", "exp_avg_sq"):
            for part in (0, 1):  # the fp8 moments, their block scales
                _same(getattr(got_s, field)[part]["w"], getattr(e_s8, field)[part]["w"], what)
        _same_sharding(got_s.exp_avg[0]["w"], p8["w"], what)
    print("explicit ok")


def case_readme():
    """The README's sharded training step ("JAX at scale") runs as written on a 2 x 4 mesh:
    its outputs keep the inputs' shardings, and its shard_map optimizer (``shard_specs``)
    gives the bits of the jitted step. The README sets its mesh for the process
    (``jax.set_mesh``); the case runs inside a ``jax.set_mesh(None)`` block, whose exit gives
    the cases after it no mesh again."""
    with jax.set_mesh(None):
        _readme()


def _readme():
    import srround

    from .readme import run

    params = {"w": jnp.asarray(_data((8, 12), 1)).astype(jnp.bfloat16)}
    params["b"] = jnp.asarray(_data((12,), 2)).astype(jnp.bfloat16)
    batch = jnp.asarray(_data((4, 8), 3))

    def loss_fn(p, x):
        y = x.astype(jnp.bfloat16) @ p["w"] + p["b"]
        return jnp.mean(jnp.square(y.astype(jnp.float32)))

    given = {"srround": srround, "jax": jax, "jnp": jnp, "params": params, "loss_fn": loss_fn}
    ns = run("from jax.sharding import NamedSharding, PartitionSpec as P", given)
    mesh, specs, tx, state = ns["mesh"], ns["specs"], ns["tx"], ns["state"]
    ps, ls = ns["params"], ns["ls"]
    new, new_state, new_ls = ns["train_step"](ps, state, ls, batch)
    for k in ps:
        _same_sharding(new[k], ps[k], f"readme params {k}")
        _same_sharding(new_state.exp_avg[k], ps[k], f"readme exp_avg {k}")
        assert not np.array_equal(_bits(new[k]), _bits(ps[k])), f"readme: {k} did not move"
    assert float(new_ls.loss_scale) == 2.0**15 and int(new_state.count) == 1

    grads = jax.grad(loss_fn)(ps, batch)
    state_specs = type(state)(P(), specs, specs, specs)
    local = jax.shard_map(
        ns["tx_local"].step,
        mesh=mesh,
        in_specs=(specs, state_specs, specs),
        out_specs=(specs, state_specs),
    )
    expected, _ = jax.jit(tx.step)(grads, state, ps)
    got, _ = jax.jit(local)(grads, state, ps)
    for k in ps:
        _same(got[k], expected[k], f"readme shard_map {k}")
    print("readme ok")


def case_missing_specs():
    """Inside ``shard_map`` an optimizer given no (or a wrong) ``shard_specs`` for a split
    leaf: a ``ValueError`` naming the leaf and ``shard_specs``, before anything runs (before,
    every block was rounded as a whole array: the same noise in every shard, bits that
    depended on the mesh). Replicated leaves need no spec."""
    mesh = _mesh((2, 4), ("data", "model"))
    specs = {"b": P("model"), "w": P(None, "model")}
    params = {"b": jnp.ones(8, jnp.bfloat16), "w": jnp.ones((4, 8), jnp.bfloat16)}
    grads = jax.tree.map(lambda p: p.astype(jnp.float32) * 1e-2, params)
    for impl in ("native", "callback"):
        for given, leaf in ((None, "params[0]"), ({"b": P("model"), "w": P()}, "params[1]")):
            tx = sj.adamw(1e-2, shard_specs=given, impl=impl)
            wb = optax.chain(optax.sgd(1e-2), sj.stochastic_write_back(0, shard_specs=given))
            state_specs = type(tx.init(params))(P(), specs, specs, specs)
            calls = {
                "adamw": (
                    tx.step,
                    (grads, tx.init(params), params),
                    (specs, state_specs, specs),
                    (specs, state_specs),
                ),
                "apply_updates": (
                    functools.partial(sj.apply_updates, seed=KEY, shard_specs=given, impl=impl),
                    (params, grads),
                    (specs, specs),
                    specs,
                ),
                "write_back": (
                    wb.update,
                    (grads, wb.init(params), params),
                    (specs, P(), specs),
                    (specs, P()),
                ),
            }
            for what, (fn, args, in_specs, out_specs) in calls.items():
                smap = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
                try:
                    jax.jit(smap).lower(*args)
                except ValueError as exc:
                    message = f"{leaf}: inside shard_map it varies over mesh axes ['model']"
                    assert message in str(exc) and "shard_specs" in str(exc), (what, exc)
                else:
                    raise AssertionError(f"{what} {impl} {given}: no error for a missing spec")
    # the functional calls the same (before 11-29 they rounded each block with the noise of
    # the first: the same noise in every shard)
    x, w = grads["w"], params["w"]
    for impl in ("native", "callback"):
        for given in (None, P()):
            calls = {
                "x": lambda x: sj.stochastic_round(x, seed=KEY, shard_spec=given, impl=impl),
                "w": lambda w: sj.stochastic_add(
                    w, w.astype(jnp.float32), seed=KEY, shard_spec=given, impl=impl
                ),
            }
            for name, fn in calls.items():
                spec = specs["w"]
                smap = jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec)
                try:
                    jax.jit(smap).lower(x if name == "x" else w)
                except ValueError as exc:
                    message = f"{name}: inside shard_map it varies over mesh axes ['model']"
                    assert message in str(exc) and "shard_spec" in str(exc), (name, exc)
                else:
                    raise AssertionError(f"{name} {impl} {given}: no error for a missing spec")
    # data parallel: replicated params, grads averaged with pmean - no spec needed
    tx = sj.adamw(1e-2, seed=KEY)
    state = tx.init(params)

    def step(g, s, p):
        return tx.step(jax.lax.pmean(g, "data"), s, p)

    state_specs = type(state)(P(), P(), P(), P())
    smap = jax.shard_map(
        step, mesh=mesh, in_specs=(P("data"), state_specs, P()), out_specs=(P(), state_specs)
    )
    per_device = jax.tree.map(lambda g: jnp.concatenate([g, g]), grads)  # one block per row
    got, _ = jax.jit(smap)(per_device, state, params)
    expected, _ = tx.step(grads, state, params)
    for k in params:
        _same(got[k], expected[k], f"data parallel {k}")
    print("missing_specs ok")


def case_flax():
    """flax.nnx as its users write it (skipped without flax): ``nnx.with_partitioning``
    params, ``nnx.Optimizer`` with the fused AdamW, an ``nnx.jit`` step on meshes with
    explicit axes: a 1 x 1 mesh (before 398171a: a ShardingTypeError) and 2 x 4 / 4 x 2 give
    the same bits, the moments keep the kernel's spec, one trace per run."""
    from flax import nnx
    from jax.sharding import AxisType

    def model_of(rngs):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("data", "model"))
        bias = nnx.with_partitioning(nnx.initializers.ones_init(), ("model",))
        kw = {"param_dtype": jnp.bfloat16, "rngs": rngs}
        return nnx.Linear(8, 16, kernel_init=init, bias_init=bias, **kw)

    def loss_fn(model, t):
        params = jax.tree.leaves(nnx.state(model, nnx.Param))
        return sum(
            jnp.sum(p.astype(jnp.float32) * jnp.sin(p.astype(jnp.float32) + t)) for p in params
        )

    def run(mesh_shape, tx):
        devices = np.array(jax.devices()[: int(np.prod(mesh_shape))]).reshape(mesh_shape)
        mesh = jax.sharding.Mesh(devices, ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
        traces = []
        with jax.set_mesh(mesh):
            model = model_of(nnx.Rngs(0))
            optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

            @nnx.jit
            def step(model, optimizer, t):
                traces.append(t)
                optimizer.update(model, nnx.grad(loss_fn)(model, t))

            for t in range(3):
                step(model, optimizer, jnp.float32(t))
        assert len(traces) == 1, f"{mesh_shape}: {len(traces)} traces"
        leaves = jax.tree_util.tree_leaves_with_path(nnx.state((model, optimizer)))
        kernel = model.kernel[...].sharding.spec
        for path, leaf in leaves:  # moments of the kernel follow it
            if leaf.shape == (8, 16):
                assert leaf.sharding.spec == kernel, (mesh_shape, path, leaf.sharding.spec)
        return {jax.tree_util.keystr(path): leaf for path, leaf in leaves}

    expected = run((1, 1), sj.adamw(1e-2, weight_decay=1e-2, seed=3))
    for mesh_shape in ((2, 4), (4, 2)):
        got = run(mesh_shape, sj.adamw(1e-2, weight_decay=1e-2, seed=3))
        for k, leaf in got.items():
            _same(leaf, expected[k], f"flax adamw {mesh_shape} {k}")
    print("flax ok")


if __name__ == "__main__":
    # every case named, in one process (its imports and compilations shared); a failed case
    # prints its traceback between markers and the next one runs, the exit status is 1
    assert len(jax.devices()) == 8, jax.devices()
    failed = False
    for name in sys.argv[1:]:
        print(f"=== {name}", flush=True)
        try:
            globals()[f"case_{name}"]()
        except Exception:
            failed = True
            traceback.print_exc(file=sys.stdout)
            print(f"{name} FAILED", flush=True)
    sys.exit(1 if failed else 0)
