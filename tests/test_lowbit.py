"""fp8 (e4m3fn, e5m2) and fp4 (e2m1fn, one value per byte): elementwise rounding against
ml_dtypes and torch, bit for bit, and stochastic rounding against a NumPy reference."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import srround

from .reference import neighbours, random16

LOWBIT = ["float8_e4m3fn", "float8_e5m2", "float4_e2m1fn"]
FMT = {name: srround.FORMATS[name] for name in LOWBIT}
ALL_PATTERNS = {name: np.arange(1 << FMT[name].bits, dtype=np.uint8) for name in LOWBIT}


def _inputs():
    """Every bf16 pattern with low halves {0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF}: every fp8/fp4
    grid value, its fp32 neighbours, every midpoint (a tie) and both sides of it, the overflow
    thresholds, fp32 subnormals, infinities and NaNs with payloads and both signs."""
    high = np.arange(1 << 16, dtype=np.uint32) << 16
    low = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)
    return (high[:, None] | low[None, :]).reshape(-1).view(np.float32)


X = _inputs()


def _u8(a):
    return np.asarray(a).view(np.uint8)


def _grid(name):
    """The finite values of a format, as float32 (every pattern, NaNs dropped)."""
    values = ALL_PATTERNS[name].view(FMT[name].numpy_dtype).astype(np.float32)
    return values[np.isfinite(values)]


# -- round to nearest ------------------------------------------------------------------------


@pytest.mark.parametrize("name", LOWBIT)
def test_round_nearest_is_ml_dtypes_cast(name):
    """overflow="inf" (the default) is ml_dtypes' cast, bit for bit, on every input class -
    NaN included for fp8; fp4 has no NaN: ml_dtypes writes a zero of the opposite sign for a
    NaN, srround keeps the NaN's sign (documented)."""
    got = _u8(srround.round_nearest(X, dtype=name))
    with np.errstate(invalid="ignore", over="ignore"):
        want = _u8(X.astype(FMT[name].numpy_dtype))
    keep = ~np.isnan(X) if name == "float4_e2m1fn" else slice(None)
    np.testing.assert_array_equal(got[keep], want[keep])
    if name == "float4_e2m1fn":
        nan = np.isnan(X)
        assert set(got[nan].tolist()) == {0, 8}
        np.testing.assert_array_equal(got[nan] >> 3, np.signbit(X[nan]))


def test_round_nearest_is_torch_cast():
    """torch's casts in torch's mode: e5m2 does not saturate; e4m3fn saturates (inf included)
    in torch 2.13, while torch 2.11 casts an e4m3fn overflow to NaN (srround's "inf" mode): the
    mode is read off torch's cast of 1e30. NaN: the same pattern for e4m3fn; torch writes
    0x7F/0xFF for an e5m2 NaN, srround ml_dtypes' 0x7E."""
    torch = pytest.importorskip("torch")
    t = torch.from_numpy(X)
    overflow = torch.tensor([1e30]).to(torch.float8_e4m3fn).view(torch.uint8).item()
    e4m3_mode = {0x7E: "saturate", 0x7F: "inf"}[overflow]
    for name, dtype, mode in (
        ("float8_e4m3fn", torch.float8_e4m3fn, e4m3_mode),
        ("float8_e5m2", torch.float8_e5m2, "inf"),
    ):
        got = srround.round_nearest(t, dtype=name, overflow=mode)
        assert got.dtype == dtype
        want = t.to(dtype)
        g, w = got.view(torch.uint8).numpy(), want.view(torch.uint8).numpy()
        nan = np.isnan(X)
        np.testing.assert_array_equal(g[~nan], w[~nan])
        assert np.isnan(got[torch.from_numpy(nan)].float().numpy()).all()
        np.testing.assert_array_equal(g[nan] >> 7, w[nan] >> 7)


@pytest.mark.parametrize("name", LOWBIT)
def test_overflow_modes(name):
    """What inf, NaN and a finite overflow become in each overflow mode (the table of
    srround/_formats.py)."""
    fmt = FMT[name]
    x = np.float32([np.inf, -np.inf, np.nan, -np.nan, 1e30, -1e30])
    top = 1 << (fmt.bits - 1)  # the sign bit
    maximum = _u8(np.float32([fmt.max_finite]).astype(fmt.numpy_dtype))[0]
    inf_mode = _u8(srround.round_nearest(x, dtype=name))
    sat_mode = _u8(srround.round_nearest(x, dtype=name, overflow="saturate"))
    if name == "float8_e5m2":
        assert inf_mode.tolist() == [0x7C, 0xFC, 0x7E, 0xFE, 0x7C, 0xFC]
        assert sat_mode.tolist() == [0x7C, 0xFC, 0x7E, 0xFE, 0x7B, 0xFB]
    elif name == "float8_e4m3fn":
        assert inf_mode.tolist() == [0x7F, 0xFF, 0x7F, 0xFF, 0x7F, 0xFF]
        assert sat_mode.tolist() == [0x7E, 0xFE, 0x7F, 0xFF, 0x7E, 0xFE]
    else:
        assert inf_mode.tolist() == sat_mode.tolist() == [7, 15, 0, 8, 7, 15]
    assert maximum | top in sat_mode


# -- widening ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", LOWBIT)
def test_to_float32_every_pattern(name):
    """Every pattern widens exactly: ml_dtypes' values, NaN payloads kept (torch's rule)."""
    fmt = FMT[name]
    patterns = ALL_PATTERNS[name]
    got = srround.to_float32(patterns.view(fmt.numpy_dtype))
    raw = srround.to_float32(patterns, dtype=name)
    np.testing.assert_array_equal(got.view(np.uint32), raw.view(np.uint32))
    want = patterns.view(fmt.numpy_dtype).astype(np.float32)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    finite = ~np.isnan(want)
    np.testing.assert_array_equal(got.view(np.uint32)[finite], want.view(np.uint32)[finite])
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
    # round trip: every pattern but NaN comes back unchanged
    back = _u8(srround.round_nearest(got, dtype=name))
    np.testing.assert_array_equal(back[finite], patterns[finite])


def test_to_float32_is_torch_widening():
    """Bit for bit torch's widening, NaN payloads included, except e5m2's signalling NaNs
    (0x7D, 0xFD), which torch quiets and srround widens with their payload as it is."""
    torch = pytest.importorskip("torch")
    for name, dtype in (("float8_e4m3fn", torch.float8_e4m3fn), ("float8_e5m2", torch.float8_e5m2)):
        t = torch.arange(256, dtype=torch.uint8).view(dtype)
        got = srround.to_float32(t)
        assert got.dtype == torch.float32
        g, w = got.view(torch.int32).numpy(), t.float().view(torch.int32).numpy()
        signalling = [0x7D, 0xFD] if name == "float8_e5m2" else []
        keep = np.setdiff1d(np.arange(256), signalling)
        np.testing.assert_array_equal(g[keep], w[keep])
        np.testing.assert_array_equal(g[signalling] | 0x400000, w[signalling])


# -- stochastic rounding ----------------------------------------------------------------------


def _reference_sr(x, name, seed, offset=0, saturate=False):
    """Reference SR (reference.py's rule: up iff bits16 < floor(frac * 2**16)) with the
    format's overflow rule, as float32 values (NaN for e4m3fn's overflow)."""
    fmt = FMT[name]
    down, up, frac = neighbours(x, fmt)
    go_up = random16(seed, offset, x.size) < np.floor(frac * 65536.0)
    value = np.where(go_up, up, down)
    over = np.abs(value) > fmt.max_finite
    if saturate or name == "float4_e2m1fn":
        replacement = np.copysign(fmt.max_finite, value)
    elif name == "float8_e4m3fn":
        replacement = np.full_like(value, np.nan)
    else:
        replacement = np.copysign(np.inf, value)
    value = np.where(over, replacement, value)
    return np.where(value == 0, np.copysign(0.0, x), value).astype(np.float32)


def _same(got_f32, want_f32):
    g, w = np.asarray(got_f32, np.float32), np.asarray(want_f32, np.float32)
    np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
    ok = ~np.isnan(w)
    np.testing.assert_array_equal(g.view(np.uint32)[ok], w.view(np.uint32)[ok])


@pytest.mark.parametrize("saturate", [False, True])
@pytest.mark.parametrize("name", LOWBIT)
def test_stochastic_round_matches_reference(name, saturate):
    """Bit for bit the reference SR, with the documented random stream: normals, subnormals,
    values past the largest finite one, ties, fp32 subnormals (a sample of the input set)."""
    rng = np.random.default_rng(1)
    fmt = FMT[name]
    x = X[np.isfinite(X)]
    x = x[np.abs(x) < 4 * fmt.max_finite]
    x = rng.choice(x, 3000, replace=False).astype(np.float32)
    overflow = "saturate" if saturate else "inf"
    got = srround.stochastic_round(x, dtype=name, seed=77, offset=5, overflow=overflow)
    _same(got.astype(np.float32), _reference_sr(x, name, 77, 5, saturate))


@pytest.mark.parametrize("name", LOWBIT)
def test_stochastic_round_neighbours_and_specials(name):
    """Over every input class: the result is one of the two neighbours (NaN, inf as
    round_nearest does); grid values come back unchanged."""
    fmt = FMT[name]
    got = srround.stochastic_round(X, dtype=name, seed=3).astype(np.float32)
    nearest = srround.round_nearest(X, dtype=name).astype(np.float32)
    special = ~np.isfinite(X)
    _same(got[special], nearest[special])
    finite = ~special & (np.abs(X) <= fmt.max_finite)
    down, up, _ = neighbours(X[finite], fmt)
    value = got[finite].astype(np.float64)
    assert np.all((value == down) | (value == up))
    grid = _grid(name)
    np.testing.assert_array_equal(
        _u8(srround.stochastic_round(grid, dtype=name, seed=9)), _u8(grid.astype(fmt.numpy_dtype))
    )


def _z_scores(name, xs, draws):
    """z-score of the mean of ``draws`` stochastic roundings of each x against x."""
    fmt = FMT[name]
    scores = []
    for k, x in enumerate(xs):
        copies = np.full(draws, x, np.float32)
        y = srround.stochastic_round(copies, dtype=name, seed=1000 + k).astype(np.float64)
        down, up, frac = (float(v[0]) for v in neighbours(np.float32([x]), fmt))
        spread = abs(up - down) * np.sqrt(frac * (1 - frac)) / np.sqrt(draws)
        scores.append((y.mean() - float(x)) / spread)
    return np.array(scores)


@pytest.mark.parametrize("name", LOWBIT)
def test_stochastic_round_is_unbiased(name):
    """E[SR(x)] = x (z-test): normal and subnormal values, both signs, fractions whose bits go
    below the 16 random bits (their probability is floored to a multiple of 2**-16: a bias below
    2**-16 of a quantum, far under what 40000 draws can see)."""
    fmt = FMT[name]
    sub = fmt.smallest_subnormal
    xs = [
        np.float32(1.0 + 0.3 * 2.0**-fmt.mantissa_bits),
        np.float32(-(1.0 + 0.7 * 2.0**-fmt.mantissa_bits)),
        np.float32(0.37 * sub),  # below the smallest subnormal
        np.float32(-1.61 * sub),  # between subnormals
        np.float32(fmt.max_finite * 0.9 + 0.1),
        np.float32(1.0 + 2.0**-fmt.mantissa_bits / 3.0),
    ]
    z = _z_scores(name, xs, 40000)
    assert np.all(np.abs(z) < 5), z


def test_probability_resolution_of_16_bits():
    """P(up) is exact to 2**-16: a fraction of 2**-17 of a quantum never rounds up, one of
    2**-16 does for one random value in 2**16 (e4m3fn drops 20 bits of an fp32 in [1, 2))."""
    x = np.full(1 << 18, 1.0 + 2.0**-3 * 2.0**-17, np.float32)
    assert (_u8(srround.stochastic_round(x, dtype="float8_e4m3fn", seed=5)) == 0x38).all()
    x = np.full(1 << 18, 1.0 + 2.0**-3 * 2.0**-16, np.float32)
    ups = int((_u8(srround.stochastic_round(x, dtype="float8_e4m3fn", seed=5)) == 0x39).sum())
    assert 0 < ups < 16


@pytest.mark.parametrize("name", LOWBIT)
def test_stochastic_add(name):
    """w <- SR(w + u) in place: the reference SR of the fp32 sum rounded once (the float64 sum
    of these inputs is exact), on ml_dtypes arrays and raw uint8 patterns alike."""
    fmt = FMT[name]
    rng = np.random.default_rng(2)
    grid = _grid(name)
    w = rng.choice(grid, 2000).astype(fmt.numpy_dtype)
    u = (rng.standard_normal(2000) * fmt.max_finite / 64).astype(np.float32)
    total = (w.astype(np.float64) + u.astype(np.float64)).astype(np.float32)
    want = _reference_sr(total, name, 11, 3)
    raw = _u8(w).copy()
    out = srround.stochastic_add(w, u, seed=11, offset=3)
    assert out is w
    _same(w.astype(np.float32), want)
    srround.stochastic_add(raw, u, seed=11, offset=3, dtype=name)
    np.testing.assert_array_equal(raw, _u8(w))


# -- backends ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", LOWBIT)
def test_cuda_bits_equal_cpu_bits(name, small_cuda_launch):
    """CUDA kernels (the simulator in CI) give the CPU kernels' bits, offsets not multiples of 4
    and lengths across several grid-stride rounds included."""
    from numba import cuda

    if not cuda.is_available():
        pytest.skip("no CUDA device and not simulated")
    fmt = FMT[name]
    rng = np.random.default_rng(4)
    x = rng.choice(X, 203).astype(np.float32)
    for overflow in ("inf", "saturate"):
        cpu = _u8(srround.stochastic_round(x, dtype=name, seed=8, offset=6, overflow=overflow))
        dev = srround.stochastic_round(
            cuda.to_device(x), dtype=name, seed=8, offset=6, overflow=overflow
        )
        np.testing.assert_array_equal(_u8(dev.copy_to_host()), cpu)
        cpu = _u8(srround.round_nearest(x, dtype=name, overflow=overflow))
        dev = srround.round_nearest(cuda.to_device(x), dtype=name, overflow=overflow)
        np.testing.assert_array_equal(_u8(dev.copy_to_host()), cpu)
    h = ALL_PATTERNS[name]
    cpu = srround.to_float32(h, dtype=name)
    dev = srround.to_float32(cuda.to_device(h), dtype=name).copy_to_host()
    np.testing.assert_array_equal(dev.view(np.uint32), cpu.view(np.uint32))
    w = rng.choice(_grid(name), 203).astype(fmt.numpy_dtype)
    u = (rng.standard_normal(203) * fmt.max_finite / 16).astype(np.float32)
    w_dev = cuda.to_device(_u8(w).copy())
    srround.stochastic_add(w_dev, cuda.to_device(u), alpha=0.5, seed=2, offset=1, dtype=name)
    srround.stochastic_add(w, u, alpha=0.5, seed=2, offset=1)
    np.testing.assert_array_equal(w_dev.copy_to_host(), _u8(w))


