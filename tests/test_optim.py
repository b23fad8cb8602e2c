"""Fused optimizer steps (srround.adamw_step / sgd_step) on NumPy buffers and CUDA (simulated
in CI): torch.optim's math, the five weight modes, bf16 states, found_inf, the RNG contract, and
CPU/CUDA bit identity."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import srround

BF16 = ml_dtypes.bfloat16
SIZES = [37, 5, 64]
STEP_STRIDE = 1 << 36  # the stream offset of step t is t * 2**36 (+ 2**34 per state stream)


def _starts(sizes):
    return np.concatenate([[0], np.cumsum(sizes)])[:-1]


def _problem(seed=0, sizes=SIZES, param_dtype=BF16, grad_dtype=BF16, state_dtype=np.float32):
    rng = np.random.default_rng(seed)
    params = [(rng.standard_normal(n) * 0.02).astype(param_dtype) for n in sizes]
    grads = [(rng.standard_normal(n) * 0.01).astype(grad_dtype) for n in sizes]
    m = [(rng.standard_normal(n) * 1e-3).astype(state_dtype) for n in sizes]
    v = [(rng.random(n) * 1e-5).astype(state_dtype) for n in sizes]
    return params, grads, m, v


def _aux(mode, params):
    if mode == "kahan":
        return [np.zeros(p.shape, p.dtype) for p in params]
    if mode == "master":
        return [p.astype(np.float32) for p in params]
    if mode == "remainder":
        return [np.zeros(p.shape, np.int16) for p in params]
    return None


def _fp32_step(params, grads, m, v, step, **hyper):
    """The same step on float32 copies of the parameters: fp32 params are updated exactly."""
    wide = [p.astype(np.float32) for p in params]
    m, v = [x.copy() for x in m], [x.copy() for x in v]
    srround.adamw_step(wide, grads, m, v, step=step, **hyper)
    return wide, m, v


def _bits(arrays):
    return [
        np.asarray(a).view(np.uint16 if np.asarray(a).dtype.itemsize == 2 else np.uint32)
        for a in arrays
    ]


def _same_bits(a, b):
    return all(np.array_equal(x, y) for x, y in zip(_bits(a), _bits(b)))


HYPER = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def test_master_weights_follow_torch_adamw():
    torch = pytest.importorskip("torch")
    params, _, _, _ = _problem()
    master = [p.astype(np.float32) for p in params]
    ours = [p.copy() for p in params]
    m = [np.zeros(p.shape, np.float32) for p in params]
    v = [np.zeros(p.shape, np.float32) for p in params]
    steps = np.zeros(len(params), np.int32)
    reference = [torch.tensor(p, requires_grad=True) for p in master]
    opt = torch.optim.AdamW(reference, lr=1e-3, weight_decay=0.01)
    rng = np.random.default_rng(1)
    for _ in range(100):
        grads = [rng.standard_normal(p.shape).astype(np.float32) for p in params]
        for t, g in zip(reference, grads):
            t.grad = torch.from_numpy(g)
        opt.step()
        srround.adamw_step(
            ours,
            grads,
            m,
            v,
            lr=1e-3,
            weight_decay=0.01,
            step=steps,
            rounding="master",
            aux=master,
            seed=0,
        )
    assert steps.tolist() == [100] * len(params)
    for mine, theirs in zip(master, reference):
        theirs = theirs.detach().numpy()
        np.testing.assert_allclose(mine, theirs, rtol=4 * 2**-23, atol=1e-3 * 2**-20)
        np.testing.assert_array_equal(ours[0], master[0].astype(BF16))  # bf16 copy = RNE


def test_sgd_follows_torch_sgd():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    for momentum, dampening, nesterov in [(0.0, 0.0, False), (0.9, 0.1, False), (0.9, 0.0, True)]:
        params = [rng.standard_normal(n).astype(np.float32) for n in SIZES]
        buffers = [np.zeros(n, np.float32) for n in SIZES]
        reference = [torch.tensor(p, requires_grad=True) for p in params]
        opt = torch.optim.SGD(
            reference,
            lr=0.05,
            momentum=momentum,
            dampening=dampening,
            nesterov=nesterov,
            weight_decay=0.01,
        )
        for step in range(1, 21):
            grads = [rng.standard_normal(n).astype(np.float32) for n in SIZES]
            for t, g in zip(reference, grads):
                t.grad = torch.from_numpy(g)
            opt.step()
            srround.sgd_step(
                params,
                grads,
                buffers,
                lr=0.05,
                momentum=momentum,
                dampening=dampening,
                nesterov=nesterov,
                weight_decay=0.01,
                step=step,
                seed=0,
            )
        for mine, theirs in zip(params, reference):
            np.testing.assert_allclose(mine, theirs.detach().numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("step", [1, 7])
def test_nearest_and_stochastic_round_the_fp32_update(step):
    params, grads, m, v = _problem()
    wide, _, _ = _fp32_step(params, grads, m, v, step, **HYPER)
    nearest = [p.copy() for p in params]
    srround.adamw_step(
        nearest,
        grads,
        [x.copy() for x in m],
        [x.copy() for x in v],
        step=step,
        rounding="nearest",
        seed=3,
        **HYPER,
    )
    assert _same_bits(nearest, [srround.round_nearest(w) for w in wide])
    stochastic = [p.copy() for p in params]
    srround.adamw_step(
        stochastic,
        grads,
        [x.copy() for x in m],
        [x.copy() for x in v],
        step=step,
        rounding="stochastic",
        seed=3,
        **HYPER,
    )
    expected = [
        srround.stochastic_round(w, seed=3, offset=step * STEP_STRIDE + int(s))
        for w, s in zip(wide, _starts(SIZES))
    ]
    assert _same_bits(stochastic, expected)
    for w, p in zip(wide, stochastic):  # one of the two bf16 neighbours of the fp32 update
        down = srround.round_nearest(w).astype(np.float32)
        got = p.astype(np.float32)
        ulp = np.abs(np.spacing(down.astype(BF16).astype(np.float32), dtype=np.float32)) * 2**16
        assert np.all(np.abs(got - w) <= ulp)


def test_bf16_states_are_stochastically_rounded_on_their_streams():
    params, grads, m, v = _problem()
    wide, m32, v32 = _fp32_step(params, grads, m, v, 2, **HYPER)
    m16 = [x.astype(BF16) for x in m]
    v16 = [x.astype(BF16) for x in v]
    # the fp32 reference from the same (bf16-representable) states
    wide, m32, v32 = _fp32_step(
        params,
        grads,
        [x.astype(np.float32) for x in m16],
        [x.astype(np.float32) for x in v16],
        2,
        **HYPER,
    )
    p = [x.copy() for x in params]
    srround.adamw_step(p, grads, m16, v16, step=2, seed=5, **HYPER)
    starts = _starts(SIZES)
    assert _same_bits(
        m16,
        [
            srround.stochastic_round(x, seed=5, offset=2 * STEP_STRIDE + 2**34 + int(s))
            for x, s in zip(m32, starts)
        ],
    )
    assert _same_bits(
        v16,
        [
            srround.stochastic_round(x, seed=5, offset=2 * STEP_STRIDE + 2**35 + int(s))
            for x, s in zip(v32, starts)
        ],
    )


def test_remainder_is_the_exact_master_trajectory():
    params, _, _, _ = _problem()
    states = {
        mode: (
            [p.copy() for p in params],
            [np.zeros(p.shape, np.float32) for p in params],
            [np.zeros(p.shape, np.float32) for p in params],
            _aux(mode, params),
            np.zeros(len(params), np.int32),
        )
        for mode in ("master", "remainder")
    }
    rng = np.random.default_rng(4)
    for _ in range(30):
        grads = [rng.standard_normal(p.shape).astype(BF16) for p in params]
        for mode, (p, m, v, aux, steps) in states.items():
            srround.adamw_step(p, grads, m, v, lr=1e-4, step=steps, rounding=mode, aux=aux, seed=1)
    (_, _, _, master, _), (high, _, _, low, _) = states["master"], states["remainder"]
    for exact, hi, lo in zip(master, high, low):
        rebuilt = (hi.view(np.uint16).astype(np.int64) << 16) + lo.astype(np.int64)
        np.testing.assert_array_equal(rebuilt.astype(np.uint32), exact.view(np.uint32))


def test_remainder_round_trip_of_edge_patterns():
    """The (bf16, int16) split of fp32 patterns: exact for every finite value and +-inf."""
    from srround._optim import REMAINDER, weight_value, weight_write

    patterns = [
        0,
        0x80000000,
        1,
        0x80000001,
        0x3F808000,
        0x3F807FFF,
        0xBF808000,
        0x7F7FFFFF,
        0xFF7FFFFF,
        0x7F800000,
        0xFF800000,
        0x00007FFF,
        0x80008000,
    ]
    for u in patterns:
        high, low = weight_write(REMAINDER, 1, 0, u, 0, 0)
        assert weight_value(REMAINDER, 1, high, low) == u, hex(u)
    high, low = weight_write(REMAINDER, 1, 0, 0xFFFFFFFF, 0, 0)  # NaN: quiet NaN, sign kept
    assert (high, low) == (0xFFC0, 0)


def test_kahan_tracks_master_where_nearest_stalls():
    params = [np.full(256, 1.0, BF16)]
    runs = {}
    for mode in ("nearest", "kahan", "master"):
        p, aux = [x.copy() for x in params], _aux(mode, params)
        m, v = [np.zeros(256, np.float32)], [np.zeros(256, np.float32)]
        for step in range(1, 201):  # updates of ~1e-4, below half a bf16 ulp at 1.0 (3.9e-3)
            srround.adamw_step(
                p,
                [np.ones(256, np.float32)],
                m,
                v,
                lr=1e-4,
                weight_decay=0.0,
                step=step,
                rounding=mode,
                aux=aux,
            )
        value = p[0].astype(np.float32)
        if mode == "kahan":
            value = value + aux[0].astype(np.float32)
        runs[mode] = value if mode != "master" else aux[0]
    assert np.all(runs["nearest"] == 1.0)  # every update lost
    # the bf16 compensation keeps ~8 bits of the lost part: within 1 % of the 0.02 moved
    np.testing.assert_allclose(runs["kahan"], runs["master"], atol=2e-4)
    assert np.all(np.abs(runs["master"] - (1.0 - 200e-4)) < 1e-4)


def test_stochastic_is_unbiased_over_seeds():
    params = [np.full(4096, 1.0, BF16)]
    total = np.zeros(4096)
    runs = 8
    for seed in range(runs):
        p = [params[0].copy()]
        m, v = [np.zeros(4096, np.float32)], [np.zeros(4096, np.float32)]
        for step in range(1, 51):
            srround.adamw_step(
                p,
                [np.ones(4096, np.float32)],
                m,
                v,
                lr=1e-4,
                weight_decay=0.0,
                step=step,
                seed=seed,
            )
        total += p[0].astype(np.float64)
    expected = 1.0 - 50e-4  # Adam with a constant gradient moves lr per step
    mean = total.mean() / runs
    # each final weight is a sum of independent roundings; its spread is < one ulp (2**-8)
    z = (mean - expected) / (2**-8 / np.sqrt(total.size * runs))
    assert abs(z) < 5, (mean, expected, z)


def test_found_inf_leaves_every_buffer_and_step_count():
    for mode in ("stochastic", "kahan", "master", "remainder"):
        params, grads, m, v = _problem(state_dtype=BF16)
        aux = _aux(mode, params)
        steps = np.full(len(params), 3, np.int32)
        before = [x.copy() for x in params + m + v + (aux or [])]
        srround.adamw_step(
            params,
            grads,
            m,
            v,
            step=steps,
            rounding=mode,
            aux=aux,
            found_inf=np.float32([1.0]),
            seed=0,
            **HYPER,
        )
        assert _same_bits(params + m + v + (aux or []), before)
        assert steps.tolist() == [3] * len(params)
        srround.adamw_step(
            params,
            grads,
            m,
            v,
            step=steps,
            rounding=mode,
            aux=aux,
            found_inf=np.float32([0.0]),
            seed=0,
            **HYPER,
        )
        assert steps.tolist() == [4] * len(params) and not _same_bits(params, before)


def test_inv_scale_is_fused():
    params, grads, m, v = _problem(grad_dtype=np.float32)
    scaled = [(g * 1024).astype(np.float32) for g in grads]
    a, b = [p.copy() for p in params], [p.copy() for p in params]
    srround.adamw_step(
        a, grads, [x.copy() for x in m], [x.copy() for x in v], step=1, seed=0, **HYPER
    )
    srround.adamw_step(
        b,
        scaled,
        [x.copy() for x in m],
        [x.copy() for x in v],
        step=1,
        seed=0,
        inv_scale=1 / 1024,
        **HYPER,
    )
    assert _same_bits(a, b)


def _to_device(arrays):
    from numba import cuda

    return None if arrays is None else [cuda.to_device(a) for a in arrays]


@pytest.mark.parametrize("grad_dtype", [BF16, np.float16], ids=["bf16_grads", "fp16_grads"])
@pytest.mark.parametrize("mode", ["stochastic", "nearest", "kahan", "master", "remainder"])
def test_cpu_and_cuda_give_the_same_bits(mode, grad_dtype, small_cuda_launch):
    """bf16 params with bf16 grads take the CPU's constant-format loops, with fp16 grads its
    generic loop: both must give the CUDA kernel's bits."""
    from numba import cuda

    if not cuda.is_available():
        pytest.skip("no CUDA device and not simulated")
    sizes = [9, 3, 6]
    state_dtype = BF16 if mode in ("stochastic", "kahan") else np.float32
    params, grads, m, v = _problem(sizes=sizes, grad_dtype=grad_dtype, state_dtype=state_dtype)
    aux = _aux(mode, params)
    device = [_to_device(x) for x in (params, grads, m, v, aux)]
    steps, device_steps = np.zeros(3, np.int32), cuda.to_device(np.zeros(3, np.int32))
    for _ in range(2):
        srround.adamw_step(
            params, grads, m, v, step=steps, rounding=mode, aux=aux, seed=9, inv_scale=0.5, **HYPER
        )
        srround.adamw_step(
            *device[:4],
            step=device_steps,
            rounding=mode,
            aux=device[4],
            seed=9,
            inv_scale=0.5,
            **HYPER,
        )
    for host, dev in zip((params, m, v, aux), (device[0], device[2], device[3], device[4])):
        if host is not None:
            assert _same_bits(host, [d.copy_to_host() for d in dev])
    assert device_steps.copy_to_host().tolist() == [2, 2, 2]


