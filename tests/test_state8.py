"""fp8 optimizer states (``adamw_step`` with float8 moments and block scales): the step's bits
against a reference assembled from independently tested parts (the fp32-state step and
``stochastic_round``), CPU = CUDA simulator, the unbiased write-back, argument errors.

One compiled CPU kernel serves every case here (mode and formats are run-time values)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import srround

from .reference import to_cuda

BF16 = ml_dtypes.bfloat16
E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
BLOCK = srround.STATE_BLOCK
SIZES = [300, 5, 128]
HYPER = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
SEED = 7


def _blocks(n):
    return -(-n // BLOCK)


def _problem(dtype=E4M3, sizes=SIZES, seed=0):
    """bf16 params and grads, fp8 moments of a step in progress (random patterns, the second
    moment nonnegative) and power-of-two block scales."""
    rng = np.random.default_rng(seed)
    params = [(rng.standard_normal(n) * 0.02).astype(BF16) for n in sizes]
    grads = [(rng.standard_normal(n) * 0.01).astype(BF16) for n in sizes]
    grads[0][:BLOCK] *= BF16(1e-3)  # a block of small values beside larger ones
    m = [(rng.standard_normal(n) * 100).astype(dtype) for n in sizes]
    s = [np.abs(rng.standard_normal(n) * 100).astype(dtype) for n in sizes]
    ms = [np.exp2(rng.integers(-20, -12, _blocks(n))).astype(np.float32) for n in sizes]
    vs = [np.exp2(rng.integers(-22, -14, _blocks(n))).astype(np.float32) for n in sizes]
    return params, grads, m, s, ms, vs


def _dequantize(q, scales):
    return q.astype(np.float32) * np.repeat(scales, BLOCK)[: q.size]


def _scale(values, dtype):
    """Reference block scales: the smallest power of two ``2**k`` with ``amax / 2**k <= max``
    (from frexp, not from the kernel's bit arithmetic)."""
    top = float(ml_dtypes.finfo(dtype).max)
    out = []
    for b in range(_blocks(values.size)):
        block = np.abs(values[b * BLOCK : (b + 1) * BLOCK].astype(np.float64))
        amax = block[np.isfinite(block)].max(initial=0.0)
        k = np.frexp(amax)[1] - 1 - int(np.log2(top)) if amax > 0 else -126
        if amax / 2.0**k > top:
            k += 1
        out.append(2.0 ** min(max(k, -126), 127))
    return np.asarray(out, np.float32)


def _reference(problem, dtype, step, rounding="stochastic"):
    """The fp8 step assembled from tested parts: the fp32-state step on the dequantized
    moments (v = s * s in float32) gives the weights and the float32 moments; each moment is
    then ``stochastic_round(x / scale)`` on its stream (contracts: noise offsets)."""
    params, grads, m, s, ms, vs = problem
    p = [x.copy() for x in params]
    m32 = [_dequantize(q, sc) for q, sc in zip(m, ms)]
    v32 = [np.square(_dequantize(q, sc)) for q, sc in zip(s, vs)]
    srround.adamw_step(p, grads, m32, v32, **HYPER, step=step, seed=SEED, rounding=rounding)
    out_m, out_s, out_ms, out_vs = [], [], [], []
    start = 0
    for x, v in zip(m32, v32):
        for stream, y, qs, ss in ((1, x, out_m, out_ms), (2, np.sqrt(v), out_s, out_vs)):
            sc = _scale(y, dtype)
            offset = (step << 36) + (stream << 34) + start
            scaled = y / np.repeat(sc, BLOCK)[: y.size]
            qs.append(srround.stochastic_round(scaled, dtype=dtype, seed=SEED, offset=offset))
            ss.append(sc)
        start += x.size
    return p, out_m, out_s, out_ms, out_vs


def _run(problem, step, **kwargs):
    params, grads, m, s, ms, vs = (list(map(np.copy, x)) for x in problem)
    srround.adamw_step(
        params,
        grads,
        m,
        s,
        **HYPER,
        step=step,
        seed=SEED,
        exp_avg_scales=ms,
        exp_avg_sq_scales=vs,
        **kwargs,
    )
    return params, m, s, ms, vs


def _functional_two_steps(params, grads, dtype):
    """``(params, m, s, m scales, s scales)`` after steps 1 and 2 of ``adamw_step`` from zero
    fp8 states: the reference of the framework optimizers."""
    zero = (
        params,
        grads,
        *([np.zeros(x.size, dtype) for x in params] for _ in range(2)),
        *([np.zeros(_blocks(x.size), np.float32) for x in params] for _ in range(2)),
    )
    first = _run(zero, 1)
    return _run((first[0], grads, *first[1:]), 2)


def _assert_same(got, want):
    for name, a, b in zip(("params", "exp_avgs", "exp_avg_sqs", "m scales", "v scales"), got, want):
        for i, (x, y) in enumerate(zip(a, b)):
            width = {1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize]
            np.testing.assert_array_equal(x.view(width), y.view(width), err_msg=f"{name}[{i}]")


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_fp8_step_bits_equal_the_reference(dtype):
    problem = _problem(dtype)
    _assert_same(_run(problem, 3), _reference(problem, dtype, 3))


def test_fp8_step_with_float32_gradients_bits_equal_the_reference():
    """bf16 parameters with float32 gradients take a constant-format branch of their own (as
    bf16 gradients do): the reference's bits."""
    params, grads, m, s, ms, vs = _problem()
    problem = (params, [g.astype(np.float32) for g in grads], m, s, ms, vs)
    _assert_same(_run(problem, 3), _reference(problem, E4M3, 3))


def test_fp8_first_step_from_zero_states():
    """Zero moments under zero scales (what a new optimizer allocates) decode to 0."""
    params, grads, m, s, ms, vs = _problem()
    zero = (params, grads, *([np.zeros_like(a) for a in x] for x in (m, s, ms, vs)))
    got = _run(zero, 1)
    _assert_same(got, _reference(zero, E4M3, 1))
    assert all(np.all(sc > 0) for sc in got[3])


def test_fp8_step_cuda_bits_equal_cpu_bits(small_cuda_launch):
    from numba import cuda

    if not cuda.is_available():
        pytest.skip("no CUDA device and not simulated")
    problem = _problem(sizes=[130, 3])
    want = _run(problem, 2)
    dev = [[to_cuda(a) for a in x] for x in problem]
    srround.adamw_step(
        dev[0],
        dev[1],
        dev[2],
        dev[3],
        **HYPER,
        step=2,
        seed=SEED,
        exp_avg_scales=dev[4],
        exp_avg_sq_scales=dev[5],
    )
    got = [[a.copy_to_host() for a in dev[i]] for i in (0, 2, 3, 4, 5)]
    _assert_same(got, want)


def test_fp8_nan_results_are_the_positive_quiet_nan(small_cuda_launch):
    """NaN gradients of both signs and a -NaN weight: the weights' NaNs are bf16 +qNaN 0x7FC0
    and the moments' NaN elements e4m3fn's +NaN 0x7F, on the CPU and CUDA alike (a NaN's sign
    from the float ops differs between them)."""
    from numba import cuda

    problem = _problem(sizes=[4, 3])
    problem[1][0][:2].view(np.uint16)[:] = [0xFFC0, 0x7FC1]
    problem[0][1][:1].view(np.uint16)[:] = 0xFFC5
    runs = [_run(problem, 2)]
    if cuda.is_available():
        dev = [[to_cuda(a) for a in x] for x in problem]
        srround.adamw_step(
            *dev[:4], **HYPER, step=2, seed=SEED, exp_avg_scales=dev[4], exp_avg_sq_scales=dev[5]
        )
        runs.append([[a.copy_to_host() for a in dev[i]] for i in (0, 2, 3, 4, 5)])
    for params, m, s, _, _ in runs:
        assert [hex(v) for v in params[0][:2].view(np.uint16)] == ["0x7fc0"] * 2
        assert hex(params[1][:1].view(np.uint16)[0]) == "0x7fc0"
        for moments in (m, s):
            assert [hex(v) for v in moments[0][:2].view(np.uint8)] == ["0x7f"] * 2
    if len(runs) == 2:
        _assert_same(runs[1], runs[0])


def test_fp8_write_back_is_unbiased():
    """Over many seeds the dequantized moments average to the float32 ones (z-test per
    element, against the spread of the two neighbours)."""
    problem = _problem(sizes=[BLOCK])
    _, _, _, ms_ref, vs_ref = _reference(problem, E4M3, 2)  # for the scales
    params, grads, m, s, ms, vs = problem
    m32 = [_dequantize(q, sc) for q, sc in zip(m, ms)]
    v32 = [np.square(_dequantize(q, sc)) for q, sc in zip(s, vs)]
    p = [x.copy() for x in params]
    srround.adamw_step(p, grads, m32, v32, **HYPER, step=2, seed=SEED)
    runs = 400
    total_m, total_s = np.zeros(BLOCK), np.zeros(BLOCK)
    for seed in range(runs):
        mm, ss = [x.copy() for x in m], [x.copy() for x in s]
        a, b = [x.copy() for x in ms], [x.copy() for x in vs]
        srround.adamw_step(
            [x.copy() for x in params],
            grads,
            mm,
            ss,
            **HYPER,
            step=2,
            seed=seed,
            exp_avg_scales=a,
            exp_avg_sq_scales=b,
        )
        total_m += _dequantize(mm[0], a[0])
        total_s += _dequantize(ss[0], b[0])
    for total, want, scale in ((total_m, m32[0], ms_ref[0]), (total_s, np.sqrt(v32[0]), vs_ref[0])):
        quantum = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(want) / scale, 2.0**-6))) - 3)
        sd = quantum * scale / 2 / np.sqrt(runs)  # at most: a Bernoulli between neighbours
        z = (total / runs - want) / np.maximum(sd, 1e-30)
        assert np.abs(z).max() < 5, np.abs(z).max()


def test_fp8_state_errors_before_any_write():
    problem = _problem()
    params, grads, m, s, ms, vs = problem
    before = [x.copy() for x in m]
    good = dict(**HYPER, step=1, exp_avg_scales=ms, exp_avg_sq_scales=vs)
    with pytest.raises(ValueError, match="exp_avg_scales: float8 exp_avgs need float32"):
        srround.adamw_step(params, grads, m, s, **{**good, "exp_avg_scales": None})
    with pytest.raises(ValueError, match=r"exp_avg_sq_scales\[1\]: 2 elements, expected 1"):
        bad = [vs[0], np.zeros(2, np.float32), vs[2]]
        srround.adamw_step(params, grads, m, s, **{**good, "exp_avg_sq_scales": bad})
    with pytest.raises(TypeError, match=r"exp_avg_scales\[0\]: expected float32"):
        bad = [x.astype(BF16) for x in ms]
        srround.adamw_step(params, grads, m, s, **{**good, "exp_avg_scales": bad})
    with pytest.raises(TypeError, match=r"exp_avg_sqs\[0\]: every state must have one dtype"):
        srround.adamw_step(params, grads, m, [x.astype(E5M2) for x in s], **good)
    with pytest.raises(ValueError, match="exp_avg_scales: block scales are only for float8"):
        m32 = [x.astype(np.float32) for x in m]
        srround.adamw_step(params, grads, m32, [x.astype(np.float32) for x in s], **good)
    with pytest.raises(ValueError, match="exp_avg_scales: expected 3 arrays"):
        srround.adamw_step(params, grads, m, s, **{**good, "exp_avg_scales": ms[:2]})
    with pytest.raises(TypeError, match=r"momentum_buffers\[0\]: expected float32 or bfloat16"):
        srround.sgd_step(params, grads, m, lr=0.1, momentum=0.9, step=1)
    with pytest.raises(ValueError, match="overlap|share"):
        srround.adamw_step(params, grads, m, s, **{**good, "exp_avg_sq_scales": ms})
    assert all(np.array_equal(a.view(np.uint8), b.view(np.uint8)) for a, b in zip(m, before))