def test_torch_dtypes_and_bits():
    """torch: results in torch.float8_e4m3fn / float8_e5m2, fp4 as uint8 bit patterns; the
    bits equal the NumPy path's; in-place stochastic_add on a float8 tensor."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    x = rng.standard_normal(1000).astype(np.float32) * 30
    for name, dtype in (
        ("float8_e4m3fn", torch.float8_e4m3fn),
        ("float8_e5m2", torch.float8_e5m2),
        ("float4_e2m1fn", torch.uint8),
    ):
        got = srround.stochastic_round(torch.from_numpy(x), dtype=name, seed=6)
        assert got.dtype == dtype
        want = _u8(srround.stochastic_round(x, dtype=name, seed=6))
        np.testing.assert_array_equal(got.view(torch.uint8).numpy(), want)
        wide = srround.to_float32(got, dtype=name if dtype == torch.uint8 else None)
        np.testing.assert_array_equal(wide.numpy(), srround.to_float32(want, dtype=name))
        w = got.clone()
        u = torch.from_numpy(x / 10)
        srround.stochastic_add(w, u, seed=1, dtype=name if dtype == torch.uint8 else None)
        w_np = want.copy()
        srround.stochastic_add(w_np, x / 10, seed=1, dtype=name)
        np.testing.assert_array_equal(w.view(torch.uint8).numpy(), w_np)


def test_bad_dtypes_are_named():
    x = np.ones(4, np.float32)
    with pytest.raises(TypeError, match="y: expected a narrow float"):
        srround.to_float32(np.zeros(4, np.uint8))
    with pytest.raises(TypeError, match=r"w: expected a float8_e4m3fn array \(or uint8 bit"):
        srround.stochastic_add(np.zeros(4, np.uint16), x, dtype="float8_e4m3fn")
    with pytest.raises(TypeError, match="does not match"):
        srround.stochastic_add(np.zeros(4, ml_dtypes.float8_e5m2), x, dtype="float8_e4m3fn")
    with pytest.raises(ValueError, match="dtype: unsupported"):
        srround.stochastic_round(x, dtype="float8_e3m4")


# -- block-scaled formats ---------------------------------------------------------------------

BLOCK_FORMATS = ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "nvfp4"]


def _block_inputs(rows=48, cols=64, seed=0):
    """Rows of different magnitudes (1e-30 .. 1e30, fp32 subnormals), zero blocks, blocks whose
    maximum is a power of two or just above the clipping threshold, and special values."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)) * 10.0 ** rng.uniform(-30, 30, (rows, 1))
    x[1] = 0.0
    x[2, :32] = 2.0**-140  # fp32 subnormals
    x[3, 5] = 2.0**7
    x[4, 7] = 1.8 * 2.0**3  # above 1.75 * 2**k: FLOOR clips it (fp8)
    x[5, 9] = 7.0  # fp4: above 6 * 2**0
    x[6, 3] = np.inf
    x[7, 20] = -np.inf
    x[8, 2] = np.nan
    x[9] = rng.integers(-8, 8, cols) * 0.5  # on the fp4 grid
    return x.astype(np.float32)


def _torchao_reference(torch, x, name):
    """(data bits, scale bits, tensor scale) of torchao on torch tensor ``x``."""
    if name == "nvfp4":
        from torchao.prototype.mx_formats.nvfp4_tensor import (
            nvfp4_quantize,
            per_tensor_amax_to_scale,
        )

        ts = per_tensor_amax_to_scale(torch.max(torch.abs(x)))
        scales, data = nvfp4_quantize(x, 16, per_tensor_scale=ts)
        return data.view(torch.uint8), scales.view(torch.uint8), ts
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    dtypes = {
        "mxfp8_e4m3": torch.float8_e4m3fn,
        "mxfp8_e5m2": torch.float8_e5m2,
        "mxfp4": torch.float4_e2m1fn_x2,
    }
    scales, data = to_mx(x, dtypes[name], 32)
    return data.view(torch.uint8), scales.view(torch.uint8), None


@pytest.mark.parametrize("name", BLOCK_FORMATS)
def test_nearest_blocks_are_torchao_bits(name):
    """rounding="nearest" (FLOOR scales for MX) gives torchao's data and scale bits, special
    values and clipped block maxima included; except the elements of MX blocks of scale
    2**-127, which torchao divides by 2**-126 (``test_mx_smallest_scale_round_trips``)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    x = _block_inputs()
    if name == "nvfp4":  # one tensor scale: the specials would make every block NaN
        x = np.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
        with np.errstate(invalid="ignore"):  # all-zero rows: 0/0, zeroed next
            x = x / np.abs(x).max(axis=1, keepdims=True) * np.float32(3.0)
        x = np.nan_to_num(x).astype(np.float32)
        x[5, 9] = 1e4
    t = torch.from_numpy(x)
    data, scales, ts = _torchao_reference(torch, t, name)
    q = srround.quantize_blocks(t, name, rounding="nearest")
    np.testing.assert_array_equal(q.scales.view(torch.uint8).numpy(), scales.numpy())
    # MX blocks of scale 2**-127 (code 0; NVFP4's e4m3 scales are never 0): torchao's x / 2**-126
    same = np.repeat(scales.numpy() != 0, data.shape[1] // scales.shape[1], axis=1)
    np.testing.assert_array_equal(q.data.view(torch.uint8).numpy()[same], data.numpy()[same])
    if ts is not None:
        assert q.tensor_scale.item() == ts.item()
    # NumPy gives the same bits
    qn = srround.quantize_blocks(x, name, rounding="nearest")
    np.testing.assert_array_equal(_u8(qn.data), q.data.view(torch.uint8).numpy())
    np.testing.assert_array_equal(_u8(qn.scales), scales.numpy())


@pytest.mark.parametrize("name", ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp4"])
def test_ceil_blocks_are_torchao_rceil_bits(name):
    """scale="ceil" with rounding="nearest" is torchao's ScaleCalculationMode.RCEIL (the least
    power of two that clips nothing) on finite blocks of normal scale; torchao's CEIL is
    another rule (up on every block whose maximum is not a power of two)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    x = np.nan_to_num(_block_inputs(), posinf=0.0, neginf=0.0)
    x[2] = 0.0  # (scale 2**-127: torchao divides by 2**-126, test_mx_smallest_scale_round_trips)
    dtype = {"mxfp8_e4m3": torch.float8_e4m3fn, "mxfp8_e5m2": torch.float8_e5m2}
    scales, data = to_mx(
        torch.from_numpy(x), dtype.get(name, torch.float4_e2m1fn_x2), 32, ScaleCalculationMode.RCEIL
    )
    q = srround.quantize_blocks(x, name, rounding="nearest", scale="ceil")
    np.testing.assert_array_equal(_u8(q.scales), scales.view(torch.uint8).numpy())
    np.testing.assert_array_equal(_u8(q.data), data.view(torch.uint8).numpy())


@pytest.mark.parametrize("name", BLOCK_FORMATS)
def test_blocks_cuda_bits_equal_cpu_bits(name, small_cuda_launch):
    """The CUDA kernels (simulator in CI) give the CPU bits, both roundings, axis 0 included."""
    from numba import cuda

    if not cuda.is_available():
        pytest.skip("no CUDA device and not simulated")
    x = _block_inputs(rows=10, cols=32, seed=3)
    if name == "nvfp4":
        x = np.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0)
    for rounding, axis in (("nearest", -1), ("stochastic", -1), ("stochastic", 0)):
        xs = x if axis == -1 else np.ascontiguousarray(x.T)
        cpu = srround.quantize_blocks(xs, name, rounding=rounding, seed=4, offset=3, axis=axis)
        dev = srround.quantize_blocks(
            cuda.to_device(xs), name, rounding=rounding, seed=4, offset=3, axis=axis
        )
        np.testing.assert_array_equal(_u8(dev.data.copy_to_host()), _u8(cpu.data))
        np.testing.assert_array_equal(_u8(dev.scales.copy_to_host()), _u8(cpu.scales))
        if name == "nvfp4":
            np.testing.assert_array_equal(dev.tensor_scale.copy_to_host(), cpu.tensor_scale)
        back = srround.dequantize_blocks(dev).copy_to_host()
        want = srround.dequantize_blocks(cpu)
        np.testing.assert_array_equal(back.view(np.uint32), want.view(np.uint32))


