"""Plain-NumPy references, independent of the kernels: float64 arithmetic and ml_dtypes casts.

Every fp32 value and every power of two involved is exact in float64, so the neighbours and the
dropped fraction below are exact.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np

import srround
from srround._rng import lane_bits16, random_block, split_seed


def neighbours(x, fmt):
    """``(down, up, frac)``: the format's values just toward zero / away from zero of float32
    ``x`` (as float64, signed like x), and the fraction of the step that x is past ``down``."""
    x = np.asarray(x, np.float64)
    mag = np.abs(x)
    emin = 1 - fmt.bias
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(np.where(mag > 0, mag, 1.0)))
    # log2 can be off by one right at powers of two: fix e so that 2**e <= mag < 2**(e+1)
    e = np.where(2.0**e > mag, e - 1, e)
    e = np.where(2.0 ** (e + 1) <= mag, e + 1, e)
    quantum = 2.0 ** (np.maximum(e, emin) - fmt.mantissa_bits)
    steps = mag / quantum
    down = np.floor(steps) * quantum
    frac = steps - np.floor(steps)
    sign = np.where(np.signbit(x), -1.0, 1.0)
    return sign * down, sign * (down + quantum), frac


def random16(seed, offset, n):
    """The 16 random bits of elements 0..n-1 of a call (the documented stream, _rng.py)."""
    k0, k1 = split_seed(seed)
    out = np.empty(n, np.int64)
    for i in range(n):
        ctr = offset + i
        x0, x1 = random_block(k0, k1, ctr >> 2)
        out[i] = lane_bits16(x0, x1, ctr & 3)
    return out


def stochastic_round(x, fmt, seed, offset=0):
    """Reference SR of finite float32 ``x``: up iff bits16 < floor(frac * 2**16). Returns the
    result as the format's NumPy dtype (inf past the largest finite value). Non-finite entries
    give meaningless values: compare only the finite ones."""
    x = np.where(np.isfinite(x), x, np.float32(0))
    down, up, frac = neighbours(x, fmt)
    go_up = random16(seed, offset, x.size) < np.floor(frac * 65536.0)
    value = np.where(go_up, up, down)
    value = np.where(np.abs(value) > fmt.max_finite, np.copysign(np.inf, value), value)
    # exact: every value is representable (or inf); keep the sign of zeros
    value = np.where(value == 0, np.copysign(0.0, x), value)
    with np.errstate(over="ignore"):
        return value.astype(np.float32).astype(fmt.numpy_dtype)


def to_cuda(a):
    """``numba.cuda.to_device(a)`` for any dtype. NumPy 2.5 refuses ml_dtypes' types (bfloat16,
    float8) in the buffer protocol numba-cuda copies through ("cannot include dtype 'E' in a
    buffer"), so such an array travels as unsigned integers of its item size."""
    from numba import cuda

    a = np.ascontiguousarray(a)
    if a.dtype.isbuiltin == 1:  # NumPy's own types (2: a registered type such as ml_dtypes')
        return cuda.to_device(a)
    return cuda.to_device(a.view(f"u{a.dtype.itemsize}")).view(a.dtype)


def bits(a):
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16}.get(a.dtype.itemsize, np.uint32))


def assert_same_bits(got, expected) -> None:
    """``got`` has the dtype and the bits of ``expected`` (NaN payloads, signed zeros)."""
    assert np.asarray(got).dtype == np.asarray(expected).dtype
    np.testing.assert_array_equal(bits(got), bits(expected))