def test_torch_adamw_fp8_states_equal_the_functional_step():
    """srround's torch AdamW with fp8 moments: the functional step's bits over two steps, the
    scales in its state, a state dict that resumes bit-identically; SGD refuses fp8."""
    torch = pytest.importorskip("torch")
    from srround.adapters.torch import SGD, AdamW

    params, grads, *_ = _problem(sizes=[300, 5])
    p_np, m, s, ms, vs = _functional_two_steps(params, grads, E4M3)
    tp = [
        torch.nn.Parameter(torch.from_numpy(x.view(np.uint16).copy()).view(torch.bfloat16))
        for x in params
    ]
    opt = AdamW(tp, **HYPER, state_dtype=torch.float8_e4m3fn, seed=SEED)
    for p, g in zip(tp, grads):
        p.grad = torch.from_numpy(g.view(np.uint16).copy()).view(torch.bfloat16)
    for step in (1, 2):
        if step == 2:  # a restored optimizer continues with the same bits
            saved = opt.state_dict()
            opt = AdamW(tp, **HYPER, state_dtype=torch.float8_e4m3fn, seed=0)
            opt.load_state_dict(saved)
        opt.step()
    for i, p in enumerate(tp):
        st = opt.state[p]
        np.testing.assert_array_equal(
            p.detach().view(torch.uint16).numpy(), p_np[i].view(np.uint16)
        )
        np.testing.assert_array_equal(st["exp_avg"].view(torch.uint8).numpy(), m[i].view(np.uint8))
        np.testing.assert_array_equal(
            st["exp_avg_sq"].view(torch.uint8).numpy(), s[i].view(np.uint8)
        )
        np.testing.assert_array_equal(st["exp_avg_scale"].numpy(), ms[i])
        np.testing.assert_array_equal(st["exp_avg_sq_scale"].numpy(), vs[i])
    with pytest.raises(ValueError, match="state_dtype: float8 states .* AdamW's only"):
        SGD(tp, lr=0.1, momentum=0.9, state_dtype=torch.float8_e4m3fn)
    fp32 = torch.optim.AdamW(tp, **HYPER)  # no state_dtype key: the optimizer's own (fp8)
    fp32.step()
    with pytest.raises(ValueError, match=r"state\[0\]\['exp_avg'\] is torch\.bfloat16"):
        opt.load_state_dict(fp32.state_dict())  # at load (test_torch_optim.py)