def _sr_blocks(name, block_row, copies, scale, seed=0):
    """``copies`` stochastic quantizations of one block row (one call on the stacked rows:
    every element gets its own stream position), dequantized, as float64 [copies, len]."""
    x = np.tile(np.asarray(block_row, np.float32), (copies, 1))
    q = srround.quantize_blocks(x, name, seed=seed, scale=scale)
    return srround.dequantize_blocks(q).astype(np.float64)


def _block_row(name, rng):
    bf = srround._blocks.BLOCK_FORMATS[name]
    row = rng.standard_normal(bf.block) * 3.0
    row[0] = 1.9 * 2.0**2  # a block maximum that FLOOR clips (its significand exceeds 1.75)
    if name == "nvfp4":
        row[0] = 1.9 * 2.0**2
    return row.astype(np.float32)


@pytest.mark.parametrize("name", BLOCK_FORMATS)
def test_stochastic_blocks_are_unbiased(name):
    """E[dequantize(quantize(x))] = x for every element under the default (non-clipping) scale
    of rounding="stochastic" (z-test over 3000 draws); FLOOR scaling clips the block maximum:
    its mean lies below x (measured in the README)."""
    rng = np.random.default_rng(11)
    row = _block_row(name, rng)
    y = _sr_blocks(name, row, 3000, None)
    mean, std = y.mean(axis=0), y.std(axis=0)
    exact = std == 0
    np.testing.assert_array_equal(mean[exact], row[exact].astype(np.float64))
    z = (mean[~exact] - row[~exact]) / (std[~exact] / np.sqrt(y.shape[0]))
    assert np.all(np.abs(z) < 5), z
    if name != "nvfp4":  # NVFP4's e4m3 scale rounds to nearest: it clips only some maxima
        floor = _sr_blocks(name, row, 3000, "floor")
        assert floor[:, 0].max() < row[0]  # always clipped below the true value


def test_floor_clips_and_ceil_does_not():
    """nearest rounding: FLOOR (torchao's) maps 1.9 * 2**3 to the largest e4m3 element,
    1.75 * 2**3; CEIL takes the next scale and keeps it within one quantum."""
    x = np.zeros((1, 32), np.float32)
    x[0, 0] = 1.9 * 2.0**3
    floor = srround.quantize_blocks(x, "mxfp8_e4m3", rounding="nearest")
    ceil = srround.quantize_blocks(x, "mxfp8_e4m3", rounding="nearest", scale="ceil")
    assert srround.dequantize_blocks(floor)[0, 0] == 1.75 * 2.0**3
    assert srround.dequantize_blocks(ceil)[0, 0] == 1.875 * 2.0**3
    assert _u8(ceil.scales)[0, 0] == _u8(floor.scales)[0, 0] + 1


@pytest.mark.parametrize("name", BLOCK_FORMATS)
def test_blocks_layout_axis_and_stream(name):
    """Blocks along any axis (same bits as the transposed array's last axis, rounding to
    nearest); element i uses stream position offset + i (its row-major index in x); shapes
    of data (fp4: axis halved), scales and the dtypes."""
    bf = srround._blocks.BLOCK_FORMATS[name]
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 2 * bf.block, 5)).astype(np.float32)
    q = srround.quantize_blocks(x, name, rounding="nearest", axis=1)
    t = np.ascontiguousarray(np.moveaxis(x, 1, -1))
    r = srround.quantize_blocks(t, name, rounding="nearest")
    np.testing.assert_array_equal(_u8(q.scales), np.moveaxis(_u8(r.scales), -1, 1))
    assert q.data.shape == (3, bf.block if bf.packed else 2 * bf.block, 5)
    assert q.scales.shape == (3, 2, 5)
    assert q.axis == 1 and q.format == name
    assert q.scales.dtype == (
        np.dtype(ml_dtypes.float8_e4m3fn) if bf.two_level else np.dtype(ml_dtypes.float8_e8m0fnu)
    )
    np.testing.assert_array_equal(
        srround.dequantize_blocks(q), np.moveaxis(srround.dequantize_blocks(r), -1, 1)
    )
    if name == "nvfp4":
        return  # the tensor scale of a part differs from the whole's
    y = rng.standard_normal((4, 2 * bf.block)).astype(np.float32)
    whole = srround.quantize_blocks(y, name, seed=5, offset=9)
    part = srround.quantize_blocks(y[2:], name, seed=5, offset=9 + 2 * y.shape[1])
    np.testing.assert_array_equal(_u8(whole.data)[2:], _u8(part.data))


def test_blocks_grid_values_round_trip():
    """Values on a block's grid come back exactly, whatever the rounding."""
    x = np.float32([[6, -4, 3, 2, 1.5, 1, 0.5, 0] * 4]) * np.float32(2.0**-5)
    for rounding in ("nearest", "stochastic"):
        q = srround.quantize_blocks(x, "mxfp4", rounding=rounding, scale="floor")
        np.testing.assert_array_equal(srround.dequantize_blocks(q), x)


def test_blocks_errors_name_the_argument():
    x = np.zeros((2, 48), np.float32)
    with pytest.raises(ValueError, match=r"x: the length 48 of axis 1 is not a multiple of .*32"):
        srround.quantize_blocks(x, "mxfp8_e4m3")
    with pytest.raises(ValueError, match="format: expected one of"):
        srround.quantize_blocks(x, "mxfp6")
    with pytest.raises(ValueError, match="rounding:"):
        srround.quantize_blocks(x, "nvfp4", rounding="up")
    with pytest.raises(ValueError, match="scale:"):
        srround.quantize_blocks(x, "nvfp4", scale="round")
    with pytest.raises(ValueError, match="axis:"):
        srround.quantize_blocks(x, "nvfp4", axis=2)
    with pytest.raises(TypeError, match="x: expected a float32"):
        srround.quantize_blocks(x.astype(np.float64), "nvfp4")
    with pytest.raises(TypeError, match="q: expected a QuantizedBlocks"):
        srround.dequantize_blocks((x, x, None))
    # a scalar names x on every framework (JAX said "axis: expected an int in [0, 0)")
    scalars = [np.float32(1.0)]
    for name in ("torch", "jax"):
        module = pytest.importorskip(name)
        scalars.append(module.tensor(1.0) if name == "torch" else module.numpy.float32(1.0))
    for scalar in scalars:
        with pytest.raises(ValueError, match="^x: expected an array with at least one dim"):
            srround.quantize_blocks(scalar, "mxfp4")


def test_nvfp4_all_zero_tensor():
    """An all-zero tensor gets tensor scale 1 and zero data (torchao's formula divides 0/0)."""
    q = srround.quantize_blocks(np.zeros((1, 16), np.float32), "nvfp4")
    assert q.tensor_scale[0] == 1.0
    assert not _u8(q.data).any()
    assert not srround.dequantize_blocks(q).any()


