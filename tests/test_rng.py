"""The counter-based stream: known answers, the (seed, offset, index) contract, bit statistics."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import srround
from srround._rng import threefry2x32

from .reference import bits, random16

# Random123 / JAX known-answer vectors for Threefry-2x32 with 20 rounds
KNOWN_ANSWERS = [
    ((0x00000000, 0x00000000), (0x00000000, 0x00000000), (0x6B200159, 0x99BA4EFE)),
    ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
    ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
]


@pytest.mark.parametrize("key,counter,expected", KNOWN_ANSWERS)
def test_threefry_known_answers(key, counter, expected):
    assert threefry2x32(*key, *counter) == expected  # compiled
    assert threefry2x32.py_func(*key, *counter) == expected  # plain Python, same source


def test_threefry_matches_jax():
    pytest.importorskip("jax")
    import jax.numpy as jnp
    from jax.extend.random import threefry_2x32

    rng = np.random.default_rng(0)
    key = rng.integers(0, 2**32, 2, dtype=np.uint32)
    counters = rng.integers(0, 2**32, (2, 64), dtype=np.uint32)
    # jax splits a flat count array into halves (x0 words, x1 words) and returns them likewise
    theirs = np.asarray(threefry_2x32(jnp.asarray(key), jnp.asarray(counters.ravel())))
    theirs = theirs.reshape(2, 64)
    ours = np.array(
        [threefry2x32(int(key[0]), int(key[1]), int(c0), int(c1)) for c0, c1 in counters.T]
    ).T
    assert np.array_equal(ours.astype(np.uint32), theirs)


def test_chunks_with_offsets_equal_one_call():
    x = np.random.default_rng(1).standard_normal(1001).astype(np.float32)
    whole = bits(srround.stochastic_round(x, seed=42, offset=7))
    parts = [
        bits(srround.stochastic_round(x[a:b], seed=42, offset=7 + a))
        for a, b in [(0, 3), (3, 4), (4, 517), (517, 1001)]
    ]
    assert np.array_equal(whole, np.concatenate(parts))


def test_seed_offset_make_calls_pure_and_distinct():
    x = np.full(4096, 1.0 + 2.0**-9, np.float32)  # P(up) = 1/4 for bf16
    a = bits(srround.stochastic_round(x, seed=1))
    assert np.array_equal(a, bits(srround.stochastic_round(x, seed=1)))
    assert not np.array_equal(a, bits(srround.stochastic_round(x, seed=2)))
    assert not np.array_equal(a, bits(srround.stochastic_round(x, seed=1, offset=4096)))


def test_manual_seed_reproduces_seedless_calls():
    x = np.full(4096, 1.0 + 2.0**-9, np.float32)
    srround.manual_seed(123)
    first = [bits(srround.stochastic_round(x)) for _ in range(3)]
    srround.manual_seed(123)
    again = [bits(srround.stochastic_round(x)) for _ in range(3)]
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not np.array_equal(first[0], first[1])


def test_a_refused_call_draws_no_seed():
    """A seedless call that fails its checks leaves the library generator alone: the draw came
    before the checks, so one bad call shifted every later seedless call after manual_seed."""
    x = np.full(4096, 1.0 + 2.0**-9, np.float32)
    srround.manual_seed(123)
    expected = bits(srround.stochastic_round(x))
    srround.manual_seed(123)
    w, wrong = np.zeros(4096, ml_dtypes.bfloat16), np.zeros(3, np.float32)
    with pytest.raises(ValueError, match="^out: shape"):
        srround.stochastic_round(x, out=np.zeros(3, ml_dtypes.bfloat16))
    with pytest.raises(ValueError, match="^u: shape"):
        srround.stochastic_add(w, wrong)
    with pytest.raises(ValueError, match=r"^params\[0\]: is read-only"):
        srround.sgd_step(
            np.frombuffer(bytes(8), ml_dtypes.bfloat16), np.ones(4, np.float32), lr=1, step=1
        )
    two = [np.zeros(4, ml_dtypes.bfloat16) for _ in range(2)]
    with pytest.raises(ValueError, match=r"^stream_starts\[1\]: .* overlaps"):
        srround.sgd_step(two, [np.ones(4, np.float32)] * 2, lr=1, step=1, stream_starts=[0, 2])
    with pytest.raises(ValueError, match="multiple of"):  # 33 is no multiple of 32
        srround.quantize_blocks(np.ones(33, np.float32), "mxfp8_e4m3")
    assert np.array_equal(bits(srround.stochastic_round(x)), expected)


def test_random_bits_statistics():
    """The 16-bit lanes the kernels consume: uniform (chi-square over 256 bins of the top byte
    and of the bottom byte), every bit balanced, adjacent lanes uncorrelated."""
    n = 1 << 17
    r = random16(seed=0xDEADBEEF, offset=12345, n=n)
    for byte in (r >> 8, r & 0xFF):
        counts = np.bincount(byte, minlength=256)
        chi2 = ((counts - n / 256) ** 2 / (n / 256)).sum()
        assert chi2 < 255 + 6 * np.sqrt(2 * 255)
    for b in range(16):
        ones = ((r >> b) & 1).sum()
        assert abs(ones - n / 2) < 5 * np.sqrt(n / 4)
    u = (r + 0.5) / 65536.0
    corr = np.corrcoef(u[:-1], u[1:])[0, 1]
    assert abs(corr) < 5 / np.sqrt(n)


def test_seed_validation():
    x = np.ones(4, np.float32)
    with pytest.raises(ValueError, match="seed"):
        srround.stochastic_round(x, seed=-1)
    with pytest.raises(ValueError, match="seed"):
        srround.stochastic_round(x, seed=2**64)
    with pytest.raises(TypeError, match="seed"):
        srround.stochastic_round(x, seed=1.5)
    with pytest.raises(ValueError, match="offset"):
        srround.stochastic_round(x, seed=1, offset=-3)
    srround.stochastic_round(x, seed=np.uint64(2**64 - 1))


def test_i32_threefry_equals_reference():
    """The kernels' i32 Threefry (an LLVM intrinsic: 32-bit words on a GPU, 8-wide AVX2 on a
    CPU) and ``random_block`` are the reference function (64-bit ints, plain Python)."""
    from numba import njit

    from srround._rng import random_block, threefry2x32_i32

    @njit
    def run(k0, k1, c0, c1):
        return threefry2x32_i32(k0, k1, c0, c1)

    for block in (0, 1, 2**32 - 1, 2**32, 2**40 + 12345, 2**62 + 7):
        want = threefry2x32.py_func(3, 2**32 - 5, block & 0xFFFFFFFF, block >> 32)
        assert tuple(int(v) for v in random_block(3, 2**32 - 5, block)) == want

    for key, counter, expected in KNOWN_ANSWERS:
        assert tuple(int(v) for v in run(*key, *counter)) == expected
    rng = np.random.default_rng(5)
    for k0, k1, c0, c1 in rng.integers(0, 2**32, (200, 4)):
        args = (int(k0), int(k1), int(c0), int(c1))
        assert tuple(int(v) for v in run(*args)) == threefry2x32(*args)


def test_cpu_random_lanes_are_the_stream():
    """``_cpu.random_lanes`` (the JAX adapter's host lanes): pieces at any position - 4-aligned
    ones filled in place, others through its buffer, one across a change of the counter's
    high word, one longer than a buffer - give the stream's 16 bits, each at its target."""
    from srround._cpu import random_lanes
    from srround._rng import split_seed

    seed = 0x0123_4567_89AB_CDEF
    positions = [0, 5, 3 * 2**34 + 7, 4093, 8, 2**35 - 8, 2**20 + 3]
    lengths = [100, 4092, 13_000, 50, 9_003, 4_000, 1]
    targets = np.concatenate([[0], np.cumsum(lengths)[:-1]]) + 4  # 4-aligned: [0, 4, ...]
    out = np.zeros(int(targets[-1] + lengths[-1]) + 1 & ~1, np.uint16)
    arrays = (np.array(a, np.int64) for a in (positions, targets, lengths))
    random_lanes(out, *split_seed(seed), *arrays)
    for p, t, n in zip(positions, targets, lengths):
        assert (out[t : t + n] == random16(seed, p, n)).all(), p
    assert (out[:4] == 0).all()


def test_cpu_fill_uses_512_bit_vectors_where_the_cpu_has_them():
    """The random-word fill (``_cpu._fill_run``, in every CPU random kernel) is vectorized 512
    bits wide on AVX-512 CPUs, where LLVM's tuning for Intel server CPUs keeps loops to 256
    bits (its Threefry rotations were ymm ``vprold``: the fill took 7-12 ms for 24.6M elements
    on the 2-core Emerald Rapids VM, 4-5 ms in zmm); the words are the stream's."""
    import re

    import llvmlite.binding as llvm
    from numba import njit

    from srround._cpu import _fill_run
    from srround._rng import split_seed

    k0, k1 = split_seed(0x0123_4567_89AB_CDEF)

    @njit
    def fill(words, k0, k1, low):
        _fill_run(words, k0, k1, low, 0)

    words = np.zeros(2 * 4099, np.uint32)  # a vector body and a remainder
    fill(words, k0, k1, 5)
    got = words.view(np.uint16)
    assert (got == random16(0x0123_4567_89AB_CDEF, 4 * 5, got.size)).all()
    try:
        avx512 = llvm.get_host_cpu_features().get("avx512f", False)
    except RuntimeError:  # llvmlite cannot tell on some hosts
        avx512 = False
    if not avx512:
        pytest.skip("no AVX-512 on this CPU (or llvmlite cannot tell)")
    asm = "\n".join(fill.inspect_asm().values())
    assert re.search(r"vprold\s+\$\d+, %zmm", asm), "the fill's rotations are not 512-bit"