@pytest.mark.parametrize("impl", ["native", "callback"])
def test_jax_adamw_fp8_states_equal_the_functional_step(impl):
    """The JAX AdamW with fp8 moments (jax.lax, and the callback into the Numba step): the
    functional bits, state leaves ``(moments, scales)``; combinations it refuses."""
    jnp = pytest.importorskip("jax.numpy")
    from srround.adapters import jax as sjax

    params, grads, *_ = _problem(sizes=[300, 5])
    p_np, m, s, ms, vs = _functional_two_steps(params, grads, E5M2)
    lr, (b1, b2), eps, wd = HYPER["lr"], HYPER["betas"], HYPER["eps"], HYPER["weight_decay"]
    tx = sjax.adamw(
        lr, b1, b2, eps, weight_decay=wd, seed=SEED, state_dtype=jnp.float8_e5m2, impl=impl
    )
    tree = {"a": jnp.asarray(params[0]), "b": jnp.asarray(params[1])}
    gtree = {"a": jnp.asarray(grads[0]), "b": jnp.asarray(grads[1])}
    state = tx.init(tree)
    for _ in range(2):
        tree, state = tx.step(gtree, state, tree)
    for i, key in enumerate("ab"):
        np.testing.assert_array_equal(
            np.asarray(tree[key]).view(np.uint16), p_np[i].view(np.uint16)
        )
        for (q, sc), want_q, want_s in (
            ((state.exp_avg[0][key], state.exp_avg[1][key]), m[i], ms[i]),
            ((state.exp_avg_sq[0][key], state.exp_avg_sq[1][key]), s[i], vs[i]),
        ):
            np.testing.assert_array_equal(np.asarray(q).view(np.uint8), want_q.view(np.uint8))
            np.testing.assert_array_equal(np.asarray(sc), want_s)
    for bad in (dict(nesterov=True), dict(mu_dtype=jnp.float32)):
        with pytest.raises(ValueError, match="state_dtype: float8_e4m3fn .* states take neither"):
            sjax.adamw(lr, state_dtype=jnp.float8_e4m3fn, impl=impl, **bad)