@pytest.mark.parametrize("impl", ["native", "callback"])
@pytest.mark.parametrize("name", LOWBIT)
def test_jax_bits_equal_numpy_bits(name, impl):
    """JAX (jax.lax path under jit, and the callback path): the NumPy path's bits; fp8 results
    in JAX's float8 dtypes, fp4 as uint8 patterns."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    from srround.adapters import jax as sj

    rng = np.random.default_rng(12)
    x = rng.choice(X, 1001).astype(np.float32)
    for overflow in ("inf", "saturate"):
        want = _u8(srround.stochastic_round(x, dtype=name, seed=3, offset=2, overflow=overflow))
        fn = jax.jit(
            lambda v: sj.stochastic_round(
                v, dtype=name, seed=3, offset=2, overflow=overflow, impl=impl
            )
        )
        got = fn(jnp.asarray(x))
        assert got.dtype == (
            jnp.uint8 if name == "float4_e2m1fn" else jnp.dtype(FMT[name].numpy_dtype)
        )
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), want)
        got = sj.round_nearest(jnp.asarray(x), dtype=name, overflow=overflow, impl=impl)
        want = _u8(srround.round_nearest(x, dtype=name, overflow=overflow))
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), want)
    h = ALL_PATTERNS[name]
    wide = sj.to_float32(jnp.asarray(h), dtype=name, impl=impl)
    np.testing.assert_array_equal(
        np.asarray(wide).view(np.uint32), srround.to_float32(h, dtype=name).view(np.uint32)
    )
    w = rng.choice(_grid(name), 1001).astype(FMT[name].numpy_dtype)
    u = (rng.standard_normal(1001) * FMT[name].max_finite / 16).astype(np.float32)
    new = sj.stochastic_add(
        jnp.asarray(_u8(w)), jnp.asarray(u), alpha=0.5, seed=2, dtype=name, impl=impl
    )
    srround.stochastic_add(w, u, alpha=0.5, seed=2)
    np.testing.assert_array_equal(np.asarray(new), _u8(w))


@pytest.mark.parametrize("name", ["mxfp8_e5m2", "nvfp4"])
def test_jax_blocks_equal_numpy_blocks(name):
    """JAX arrays (under jit, a key as the seed): the NumPy path's bits, dequantize included."""
    jax = pytest.importorskip("jax")
    key = jax.random.key(3)
    x = np.random.default_rng(6).standard_normal((4, 64)).astype(np.float32)
    seed = int(jax.random.key_data(key)[0]) | (int(jax.random.key_data(key)[1]) << 32)
    want = srround.quantize_blocks(x, name, seed=seed, offset=5, axis=1)
    q = jax.jit(lambda v, k: srround.quantize_blocks(v, name, seed=k, offset=5, axis=1))(
        jax.numpy.asarray(x), key
    )
    assert q.axis == 1 and q.format == name
    np.testing.assert_array_equal(np.asarray(q.data).view(np.uint8), _u8(want.data))
    np.testing.assert_array_equal(np.asarray(q.scales).view(np.uint8), _u8(want.scales))
    np.testing.assert_array_equal(
        np.asarray(srround.dequantize_blocks(q)), srround.dequantize_blocks(want)
    )


