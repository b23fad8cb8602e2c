"""Rounding correctness on the CPU: bit-exact references, exhaustive outcome checks, statistics,
special values, and property-based tests on random bit patterns."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from numba import njit

import srround
from srround._scalar import encode_stochastic

from . import reference
from .reference import FORMAT_NAMES, SPECIAL_BITS, bits

FMTS = [srround.FORMATS[n] for n in FORMAT_NAMES]


def f32(*patterns):
    return np.array(patterns, dtype=np.uint32).view(np.float32)


def structured_patterns():
    """Every fp32 sign/exponent/top-mantissa combination (all 2**16 high halves) with low halves
    at the tie, just around it and at the ends, plus 2**20 random patterns."""
    high = np.arange(1 << 16, dtype=np.uint32) << 16
    lows = np.array(
        [0, 1, 0x0FFF, 0x1000, 0x1001, 0x2000, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=np.uint32
    )
    rng = np.random.default_rng(1234)
    patterns = np.concatenate(
        [(high[:, None] | lows[None, :]).ravel(), rng.integers(0, 1 << 32, 1 << 20, np.uint32)]
    )
    return patterns.view(np.float32)


# -- round to nearest ------------------------------------------------------------------------


def test_round_nearest_bf16_matches_ml_dtypes_bit_for_bit_nan_included():
    x = structured_patterns()
    with np.errstate(all="ignore"):
        expected = x.astype(ml_dtypes.bfloat16)
    assert np.array_equal(bits(srround.round_nearest(x)), bits(expected))


def test_round_nearest_fp16_matches_numpy_and_nan_policy():
    x = structured_patterns()
    with np.errstate(all="ignore"):
        expected = x.astype(np.float16)
    got = srround.round_nearest(x, dtype="float16")
    nan = np.isnan(x)
    assert np.array_equal(bits(got)[~nan], bits(expected)[~nan])
    # NaN policy: canonical quiet NaN with the sign kept (NumPy keeps payload bits instead)
    sign = (x.view(np.uint32)[nan] >> 31).astype(np.uint16) << 15
    assert np.array_equal(bits(got)[nan], sign | 0x7E00)


def test_round_nearest_fp16_nan_agrees_with_torch_on_sign_and_quiet_bit():
    """torch's fp16 cast quiets NaNs and keeps the top payload bits; srround's one policy for all
    formats is the canonical quiet NaN: both give a quiet NaN with the input's sign."""
    torch = pytest.importorskip("torch")
    x = f32(0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001, 0x7FC00000, 0xFFC00000, 0x7FA00000, 0xFF800001)
    theirs = torch.from_numpy(x.copy()).to(torch.float16).view(torch.int16).numpy().view(np.uint16)
    ours = bits(srround.round_nearest(x, dtype="float16"))
    assert np.array_equal(ours & 0xFE00, theirs & 0xFE00)  # sign, all-ones exponent, quiet bit
    assert np.array_equal(ours & 0x1FF, np.zeros_like(ours))  # canonical: no payload


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.name)
def test_to_float32_is_exact_on_every_pattern(fmt):
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(fmt.numpy_dtype)
    expected = h.astype(np.float32)
    assert np.array_equal(bits(srround.to_float32(h)), bits(expected))


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.name)
def test_round_nearest_saturate(fmt):
    big = np.float32([3e38, -3e38, np.inf, 70000.0])
    got = srround.round_nearest(big, dtype=fmt.name, overflow="saturate").astype(np.float64)
    top = fmt.max_finite
    expected = [top if fmt.name == "float16" else 3e38, -top if fmt.name == "float16" else -3e38]
    assert got[2] == np.inf  # inf is not an overflow
    if fmt.name == "float16":
        assert list(got[:2]) == expected and got[3] == top


# -- stochastic rounding: exact outcome sets -------------------------------------------------


@njit(cache=True)
def _count_up(u, mantissa_bits, exponent_bits, down_bits):
    """Over all 2**16 random inputs: how many results differ from ``down_bits``, and the set of
    distinct results (at most 2)."""
    results = set()
    ups = 0
    for r in range(1 << 16):
        v = encode_stochastic(u, r, mantissa_bits, exponent_bits, False)
        results.add(v)
        if v != down_bits:
            ups += 1
    return ups, len(results)


