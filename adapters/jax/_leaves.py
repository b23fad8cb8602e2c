"""The native step's loops: how a tree's leaves become XLA loops and where each loop gets the
random bits of its elements. The entry point is ``_native_leaves`` (one XLA loop per leaf, or
per group of small leaves; on one CPU device random lanes made a run of leaves at a time,
elsewhere computed in each leaf's loop from its global indices). What a leaf computes - the
AdamW, SGD and ``apply_updates`` math, the ``update`` functions - is ``optim.py``'s."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _pallas
from ._callback import random_lanes
from ._lax import _element_index, _opaque, _random16, _threefry2x32, _u

_U32 = jnp.uint32


@functools.partial(jax.jit, static_argnames=("update", "cfg", "global_shape", "lane0"))
def _leaf_call(arrays, k0, k1, hi, start_lo, lane0, origin, extra, *, update, cfg, global_shape):
    """``update(cfg, *arrays, bits, *extra)`` of one leaf (``arrays[0]`` gives its shape) at
    global element ``start = 4 start_lo + lane0`` (``start_lo`` a traced uint32 scalar, so
    leaves of the same shapes and dtypes are traced and lowered once; ``lane0`` in 0-3, static:
    with 0, a GPU thread's four elements share one Threefry block, see ``_element_index``),
    ``bits(stream)`` the random bits of its elements: counters whose high word is ``hi +
    stream`` (``hi``: a traced uint32, ``4 t`` at step ``t``). ``origin`` (traced uint32 scalars or
    ``None``, one per dimension): where the leaf's elements are in its ``global_shape`` (a
    block of a sharded leaf inside ``shard_map``; zeros for a whole leaf, or ``global_shape``
    None): its elements use the counters of their global indices."""
    shape = arrays[0].shape

    def bits(stream):
        index = _element_index(shape, origin, global_shape)
        return _random16(k0, k1, start_lo, hi + _U32(stream), lane0, index)

    return update(cfg, *arrays, bits, *extra)


def _dtypes(x):
    """The dtype of a leaf's buffer (a tuple of them for an fp8 state pair; None: absent)."""
    if isinstance(x, tuple):
        return tuple(jnp.dtype(e.dtype) for e in x)
    return None if x is None else jnp.dtype(x.dtype)


@functools.partial(jax.jit, static_argnames=("update", "cfg"))
def _shared_leaf_call(arrays, lanes, start, extra, *, update, cfg):
    """``update(cfg, *arrays, bits, *extra)`` of one leaf whose elements have the random lanes
    (uint16) of ``lanes[stream]`` from position ``start`` (a uint32 scalar) on: a dynamic
    slice, read in the leaf's loop."""
    shape, size = arrays[0].shape, arrays[0].size

    def bits(stream):
        window = lax.dynamic_slice(lanes[stream], (start,), (size,))
        return window.reshape(shape).astype(_U32)

    return _packed(lambda: update(cfg, *arrays, bits, *extra), shape, start)


_SMALL_LEAF = 1 << 14  # leaves up to this size are updated together (``_small_leaves_call``)


@functools.partial(jax.jit, static_argnames=("update", "cfg"))
def _small_leaves_call(arrays, lanes, probe, extra, *, update, cfg):
    """``update(cfg, *arrays, bits, *extra)`` of several small leaves of the same dtypes in
    one loop: ``arrays[i]`` holds input ``i`` of every leaf (``None`` where absent),
    ``lanes[stream]`` the random lanes (uint16) of their elements, leaf after leaf
    (``_small_lanes``); ``probe``: a uint32 XLA cannot evaluate. The leaves are flattened and
    concatenated, and the outputs split back: XLA's compile time grows with the loops of a
    program more than with their sizes, and copying a small leaf costs little. Same bits (the
    update is elementwise)."""
    shapes = [x.shape for x in arrays[0]]
    sizes = [x.size for x in arrays[0]]

    def joined(leaves):
        if leaves[0] is None:
            return None
        return jnp.concatenate([x.reshape(-1) for x in leaves])

    flat = tuple(joined(leaves) for leaves in arrays)

    def bits(stream):
        return lanes[stream][: sum(sizes)].astype(_U32)

    def compute():
        return _packed(lambda: update(cfg, *flat, bits, *extra), (sum(sizes),), probe)

    # computed in a conditional XLA cannot evaluate, so the outputs are buffers the slices
    # below read: XLA would otherwise copy the math into each slice's loop
    zero = _u(probe) & ~_u(probe)
    absent = jax.tree_util.tree_map(lambda o: jnp.zeros(o.shape, o.dtype), jax.eval_shape(compute))
    outs = lax.cond(zero == 0, compute, lambda: absent)
    # each leaf's slice at a runtime offset: slices of one size are one kernel (at constant
    # offsets every slice is a kernel of its own, about 20 ms of XLA compile time each)
    within = dict(enumerate(np.cumsum([0] + sizes[:-1]).tolist()))
    of_leaf = split_joined(within, sizes, shapes, (probe,))
    return [tuple(None if o is None else of_leaf(o, k) for o in outs) for k in range(len(sizes))]


def host_units(live, columns, pack: bool) -> list[list[int]]:
    """The leaves ``live`` of a host call as units, each one operand per column (``columns``:
    per-leaf lists, the first the params): with ``pack`` (whole leaves on one CPU device),
    small leaves (``_SMALL_LEAF``) of the same dtypes in every column share a unit,
    their buffers joined; every other leaf is a unit of its own. XLA's compile time grows
    faster than linearly with a custom call's operands (``docs/performance.md``)."""
    if not pack:
        return [[i] for i in live]
    units: list[list[int]] = []
    joined: dict[tuple, list[int]] = {}
    for i in live:
        if columns[0][i].size > _SMALL_LEAF:
            units.append([i])
            continue
        kind = tuple(_dtypes(col[i]) for col in columns)
        if kind not in joined:
            joined[kind] = []
            units.append(joined[kind])
        joined[kind].append(i)
    return units


def joined_runs(units, sizes, stream_starts, max_gap=0):
    """Per unit of leaves (``host_units``), ``None`` for a single leaf, else the runs of its
    joined buffer as ``(buffer start, length, stream position)``, leaves that follow one
    another in the stream merged into one run; each joined leaf's buffer start; and the gaps
    taken in: with ``max_gap``, up to that many stream positions between two leaves of a unit
    become part of its buffer (``gaps[i]``: the zeros before leaf ``i``, ``join_units``),
    so that the two are one run."""
    joined: list[Any] = []
    within: dict[int, int] = {}
    gaps: dict[int, int] = {}
    for u in units:
        if len(u) == 1:
            joined.append(None)
            continue
        runs: list[tuple[int, int, int]] = []
        at = 0
        for i in u:
            gap = stream_starts[i] - (runs[-1][2] + runs[-1][1]) if runs else -1
            if 0 <= gap <= max_gap:
                if gap:
                    gaps[i], at = gap, at + gap
                runs[-1] = (runs[-1][0], runs[-1][1] + gap + sizes[i], runs[-1][2])
            else:
                runs.append((at, sizes[i], stream_starts[i]))
            within[i], at = at, at + sizes[i]
        joined.append(tuple(runs))
    return joined, within, gaps


def join_units(leaves, units, gaps=None):
    """Per unit: its leaf, or its leaves flattened and joined, ``gaps[i]`` zeros before leaf
    ``i`` (``joined_runs``; ``None``: absent)."""
    gaps = gaps or {}

    def joined(u):
        pieces = []
        for i in u:
            if i in gaps:
                pieces.append(jnp.zeros(gaps[i], leaves[i].dtype))
            pieces.append(leaves[i].reshape(-1))
        return jnp.concatenate(pieces)

    return [leaves[u[0]] if len(u) == 1 or leaves[u[0]] is None else joined(u) for u in units]


def split_joined(within, sizes, shapes, probes):
    """``of_leaf(result, k)``: leaf ``k``'s piece (``sizes[k]`` elements, reshaped to
    ``shapes[k]``) of its unit's ``result``, for the joined leaves in ``within`` (their buffer
    starts) sliced out at runtime offsets (``_opaque`` of ``probes``: slices of one size are
    one kernel for XLA; at constant offsets each would be one of its own); any other leaf's
    result as it is."""
    offset_of = dict(zip(within, _opaque(list(within.values()), probes))) if within else {}

    def of_leaf(result, k):
        if k not in offset_of:
            return result
        return lax.dynamic_slice(result, (offset_of[k],), (sizes[k],)).reshape(shapes[k])

    return of_leaf


def _packed(compute, shape, probe):
    """``compute()`` (a tuple of arrays or ``None``), its outputs of ``shape`` computed in one
    loop: XLA's CPU backend emits a loop per output and copies the math the outputs share into
    each (with bf16 states, the AdamW math three times). Where the outputs are 8- or 16-bit
    and fit 64 bits per element, they are computed as one array of their bit patterns side by
    side, in the taken branch of a conditional on the opaque uint32 ``probe`` (so XLA cannot
    fuse it into the readers), and split from it. Same values, bit for bit."""
    outs = jax.eval_shape(compute)
    live = [k for k, o in enumerate(outs) if o is not None]
    if any(isinstance(outs[k], tuple) for k in live):  # fp8 states: (moments, block scales)
        return compute()
    widths = [jnp.dtype(outs[k].dtype).itemsize * 8 for k in live]
    if (
        len(live) < 2
        or sum(widths) > 64
        or max(widths) > 16  # a float32 output is written once and read by the others
        or any(outs[k].shape != tuple(shape) for k in live)
        or isinstance(probe, (int, np.integer))
    ):
        return compute()
    with jax.enable_x64(True):
        word = jnp.uint32 if sum(widths) <= 32 else jnp.uint64

        def taken():
            values = compute()
            total, shift = None, 0
            for k, w in zip(live, widths):
                bits = lax.bitcast_convert_type(values[k], jnp.dtype(f"uint{w}")).astype(word)
                bits = bits << word(shift) if shift else bits
                total = bits if total is None else total | bits
                shift += w
            return total

        zero = _u(probe) & ~_u(probe)
        packed = lax.cond(zero == 0, taken, lambda: jnp.zeros(tuple(shape), word))
        result, shift = list(outs), 0
        for k, w in zip(live, widths):
            bits = (packed >> word(shift)) if shift else packed
            result[k] = lax.bitcast_convert_type(bits.astype(jnp.dtype(f"uint{w}")), outs[k].dtype)
            shift += w
    return tuple(result)


# random lanes of one run of leaves, all streams together, on one CPU device: below glibc's
# largest mmap threshold (32 MiB), so XLA's buffer for them is heap memory it reuses from call
# to call, not fresh pages (a page fault per 4 KiB: ~1 ms per 5 MiB on the 2-core CI machine)
_LANE_BYTES = 16 << 20


def _chunk_lanes(k0, k1, highs, first, count: int, zero):
    """The 16-bit random lanes (uint16, one row per counter high word in ``highs``) of the
    ``4 * count`` stream positions from block ``first`` on (uint32, traced): position ``i``
    is lane ``i & 3`` of the Threefry block ``first + (i >> 2)`` (``_lax._random16``), so a
    leaf reads its bits as one contiguous window. Computed in a conditional on ``zero`` (a
    uint32 0 XLA cannot evaluate), which keeps it out of its readers' loops (each would
    compute the Threefry again)."""
    shape = (len(highs), count, 4)

    def lanes():
        blocks = lax.broadcasted_iota(_U32, shape, 1) + first
        lane = lax.broadcasted_iota(_U32, shape, 2)
        high = jnp.stack([_u(h) for h in highs])[:, None, None]
        x0, x1 = _threefry2x32(k0, k1, blocks, high)
        word = jnp.where(lane < 2, x0, x1)
        return ((word >> ((lane & 1) << 4)) & 0xFFFF).astype(jnp.uint16).reshape(len(highs), -1)

    return lax.cond(zero == 0, lanes, lambda: jnp.zeros((len(highs), 4 * count), jnp.uint16))


def _small_lanes(k0, k1, highs, starts, sizes, zero):
    """The 16-bit random lanes (uint16, one row per counter high word in ``highs``) of the
    elements of leaves at stream positions ``starts`` (uint32, traced) of ``sizes``, leaf after
    leaf, each element computing its Threefry block (few elements); in a conditional on
    ``zero`` as ``_chunk_lanes``."""
    positions = jnp.concatenate([lax.iota(_U32, n) + s for s, n in zip(starts, sizes)])

    def lanes():
        rows = [_random16(k0, k1, _U32(0), h, 0, positions) for h in highs]
        return jnp.stack(rows).astype(jnp.uint16)

    return lax.cond(zero == 0, lanes, lambda: jnp.zeros((len(highs), positions.size), jnp.uint16))


def _lane_chunks(starts, sizes, leaves, limit: int) -> list[list[int]]:
    """``leaves`` (indices, in order of their starts) in runs whose positions span at most
    ``limit`` (a larger leaf alone): each run's random lanes are one buffer."""
    chunks: list[list[int]] = []
    base = 0
    for k in sorted(leaves, key=lambda k: starts[k]):
        if not chunks or starts[k] + sizes[k] - base > limit:
            chunks.append([])
            base = starts[k] & ~3
        chunks[-1].append(k)
    return chunks


def _zero_after(outputs, zero):
    """A uint32 0 read from the first element of each array in ``outputs``, in a conditional
    on ``zero`` (a uint32 0 XLA cannot evaluate): what depends on it runs after the loops that
    wrote them. Read outside a conditional, XLA would fuse a copy of those loops into the
    read, reading their inputs after the loops overwrote them in place."""

    def read(leaves):
        result = _U32(0)
        for a in leaves:
            width = jnp.dtype(a.dtype).itemsize * 8
            bits = lax.bitcast_convert_type(a.reshape(-1)[0], jnp.dtype(f"uint{width}"))
            result = result | (bits.astype(_U32) & ~bits.astype(_U32))
        return result

    leaves = jax.tree_util.tree_leaves(outputs)
    return lax.cond(zero == 0, read, lambda leaves: _U32(0), leaves)


def _lanes_by_stream(streams, lax_lanes, host_lanes, host_bits: bool):
    """``{stream: its row of lanes}``: ``host_lanes()`` where the program is lowered for the
    CPU and ``host_bits`` is set, else ``lax_lanes()`` (the same lanes; ``{}`` without
    streams). ``lax.platform_dependent``, so a program traced on a CPU machine and lowered for
    a GPU (``jax.export``) takes no host call; both are traced (a few ops each)."""
    if not streams:
        return {}
    if host_bits:
        rows = lax.platform_dependent(cpu=host_lanes, default=lax_lanes)
    else:
        rows = lax_lanes()
    return {s: rows[i] for i, s in enumerate(streams)}


def _one_cpu_leaves(update, cfg, columns, starts, k0, k1, t, extras, host_bits):
    """``_native_leaves`` on one CPU device (see there); ``host_bits``: the random lanes from
    the Numba kernels (``_callback.random_lanes``), else from ``jax.lax`` ops."""
    n, sizes = len(starts), [x.size for x in columns[0]]
    small: dict[tuple, list[int]] = {}  # small leaves by their dtypes and extra arguments
    big = []
    for k in range(n):
        kind = tuple(_dtypes(col[k]) for col in columns)
        if sizes[k] <= _SMALL_LEAF and not any(isinstance(d, tuple) for d in kind):
            small.setdefault(kind + (id(extras[k]),), []).append(k)
        else:
            big.append(k)
    streams = _streams(update, cfg, columns, extras[0])
    # positions per run; with several streams (bf16 states) the leaves' loops keep about as
    # many bytes of packed outputs alive as the lanes take: half the lanes, so XLA's whole
    # temporary buffer stays below the mmap threshold too (bf16 states, 24.6M params: 37.7 MB
    # of temporaries and 9,600 page faults a step with 16 MiB of lanes, 18.6 MB and none with 8)
    budget = _LANE_BYTES if len(streams) <= 1 else _LANE_BYTES // 2
    limit = max(4, budget // (2 * max(1, len(streams))) & ~3)
    chunks = _lane_chunks(starts, sizes, big, limit)
    bases = [starts[ks[0]] & ~3 for ks in chunks]
    base_of = {k: b for b, ks in zip(bases, chunks) for k in ks}
    # runtime scalars, so loops of the same shapes are one kernel: every leaf's start (in its
    # run's lanes, or in the stream for a small leaf) and every run's first block
    words = _opaque(
        [starts[k] - base_of.get(k, 0) for k in range(n)] + [b >> 2 for b in bases], (k0, k1, t)
    )
    high = _u(t) * _U32(4)
    highs = [high + _U32(s) for s in streams]  # counter high word of each stream

    outs: list[Any] = [None] * n
    for group in small.values():
        at, count = [words[k] for k in group], [sizes[k] for k in group]
        zero = words[group[0]] & ~words[group[0]]
        lanes = _lanes_by_stream(
            streams,
            lambda: _small_lanes(k0, k1, highs, at, count, zero),
            lambda: random_lanes(
                k0, k1, high, [(starts[k], sizes[k]) for k in group], zero, streams
            ),
            host_bits,
        )
        arrays = tuple(tuple(col[k] for k in group) for col in columns)
        extra = extras[group[0]]
        results = _small_leaves_call(arrays, lanes, words[group[0]], extra, update=update, cfg=cfg)
        for k, o in zip(group, results):
            outs[k] = o
    after = None
    for c, ks in enumerate(chunks):
        first = words[n + c]
        zero = first & ~first if after is None else (first & ~first) | after
        span = max(starts[k] + sizes[k] for k in ks) - bases[c]
        # runs but the last have lanes of one size (one kernel), the last only what it needs
        count = -(-(span if c == len(chunks) - 1 else max(span, limit)) // 4)
        lanes = _lanes_by_stream(
            streams,
            lambda: _chunk_lanes(k0, k1, highs, first, count, zero),
            lambda: random_lanes(k0, k1, high, [(bases[c], 4 * count)], zero, streams),
            host_bits,
        )
        for k in ks:
            arrays = tuple(col[k] for col in columns)
            outs[k] = _shared_leaf_call(arrays, lanes, words[k], extras[k], update=update, cfg=cfg)
        # the next run's lanes come after this run's last loop (XLA keeps that order for the
        # others), so they reuse its buffer: a few MiB of lanes, not 2 bytes per element
        after = _zero_after(outs[ks[-1]], zero)
    return outs


def _streams(update, cfg, columns, extra) -> list[int]:
    """The streams ``update`` draws random bits from, by an abstract trace of each kind of
    leaf (its dtypes)."""
    needed, kinds = set(), set()
    for k in range(len(columns[0])):
        arrays = tuple(c[k] for c in columns)
        kind = tuple(_dtypes(a) for a in arrays)
        if kind in kinds:
            continue
        kinds.add(kind)

        def probe(arrays, extra):
            def bits(stream):
                needed.add(stream)
                return jnp.zeros(arrays[0].shape, _U32)

            return update(cfg, *arrays, bits, *extra)

        jax.eval_shape(probe, arrays, extra)
    return sorted(needed)


def _on_one_cpu(leaves) -> bool:
    """Whether the leaves are computed on one CPU device: the CPU backend (elsewhere the
    Threefry rounds in each leaf's loop cost no compile time worth a buffer of random bits)
    and no leaf laid out over several devices (its abstract value's mesh: set under ``jit``
    with sharded arrays and inside ``shard_map``) nor split in its type on a mesh of one
    device (explicit axes: leaves of different specs cannot be concatenated)."""
    if jax.default_backend() != "cpu":
        return False
    for x in leaves:
        sharding = getattr(jax.typeof(x), "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        if mesh is None or mesh.empty:
            continue
        if mesh.size > 1 or any(entry is not None for entry in sharding.spec):
            return False
    return True


def _native_leaves(
    update, cfg, columns, starts, k0, k1, t, extras=None, layouts=None, host_bits=False
):
    """``update(cfg, *arrays, bits, *extras[k])`` (a tuple of arrays or ``None``) for every
    leaf ``k``: ``columns`` holds per input a list of nonempty leaves (``None`` where absent),
    leaf ``k`` at global element ``starts[k]``; ``bits(stream)`` gives the random bits of its
    elements (counter ``t * 2**36 + stream * 2**34 + starts[k] + j``); ``extras[k]``: the
    leaf's extra arguments (default none; e.g. coefficients with or without weight decay,
    optax's ``mask``: leaves that share one object share a loop). Each leaf is a loop of its own
    over its buffers (nothing concatenated or sliced back), made in one of two ways (the same
    bits).

    * on one CPU device (``_one_cpu_leaves``): the leaves in runs whose random bits are one
      buffer of 16-bit lanes of at most ``_LANE_BYTES`` (a leaf with more elements is a run
      of its own), made by ``jax.lax`` ops or, with ``host_bits``, by the Numba kernels (one
      Threefry block per four elements); each leaf's loop reads its window of them. The runs
      follow one another, so their buffers reuse one block of XLA's memory (lanes for the
      whole tree would be 2 bytes per element and stream, fresh pages every call).
      Leaves of up to ``_SMALL_LEAF`` elements with the same dtypes share one loop.
    * otherwise (GPU, TPU; laid out over several devices: ``jit`` with sharded arrays,
      ``shard_map``): every leaf's loop computes its bits from the global element indices
      (``_leaf_call``), so it stays elementwise and keeps its leaf's sharding.

    Compile time: the leaf starts reach the loops as runtime scalars (``_lax._opaque``; their
    first lane, 0-3, as a constant), so the loops of leaves with the same shapes and dtypes are
    one computation, which XLA's CPU backend compiles once (a start folded in as a constant
    makes every leaf's loop a kernel of its own); on one CPU device no big leaf's loop carries
    Threefry rounds.
    ``layouts[k]``: ``(origin, global_shape)`` of a block of a sharded leaf inside
    ``shard_map`` (``None``: the whole leaf). Returns the per-leaf tuples."""
    if not starts:  # no leaf, or only empty ones (before: an IndexError)
        return []
    layouts = layouts or [None] * len(starts)
    extras = extras or [()] * len(starts)
    if all(lay is None for lay in layouts) and _on_one_cpu(columns[0]):
        return _one_cpu_leaves(update, cfg, columns, starts, k0, k1, t, extras, host_bits)
    words = _opaque([s >> 2 for s in starts], (k0, k1, t))
    outs = []
    for k, layout in enumerate(layouts):
        shape = columns[0][k].shape
        # a zero of the leaf's own (its start word differs from leaf to leaf) in the origin of
        # its leading dimensions. Leaves of one shape would otherwise share the row offsets of
        # their element indices (a small array), and XLA's GPU backend merges loops that share
        # an operand into one kernel (sibling multi-output fusion): 8 AdamW leaves of 8.4M
        # elements became one kernel of 152 registers a thread; one per leaf takes 48 (sm_90).
        # A whole leaf's column origin stays a known 0 (``_element_index``).
        zero = words[k] & ~words[k]
        if layout is None:
            origin, global_shape = (zero,) * (len(shape) - 1) + (None,), None
        else:
            origin, global_shape = tuple(_u(o) + zero for o in layout[0]), layout[1]
        arrays = tuple(c[k] for c in columns)
        call = _leaf_call
        if _pallas.takes(update, arrays):
            call = functools.partial(_pallas.leaf_call, _leaf_call)
        outs.append(
            call(
                arrays,
                k0,
                k1,
                _u(t) * _U32(4),
                words[k],
                starts[k] & 3,
                origin,
                extras[k],
                update=update,
                cfg=cfg,
                global_shape=global_shape,
            )
        )
    return outs
