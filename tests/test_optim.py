"""The functional optimizer API (srround.adamw_step / sgd_step) beyond the contract every front
end shares (tests/test_optim_contract.py): the remainder split, the modes' statistics (kahan
against nearest, unbiased stochastic rounding), argument errors, the CUDA gradient check."""

from __future__ import annotations

import contextlib

import ml_dtypes
import numpy as np
import pytest

import srround

from .reference import to_cuda

BF16 = ml_dtypes.bfloat16
SIZES = [37, 5, 64]


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


def _bits(arrays):
    return [
        np.asarray(a).view(np.uint16 if np.asarray(a).dtype.itemsize == 2 else np.uint32)
        for a in arrays
    ]


def _same_bits(a, b):
    return all(np.array_equal(x, y) for x, y in zip(_bits(a), _bits(b)))


HYPER = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


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


def _adamw_ones(p, steps, **kw):
    """``steps`` AdamW steps (lr 1e-4, no weight decay) of the one tensor ``p[0]``, gradient 1."""
    n = p[0].size
    m, v = [np.zeros(n, np.float32)], [np.zeros(n, np.float32)]
    for step in range(1, steps + 1):
        srround.adamw_step(
            p, [np.ones(n, np.float32)], m, v, lr=1e-4, weight_decay=0.0, step=step, **kw
        )


def test_kahan_tracks_master_where_nearest_stalls():
    params = [np.full(256, 1.0, BF16)]
    runs = {}
    for mode in ("nearest", "kahan", "master"):
        p, aux = [x.copy() for x in params], _aux(mode, params)
        # updates of ~1e-4, below half a bf16 ulp at 1.0 (3.9e-3)
        _adamw_ones(p, 200, rounding=mode, aux=aux)
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
        _adamw_ones(p, 50, seed=seed)
        total += p[0].astype(np.float64)
    expected = 1.0 - 50e-4  # Adam with a constant gradient moves lr per step
    mean = total.mean() / runs
    # each final weight is a sum of independent roundings; its spread is < one ulp (2**-8)
    z = (mean - expected) / (2**-8 / np.sqrt(total.size * runs))
    assert abs(z) < 5, (mean, expected, z)


def _to_device(arrays):
    return None if arrays is None else [to_cuda(a) for a in arrays]


def test_16_bit_params_with_float32_grads_take_a_vectorized_cpu_loop():
    """Finding: a CPU step of bf16 (or fp16) parameters with float32 gradients ran the scalar
    loop of run-time formats (24.6M params in 196 tensors, 2 cores: 192 ms against 28 ms with
    bf16 gradients); these pairs now have constant-format loops (34 ms, same run). The bits
    are the contract tests' (``test_front_end_gives_the_reference_bits``, fp32 gradients)."""
    from srround import _cpu
    from srround._elements import BF16, F16, F32, Column

    table = np.zeros((4, len(Column)), np.int64)
    table[:, Column.P_FMT] = [BF16, F16, BF16, F32]
    table[:, Column.G_FMT] = [F32, F32, BF16, F32]
    cases = dict(zip(_cpu.CONSTANT_FORMATS + ("other",), _cpu.format_cases(table)))
    assert cases == {
        (BF16, BF16): True,
        (F16, F16): False,
        (F32, F32): True,
        (BF16, F32): True,
        (F16, F32): True,
        "other": False,
    }


@pytest.mark.parametrize("rounding", ["kahan", "master", "remainder"])
def test_float32_params_need_no_aux(rounding):
    """With float32 parameters only, the modes' aux buffers are all None, and ``aux=None``
    says so: the step is the other modes' (a float32 parameter is written exactly). It was a
    ValueError, which the JAX step's host call raised at run time for an all-float32 tree."""
    rng = np.random.default_rng(3)
    params = [rng.standard_normal(n).astype(np.float32) for n in SIZES]
    grads = [rng.standard_normal(n).astype(np.float32) for n in SIZES]
    runs = {}
    for mode in (rounding, "stochastic"):
        p = [x.copy() for x in params]
        m, v = [np.zeros_like(x) for x in p], [np.zeros_like(x) for x in p]
        srround.adamw_step(p, grads, m, v, rounding=mode, step=1, **HYPER)
        runs[mode] = p + m + v
    for a, b in zip(runs[rounding], runs["stochastic"]):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


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


def test_missing_buffers_are_refused_before_the_step():
    """A None gradient or state used to reach the kernel as address 0: a segmentation fault,
    or AdamW without its first moment / SGD without momentum, silently."""
    params, grads, m, v = _problem()
    before = [b.copy() for b in _bits(params)]
    cases = [
        (r"grads\[1\]", lambda: srround.sgd_step(params, [grads[0], None, grads[2]], m, **sgd)),
        ("exp_avgs", lambda: srround.adamw_step(params, grads, None, v, **good)),
        ("exp_avg_sqs", lambda: srround.adamw_step(params, grads, m, None, **good)),
        (r"exp_avgs\[2\]", lambda: srround.adamw_step(params, grads, [*m[:2], None], v, **good)),
        (r"momentum_buffers\[0\]", lambda: srround.sgd_step(params, grads, [None] * 3, **sgd)),
        (r"exp_avg_scales\[0\]", lambda: srround.adamw_step(params, grads, m8, v8, **fp8)),
    ]
    m8 = [np.zeros(n, ml_dtypes.float8_e4m3fn) for n in SIZES]
    v8 = [a.copy() for a in m8]
    scales = [np.zeros(1, np.float32) for _ in SIZES]
    fp8 = dict(exp_avg_scales=[None, *scales[1:]], exp_avg_sq_scales=scales, step=1, **HYPER)
    good, sgd = dict(step=1, seed=0, **HYPER), dict(lr=0.1, momentum=0.9, step=1, seed=0)
    for name, call in cases:
        with pytest.raises((TypeError, ValueError), match=f"^{name}: "):
            call()
    assert all(np.array_equal(a, b) for a, b in zip(_bits(params), before))


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
        table[:, _optim.NOISE] = [0, 13, 19]  # each tensor's own range of the stream
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


@pytest.mark.cuda
def test_cuda_set_grad_addresses_moves_the_table_to_new_gradients(small_cuda_launch):
    """``FusedStep.set_grad_addresses`` (the torch optimizers' table reading new gradients
    after ``zero_grad(set_to_none=True)``) on CUDA: the device table and the overflow check's
    columns follow the new buffers (the CPU path is covered through srround.adapters.torch)."""
    from numba import cuda

    from srround import _optim
    from srround._tensor_list import address

    if not cuda.is_available():
        pytest.skip("no CUDA device and not simulated")
    finite = [np.ones(5, np.float32), np.ones(3, np.float32)]
    overflowed = [np.ones(5, np.float32), np.array([1.0, np.inf, 1.0], np.float32)]
    old, new = _to_device(finite), _to_device(overflowed)
    table = np.zeros((2, _optim.TABLE_COLUMNS), np.int64)
    table[:, _optim.G_ADDR] = [address(d) for d in old]
    table[:, _optim.NOISE] = [0, 5]
    stream = cuda.default_stream()
    steps = cuda.to_device(np.zeros(2, np.uint32))
    mode = _optim.MODES["stochastic"]
    fused = _optim.FusedStep(_optim.ADAMW, mode, 0, table, [5, 3], steps, "cuda", stream)
    for grads, flag in ((old, 0.0), (new, 1.0)):
        fused.set_grad_addresses(np.array([address(d) for d in grads], np.int64))
        found = cuda.to_device(np.zeros(1, np.float32).view(np.uint32))
        fused.check_grads(found)
        assert found.copy_to_host().view(np.float32)[0] == flag
        on_device = fused.table.copy_to_host()[:, _optim.G_ADDR]
        assert list(on_device) == [address(d) for d in grads]


@pytest.mark.cuda
def test_cuda_sgd_with_momentum_in_some_groups_matches_cpu(small_cuda_launch):
    """A table where only some tensors have a momentum buffer (SGD param groups with and
    without momentum): the CUDA step built for it reads the buffer's presence per tensor (the
    other configurations fold it), and gives the CPU step's bits over two steps."""
    from numba import cuda

    from srround import _optim
    from srround._elements import BF16 as BF16_CODE
    from srround._tensor_list import address

    if not cuda.is_available():
        pytest.skip("no CUDA device and not simulated")
    rng = np.random.default_rng(6)
    sizes, groups = [11, 7, 9], [0, 1, 0]
    params = [rng.standard_normal(n).astype(np.float32).astype(BF16) for n in sizes]
    grads = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    buffers = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    # (lr, momentum, dampening, weight_decay, nesterov) per group; group 1 without momentum
    hyper = np.array([[0.1, 0.9, 0.0, 0.01, 0.0], [0.05, 0.0, 0.0, 0.0, 0.0]])

    def run(device):
        arrays = [[a.copy() for a in x] for x in (params, grads, buffers)]
        if device == "cuda":
            arrays = [_to_device(x) for x in arrays]
        ps, gs, bs = arrays
        table = np.zeros((3, _optim.TABLE_COLUMNS), np.int64)
        table[:, _optim.P_ADDR] = [address(p) for p in ps]
        table[:, _optim.P_FMT] = BF16_CODE  # gradients: float32 (code 0)
        table[:, _optim.G_ADDR] = [address(g) for g in gs]
        table[:, _optim.S1_ADDR] = [address(b) if g == 0 else 0 for b, g in zip(bs, groups)]
        table[:, _optim.GROUP] = groups
        table[:, _optim.NOISE] = [0, 11, 18]
        steps = np.zeros(3, np.uint32)
        flags = [np.float32([1.0]).view(np.uint32), np.zeros(1, np.uint32)]
        stream = None
        if device == "cuda":
            steps, flags, stream = to_cuda(steps), _to_device(flags), cuda.default_stream()
        mode = _optim.MODES["stochastic"]
        fused = _optim.FusedStep(_optim.SGD, mode, 0, table, sizes, steps, device, stream)
        fused.set_hyper(hyper)
        for _ in range(2):
            fused.run(*flags, 5, 6)
        if device == "cuda":
            ps, bs = ([a.copy_to_host() for a in x] for x in (ps, bs))
        return ps + bs

    assert _same_bits(run("cuda"), run("cpu"))


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_stream_starts_pieces_equal_the_whole(opt):
    """A tensor updated in pieces (a shard's contiguous runs), each piece's ``stream_starts``
    the tensor's start plus its first flat index, gets the bits of the whole-tensor step; the
    default starts are the prefix sums of the sizes."""
    rng = np.random.default_rng(4)
    shapes = [(6, 5), (64,)]
    params = [rng.standard_normal(s).astype(np.float32).astype(ml_dtypes.bfloat16) for s in shapes]
    grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]

    def step(ps, gs, **kw):
        states = [np.zeros(p.shape, np.float32) for p in ps]
        if opt == "adamw":
            v = [np.zeros(p.shape, np.float32) for p in ps]
            srround.adamw_step(ps, gs, states, v, lr=1e-2, step=3, seed=7, **kw)
        else:
            srround.sgd_step(ps, gs, states, lr=1e-2, momentum=0.9, step=3, seed=7, **kw)

    whole = [p.copy() for p in params]
    step(whole, grads)
    flat, rest = params[0].copy().reshape(-1), params[1].copy()
    # the second leaf first, then the runs of the first in reverse (not the prefix sums)
    runs = [(r * 5 + a, r * 5 + b) for r in range(6) for a, b in ((0, 2), (2, 5))][::-1]
    pieces = [rest] + [flat[a:b] for a, b in runs]
    g_pieces = [grads[1]] + [grads[0].reshape(-1)[a:b] for a, b in runs]
    step(pieces, g_pieces, stream_starts=[30] + [a for a, _ in runs])
    for got, expected in zip((flat.reshape(6, 5), rest), whole):
        np.testing.assert_array_equal(got.view(np.uint16), expected.view(np.uint16))
    moved = [p.copy() for p in params]
    step(moved, grads, stream_starts=[0, 31])  # another start: other bits
    assert not np.array_equal(moved[1].view(np.uint16), whole[1].view(np.uint16))