def interesting_values(fmt):
    tiny = fmt.smallest_subnormal
    values = [
        1.0,
        1.0 + 2.0**-20,
        1.0 + 2.0**-9,
        3.0 / 7.0,
        -0.1,
        1e-3,
        12345.678,
        -(2.0**-130),
        tiny * 0.5,
        tiny * 0.25,
        tiny * 1.5,
        tiny * 3.75,
        -tiny * 0.7,
        tiny * 2.0**-10,
        2.0**-126 * 1.5,
        2.0**-140,
        65519.0,
        65504.0 + 8.0,
        3.0e38,
    ]
    x = np.array(values, np.float32)
    return x[np.abs(x.astype(np.float64)) < 2.0 ** (fmt.bias + 1)]  # inside the format's range


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.name)
def test_sr_exhaustive_over_random_bits(fmt):
    """For each x, all 2**16 random inputs: results are exactly {down, up} and the number that
    round up is floor(2**16 * frac) - the probability contract, with no sampling error."""
    x = interesting_values(fmt)
    down, up, frac = reference.neighbours(x, fmt)
    with np.errstate(over="ignore"):
        down_bits = bits(down.astype(np.float32).astype(fmt.numpy_dtype))
    for i, u in enumerate(x.view(np.uint32)):
        ups, distinct = _count_up(int(u), fmt.mantissa_bits, fmt.exponent_bits, int(down_bits[i]))
        assert ups == int(np.floor(frac[i] * 65536.0)), (x[i], ups)
        assert distinct == (2 if ups else 1)


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.name)
@pytest.mark.parametrize("offset", [0, 3, 2**33 + 1])
def test_sr_matches_reference(fmt, offset):
    rng = np.random.default_rng(7)
    x = np.concatenate(
        [
            rng.standard_normal(5000).astype(np.float32),
            (rng.standard_normal(3000) * fmt.smallest_subnormal * 40).astype(np.float32),
            interesting_values(fmt),
        ]
    )
    got = srround.stochastic_round(x, dtype=fmt.name, seed=99, offset=offset)
    expected = reference.stochastic_round(x, fmt, seed=99, offset=offset)
    assert np.array_equal(bits(got), bits(expected))


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.name)
def test_sr_unbiased(fmt):
    """Mean of SR(x) over 4000 draws per value: max |z| over 300 values stays small."""
    rng = np.random.default_rng(3)
    values = np.concatenate(
        [
            rng.uniform(-4, 4, 200),
            rng.uniform(-1, 1, 100) * fmt.smallest_subnormal * 64,
        ]
    ).astype(np.float32)
    draws = 4000
    x = np.repeat(values, draws)
    y = srround.stochastic_round(x, dtype=fmt.name, seed=2024).astype(np.float64)
    y = y.reshape(len(values), draws)
    down, up, frac = reference.neighbours(values, fmt)
    p = np.floor(frac * 65536.0) / 65536.0  # exact P(up) of the contract
    step = np.abs(up - down)
    mean_expected = np.abs(down) + p * step
    sd = np.sqrt(p * (1 - p)) * step
    z = (np.abs(y).mean(axis=1) - mean_expected) / np.where(sd > 0, sd / np.sqrt(draws), 1)
    assert np.max(np.abs(z)) < 5.5
    # and the contract's bias against exact x is below 2**-16 of a step
    assert np.all(np.abs(mean_expected - np.abs(values.astype(np.float64))) <= step * 2.0**-16)


def test_sr_ties_and_subnormals_probabilities():
    bf16, fp16 = srround.FORMATS["bfloat16"], srround.FORMATS["float16"]
    n = 200_000
    cases = [
        (bf16, 1.0 + 2.0**-8),  # exact tie between 1 and 1 + 2**-7: P(up) = 1/2
        (bf16, 2.0**-130 * 1.25),  # fp32 normal, bf16 subnormal range
        (fp16, fp16.smallest_subnormal * 0.25),  # below the smallest fp16 subnormal
        (fp16, 2.0**-14 * 0.75 + 2.0**-26),  # fp16 subnormal range, P depends on low bits
    ]
    for fmt, value in cases:
        x = np.full(n, value, np.float32)
        y = srround.stochastic_round(x, dtype=fmt.name, seed=11).astype(np.float64)
        down, up, frac = reference.neighbours(x[:1], fmt)
        p = np.floor(frac[0] * 65536) / 65536
        p_hat = np.mean(y == up[0])
        assert np.all((y == up[0]) | (y == down[0]))
        assert abs(p_hat - p) < 5 * np.sqrt(p * (1 - p) / n) + 1e-9, (fmt.name, value, p, p_hat)


# -- special values -----------------------------------------------------------------------------

SPECIALS = [*SPECIAL_BITS, 0x7F7F0000, 0x80000001, 0x007FFFFF, 0x3F800000, 0xBF808000]


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.name)
def test_special_values(fmt, backend):
    x = f32(*SPECIALS)
    sign = (x.view(np.uint32) >> 31).astype(np.uint16) << (fmt.bits - 1)
    quiet_nan = np.uint16(fmt.inf_bits | (1 << (fmt.mantissa_bits - 1)))
    for seed in (0, 1, 2**64 - 1):
        got = bits(backend.get(srround.stochastic_round(backend.put(x), dtype=fmt.name, seed=seed)))
        nan = np.isnan(x)
        assert np.array_equal(got[nan], sign[nan] | quiet_nan)  # NaN stays a quiet NaN, sign kept
        inf = np.isinf(x)
        assert np.array_equal(got[inf], sign[inf] | fmt.inf_bits)
        zero = x == 0
        assert np.array_equal(got[zero], sign[zero])  # signed zeros kept
        # already representable: unchanged, no randomness
        with np.errstate(over="ignore", invalid="ignore"):
            representable = bits(x.astype(fmt.numpy_dtype).astype(np.float32)) == x.view(np.uint32)
        keep = representable & np.isfinite(x)
        with np.errstate(over="ignore"):
            assert np.array_equal(got[keep], bits(x[keep].astype(fmt.numpy_dtype)))
    # FLT_MAX is above both formats' largest finite value: inf, or the max under "saturate"
    flt_max = f32(0x7F7FFFFF, 0xFF7FFFFF)
    got = srround.stochastic_round(backend.put(flt_max), dtype=fmt.name, seed=3)
    got = backend.get(got).astype(np.float64)
    if fmt.name == "float16":
        assert list(got) == [np.inf, -np.inf]
    got = backend.get(
        srround.stochastic_round(backend.put(flt_max), dtype=fmt.name, seed=3, overflow="saturate")
    ).astype(np.float64)
    assert list(got) == [fmt.max_finite, -fmt.max_finite]


def test_bf16_max_finite_rounds_to_inf_only_by_its_probability():
    bf16 = srround.FORMATS["bfloat16"]
    top = np.float32(bf16.max_finite)  # 0x7F7F0000
    x = np.full(100_000, np.uint32(0x7F7F8000), np.uint32).view(np.float32)  # half way to 2**128
    y = srround.stochastic_round(x, seed=5).astype(np.float64)
    assert set(np.unique(y)) == {float(top), np.inf}
    assert abs(np.mean(np.isinf(y)) - 0.5) < 0.01
    assert np.all(srround.stochastic_round(np.full(1000, top), seed=1).astype(np.float32) == top)


# -- property-based ----------------------------------------------------------------------------


@given(
    patterns=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64),
    seed=st.integers(0, 2**64 - 1),
    offset=st.integers(0, 2**40),
    name=st.sampled_from(FORMAT_NAMES),
)
def test_property_sr_in_neighbours_rne_matches_reference(patterns, seed, offset, name):
    fmt = srround.FORMATS[name]
    x = np.array(patterns, np.uint32).view(np.float32)
    got = srround.stochastic_round(x, dtype=name, seed=seed, offset=offset)
    finite = np.isfinite(x)
    expected = reference.stochastic_round(x, fmt, seed, offset)
    assert np.array_equal(bits(got)[finite], bits(expected)[finite])
    assert np.all(np.isnan(got.astype(np.float32)) == np.isnan(x))
    # round-to-nearest agrees with the NumPy / ml_dtypes cast on all non-NaN patterns
    with np.errstate(all="ignore"):
        cast = x.astype(fmt.numpy_dtype)
    nan = np.isnan(x)
    assert np.array_equal(bits(srround.round_nearest(x, dtype=name))[~nan], bits(cast)[~nan])