def test_jax_block_quantization_gradients():
    """As the README says: integer codes carry no gradient (JAX's rule), and the
    straight-through form it gives passes the gradient through unchanged (derivative 1)."""
    jax = pytest.importorskip("jax")
    lax = jax.lax
    x = jax.numpy.asarray(np.random.default_rng(2).standard_normal((2, 32)), np.float32)
    key = jax.random.key(1)

    def round_trip(v):
        return srround.dequantize_blocks(srround.quantize_blocks(v, "nvfp4", seed=key))

    plain = jax.grad(lambda v: round_trip(v).sum())(x)
    straight = jax.grad(lambda v: (v + lax.stop_gradient(round_trip(v) - v)).sum())(x)
    np.testing.assert_array_equal(np.asarray(plain), 0.0)
    np.testing.assert_array_equal(np.asarray(straight), 1.0)
    forward = x + lax.stop_gradient(round_trip(x) - x)
    np.testing.assert_allclose(np.asarray(forward), np.asarray(round_trip(x)), rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", BLOCK_FORMATS)
def test_jax_native_blocks_equal_callback_blocks(name):
    """The ``jax.lax`` block path (the default) gives the kernels' bits on the edge inputs
    (magnitudes 1e-30..1e30, fp32 subnormals, clipping maxima, inf, NaN), both roundings,
    axis 0 and -1, dequantize included."""
    jax = pytest.importorskip("jax")
    from srround.adapters import jax as sj

    x = _block_inputs(rows=10, cols=64, seed=2)
    if name == "nvfp4":  # one tensor scale: keep a NaN out of all but one case
        x = np.nan_to_num(x, nan=0.0, posinf=3.0, neginf=-3.0)
    for rounding, axis, xs in (
        ("nearest", -1, x),
        ("stochastic", -1, x),
        ("stochastic", 0, np.ascontiguousarray(x.T)),
    ):
        xj = jax.numpy.asarray(xs)
        got = sj.quantize_blocks(xj, name, rounding=rounding, seed=9, offset=7, axis=axis)
        want = sj.quantize_blocks(
            xj, name, rounding=rounding, seed=9, offset=7, axis=axis, impl="callback"
        )
        assert got.axis == want.axis
        for a, b in ((got.data, want.data), (got.scales, want.scales)):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(_u8(np.asarray(a)), _u8(np.asarray(b)))
        if name == "nvfp4":
            assert np.asarray(got.tensor_scale).tobytes() == np.asarray(want.tensor_scale).tobytes()
        back = np.asarray(sj.dequantize_blocks(got)).view(np.uint32)
        np.testing.assert_array_equal(
            back, np.asarray(sj.dequantize_blocks(want, impl="callback")).view(np.uint32)
        )


def test_jax_native_nvfp4_scales_on_random_tensors():
    """NVFP4's scales on the ``jax.lax`` path are the kernels' on ordinary tensors too. XLA
    rewrote ``amax / 2688`` as ``amax * (1 / 2688)`` and ``(amax / 6) / ts`` as
    ``amax / (6 * ts)``: the tensor scale of 1 tensor in 5 and the block multipliers of a
    third of the blocks were 1 ulp off the kernels (``_lax.div`` keeps the divisions)."""
    jax = pytest.importorskip("jax")
    from srround.adapters import jax as sj

    rng = np.random.default_rng(11)
    for _ in range(24):
        x = rng.standard_normal((4, 64)).astype(np.float32) * np.float32(10.0 ** rng.uniform(-3, 3))
        xj = jax.numpy.asarray(x)
        got = sj.quantize_blocks(xj, "nvfp4", seed=1)
        want = sj.quantize_blocks(xj, "nvfp4", seed=1, impl="callback")
        assert np.asarray(got.tensor_scale).tobytes() == np.asarray(want.tensor_scale).tobytes()
        for a, b in ((got.data, want.data), (got.scales, want.scales)):
            np.testing.assert_array_equal(_u8(np.asarray(a)), _u8(np.asarray(b)))
        back = np.asarray(sj.dequantize_blocks(got)).view(np.uint32)
        want_back = np.asarray(sj.dequantize_blocks(want, impl="callback")).view(np.uint32)
        np.testing.assert_array_equal(back, want_back)


# -- audit ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2"])
def test_audit_fp8_range_and_lost_updates(name):
    """``dtype=fp8``: the range counts are those of ml_dtypes' cast (overflow to NaN/inf, flush
    to zero, subnormal), and the lost updates of the weights in range those of brute-force
    round-to-nearest."""
    from srround import audit

    fmt = FMT[name]
    rng = np.random.default_rng(8)
    w = (rng.standard_normal(4000) * 10.0 ** rng.uniform(-6, 5, 4000)).astype(np.float32)
    w[:8] = [464.0, 464.0001, 470.0, 490.0, 448.0, 300.0, 61440.0, fmt.smallest_subnormal / 2]
    result = audit.audit_tensor(w, lr=1e-3, dtype=name)
    r = result.fp16
    with np.errstate(all="ignore"):
        cast = w.astype(fmt.numpy_dtype).astype(np.float64)
    assert r.dtype == name
    assert r.overflow == int((~np.isfinite(cast)).sum())
    assert r.flushed == int(((cast == 0) & (w != 0)).sum())
    min_normal = 2.0 ** (1 - fmt.bias)
    assert r.subnormal == int(((np.abs(w) < min_normal) & (w != 0) & (cast != 0)).sum())
    # lost updates: q = RNE(w); a direction is lost when RNE(q +- lr) == q
    ok = np.isfinite(cast)
    q = cast[ok]
    lost = 0.0
    for sign in (1.0, -1.0):
        with np.errstate(all="ignore"):
            moved = (q + sign * 1e-3).astype(np.float32).astype(fmt.numpy_dtype).astype(np.float64)
        lost += 0.5 * float((moved == q).sum())
    # weights that become inf or NaN in the target are left out (e4m3fn's 464 < |w| < 496
    # rounds to its NaN pattern: counted as updates, and lost, until 11-29)
    assert result.stagnation.updates == ok.sum()
    assert result.stagnation.lost_updates == lost
    # weights stored in the format, audited as it (dtype=None): the same (e4m3fn's top binade,
    # 256 to 448, was left out until 11-29)
    stored = audit.audit_tensor(w[ok].astype(fmt.numpy_dtype), lr=1e-3).stagnation
    assert (stored.updates, stored.lost_updates) == (ok.sum(), lost)
    assert name in audit.fp16_verdict(r)


def test_audit_cli_takes_fp8(tmp_path, capsys):
    from srround import _cli

    path = tmp_path / "w.npy"
    np.save(path, np.float32([1.0, 500.0, 2.0**-12, 3.0]))
    assert _cli.main(["audit", str(path), "--dtype", "float8_e4m3fn"]) in (0, None)
    out = capsys.readouterr().out
    assert "float8_e4m3fn: not safe as is: 1 overflow to NaN and 1 flush to zero" in out


def test_cupy_fp8_and_blocks(cupy_module):
    """CuPy (its simulator stand-in in CI): fp8 results and block quantization, NumPy's bits."""
    cupy = cupy_module
    x = np.random.default_rng(9).standard_normal((2, 32)).astype(np.float32)
    y = srround.stochastic_round(cupy.asarray(x), dtype="float8_e5m2", seed=1)
    np.testing.assert_array_equal(
        cupy.asnumpy(y).view(np.uint8),
        _u8(srround.stochastic_round(x, dtype="float8_e5m2", seed=1)),
    )
    q = srround.quantize_blocks(cupy.asarray(x), "mxfp4", seed=2)
    want = srround.quantize_blocks(x, "mxfp4", seed=2)
    np.testing.assert_array_equal(cupy.asnumpy(q.data).view(np.uint8), _u8(want.data))
    np.testing.assert_array_equal(cupy.asnumpy(q.scales).view(np.uint8), _u8(want.scales))


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_nvfp4_tiny_tensor(rounding):
    """A tensor whose amax / 2688 is below 2**-121 (amax below about 1e-33): torchao's formula
    overflows ``(1 / tensor_scale) / block_scale`` to inf there (a zero element became the NaN
    code, 0 * inf) or divides by a tensor scale that underflowed to 0 (a ZeroDivisionError in
    the CPU kernel). The tensor scale is floored at 2**-121: every value stays finite, zeros
    stay zero, and the elements round on the grid of their block; the jax.lax path agrees."""
    try:
        import jax

        from srround.adapters import jax as sj
    except ImportError:
        jax = None
    for v in (1e-33, 1e-36, 2.0**-126, 1e-44):
        x = np.zeros((2, 16), np.float32)
        x[0, :3] = np.float32([v, -v / 2, v / 3])
        x[1, 0] = v / 1000  # a block far below the tensor's largest
        q = srround.quantize_blocks(x, "nvfp4", rounding=rounding, seed=1)
        assert q.tensor_scale[0] == max(np.float32(v) / np.float32(2688), np.float32(2.0**-121))
        back = srround.dequantize_blocks(q)
        assert np.all(np.isfinite(back))
        np.testing.assert_array_equal(back[x == 0], 0.0)
        step = srround.dequantize_blocks(q._replace(data=np.full_like(_u8(q.data), 0x11)))
        assert np.all(np.abs(back - x) <= step[:, :1] * 4)  # within a grid step (<= 2 * scale)
        if jax is not None:  # the jax.lax path: the same bits
            qj = sj.quantize_blocks(jax.numpy.asarray(x), "nvfp4", rounding=rounding, seed=1)
            assert np.asarray(qj.tensor_scale).tobytes() == q.tensor_scale.tobytes()
            np.testing.assert_array_equal(np.asarray(qj.data), _u8(q.data))
            np.testing.assert_array_equal(_u8(np.asarray(qj.scales)), _u8(q.scales))
            np.testing.assert_array_equal(np.asarray(sj.dequantize_blocks(qj)), back)


def test_blocks_cuda_empty_and_tiny_nvfp4(small_cuda_launch, monkeypatch):
    """CUDA (simulator in CI): an empty NVFP4 tensor gets tensor scale 1, as on the CPU (it
    was left unwritten: whatever the allocation held), and a tiny tensor the CPU's bits."""
    from numba import cuda

    if not cuda.is_available():
        pytest.skip("no CUDA device and not simulated")
    allocate = cuda.device_array

    def garbage(shape, dtype):  # new device arrays hold all-ones bytes: unwritten ones show
        out = allocate(shape, dtype=dtype)
        if out.size:  # through an unsigned view: numba cannot copy float8 host arrays over
            words = out.view(np.dtype(f"u{np.dtype(dtype).itemsize}"))
            words.copy_to_device(np.full(words.shape, 0xFF, words.dtype))
        return out

    monkeypatch.setattr(cuda, "device_array", garbage)
    for shape in ((0, 16), (2, 0)):
        q = srround.quantize_blocks(cuda.to_device(np.full(shape, 1.0, np.float32)), "nvfp4")
        np.testing.assert_array_equal(q.tensor_scale.copy_to_host(), np.ones(1, np.float32))
        assert srround.dequantize_blocks(q).copy_to_host().shape == shape
    x = np.zeros((2, 16), np.float32)
    x[0, :2] = np.float32([1e-44, 1e-40])
    cpu = srround.quantize_blocks(x, "nvfp4", seed=2)
    dev = srround.quantize_blocks(cuda.to_device(x), "nvfp4", seed=2)
    np.testing.assert_array_equal(dev.tensor_scale.copy_to_host(), cpu.tensor_scale)
    np.testing.assert_array_equal(_u8(dev.data.copy_to_host()), _u8(cpu.data))
    np.testing.assert_array_equal(_u8(dev.scales.copy_to_host()), _u8(cpu.scales))


def test_dequantize_blocks_errors_name_the_argument():
    """A QuantizedBlocks with an axis out of range or a tensor scale that is not one value is
    a ValueError naming the field (an IndexError before, or the first of several values read
    silently), on the NumPy and the JAX paths."""
    x = np.ones((2, 32), np.float32)
    mx, nv = (srround.quantize_blocks(x, name) for name in ("mxfp4", "nvfp4"))
    cases = [
        (mx._replace(axis=2), "q.axis: expected an int in"),
        (mx._replace(axis=-3), "q.axis: expected an int in"),
        (mx._replace(axis=1.0), "q.axis: expected an int in"),
        (nv._replace(tensor_scale=np.ones(0, np.float32)), "q.tensor_scale: expected one"),
        (nv._replace(tensor_scale=np.ones(3, np.float32)), "q.tensor_scale: expected one"),
    ]
    jax = pytest.importorskip("jax")
    for q, match in cases:
        with pytest.raises(ValueError, match=match):
            srround.dequantize_blocks(q)
        arrays = (None if a is None else jax.numpy.asarray(a) for a in q[:3])
        qj = q._replace(**dict(zip(("data", "scales", "tensor_scale"), arrays)))
        for impl in ("native", "callback"):
            with pytest.raises(ValueError, match=match):
                srround.adapters.jax.dequantize_blocks(qj, impl=impl)
    back = srround.dequantize_blocks(nv._replace(tensor_scale=np.ones((), np.float32)))
    assert back.shape == x.shape  # one value in any shape (torchao's is 0-d)


def test_nvfp4_e8m0_scales_error_says_what_is_expected():
    """NVFP4 scales given as e8m0 (MX's scale dtype): the TypeError names the one dtype NVFP4
    scales take, not every narrow float dtype (fp16, bf16, e5m2, ... were listed)."""
    torch = pytest.importorskip("torch")
    x = np.ones((2, 32), np.float32)
    q = srround.quantize_blocks(x, "nvfp4")
    qt = srround.quantize_blocks(torch.from_numpy(x), "nvfp4")
    cases = [
        (q._replace(scales=q.scales.view(ml_dtypes.float8_e8m0fnu)), "float8_e4m3fn array"),
        (qt._replace(scales=qt.scales.view(torch.float8_e8m0fnu)), "torch.float8_e4m3fn tensor"),
    ]
    for bad, want in cases:
        with pytest.raises(TypeError, match=rf"q.scales: expected an? {want} \(or .*uint8 bit"):
            srround.dequantize_blocks(bad)


@pytest.mark.parametrize("name", ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp4"])
def test_mx_smallest_scale_round_trips(name):
    """Blocks whose scale is e8m0's smallest, 2**-127 (code 0: block maximum below
    2**(emax - 126)): their elements are x / 2**-127, as OCP MX defines them, so values on the
    grid come back exactly. torchao divides by 2**-126 there (a Triton workaround) while its
    dequantization multiplies by 2**-127: every value came back halved."""
    jax = pytest.importorskip("jax")
    bf = srround._blocks.BLOCK_FORMATS[name]
    grid = _grid(bf.element.name)
    rows = -(-grid.size // (bf.block - 1))
    x = np.resize(grid, (rows, bf.block))
    x[:, 0] = bf.element.max_finite
    x = (x * np.float32(2.0**-127)).astype(np.float32)  # exact: fp32 subnormals go to 2**-149
    for rounding in ("nearest", "stochastic"):
        q = srround.quantize_blocks(x, name, rounding=rounding, seed=0)
        assert not _u8(q.scales).any()
        np.testing.assert_array_equal(srround.dequantize_blocks(q), x)
        qj = srround.quantize_blocks(jax.numpy.asarray(x), name, rounding=rounding, seed=0)
        np.testing.assert_array_equal(_u8(np.asarray(qj.data)), _u8(q.data))  # jax.lax path


@pytest.mark.parametrize("impl", ["native", "callback"])
def test_jax_dequantize_blocks_checks_the_fields(impl):
    """JAX: a QuantizedBlocks whose data, scales or tensor scale do not fit its format is an
    error naming the field at trace time, as on NumPy (before: JAX's reshape errors, a host
    call failing at run time, or NVFP4 data read under e8m0 scales silently)."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    from srround.adapters import jax as sj

    mx = sj.quantize_blocks(jnp.ones((2, 64)), "mxfp4", impl=impl)
    nv = sj.quantize_blocks(jnp.ones((2, 64)), "nvfp4", impl=impl)
    cases = [
        (mx._replace(scales=mx.scales[:, :1]), ValueError, r"q.scales: shape \(2, 1\)"),
        (mx._replace(data=mx.data[:, :8]), ValueError, "q.data: the length 16 of axis 1"),
        (mx._replace(data=mx.data.astype(jnp.float32)), TypeError, "q.data: expected"),
        (mx._replace(scales=mx.scales.astype(jnp.float32)), TypeError, "q.scales: expected"),
        (
            nv._replace(scales=nv.scales.view(jnp.uint8).view(jnp.float8_e8m0fnu)),
            TypeError,
            "q.scales",
        ),
        (
            nv._replace(tensor_scale=nv.tensor_scale.astype(jnp.bfloat16)),
            TypeError,
            "q.tensor_scale",
        ),
    ]
    for q, error, match in cases:
        with pytest.raises(error, match=match):
            jax.jit(lambda q: sj.dequantize_blocks(q, impl=impl))(q)


def test_audit_refuses_fp4():
    """The audit's range statistics exist for 16-bit and fp8 targets only: ``dtype=fp4`` is a
    ValueError naming it (it audited fp16's range under an fp4 name silently)."""
    from srround import audit

    w = np.float32([1.0, 3.0, 100.0])
    for call in (audit.audit_tensor, audit.stagnation):
        with pytest.raises(ValueError, match="dtype: .*float4_e2m1fn"):
            call(w, lr=1e-3, dtype="float4_e2m1fn")


def test_jax_native_nvfp4_subnormal_block_scales():
    """The jax.lax path on XLA's CPU backend, which flushes float32 subnormals: a block whose
    ``amax / 6`` is subnormal, under a tensor scale small enough that ``(amax / 6) /
    tensor_scale`` is still above the least e4m3 block scale, got a block scale of 2**-6
    (its quotient flushed to 0) where the kernels give the quotient's e4m3 value."""
    jax = pytest.importorskip("jax")
    from srround.adapters import jax as sj

    for v in (2.0**-126, 5 * 2.0**-126, 2.0**-124, 3 * 2.0**-150, 2.0**-149):
        x = np.zeros((2, 16), np.float32)
        x[0, :2] = np.float32([v, v / 3])
        x[1, 0] = 1e-36  # the tensor's largest: tensor scale 2**-121
        for rounding in ("nearest", "stochastic"):
            want = srround.quantize_blocks(x, "nvfp4", rounding=rounding, seed=4)
            got = sj.quantize_blocks(jax.numpy.asarray(x), "nvfp4", rounding=rounding, seed=4)
            np.testing.assert_array_equal(_u8(np.asarray(got.scales)), _u8(want.scales))
            np.testing.assert_array_equal(np.asarray(got.data), _u8(want.data))


def test_dequantize_blocks_takes_framework_float32():
    """``dequantize_blocks(dtype=)`` takes float32 as every ``dtype=`` takes a format: a name,
    NumPy's dtype or the framework's own object (``torch.float32`` was a ValueError)."""
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    from srround.adapters import jax as sj

    x = np.ones((2, 32), np.float32)
    qt = srround.quantize_blocks(torch.from_numpy(x), "mxfp4")
    for dtype in ("float32", np.float32, torch.float32):
        np.testing.assert_array_equal(srround.dequantize_blocks(qt, dtype=dtype).numpy(), x)
    qj = srround.quantize_blocks(jax.numpy.asarray(x), "mxfp4")
    for impl in ("native", "callback"):
        got = sj.dequantize_blocks(qj, dtype=jax.numpy.float32, impl=impl)
        np.testing.assert_array_equal(np.asarray(got), x)
    for dtype in ("bfloat16", torch.bfloat16, np.float16):
        with pytest.raises(ValueError, match="dtype: only float32"):
            srround.dequantize_blocks(qt, dtype=dtype)


@pytest.mark.parametrize("jax_first", [False, True])
def test_quantized_blocks_is_a_pytree_whatever_the_import_order(jax_first):
    """``QuantizedBlocks`` is a JAX pytree (arrays leaves, ``format`` and ``axis`` static)
    as soon as both srround and JAX are imported, in either order, without
    ``srround.adapters.jax`` (before, the NamedTuple's format string was a leaf until the
    adapter was imported: ``jax.device_put`` of a NumPy-made result failed). ``import srround``
    alone still imports no JAX."""
    import subprocess
    import sys

    pytest.importorskip("jax")
    imports = (
        "import jax, srround"
        if jax_first
        else "import importlib.util, srround, sys\nassert 'jax' not in sys.modules\n"
        "assert importlib.util.find_spec('jax')\nimport jax"  # a probe first imports nothing
    )
    code = f"""{imports}
import numpy as np, sys
q = srround.quantize_blocks(np.ones((2, 32), np.float32), "nvfp4")
leaves, tree = jax.tree_util.tree_flatten(q)
assert len(leaves) == 3 and all(isinstance(x, np.ndarray) for x in leaves), leaves
qd = jax.device_put(q)
assert (qd.format, qd.axis) == ("nvfp4", 1) and isinstance(qd.data, jax.Array)
assert "srround.adapters.jax" not in sys.modules
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize("impl", ["native", "callback"])
def test_jax_takes_float4_e2m1fn_arrays(impl):
    """JAX arrays of dtype ``jnp.float4_e2m1fn`` are fp4 inputs as NumPy's
    ``ml_dtypes.float4_e2m1fn`` arrays are (they were a TypeError: only uint8 patterns), the
    same bits; ``stochastic_add`` returns the new ``w`` in ``w``'s dtype."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    from srround.adapters import jax as sj

    codes = np.arange(16, dtype=np.uint8)
    w_np = codes.view(ml_dtypes.float4_e2m1fn)
    w = jnp.asarray(w_np)
    u = np.linspace(-3, 3, 16, dtype=np.float32)
    for call in (
        lambda w: sj.to_float32(w, impl=impl),
        jax.jit(lambda w: sj.to_float32(w, impl=impl)),
    ):
        np.testing.assert_array_equal(np.asarray(call(w)), srround.to_float32(w_np))
    got = sj.stochastic_add(w, jnp.asarray(u), seed=3, impl=impl)
    want = srround.stochastic_add(w_np.copy(), u, seed=3)
    assert got.dtype == jnp.float4_e2m1fn
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), want.view(np.uint8))
    with pytest.raises(TypeError, match="does not match"):
        sj.to_float32(w, dtype="float8_e4m3fn", impl=impl)


@pytest.mark.parametrize("name", ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp4"])
def test_ceil_blocks_at_flt_max_dequantize_to_inf(name):
    """CEIL on a block of +-FLT_MAX: the elements round up to the scale's next power of two,
    the MX value +-2**128, which float32 cannot hold: ``dequantize_blocks`` gives +-inf (its
    correctly rounded float32; torchao's RCEIL bits, which torchao dequantizes to inf too).
    FLOOR clips the block to its largest element instead (finite). e4m3, nearest: the first
    value that reaches 2**128 is 1.9375 * 2**127 (the tie between 240 and 256 * 2**120)."""
    big = np.float32(np.finfo(np.float32).max)
    x = np.full((1, 32), big, np.float32)
    x[0, 1] = -big
    ceil = srround.quantize_blocks(x, name, rounding="nearest", scale="ceil")
    back = srround.dequantize_blocks(ceil)
    assert np.isposinf(back[0, 0]) and np.isneginf(back[0, 1])
    floor = srround.dequantize_blocks(srround.quantize_blocks(x, name, rounding="nearest"))
    assert np.isfinite(floor).all() and floor[0, 0] < big
    if name == "mxfp8_e4m3":
        edge = np.full((1, 32), np.float32(1.9375 * 2.0**127), np.float32)
        below = np.nextafter(edge, np.float32(0))
        for value, finite in ((edge, False), (below, True)):
            q = srround.quantize_blocks(value, name, rounding="nearest", scale="ceil")
            assert np.isfinite(srround.dequantize_blocks(q)).all() == finite
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx

    dtype = {"mxfp8_e4m3": torch.float8_e4m3fn, "mxfp8_e5m2": torch.float8_e5m2}
    dtype = dtype.get(name, torch.float4_e2m1fn_x2)
    scales, data = to_mx(torch.from_numpy(x), dtype, 32, ScaleCalculationMode.RCEIL)
    np.testing.assert_array_equal(_u8(ceil.scales), scales.view(torch.uint8).numpy())
    np.testing.assert_array_equal(_u8(ceil.data), data.view(torch.uint8).numpy())
    np.testing.assert_array_equal(to_dtype(data, scales, dtype, 32, torch.float32).numpy(), back)


def _fp4_inputs_with_a_high_nibble():
    codes = np.array([0x01, 0x0F, 0x2A, 0x03], np.uint8)  # 0x2A: two packed codes
    return codes, np.linspace(-1, 1, 4, dtype=np.float32)


def test_fp4_bytes_above_0x0f_are_refused():
    """fp4 inputs are one code per byte: a byte above 0x0F (torchao's two-per-byte
    float4_e2m1fn_x2 passed as dtype="float4_e2m1fn") is a ValueError naming the argument,
    before anything is written - NumPy (uint8 and ml_dtypes arrays), torch and CUDA (the
    simulator). Before, the low nibble was read and the high one dropped silently."""
    torch = pytest.importorskip("torch")
    codes, u = _fp4_inputs_with_a_high_nibble()
    match = "holds byte 0x2A, not an fp4 code"
    cases = [
        (codes.copy(), np.array),
        (codes.view(ml_dtypes.float4_e2m1fn).copy(), np.array),
        (torch.from_numpy(codes.copy()), torch.from_numpy),  # torch: fp4 is uint8 patterns
    ]
    for y, wrap in cases:
        out = wrap(np.full(4, 7.0, np.float32))
        with pytest.raises(ValueError, match=f"y: {match}"):
            srround.to_float32(y, dtype="float4_e2m1fn", out=out)
        with pytest.raises(ValueError, match=f"w: {match}"):
            srround.stochastic_add(y, wrap(u), seed=0, dtype="float4_e2m1fn")
        assert (np.asarray(out) == 7.0).all()
        np.testing.assert_array_equal(np.asarray(y).view(np.uint8), codes)  # unwritten
    from numba import cuda

    if cuda.is_available():
        w = cuda.to_device(codes)
        with pytest.raises(ValueError, match=f"y: {match}"):
            srround.to_float32(w, dtype="float4_e2m1fn")
        with pytest.raises(ValueError, match=f"w: {match}"):
            srround.stochastic_add(w, cuda.to_device(u), seed=0, dtype="float4_e2m1fn")
        np.testing.assert_array_equal(w.copy_to_host(), codes)
        ok = cuda.to_device(codes & 0xF)
        np.testing.assert_array_equal(
            srround.to_float32(ok, dtype="float4_e2m1fn").copy_to_host(),
            srround.to_float32(codes & 0xF, dtype="float4_e2m1fn"),
        )


@pytest.mark.parametrize("impl", ["native", "callback"])
def test_jax_fp4_bytes_above_0x0f_are_refused(impl):
    """JAX: a concrete uint8 fp4 input with a byte above 0x0F is the same ValueError, before
    anything runs; under jit (values unknown when tracing) the callback raises it from its host
    call and the jax.lax path reads the byte as NaN (fp4 has no NaN: it cannot pass as a value)."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    from srround.adapters import jax as sj

    codes, u = _fp4_inputs_with_a_high_nibble()
    y, uj = jnp.asarray(codes), jnp.asarray(u)
    match = "holds byte 0x2A, not an fp4 code"
    with pytest.raises(ValueError, match=f"y: {match}"):
        sj.to_float32(y, dtype="float4_e2m1fn", impl=impl)
    with pytest.raises(ValueError, match=f"w: {match}"):
        sj.stochastic_add(y, uj, seed=0, dtype="float4_e2m1fn", impl=impl)
    widen = jax.jit(lambda y: sj.to_float32(y, dtype="float4_e2m1fn", impl=impl))
    if impl == "callback":
        with pytest.raises(Exception, match=match):
            jax.block_until_ready(widen(y))
    else:
        got = np.asarray(widen(y))
        assert np.isnan(got[2]) and not np.isnan(np.delete(got, 2)).any()