def test_stream_starts_errors():
    p, g = np.ones(4, ml_dtypes.bfloat16), np.ones(4, np.float32)
    m, v = np.zeros(4, np.float32), np.zeros(4, np.float32)
    kw = dict(lr=1e-3, step=1, seed=0)
    with pytest.raises(ValueError, match="stream_starts: expected 1 arrays"):
        srround.adamw_step([p], [g], [m], [v], stream_starts=[0, 4], **kw)
    with pytest.raises(ValueError, match=r"stream_starts\[0\]"):
        srround.adamw_step([p], [g], [m], [v], stream_starts=[-1], **kw)
    with pytest.raises(TypeError, match=r"stream_starts\[0\]"):
        srround.adamw_step([p], [g], [m], [v], stream_starts=[1.5], **kw)
    with pytest.raises(ValueError, match=r"^stream_starts\[0\]: 17179869182 \+ 4 elements"):
        srround.adamw_step([p], [g], [m], [v], stream_starts=[2**34 - 2], **kw)  # was 'params:'
    assert np.array_equal(p, np.ones(4, ml_dtypes.bfloat16))  # nothing written
    # overlapping ranges would share (correlated) noise: before, taken silently
    ps, gs = [p, p.copy()], [g, g.copy()]
    ms, vs = [m, m.copy()], [v, v.copy()]
    with pytest.raises(ValueError, match=r"^stream_starts\[1\]: params\[1\]'s noise \[2, 6\)"):
        srround.adamw_step(ps, gs, ms, vs, stream_starts=[0, 2], **kw)
    with pytest.raises(ValueError, match=r"^stream_starts\[0\]: .* overlaps params\[1\]'s"):
        srround.sgd_step(ps, gs, ms, stream_starts=[5, 2], momentum=0.9, **kw)
    assert all(np.array_equal(q, np.ones(4, ml_dtypes.bfloat16)) for q in ps)
    empty = [np.ones(0, ml_dtypes.bfloat16), p]  # an empty tensor draws nothing
    srround.sgd_step(empty, [np.ones(0, np.float32), g], stream_starts=[1, 0], **kw)


def test_stream_starts_as_a_numpy_array():
    """The starts as NumPy ints (np.cumsum's result) are the list of them; before, the array
    was taken as one entry: 'stream_starts: expected 2 arrays (one per parameter), got 1'."""
    sizes = [3, 5]
    steps = []
    for starts in ([7, 10], np.cumsum([7, 3])):
        params = [np.full(n, 0.3, ml_dtypes.bfloat16) for n in sizes]
        grads = [np.full(n, 1e-3, np.float32) for n in sizes]
        srround.sgd_step(params, grads, lr=0.1, step=1, seed=4, stream_starts=starts)
        steps.append([p.view(np.uint16).tolist() for p in params])
    assert steps[0] == steps[1]
    with pytest.raises(TypeError, match=r"^stream_starts\[0\]: expected an int, got 7.0"):
        srround.sgd_step(params, grads, lr=0.1, step=1, stream_starts=np.float32([7, 10]))