# -- stochastic_add -------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.name)
def test_stochastic_add_matches_reference(fmt):
    rng = np.random.default_rng(5)
    w = rng.standard_normal(4099).astype(np.float32).astype(fmt.numpy_dtype)
    u = (rng.standard_normal(4099) * 1e-3).astype(np.float32)
    alpha = 0.25  # a power of two: w + alpha * u has a single fp32 rounding in NumPy as well
    total = w.astype(np.float32) + np.float32(alpha) * u
    expected = reference.stochastic_round(total, fmt, seed=17, offset=5)
    srround.stochastic_add(w, u, alpha=alpha, seed=17, offset=5)
    assert np.array_equal(bits(w), bits(expected))


def test_stochastic_add_tracks_small_updates_where_nearest_stalls():
    w_sr = np.full(20_000, 0.01, np.float32).astype(ml_dtypes.bfloat16)
    w_rn = w_sr.copy()
    start = float(w_sr[0])
    u = np.full(20_000, -1e-5, np.float32)  # far below half an ulp of 0.01 in bf16 (~3e-5)
    srround.manual_seed(0)
    for _ in range(100):
        srround.stochastic_add(w_sr, u)
        w_rn = srround.round_nearest(w_rn.astype(np.float32) + u)
    assert np.all(w_rn.astype(np.float32) == np.float32(start))  # nearest: every update lost
    mean = w_sr.astype(np.float64).mean()
    assert abs(mean - (start - 100 * 1e-5)) < 2e-6  # SR: the mean follows the fp32 trajectory


def test_32bit_encoder_is_the_general_path():
    """``_scalar._encode_narrow`` (fp16, fp8 and fp4 in 32-bit IR, so loops vectorize twice as
    wide) gives the general path's patterns for every format, overflow mode and rounding, on
    patterns of every fp32 exponent, specials included, and random bits."""
    from numba import njit

    from srround import _scalar as s
    from srround._formats import FORMATS

    @njit
    def mismatches(us, bits, m, e, saturate, kind, stochastic):
        count = 0
        for i in range(us.size):
            u, b = np.int64(us[i]), np.int64(bits[i])
            special = s._special(u, m, e, saturate, kind)
            base, q, r, shift = s._quantize(u, m, e)
            if stochastic:
                up = 1 if b < (r << 16) >> shift else 0
            else:
                half = 1 << (shift - 1)
                up = 1 if (r > half or (r == half and (q & 1) == 1)) else 0
            general = special if special >= 0 else s._finish(u, base + q + up, m, e, saturate, kind)
            count += general != s._encode_narrow(u, b, m, e, saturate, kind, stochastic)
        return count

    rng = np.random.default_rng(7)
    n = 1 << 17
    exponents = rng.integers(0, 256, n, dtype=np.uint32) << 23
    us = (rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32) & 0x807FFFFF) | exponents
    us[:8] = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 1, 0x80000001]
    bits16 = rng.integers(0, 1 << 16, n, dtype=np.uint32)
    for name in ("float16", "float8_e5m2", "float8_e4m3fn", "float4_e2m1fn"):
        fmt = FORMATS[name]
        for saturate in (False, True):
            for stochastic in (False, True):
                args = (fmt.mantissa_bits, fmt.exponent_bits, saturate, fmt.specials, stochastic)
                assert mismatches(us, bits16, *args) == 0, (name, saturate, stochastic)


def test_read_only_and_writable_inputs_run_one_compiled_kernel():
    """Numba types read-only and writable arrays apart: each rounding kernel took a second
    compile (~5 s cold) once a process passed both. Inputs now reach the kernels read-only."""
    from srround import _cpu
    from srround._block_kernels import amax_bits_cpu

    x = np.linspace(-1.5, 1.5, 64, dtype=np.float32)
    frozen = x.copy()
    frozen.flags.writeable = False
    w = srround.round_nearest(x, dtype="bfloat16")
    for a in (x, frozen):
        srround.stochastic_round(a, seed=1)
        srround.round_nearest(a, dtype="float8_e4m3fn")
        srround.to_float32(srround.round_nearest(a))
        srround.stochastic_add(w, a, seed=1)
        srround.quantize_blocks(a, "nvfp4", seed=1)  # its tensor scale: amax_bits_cpu
    kernels = (_cpu.stochastic_round, _cpu.round_nearest, _cpu.to_float32, _cpu.stochastic_add)
    kernels += (amax_bits_cpu,)
    for kernel in kernels:
        assert kernel.signatures, kernel
        for signature in kernel.signatures:
            assert not signature[0].mutable, (kernel, signature)