def normal_params(shapes, dtypes, seed=0) -> list:
    """Standard-normal arrays of ``shapes``, each cast to the dtype at its place in ``dtypes``."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(d) for s, d in zip(shapes, dtypes)]


# the 16-bit formats; fp8 and fp4 (one value per byte) are tested in test_lowbit.py
FORMAT_NAMES = [name for name, fmt in srround.FORMATS.items() if fmt.bits == 16]


# -- fma: hard cases and the Numba reference (shared by the JAX fma tests) ----------------------

# float32 bit patterns: NaNs (quiet and signalling, both signs), infinities, zeros, the largest
# finite value and the smallest subnormal; the special-value tests add their own cases to these.
SPECIAL_BITS = [
    0x7FFFFFFF,
    0xFFFFFFFF,
    0x7F800001,
    0x7FC00000,
    0xFFC00000,
    0x7F800000,
    0xFF800000,
    0,
    0x80000000,
    0x7F7FFFFF,
    0x00000001,
]
_FMA_SPECIALS = [
    0x7FFFFFFF,
    0xFFC00000,
    0x7FA00000,
    *SPECIAL_BITS[5:],
    0x807FFFFF,
    0x00800000,
    0x3F800000,
]


def fma_hard_cases(seed: int, n: int = 1 << 15) -> list[tuple]:
    """float32 bit-pattern triples ``(a, b, c)`` (C-contiguous uint32 arrays) on which an fma
    is easy to get wrong: cancellation, exact ties, subnormal operands and results, overflow,
    sums at and next to ties, and every combination of special values."""
    rng = np.random.default_rng(seed)

    def patterns(lo, hi):
        sign = rng.integers(0, 2, n, dtype=np.uint32) << 31
        return (
            sign
            | (rng.integers(lo, hi, n, dtype=np.uint32) << 23)
            | rng.integers(0, 1 << 23, n, dtype=np.uint32)
        )

    def f32_bits(x):
        return np.asarray(x, np.float32).view(np.uint32)

    a = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    cancel = -(a.astype(np.float64) * b) * (
        1 + rng.standard_normal(n) * 2.0 ** -rng.integers(0, 40, n)
    )
    tie_a, tie_b = (
        rng.integers(2**12, 2**13, n) * 2.0 ** rng.integers(-20, 20, n) for _ in range(2)
    )
    tie_c = rng.integers(-(2**24), 2**24, n) * 2.0 ** rng.integers(-50, 10, n)
    special = np.array(_FMA_SPECIALS, np.uint32)
    grid = [g.ravel() for g in np.meshgrid(special, special, special, indexing="ij")]
    cases = [
        (a.view(np.uint32), b.view(np.uint32), f32_bits(cancel)),
        (f32_bits(tie_a), f32_bits(tie_b), f32_bits(tie_c)),
        (patterns(0, 255), patterns(0, 255), patterns(0, 256)),
        (patterns(20, 110), patterns(20, 110), patterns(0, 30)),  # subnormal results
        (patterns(0, 3), patterns(100, 160), patterns(0, 3)),  # subnormal operands
        (patterns(100, 160), patterns(0, 3), patterns(0, 3)),  # and sums
        (patterns(150, 254), patterns(100, 254), patterns(200, 255)),  # overflow
        (
            patterns(100, 150),
            f32_bits(1 + rng.integers(0, 2**23, n) * 2.0**-23),
            f32_bits(rng.choice([-1, 1], n) * 2.0**-24 * rng.choice([1, 1 + 2.0**-23], n)),
        ),
        tuple(grid),  # sums at and next to ties, then specials
    ]
    return [tuple(np.ascontiguousarray(v, np.uint32) for v in case) for case in cases]


QNAN32 = 0x7FC00000  # the NaN of srround's arithmetic (docs/contracts.md, "Special values")


def canonical_nan(patterns):
    """fp32 patterns (uint32) with every NaN replaced by +qNaN ``QNAN32``: what srround writes
    for a NaN it computes, on every device (the CPU's own NaN keeps an operand's sign)."""
    patterns = np.asarray(patterns, np.uint32)
    return np.where((patterns & 0x7FFFFFFF) > 0x7F800000, np.uint32(QNAN32), patterns)


def fma32_bits(a, b, c):
    """Bits of Numba's ``fma32`` (llvm.fma.f32, one rounding) of uint32 pattern arrays, a NaN
    as ``QNAN32`` (the rule of srround's arithmetic)."""
    return canonical_nan(_fma32_loop(a, b, c))


def _compile_fma32():
    from numba import njit

    from srround._scalar import bits_to_f32, f32_to_bits, fma32

    @njit
    def loop(a, b, c):
        out = np.empty(a.size, np.uint32)
        for i in range(a.size):
            out[i] = f32_to_bits(
                fma32(
                    bits_to_f32(np.int64(a[i])),
                    bits_to_f32(np.int64(b[i])),
                    bits_to_f32(np.int64(c[i])),
                )
            )
        return out

    return loop


def _fma32_loop(a, b, c):
    global _fma32_loop
    _fma32_loop = _compile_fma32()  # compiled on first use only
    return _fma32_loop(a, b, c)


def assert_same_fma_bits(case, x, y, z, want, got):
    """``got == want`` bit for bit, NaNs included (both ``QNAN32``). Failures show the first
    operands as hex."""
    bad = np.flatnonzero(np.asarray(want) != np.asarray(got))
    assert bad.size == 0, (
        case,
        [tuple(hex(int(v[j])) for v in (x, y, z, want, got)) for j in bad[:5]],
    )


def half_sgd(params, lr):
    """A ``torch.optim.Optimizer``: SGD on fp16 parameters with the update formed in fp32 (for an
    ``lr`` too large for fp16). The loss-scaling tests and ``benchmarks/bench_lossscale.py``
    train with it."""
    import torch

    class HalfSGD(torch.optim.Optimizer):
        def __init__(self, params, lr):
            super().__init__(params, {"lr": lr})

        @torch.no_grad()
        def step(self):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.copy_((p.float() - group["lr"] * p.grad.float()).half())

    return HalfSGD(params, lr)


def run_python(args, *, env, cwd, timeout=600, check=True) -> subprocess.CompletedProcess:
    """``python *args`` in ``cwd`` with exactly ``env``, its text output captured; with ``check``,
    assert that it exits 0 and show the tails of its output where it does not."""
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc
