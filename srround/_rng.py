"""Counter-based random bits: Threefry-2x32-20, one stream for every backend.

Algorithm (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011; the Random123
reference and ``jax.random``'s ``threefry_2x32`` compute the same function):

    key (k0, k1), counter (c0, c1), all 32-bit words; arithmetic modulo 2**32.
    ks = (k0, k1, k0 ^ k1 ^ 0x1BD11BDA)
    x0, x1 = c0 + ks[0], c1 + ks[1]
    for g in 0..4:                                  # 5 groups of 4 rounds = 20 rounds
        for r in (13, 15, 26, 6) if g is even else (17, 29, 16, 24):
            x0 = x0 + x1;  x1 = rotl32(x1, r) ^ x0
        x0 += ks[(g + 1) % 3];  x1 += ks[(g + 2) % 3] + g + 1

The rounds are written out one by one with literal rotations: indexing a tuple of rotations at
run time puts it in local memory on CUDA, several times slower.
``threefry2x32`` computes on Numba's 64-bit integers masked to 32 bits, so the same source is
exact under ``njit``, ``cuda.jit``, the CUDA simulator and plain Python: the reference.
``threefry2x32_i32``, the same function emitted as 32-bit LLVM arithmetic (a GPU has no 64-bit
integer unit: each 64-bit op is two or more 32-bit ones, and a rotation three shifts instead
of one funnel shift; a CPU's vector registers hold twice the lanes), is what the kernels run
(``random_block``).

How srround uses it - the key from the seed, the counter of element ``i`` (``offset + i``),
four 16-bit lanes per block - is the RNG contract, section 1 of ``docs/contracts.md``: element
i's 16 random bits depend only on (seed, offset + i).
"""

from __future__ import annotations

import os

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

MASK32 = 0xFFFFFFFF
_KS_PARITY = 0x1BD11BDA


@njit(forceinline=True, cache=True)
def _rotl32(x, r):
    return ((x << r) | (x >> (32 - r))) & MASK32


@njit(forceinline=True, cache=True)
def _mix(x0, x1, r):
    x0 = (x0 + x1) & MASK32
    x1 = _rotl32(x1, r) ^ x0
    return x0, x1


@njit(forceinline=True, cache=True)
def threefry2x32(k0, k1, c0, c1):
    """Threefry-2x32 with 20 rounds on 32-bit words held in ints; returns ``(x0, x1)``."""
    k0 = k0 & MASK32
    k1 = k1 & MASK32
    k2 = k0 ^ k1 ^ _KS_PARITY
    x0 = (c0 + k0) & MASK32
    x1 = (c1 + k1) & MASK32
    x0, x1 = _mix(x0, x1, 13)
    x0, x1 = _mix(x0, x1, 15)
    x0, x1 = _mix(x0, x1, 26)
    x0, x1 = _mix(x0, x1, 6)
    x0 = (x0 + k1) & MASK32
    x1 = (x1 + k2 + 1) & MASK32
    x0, x1 = _mix(x0, x1, 17)
    x0, x1 = _mix(x0, x1, 29)
    x0, x1 = _mix(x0, x1, 16)
    x0, x1 = _mix(x0, x1, 24)
    x0 = (x0 + k2) & MASK32
    x1 = (x1 + k0 + 2) & MASK32
    x0, x1 = _mix(x0, x1, 13)
    x0, x1 = _mix(x0, x1, 15)
    x0, x1 = _mix(x0, x1, 26)
    x0, x1 = _mix(x0, x1, 6)
    x0 = (x0 + k0) & MASK32
    x1 = (x1 + k1 + 3) & MASK32
    x0, x1 = _mix(x0, x1, 17)
    x0, x1 = _mix(x0, x1, 29)
    x0, x1 = _mix(x0, x1, 16)
    x0, x1 = _mix(x0, x1, 24)
    x0 = (x0 + k1) & MASK32
    x1 = (x1 + k2 + 4) & MASK32
    x0, x1 = _mix(x0, x1, 13)
    x0, x1 = _mix(x0, x1, 15)
    x0, x1 = _mix(x0, x1, 26)
    x0, x1 = _mix(x0, x1, 6)
    x0 = (x0 + k2) & MASK32
    x1 = (x1 + k0 + 5) & MASK32
    return x0, x1


_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))  # of even and odd groups of four rounds


@intrinsic
def threefry2x32_i32(typingctx, k0, k1, c0, c1):
    """``threefry2x32`` emitted as LLVM ``i32`` arithmetic on the low 32 bits of each integer
    argument, round for round; returns ``(x0, x1)`` as uint32. Usable inside compiled code
    only (``njit``, ``cuda.jit``), not from plain Python."""

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)

        def word(value):
            width = value.type.width
            if width > 32:
                return builder.trunc(value, i32)
            return builder.zext(value, i32) if width < 32 else value

        k0, k1, c0, c1 = (word(a) for a in args)
        ks = (k0, k1, builder.xor(builder.xor(k0, k1), i32(_KS_PARITY)))
        x0, x1 = builder.add(c0, ks[0]), builder.add(c1, ks[1])
        for g in range(5):
            for r in _ROTATIONS[g % 2]:
                x0 = builder.add(x0, x1)
                x1 = builder.xor(
                    builder.or_(builder.shl(x1, i32(r)), builder.lshr(x1, i32(32 - r))), x0
                )
            x0 = builder.add(x0, ks[(g + 1) % 3])
            x1 = builder.add(builder.add(x1, ks[(g + 2) % 3]), i32(g + 1))
        return context.make_tuple(builder, signature.return_type, (x0, x1))

    if not all(isinstance(a, types.Integer) for a in (k0, k1, c0, c1)):
        return None
    return types.UniTuple(types.uint32, 2)(k0, k1, c0, c1), codegen


@njit(forceinline=True, cache=True)
def random_block(k0, k1, block):
    """The 64 random bits of counter block ``block`` (= (offset + i) >> 2), as ``(x0, x1)``
    (int64 holding 32-bit words): ``threefry2x32`` in 32-bit arithmetic."""
    x0, x1 = threefry2x32_i32(k0, k1, block, block >> 32)
    return np.int64(x0), np.int64(x1)


@njit(forceinline=True, cache=True)
def lane_bits16(x0, x1, lane):
    """The 16 random bits of ``lane`` (0..3) of a block: x0 low, x0 high, x1 low, x1 high."""
    word = x0 if lane < 2 else x1
    return (word >> (16 * (lane & 1))) & 0xFFFF


def split_seed(seed: int) -> tuple[int, int]:
    """Threefry key words ``(k0, k1)`` of an unsigned 64-bit seed."""
    return seed & MASK32, (seed >> 32) & MASK32


# -- the library generator behind seed=None ------------------------------------------------

_generator = np.random.default_rng()
_manually_seeded = False  # manual_seed called: the seed=None draws are reproducible


def manual_seed(seed: int) -> None:
    """Seed the generator that calls with ``seed=None`` draw their seeds from (like
    ``torch.manual_seed``): after ``manual_seed(s)`` the sequence of such calls is reproducible."""
    global _generator, _manually_seeded
    if seed is None:
        raise TypeError(
            "seed: manual_seed needs an int in [0, 2**64), got None (seed=None is what the"
            " rounding calls take to draw from this generator)"
        )
    _generator = np.random.default_rng(check_seed(seed, "seed"))
    _manually_seeded = True


def _fresh_generator_in_child() -> None:
    """A forked child gets a copy of its parent's generator: without this, every
    ``multiprocessing`` child or DataLoader worker drew the same ``seed=None`` seeds, the
    parent's next ones (correlated noise). A child draws fresh entropy, unless ``manual_seed``
    made the sequence reproducible: then it continues the parent's (call ``manual_seed`` with
    a seed of its own in each worker, as ``worker_init_fn`` does for torch's generator)."""
    global _generator
    if not _manually_seeded:
        _generator = np.random.default_rng()


os.register_at_fork(after_in_child=_fresh_generator_in_child)


def manually_seeded() -> bool:
    """Whether ``manual_seed`` seeded the library generator (else its seeds are fresh entropy,
    a different sequence in every process)."""
    return _manually_seeded


def next_seed() -> int:
    """A fresh 64-bit seed from the library generator."""
    return int(_generator.integers(0, 1 << 64, dtype=np.uint64))


def check_seed(seed, name: str) -> int:
    """Validate a user seed: a Python or NumPy integer in [0, 2**64)."""
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"{name}: expected an int in [0, 2**64) or None, got {type(seed).__name__}")
    seed = int(seed)
    if not 0 <= seed < 1 << 64:
        raise ValueError(f"{name}: expected an int in [0, 2**64), got {seed}")
    return seed


def check_offset(offset, name: str = "offset") -> int:
    """Validate a stream offset: an int in [0, 2**62)."""
    if isinstance(offset, (bool, np.bool_)) or not isinstance(offset, (int, np.integer)):
        raise TypeError(f"{name}: expected a non-negative int, got {type(offset).__name__}")
    offset = int(offset)
    if not 0 <= offset < 1 << 62:
        raise ValueError(f"{name}: expected an int in [0, 2**62), got {offset}")
    return offset