def test_stream_starts_not_with_fp8_states():
    p, g = np.ones(4, ml_dtypes.bfloat16), np.ones(4, np.float32)
    m, v = np.zeros(4, ml_dtypes.float8_e4m3fn), np.zeros(4, ml_dtypes.float8_e4m3fn)
    scales = [np.zeros(1, np.float32)], [np.zeros(1, np.float32)]
    with pytest.raises(ValueError, match="stream_starts: not with fp8 states"):
        srround.adamw_step(
            [p],
            [g],
            [m],
            [v],
            lr=1e-3,
            step=1,
            seed=0,
            stream_starts=[0],
            exp_avg_scales=scales[0],
            exp_avg_sq_scales=scales[1],
        )


def test_cuda_noise_at_unaligned_stream_starts_matches_cpu(small_cuda_launch):
    """The CUDA step's noise (a Threefry block per element and stream, four elements' lanes in
    a block): bf16 params and states (three streams), tensors of odd sizes, and noise starts
    not aligned with the elements' places (``stream_starts``): the CPU's bits."""
    rng = np.random.default_rng(9)
    sizes = (7, 13, 5, 9)
    starts = [5, 102, 19, 41]  # disjoint ranges, none aligned to a block of four

    def run(put, get):
        ps = [put(rng_p.copy()) for rng_p in params]
        gs = [put(g) for g in grads]
        ms = [put(np.zeros(n, ml_dtypes.bfloat16)) for n in sizes]
        vs = [put(np.zeros(n, ml_dtypes.bfloat16)) for n in sizes]
        for t in (1, 2):
            srround.adamw_step(ps, gs, ms, vs, lr=1e-2, step=t, seed=3, stream_starts=starts)
        return [get(a).view(np.uint16) for a in ps + ms + vs]

    params = [rng.standard_normal(n).astype(np.float32).astype(ml_dtypes.bfloat16) for n in sizes]
    grads = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    cpu = run(lambda a: a, lambda a: a)
    cuda = run(to_cuda, lambda a: a.copy_to_host())
    for a, b in zip(cuda, cpu):
        np.testing.assert_array_equal(a, b)


def test_step_reuse_keeps_the_table_while_the_buffers_stay(monkeypatch):
    """``StepReuse`` (the JAX host step's): a call on the last call's buffers skips the planning
    and gives the bits of a plain call; other buffers, another step count, lr, seed or scale
    are honoured; a rejected argument still raises on a reused table."""
    from srround import _api, _plan

    planned = []
    plan_step = _plan.plan_step
    monkeypatch.setattr(_plan, "plan_step", lambda *a, **k: planned.append(1) or plan_step(*a, **k))

    def run(problems, context):
        calls = [
            (1, 1e-3, 5, 1.0, 0),
            (2, 2e-3, 6, 0.5, 0),
            (3, 2e-3, 6, 0.5, 1),
            (4, 1e-3, 7, 1.0, 1),
        ]
        for t, lr, seed, inv_scale, which in calls:
            p, g, m, v = problems[which]
            with context():
                srround.adamw_step(p, g, m, v, lr=lr, step=t, seed=seed, inv_scale=inv_scale)
        return problems

    def fresh():
        first = _problem()
        second = [list(first[0]), _problem(seed=1)[1], list(first[2]), list(first[3])]
        return [first, second]  # the same params and states, other gradients from step 3

    expected = run(fresh(), contextlib.nullcontext)
    planned.clear()
    reuse = _api.StepReuse()
    got = run(fresh(), reuse.active)
    assert len(planned) == 2  # steps 1 and 3 (new gradient buffers); 2 and 4 reuse
    for e, r in zip(expected, got):
        for a, b in zip(e, r):
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))
    p, g, m, v = got[1]
    with reuse.active(), pytest.raises(ValueError, match="inv_scale"):
        srround.adamw_step(p, g, m, v, lr=1e-3, step=5, seed=5, inv_scale=-1.0)
    with reuse.active(), pytest.raises(ValueError, match="step"):
        srround.adamw_step(p, g, m, v, lr=1e-3, step=0, seed=5)


@pytest.mark.parametrize(
    "device, rows, cols, split",
    [
        ("cpu", 5, 3000, 1700),  # runs cross the CPU's 4096-element work items
        pytest.param("cuda", 3, 7, 3, marks=pytest.mark.cuda),
    ],
)
def test_noise_runs_give_a_column_piece_the_bits_of_the_whole_tensor(
    device, rows, cols, split, small_cuda_launch
):
    """A table row whose noise is runs (``NOISE_RUN``, ``NOISE_SKIP``: a tensor-parallel
    column shard, each of its rows a run of the full tensor's stream): each column piece of a
    matrix, stepped next to a plain tensor as one rank of two would, gets the bits the whole
    matrix gets, states included (bf16 states round with their own streams); before, a table
    row's noise was one range."""
    from srround import _dispatch, _optim, _plan
    from srround._rng import split_seed

    rng = np.random.default_rng(3)
    whole = [(rng.standard_normal((rows, cols)) * s).astype(BF16) for s in (0.02, 0.01, 1e-3)]
    whole.append((rng.random((rows, cols)) * 1e-5).astype(BF16))
    extra = [(rng.standard_normal(11) * s).astype(BF16) for s in (0.02, 0.01, 1e-3, 1e-5)]
    expected = [a.copy() for a in whole], [a.copy() for a in extra]
    hyper = dict(HYPER, rounding="stochastic", seed=99)
    for step in (1, 2):  # the matrix at stream start 0, the plain tensor's range after it
        for arrays, start in zip(expected, (0, rows * cols)):
            flat = ([a.reshape(-1)] for a in arrays)
            srround.adamw_step(*flat, step=step, stream_starts=[start], **hyper)
    on = to_cuda if device == "cuda" else (lambda a: a)
    stream = None
    if device == "cuda":
        from numba import cuda

        stream = cuda.default_stream()
    lr, (b1, b2), eps, wd = HYPER["lr"], HYPER["betas"], HYPER["eps"], HYPER["weight_decay"]
    columns = (slice(0, split), slice(split, cols))
    for piece, (run, skip) in zip(columns, [(split, cols - split), (cols - split, split)]):
        host = [[np.ascontiguousarray(a[:, piece]).reshape(-1) for a in whole], extra]
        buffers = [[on(a.copy()) for a in tensor] for tensor in host]
        params, grads, m, v = (list(column) for column in zip(*buffers))
        plan = _plan.plan_step(
            _dispatch.adapter_for(params=params[0]),
            "stochastic",
            params,
            grads,
            (("states1", m), ("states2", v)),
            None,
            noise=[piece.start, rows * cols],
            runs=[(run, skip), (0, 0)],
        )
        steps = on(np.zeros(2, np.uint32))
        kind, mode = _optim.ADAMW, _optim.STOCHASTIC
        fused = _optim.FusedStep(
            kind, mode, plan.state_fmt, plan.table, plan.sizes, steps, device, stream
        )
        fused.set_hyper(np.array([[lr, b1, b2, eps, wd]], np.float64))
        for _ in (1, 2):
            one = on(np.array([1.0], np.float32).view(np.uint32))
            fused.run(one, on(np.zeros(1, np.uint32)), *split_seed(99))
        got = [
            [np.asarray(b.copy_to_host() if device == "cuda" else b) for b in tensor]
            for tensor in buffers
        ]
        for i in (0, 2, 3):  # params, exp_avg, exp_avg_sq (the gradient is read only)
            want = expected[0][i][:, piece].reshape(-1)
            assert np.array_equal(got[0][i].view(np.uint16), want.view(np.uint16))
            assert np.array_equal(got[1][i].view(np.uint16), expected[1][i].view(np.uint16))
        assert not np.array_equal(got[0][0], host[0][0])  # the steps moved the parameters