def test_sgd_cpu_and_cuda_give_the_same_bits(small_cuda_launch):
    from numba import cuda

    if not cuda.is_available():
        pytest.skip("no CUDA device and not simulated")
    sizes = [7, 4]
    params, grads, m, _ = _problem(sizes=sizes, state_dtype=BF16)
    device = [_to_device(x) for x in (params, grads, m)]
    for step in (1, 2):
        for p, g, b in ((params, grads, m), device):
            srround.sgd_step(
                p, g, b, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, step=step, seed=2
            )
    assert _same_bits(params, [d.copy_to_host() for d in device[0]])
    assert _same_bits(m, [d.copy_to_host() for d in device[2]])


def test_fp32_and_fp16_params_mixed_in_one_step():
    rng = np.random.default_rng(6)
    params = [
        rng.standard_normal(8).astype(np.float32),
        rng.standard_normal(8).astype(np.float16),
        rng.standard_normal(8).astype(BF16),
    ]
    grads = [rng.standard_normal(8).astype(np.float32) for _ in params]
    m = [np.zeros(8, np.float32) for _ in params]
    v = [np.zeros(8, np.float32) for _ in params]
    aux = [None, params[1].astype(np.float32), params[2].astype(np.float32)]
    wide = [p.astype(np.float32) for p in params]
    srround.adamw_step(wide, grads, [x.copy() for x in m], [x.copy() for x in v], step=1, **HYPER)
    srround.adamw_step(params, grads, m, v, step=1, rounding="master", aux=aux, **HYPER)
    np.testing.assert_array_equal(params[0], wide[0])
    np.testing.assert_array_equal(aux[1], wide[1])
    np.testing.assert_array_equal(params[1], wide[1].astype(np.float16))


def test_bad_arguments_name_themselves():
    params, grads, m, v = _problem()
    good = dict(step=1, **HYPER)
    cases = [
        (dict(rounding="truncate"), ValueError, "rounding"),
        (dict(rounding="kahan"), ValueError, "aux"),
        (dict(rounding="master", aux=[np.zeros(n, BF16) for n in SIZES]), TypeError, "aux[0]"),
        (
            dict(rounding="master", aux=[np.zeros(n, np.float32) for n in SIZES[:2]]),
            ValueError,
            "aux",
        ),
    ]
    for extra, error, name in cases:
        with pytest.raises(error, match=name.replace("[", r"\[").replace("]", r"\]")):
            srround.adamw_step(params, grads, m, v, **{**good, **extra})
    with pytest.raises(ValueError, match=r"grads\[1\]"):
        srround.adamw_step(params, [grads[0], grads[0], grads[2]], m, v, **good)
    with pytest.raises(TypeError, match=r"exp_avg_sqs\[0\]"):
        srround.adamw_step(params, grads, m, [x.astype(np.float16) for x in v], **good)
    with pytest.raises(TypeError, match=r"exp_avg_sqs\[0\]"):  # one state dtype for all
        srround.adamw_step(params, grads, m, [x.astype(BF16) for x in v], **good)
    with pytest.raises(TypeError, match=r"params\[0\]"):
        srround.adamw_step(
            [p.astype(np.float16) for p in params],
            grads,
            m,
            v,
            rounding="remainder",
            aux=_aux("remainder", params),
            **HYPER,
            step=1,
        )
    with pytest.raises(ValueError, match="step"):
        srround.adamw_step(params, grads, m, v, **{**good, "step": 0})
    with pytest.raises(ValueError, match="step"):
        srround.adamw_step(params, grads, m, v, **{**good, "step": np.zeros(2, np.int32)})
    frozen = [p.copy() for p in params]
    frozen[0].flags.writeable = False
    with pytest.raises(ValueError, match=r"params\[0\]"):
        srround.adamw_step(frozen, grads, m, v, **good)
    with pytest.raises(ValueError, match="momentum_buffers"):
        srround.sgd_step(params, grads, lr=0.1, momentum=0.9, step=1)


@pytest.mark.cuda
def test_cuda_check_grads_flags_any_non_finite(small_cuda_launch):
    """``FusedStep.check_grads`` on CUDA (the torch GradScaler's check through the cached table;
    the CPU path is covered through srround.adapters.torch.AdamW): a single inf/NaN anywhere,
    in fp32, bf16 or fp16 gradients, sets the flag; finite gradients leave it and are unchanged."""
    from numba import cuda

    from srround import _optim
    from srround._tensor_list import address

    if not cuda.is_available():
        pytest.skip("no CUDA device and not simulated")
    rng = np.random.default_rng(4)
    host = [
        rng.standard_normal(n).astype(dtype)
        for n, dtype in ((13, np.float32), (6, BF16), (9, np.float16))
    ]
    codes = [0, 1, 2]
    for where in (None, (0, 12), (1, 0), (2, 4)):
        grads = [g.copy() for g in host]
        if where is not None:
            grads[where[0]][where[1]] = np.nan if where[0] == 1 else np.inf
        device = _to_device(grads)
        table = np.zeros((3, _optim.TABLE_COLUMNS), np.int64)
        table[:, _optim.G_ADDR] = [address(d) for d in device]
        table[:, _optim.G_FMT] = codes
        stream = cuda.default_stream()
        fused = _optim.FusedStep(
            _optim.ADAMW,
            _optim.MODES["stochastic"],
            0,
            table,
            [g.size for g in grads],
            cuda.to_device(np.zeros(3, np.uint32)),
            "cuda",
            stream,
        )
        found = cuda.to_device(np.zeros(1, np.float32).view(np.uint32))
        fused.check_grads(found)
        assert found.copy_to_host().view(np.float32)[0] == (0.0 if where is None else 1.0)
        assert _same_bits([d.copy_to_host() for d in device], grads)
