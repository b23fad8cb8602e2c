"""Optimizer steps for JAX pytrees with srround's rounding: ``apply_updates`` and fused ``adamw``.

``apply_updates(params, updates, seed, *, step=None, impl=None)`` - a drop-in for
``optax.apply_updates``: bf16/fp16 leaves become ``SR(p + u)`` (``stochastic_add``: the sum in
float32 with one rounding, then stochastically rounded), float32 leaves ``p + u`` as optax does.
``stochastic_write_back(seed)`` - the same write-back as an optax transformation, last in a
chain, for frameworks that call ``optax.apply_updates`` themselves (flax).

``adamw(learning_rate, b1, b2, eps, weight_decay, *, seed, rounding, state_dtype, impl)`` - the
fused AdamW of ``srround.adamw_step`` (torch.optim.AdamW's math, float32, explicit fma, the weight
modes ``stochastic``, ``nearest``, ``kahan``, ``master``, ``remainder``), bit for bit
``srround.adamw_step`` on NumPy copies of the same buffers:

* ``tx.init(params) -> AdamWState``; ``tx.step(grads, state, params, *, found_inf=None,
  inv_scale=None) -> (new_params, new_state)``: the fused path. It returns the parameters
  because stochastic rounding happens in the write-back: an optax ``update`` returns updates and
  ``optax.apply_updates`` adds them with round-to-nearest, which cannot stochastically round.
* ``tx`` is also an ``optax.GradientTransformationExtraArgs`` (when optax is installed):
  ``tx.update(grads, state, params)`` runs ``step`` and returns float32 ``updates`` with
  ``float32(p + u) == new_params`` (``new - p``, nudged by one ulp where that subtraction
  rounded), so ``optax.apply_updates(params, updates)`` (``(p + u).astype(p.dtype)``)
  reproduces ``new_params`` - stochastic rounding included - except in rare cases where no
  such float32 ``u`` exists (an fp32 weight moving far relative to its magnitude, toward zero
  or away from it: 0.4 % of N(0, 1) weights in an AdamW step at lr 1e-2; bf16/fp16 weights
  whose exponent changes by more than ~16). ``step`` is exact
  always and does less work: prefer it (or ``optax.adamw`` plus ``apply_updates`` here).
  ``update`` needs ``params`` and must come last in an ``optax.chain``; it takes ``step``'s
  ``found_inf`` and ``inv_scale`` as optax's extra arguments (``flax.nnx.Optimizer.update``
  hands its keyword arguments on), other extra arguments are ignored as optax does.

Random stream (the one of the fused kernels, ``srround.adamw_step``): the leaves in
``jax.tree_util.tree_leaves`` order are one tensor list; leaf ``k`` starts at global element
``starts[k]`` (the sum of the sizes of the leaves before it). At step ``t`` (1-based) element
``j`` of leaf ``k`` rounds with counter ``t * 2**36 + stream * 2**34 + starts[k] + j`` (stream
0 weights, 1 exp_avg, 2 exp_avg_sq - bf16 states only). ``apply_updates`` uses the weight
stream of step ``step`` (``step * 2**36 + starts[k] + j``), or ``starts[k] + j`` when
``step=None``: then the key must change every step (``jax.random.fold_in(key, step)``) - reusing
a key (or int seed) with ``step=None`` reuses the same noise. ``adamw``'s seed is fixed for the
run: the step count in the state moves the stream.

Seeds: an int in [0, 2**64) or a JAX PRNG key (``srround.adapters.jax._api``: key
data ``(w0, w1)`` equals the int seed ``w0 | w1 << 32``).

Implementations (``impl``):

* ``None`` (default): for ``adamw`` and ``sgd`` the callback path where the program is lowered
  for the CPU (``lax.platform_dependent``) - on a CPU the Numba step in XLA's own buffers runs a
  step in less time than ``optax.adamw`` and compiles in less (``benchmarks/bench_optim.py
  --jax``) - and native elsewhere (optax's ``mask``: one host call for the leaves inside it,
  one for those outside); native for the settings the host step does not take (``nesterov``,
  ``eps_root``, another ``mu_dtype``, fp8 states), with the random lanes from the host on
  one CPU device as ``apply_updates`` below. For
  ``apply_updates`` the native path, except that on one CPU device (where the program is
  lowered for the CPU) its random lanes come from the Numba kernels through the FFI target
  (``_callback.random_lanes``: one Threefry block per four elements) - the same bits.
* ``"native"``: ``jax.lax`` only, jit-able on any backend, with the Threefry stream
  and rounding of ``_lax.py``. Every fma of the AdamW math is exact (``_fma``: float64 ops
  rounded to odd, subnormals in integer ops), and so is the sum of ``apply_updates`` (``_add``:
  float32 and integer ops); the other float32 ops are single IEEE ops. Bits can differ from
  the Numba kernels where a state, weight, gradient or intermediate is subnormal
  (|x| < 2**-126): XLA's CPU backend (and TPU) flushes float32 subnormals to zero. ``_fma``
  and the bias corrections need IEEE float64 (traced under ``jax.enable_x64``): CPU and GPU;
  TPU emulates float64 and may differ in the last bit. How the leaves become XLA loops and
  where each gets its random bits (on one CPU device, runs of leaves sharing a buffer of
  random lanes; elsewhere, each leaf's bits from its elements' global indices): ``_leaves.py``
  (``_native_leaves``), the same bits either way.
* ``"callback"``: host calls (``_callback.py``) into ``srround.adamw_step`` (one for the whole
  tree) / ``srround.stochastic_add`` (one for all leaves), per shard under ``jit``, with IEEE
  subnormals. On the CPU they update XLA's result buffers in place (donated params and
  states: their own buffers, no copy); elsewhere they are device -> host -> device copies.

``found_inf`` (a scalar; nonzero/True/NaN means skip): the step returns params and state
unchanged (``lax.cond``), the step count included, with no host synchronisation. An array
``inv_scale`` that is not a positive finite float32 skips the step the same way, on both
implementations (a Python float must be one: ``ValueError``), and so does a learning rate
given at run time (a schedule's, an injected one) that is negative, NaN or inf, or for which
AdamW's ``lr / (1 - b1)`` or ``1 - lr * weight_decay`` is beyond float32.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from srround import _optim, _state8, _validate
from srround._api import StepReuse
from srround._formats import FORMATS

from . import _leaves
from ._api import _key_words, _straight_through, check_arrays, refuse_host_float64
from ._callback import (
    _callback,
    _host,
    _origin_arg,
    _per_shard,
    _runs,
    _seed_of,
    stochastic_add_leaves,
    varying_as,
)
from ._lax import (
    _check_split,
    _decode,
    _encode,
    _shard_layout,
    _u,
    block_element,
    canonical_nan,
    div,
    element_value,
    exact_ops,
    mul_bits,
    narrow,
    sqrt,
)
from ._leaves import _native_leaves
from ._pallas import elementwise

__all__ = [
    "ADAMW_STATIC_ARGS",
    "SGD_STATIC_ARGS",
    "AdamWState",
    "SGDState",
    "WriteBackState",
    "adamw",
    "apply_updates",
    "sgd",
    "stochastic_write_back",
]

_U32 = jnp.uint32
_NARROW = {jnp.dtype(jnp.bfloat16): "bfloat16", jnp.dtype(jnp.float16): "float16"}
_ROUNDINGS = tuple(_optim.MODES)
_GRAD_DTYPES = (jnp.dtype(jnp.float32), *_NARROW)


def _impl(impl, default="native") -> str:
    if impl is None:
        return default
    if impl not in ("native", "callback"):
        raise ValueError(f"impl: expected 'native', 'callback' or None, got {impl!r}")
    return impl


def _starts(shapes) -> list[int]:
    """Global element where each leaf starts (``shapes``: leaves or their global shapes)."""
    starts, total = [], 0
    for shape in shapes:
        starts.append(total)
        total += int(
            np.prod(shape if isinstance(shape, tuple) else np.shape(shape), dtype=np.int64)
        )
    if total >= _optim.MAX_ELEMENTS:
        raise ValueError(f"params: {total} elements, at most {_optim.MAX_ELEMENTS - 1} per step")
    return starts


def _f32(bits):
    return lax.bitcast_convert_type(bits, jnp.float32)


def _b32(x):
    return lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), _U32)


def _wide(x, exact: bool):
    """float64 value of float32 ``x``. ``exact``: subnormals too, needed for values read from
    buffers: XLA's CPU backend and TPUs convert them to zero, so there they are rebuilt from
    their bits; XLA's GPU backend converts them as IEEE does (``xla_gpu_ftz`` is off by
    default, as for ``_add``), so on CUDA it is the conversion (on an H100 the fused step kept
    its bits and took 5 % less time). The results of float32 ops are flushed on the CPU
    already. Call under ``jax.enable_x64``."""
    if not exact:
        return x.astype(jnp.float64)
    return lax.platform_dependent(x, cuda=_wide_by_conversion, default=_wide_from_bits)


def _wide_by_conversion(x):
    return x.astype(jnp.float64)


def _wide_from_bits(x):
    bits = _b32(x)
    tiny = (bits & 0x7FFFFF).astype(jnp.float64) * 2.0**-149  # a subnormal's quanta
    tiny = jnp.where((bits >> 31) == 1, -tiny, tiny)
    return jnp.where((bits & 0x7F800000) == 0, tiny, x.astype(jnp.float64))


_SIGN = np.uint32(0x80000000)


def _add(u, w):
    """``u + w`` of float32 arrays read from buffers, rounded once (to nearest even),
    subnormals included (the bits of ``_fma(1, u, w)``), a NaN as +qNaN. XLA's GPU backend
    adds float32 as IEEE does (``add.rn.f32``: subnormals kept, as ``xla_gpu_ftz`` is off by
    default), so on CUDA it is one add; elsewhere (XLA's CPU backend and TPUs flush
    subnormals) ``_add_flushing``."""
    return lax.platform_dependent(u, w, cuda=_add_ieee, default=_add_flushing)


def _add_ieee(u, w):
    return _f32(canonical_nan(_b32(u + w)))


def _add_flushing(u, w):
    """``_add`` in float32 and integer ops on a backend that flushes subnormals. Where the
    larger magnitude is at least 2**-60 the float32 sum is right even with subnormals flushed:
    a subnormal operand is below half an ulp of the other, and the sum is 0 or normal. Below,
    both operands are scaled by 2**64 in integer ops (a subnormal's quanta through an exact
    int -> float conversion), added - normal operands, and a sum rounded as the unscaled one
    (normal) or exact (a multiple of 2**-85 below 2**-62) - and scaled back in integer ops.
    NaN/inf operands: the float32 sum, a NaN as +qNaN."""
    ub, wb = _b32(u), _b32(w)
    big = jnp.maximum(ub & 0x7FFFFFFF, wb & 0x7FFFFFFF) >= 0x21800000  # 2**-60

    def scaled(b):  # b * 2**64 (finite |b| < 2**-60)
        magnitude = b & 0x7FFFFFFF
        quanta = magnitude.astype(jnp.int32).astype(jnp.float32) * np.float32(2.0**-85)
        subnormal = _b32(quanta) | (b & _SIGN)
        return _f32(jnp.where(magnitude < 0x00800000, subnormal, b + (64 << 23)))

    total = _b32(scaled(ub) + scaled(wb))
    magnitude = total & 0x7FFFFFFF
    quanta = (_f32(magnitude) * np.float32(2.0**85)).astype(_U32)  # a sum below 2**-126
    small = jnp.where(magnitude >= 0x20800000, total - (64 << 23), (total & _SIGN) | quanta)
    return _f32(jnp.where(big, canonical_nan(_b32(u + w)), small))


def _fma(a, b, c, exact=(True, True, True)):
    """``fma(a, b, c)`` of float32 arrays/scalars with one rounding (to nearest even), the bits
    of the adapter's integer ``_fma_bits`` and of the Numba kernels' fma, in float64 ops.
    Finite operands: ``a * b`` is exact in float64 (48-bit significand); ``s = a * b + c``
    rounds once more, so ``s`` is rounded to odd (TwoSum gives its error ``e``; an inexact ``s``
    is truncated toward zero - one ulp down in magnitude where ``e`` points inward - and its
    last bit set: fewer ops on a GPU than a select between ``s`` +- 1 ulp, 984 -> 928 SASS
    instructions in the fused step's kernel), which makes the rounding to float32 (24
    <= 53 - 2 bits) that of ``a * b + c``. Infinities follow from the float64 ops (a float32
    product cannot overflow float64); a NaN result is +qNaN (``_lax.narrow``), as all of
    srround's arithmetic. Needs IEEE float64 (CPU, GPU). ``exact``: per operand, as
    ``_wide``. Each operand is read once (an expensive producer, such as a division, read
    twice would be materialized by XLA's CPU fusion); the result's last op takes several
    arrays, so XLA writes it once for all its users. Inside a Pallas kernel: its ``fma``
    (``_lax.kernel_ops``)."""
    if (ops := exact_ops()) is not None:
        return ops.fma(a, b, c)
    with jax.enable_x64(True):
        a, b, c = (_wide(jnp.asarray(v, jnp.float32), e) for v, e in zip((a, b, c), exact))
        p = a * b
        s = p + c
        bb = s - p
        e = (p - (s - bb)) + (c - bb)  # s + e == p + c exactly (TwoSum)
        sb = lax.bitcast_convert_type(s, jnp.uint64)
        eb = lax.bitcast_convert_type(e, jnp.uint64)
        inexact = jnp.abs(e) > 0  # not where s is inf or NaN (e is NaN)
        # to odd: toward zero (one ulp down where e points inward), then the last bit set
        inward = inexact & ((sb ^ eb) >> 63 == 1)
        toward_zero = jnp.where(inward, sb - 1, sb)
        s = lax.bitcast_convert_type(toward_zero | inexact.astype(jnp.uint64), jnp.float64)
        return narrow(s)


def _widen_bits(x):
    """Exact fp32 patterns (uint32) of a float32/bf16/fp16 array."""
    name = _NARROW.get(jnp.dtype(x.dtype))
    if name is None:
        if x.dtype != jnp.float32:
            raise TypeError(f"expected a float32, bfloat16 or float16 array, got {x.dtype}")
        return lax.bitcast_convert_type(x, _U32)
    h = lax.bitcast_convert_type(x, jnp.uint16).astype(_U32)
    return h << 16 if name == "bfloat16" else _decode(h, FORMATS[name])


def _narrow_out(patterns, dtype):
    return lax.bitcast_convert_type(patterns.astype(jnp.uint16), dtype)


# -- apply_updates -----------------------------------------------------------------------------


def _check_step(step):
    """``apply_updates``' ``step``: ``None``, an int in ``[0, MAX_STEPS)`` or an integer scalar
    array (traced: its range is the caller's)."""
    if step is None:
        return
    if isinstance(step, (int, np.integer)) and not isinstance(step, bool):
        _validate.integer(step, "step", low=0, high=_optim.MAX_STEPS)
        return
    dtype, shape = getattr(step, "dtype", None), getattr(step, "shape", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer) or shape != ():
        raise TypeError(
            f"step: expected None, an int or an integer scalar array, got {type(step).__name__}"
            + ("" if dtype is None else f" of dtype {dtype} and shape {shape}")
        )


def _apply_update(cfg, w, u, bits):
    """``SR(w + u)`` of a narrow leaf, the sum
    the exact ``fma(1, u, w)`` of ``stochastic_add``, rounded with ``bits(0)`` (the weight
    stream). ``cfg`` is unused (``_native_leaves``'s signature). Returns a 1-tuple."""
    sums = _b32(_add(u, _f32(_widen_bits(w))))
    fmt = FORMATS[_NARROW[jnp.dtype(w.dtype)]]
    return (_narrow_out(_encode(sums, fmt, False, bits(0)), w.dtype),)


# stream positions (other leaves' elements) the callback ``apply_updates`` computes and drops
# between two joined leaves rather than add them as two runs: a host call each
# (``srround.stochastic_add``, about 0.1 ms) costs more than that many elements
_APPLY_GAP = 1 << 14


@functools.partial(
    jax.jit, static_argnames=("impl", "names", "starts", "global_shapes", "host_bits")
)
def _apply_narrow(ws, us, k0, k1, t, origins, *, impl, names, starts, global_shapes, host_bits):
    """``SR(w + u)`` of the nonempty narrow leaves ``ws`` (formats ``names``, leaf k at global
    element ``starts[k]``): native, ``_apply_update`` leaf by leaf (``_native_leaves``), or one
    host call for them all (per shard under ``jit``); with ``stochastic_add``'s
    straight-through gradient ``dp + du``. Jitted: an eager call is one compiled program,
    under an outer ``jit`` it is inlined."""

    def added(ws, us, k0, k1, t, origins):
        if impl == "native":
            layouts = [None if o is None else (o, g) for o, g in zip(origins, global_shapes)]
            outs = _native_leaves(
                _apply_update,
                None,
                (ws, us),
                starts,
                k0,
                k1,
                t,
                layouts=layouts,
                host_bits=host_bits,
            )
            return [o[0] for o in outs]
        fmts = [FORMATS[name] for name in names]
        # on one CPU device small leaves reach the host joined (as the host step's), the
        # small gaps between them in the stream taken in: one run, one kernel call
        pack = all(o is None for o in origins) and _leaves._on_one_cpu(ws)
        units = _leaves.host_units(range(len(ws)), [ws, us], pack)
        sizes = [w.size for w in ws]
        joined, within, gaps = _leaves.joined_runs(units, sizes, starts, _APPLY_GAP)
        outs = stochastic_add_leaves(
            _leaves.join_units(ws, units, gaps),
            _leaves.join_units(us, units, gaps),
            1.0,
            [fmts[u[0]] for u in units],
            k0,
            k1,
            [starts[u[0]] if len(u) == 1 else 0 for u in units],
            "inf",
            [origins[u[0]] for u in units],
            [global_shapes[u[0]] if len(u) == 1 else None for u in units],
            step=t,
            joined=joined,
        )
        unit_of = {k: j for j, u in enumerate(units) for k in u}
        of_leaf = _leaves.split_joined(within, sizes, {k: ws[k].shape for k in within}, (k0, k1, t))
        return [of_leaf(outs[unit_of[k]], k) for k in range(len(ws))]

    return _straight_through(
        added,
        (ws, us),
        (k0, k1, t, origins),
        lambda diff, d: [dw.astype(jnp.float32) + du for dw, du in zip(*d)],
    )


def _is_spec(x) -> bool:
    return x is None or isinstance(x, PartitionSpec)


def _leaf_specs(shard_specs, params, treedef, name="shard_specs"):
    """Per leaf of ``params`` (``treedef``'s order) its partition spec or ``None``:
    ``shard_specs`` is a spec, or a pytree prefix of ``params`` with specs (or ``None``) as
    leaves, as ``shard_map``'s ``in_specs``."""
    if shard_specs is None:
        return [None] * treedef.num_leaves
    try:
        full = jax.tree.broadcast(shard_specs, params, is_leaf=_is_spec)
        return treedef.flatten_up_to(full)
    except (ValueError, TypeError) as exc:
        raise ValueError(
            f"{name}: expected a PartitionSpec or a pytree prefix of params with PartitionSpec"
            f" (or None) leaves, as shard_map's in_specs: {exc}"
        ) from None


def _layouts(leaves, specs, name="params"):
    """Per leaf ``(origin, global_shape)`` inside ``shard_map`` (``None``: not split) and the
    global shapes. A leaf that varies over a mesh axis its spec does not split it over (typed
    so by ``shard_map``'s ``check_vma``) is a ``ValueError``: a parameter varies over exactly
    the axes it is split over, and a block taken as a whole array would round with the noise
    of the other blocks."""
    layouts, global_shapes = [], []
    for k, (x, spec) in enumerate(zip(leaves, specs)):
        if x is None:
            layouts.append(None)
            global_shapes.append(None)
            continue
        _check_split(x, spec, f"{name}[{k}]", "shard_specs")
        origin, global_shape = _shard_layout(np.shape(x), spec, f"{name}[{k}]")
        layouts.append(None if origin is None else (origin, global_shape))
        global_shapes.append(global_shape)
    return layouts, global_shapes


def _param_array(p, k: int):
    """Leaf ``k`` of ``apply_updates``' params as an array (a number too, as optax takes it);
    anything else (an equinox model's activation function) is a ``TypeError``."""
    if not isinstance(p, (jax.Array, np.ndarray, np.generic, int, float)) or isinstance(p, bool):
        raise TypeError(
            f"params[{k}]: expected an array, got {type(p).__name__} (give such a leaf a None"
            " update, as eqx.filter_grad does, and it is kept as it is)"
        )
    return jnp.asarray(p)


def apply_updates(params, updates, seed, *, step=None, impl=None, shard_specs=None):
    """``optax.apply_updates`` with stochastic rounding of the low-precision leaves.

    Args:
        params: a pytree of arrays (``None`` leaves are kept, as optax does).
        updates: a pytree of the same structure, or a prefix of it, as ``eqx.apply_updates``
            takes: a ``None`` update keeps its params as they are (any leaves: an equinox
            model's functions too) and takes no place in the random stream. Each other leaf
            broadcasts to its param's shape as in optax (a scalar update too); float32/bf16/
            fp16 (exactly widened to float32) or a Python number (float32, also under
            ``jax_enable_x64``).
        seed: a JAX PRNG key or an int in [0, 2**64). With ``step=None`` pass a fresh key
            every step (``jax.random.fold_in(key, step)``): the same key gives the same noise.
        step: ``None`` (the same stream as 0), or the step (int or traced int scalar in
            [0, 2**26); optax's ``count`` or the 1-based step alike): leaf ``k`` then uses the
            weight stream of the fused optimizers at counter ``step * 2**36 + starts[k]``,
            so a fixed seed gives fresh noise every step.
        impl: ``None`` (default): ``"native"``, except on one CPU device where the random
            bits come from the Numba kernels (through the FFI target) and the sums and
            rounding from ``jax.lax`` (the fastest there); ``"native"`` (``jax.lax`` only)
            or ``"callback"``. The same bits every way.
        shard_specs: inside ``shard_map`` only: the partition specs of ``params`` (a spec or a
            pytree prefix, as ``in_specs``). Each device then updates its blocks with the
            noise of their global elements, equal to the unsharded call. Under ``jit`` with
            sharded arrays nothing is needed (the native path partitions by itself).

    Returns:
        the new params (same shapes, dtypes and shardings): bf16/fp16 leaves ``SR(p + u)``
        (``stochastic_add(p, u, offset=...)`` with ``offset = starts[k]`` or
        ``step * 2**36 + starts[k]``, ``starts[k]`` the global element where leaf k starts),
        other leaves ``(p + u).astype(p.dtype)`` as optax. Under ``jax.grad`` the derivative
        is optax's (``dp + du``; straight-through for the rounding, as ``stochastic_add``).

    Raises:
        ValueError: an update that does not broadcast to its param's shape, a deleted
            (donated) array, leaves on different meshes, bad ``shard_specs``.
        TypeError: a float64 (or non-float) update for a bf16/fp16 param (it would round
            twice); an update for a leaf that is not an array or a number.
    """
    host_bits = impl is None
    impl = _impl(impl)
    _check_step(step)
    if seed is None:
        raise TypeError(
            "seed: apply_updates needs a JAX PRNG key or an int (a seed drawn here would be"
            " drawn once under jit, a constant of the program: the same noise every step)"
        )

    def is_none(x):
        return x is None

    p_leaves, treedef = jax.tree_util.tree_flatten(params, is_leaf=is_none)
    try:  # equinox's rule: updates may be a prefix of params, a None update keeps its params
        u_leaves = treedef.flatten_up_to(jax.tree.broadcast(updates, params, is_leaf=is_none))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"updates: not the structure of params: {exc}") from None
    p_leaves = [None if u is None else p for p, u in zip(p_leaves, u_leaves)]
    check_arrays(("params", p_leaves), ("updates", u_leaves), ("seed", seed))
    specs = _leaf_specs(shard_specs, params, treedef)
    layouts, global_shapes = _layouts(p_leaves, specs)
    present = [g for g in global_shapes if g is not None]
    starts_present = _starts(present)
    starts, i = [], 0
    for p in p_leaves:
        starts.append(None if p is None else starts_present[i])
        i += p is not None
    k0, k1 = _key_words(seed)
    t = 0 if step is None else step
    out = jax.tree_util.tree_leaves(params, is_leaf=is_none)  # kept where p or u is None
    narrow = []
    for k, (p, u) in enumerate(zip(p_leaves, u_leaves)):
        if p is None:
            continue
        p = _param_array(p, k)
        name = _NARROW.get(jnp.dtype(p.dtype))
        if name is None:
            out[k] = jnp.asarray(p + u).astype(p.dtype)
            continue
        if isinstance(u, (int, float)) and not isinstance(u, bool):  # float32, also under x64
            u = np.float32(u)
        refuse_host_float64(
            u, f"updates[{k}]", f"float32, bfloat16 or float16 for a {p.dtype} param"
        )
        u = jnp.asarray(u)
        if not jnp.issubdtype(u.dtype, jnp.floating) or jnp.dtype(u.dtype).itemsize > 4:
            raise TypeError(
                f"updates[{k}]: expected float32, bfloat16 or float16 for a {p.dtype} param,"
                f" got {u.dtype} (float64 would round twice: compute the update in float32)"
            )
        if u.shape != p.shape:
            try:
                shape = jnp.broadcast_shapes(u.shape, p.shape)
            except ValueError:
                shape = None
            if shape != p.shape:
                raise ValueError(
                    f"updates[{k}]: shape {u.shape} does not broadcast to its param's shape"
                    f" {p.shape}"
                )
            u = jnp.broadcast_to(u, p.shape)
        u = u.astype(jnp.float32)
        if p.size == 0:
            out[k] = p
            continue
        narrow.append((k, p, u, name))
    if narrow:
        results = _apply_narrow(
            [p for _, p, _, _ in narrow],
            [u for _, _, u, _ in narrow],
            _u(k0),
            _u(k1),
            jnp.asarray(t, jnp.int32),
            [None if layouts[k] is None else layouts[k][0] for k, *_ in narrow],
            impl=impl,
            names=tuple(name for *_, name in narrow),
            starts=tuple(starts[k] for k, *_ in narrow),
            global_shapes=tuple(None if layouts[k] is None else layouts[k][1] for k, *_ in narrow),
            host_bits=host_bits,
        )
        for (k, *_), r in zip(narrow, results):
            out[k] = r
    return jax.tree_util.tree_unflatten(treedef, out)


class WriteBackState(NamedTuple):
    """State of ``stochastic_write_back``: ``count``, int32 scalar, the updates taken."""

    count: Any


def stochastic_write_back(seed, *, impl=None, shard_specs=None):
    """An optax transformation, last in an ``optax.chain``, that turns any optimizer's
    updates into ones that ``optax.apply_updates`` writes back with stochastic rounding: for
    the frameworks that call ``optax.apply_updates`` themselves (``flax.nnx.Optimizer.update``,
    flax's ``TrainState.apply_gradients``).

    ``update(updates, state, params)`` returns float32 ``u`` with ``float32(p + u) == n``,
    ``n = apply_updates(params, updates, seed, step=count + 1)`` (as the fused optimizers'
    ``update``, module docstring: ``n`` exactly, except where no such float32 ``u`` exists, a
    bf16/fp16 weight whose exponent changes by more than ~16), for bf16/fp16 leaves; other
    leaves' updates pass unchanged, and ``None`` updates stay ``None``. The fixed ``seed`` and
    the count in the state give fresh noise every step, the weight stream of the fused
    optimizers.

    Args:
        seed: a JAX PRNG key or an int in [0, 2**64), fixed for the run.
        impl: as ``apply_updates``.
        shard_specs: as ``apply_updates`` (inside ``shard_map`` only).

    Returns:
        an ``optax.GradientTransformation`` with ``WriteBackState`` states.

    Raises:
        ValueError: ``update`` without ``params``; ``apply_updates``' errors.
    """
    if seed is None:  # as apply_updates: a seed drawn here would be fixed by jit
        raise TypeError("seed: stochastic_write_back needs a JAX PRNG key or an int")
    _key_words(seed)  # a bad seed fails here, when the transformation is made

    def init(params):
        del params
        return WriteBackState(jnp.zeros((), jnp.int32))

    def update(updates, state, params=None, **extra_args):
        del extra_args  # what optax.chain hands every transformation (found_inf: the fused ones)
        if params is None:
            raise ValueError("stochastic_write_back: update needs params (it rounds p + u)")
        count = state.count + 1
        new = apply_updates(params, updates, seed, step=count, impl=impl, shard_specs=shard_specs)

        def exact(u, n, p):
            if u is None or jnp.dtype(n.dtype) not in _NARROW:
                return u
            return _exact_update(n, p)

        def is_none(x):
            return x is None

        return jax.tree.map(exact, updates, new, params, is_leaf=is_none), WriteBackState(count)

    return _Base(init, update)


# -- fused AdamW -------------------------------------------------------------------------------


class AdamWState(NamedTuple):
    """State of ``adamw`` (a pytree).

    Attributes:
        count: int32 scalar, steps taken (the 1-based step of the next update is count + 1).
        exp_avg, exp_avg_sq: pytrees like params, ``state_dtype`` (float32 or bfloat16); fp8
            states: the pair ``(codes, scales)`` of pytrees like params (the float8 moments and
            each leaf's float32 block scales).
        aux: pytree like params of the weight mode's buffers (``None`` for float32 leaves and
            for ``stochastic``/``nearest``): kahan compensation (param dtype, starts at 0),
            master weights (float32), remainder (int16, starts at 0).
    """

    count: Any
    exp_avg: Any
    exp_avg_sq: Any
    aux: Any


def _power64(base: float, exponent):
    """float64 ``base ** exponent`` (traced integer ``exponent >= 0``) by repeated squaring,
    the products of ``_optim._power`` in its order: the squares of ``base`` are Python floats
    (the same float64 products), and the loop is unrolled over every bit of the exponent's
    dtype, a select and a product a bit. No ``while_loop``: on a GPU each of its iterations
    would be a kernel launch and a read of the condition back to the host, in series before
    the step's loop can start."""
    exponent = jnp.asarray(exponent)
    result, square = jnp.float64(1.0), float(base)
    for k in range(jnp.iinfo(exponent.dtype).bits - 1):
        result = jnp.where((exponent >> k) & 1 == 1, result * square, result)
        square *= square
    return result


def _coefs(t, lr, b1: float, b2: float, wd: float):
    """``_optim.prepare_coefs`` for AdamW at 1-based step ``t`` (traced int32): float32
    ``(1 - lr*wd, lr / bc1, sqrt(bc2))`` computed in float64 as the kernel does."""
    with jax.enable_x64(True):
        bc1 = 1.0 - _power64(b1, t)
        bc2 = 1.0 - _power64(b2, t)
        if isinstance(lr, (int, float, np.floating, np.integer)):
            decay = jnp.float32(np.float32(1.0 - float(lr) * wd))
            lr64 = jnp.float64(float(lr))
        else:
            lr64 = jnp.asarray(lr).astype(jnp.float32).astype(jnp.float64)
            decay = narrow(1.0 - lr64 * wd)
        step_size = narrow(lr64 / bc1)
        bc2_sqrt = narrow(jnp.sqrt(bc2))
        bc1_next = 1.0 - _power64(b1, t + 1)
        # the optax variants (nesterov, eps_root): float32 lr, bc1, bc1(t + 1), bc2
        extra = tuple(narrow(x) for x in (lr64, bc1, bc1_next, bc2))
    return decay, step_size, bc2_sqrt, extra


def _no_decay(coefs):
    """``coefs`` with the weight decay factor 1 (leaves outside optax's ``mask``)."""
    return (jnp.float32(1.0),) + tuple(coefs[1:])


def _adamw_math(p, g, m, v, coefs, constants, variant=(False, 0.0)):
    """``_optim.adamw_math`` on float32 arrays, the same operations in the same order (``p``,
    ``g``, ``m``, ``v`` read from buffers). ``variant = (nesterov, eps_root)``: optax's
    options, outside the kernels' math: ``denom = sqrt(v / bc2 + eps_root) + eps`` and the
    Nesterov numerator ``b1 m / (1 - b1**(t+1)) + (1 - b1) g / (1 - b1**t)``."""
    decay, step_size, bc2_sqrt, (lr32, bc1, bc1_next, bc2) = coefs
    beta2, eps, omb1, omb2 = constants
    nesterov, eps_root = variant
    p = p * decay
    m = _fma(omb1, g - m, m, exact=(True, False, True))
    v = _fma(omb2 * g, g, v * beta2, exact=(False, True, False))
    # Divisions and square roots: _lax.div and _lax.sqrt (correctly rounded on a GPU too)
    if nesterov or eps_root:
        if eps_root:
            denom = sqrt(div(v, bc2) + jnp.float32(eps_root)) + eps
        else:
            denom = div(sqrt(v), jnp.where(v >= 0, bc2_sqrt, -bc2_sqrt)) + eps
        if nesterov:
            b1 = jnp.float32(1.0) - omb1
            num = div(b1 * m, bc1_next) + div(omb1 * g, bc1)
            return _fma(-lr32, div(num, denom), p, exact=(True, False, False)), m, v
        return _fma(-step_size, div(m, denom), p, exact=(True, False, False)), m, v
    # XLA's algebraic simplifier rewrites x / broadcast(c) into x * broadcast(1 / c) (not
    # correctly rounded: 1-ulp differences); an elementwise divisor it cannot see through
    # keeps the IEEE division. Where v < 0 or NaN, sqrt(v) is NaN and so is the quotient.
    divisor = jnp.where(v >= 0, bc2_sqrt, -bc2_sqrt)
    denom = div(sqrt(v), divisor) + eps
    return _fma(-step_size, div(m, denom), p, exact=(True, False, False)), m, v


def _aux_bits(mode, aux):
    """uint32 patterns of a leaf's aux buffer (remainder: the int16 sign-extended)."""
    if mode == "master":
        return _b32(aux)
    if mode == "remainder":
        return lax.bitcast_convert_type(aux.astype(jnp.int32), _U32)
    return lax.bitcast_convert_type(aux, jnp.uint16).astype(_U32)  # kahan


def _weight_value(mode, p_bits, aux_bits):
    """fp32 patterns the update starts from for a bf16/fp16 leaf (``_optim.weight_value``;
    ``p_bits`` already widened: remainder adds the signed low half to bf16 << 16)."""
    if mode == "master":
        return aux_bits
    if mode == "remainder":
        return p_bits + aux_bits
    return p_bits


def _weight_write(mode, fmt, old_bits, new_bits, aux_bits, bits16):
    """``_optim.weight_write`` for bf16/fp16: (param patterns, aux patterns or None)."""
    if mode == "stochastic":
        return _encode(new_bits, fmt, False, bits16), None
    if mode == "nearest":
        return _encode(new_bits, fmt, False), None
    if mode == "master":
        return _encode(new_bits, fmt, False), new_bits
    if mode == "kahan":
        old = _f32(old_bits)
        compensated = _f32(_decode(aux_bits, fmt)) + (_f32(new_bits) - old)
        written = _encode(canonical_nan(_b32(old + compensated)), fmt, False)
        moved = _f32(_decode(written, fmt)) - old
        return written, _encode(canonical_nan(_b32(compensated - moved)), fmt, False)
    # remainder (bf16)
    nan = (new_bits & 0x7FFFFFFF) > 0x7F800000
    high = ((new_bits + 0x8000) >> 16) & 0xFFFF
    low = (new_bits - (high << 16)) & 0xFFFF
    high = jnp.where(nan, ((new_bits >> 16) & 0x8000) | 0x7FC0, high)
    return high, jnp.where(nan, _U32(0), low)


def _read_leaf(mode, p, g, a, inv_scale):
    """What both optimizers' updates start from: ``(aux_bits, old, g)`` - the fp32 patterns
    of the leaf's aux buffer (``None`` without one), the fp32 patterns of the weight the update
    starts from (``_weight_value``) and the float32 gradient times ``inv_scale``."""
    p_bits = _widen_bits(p)
    aux_bits = _aux_bits(mode, a) if _NARROW.get(jnp.dtype(p.dtype)) and a is not None else None
    old = p_bits if aux_bits is None else _weight_value(mode, p_bits, aux_bits)
    g = _f32(_widen_bits(g))
    if inv_scale is not None:
        g = g * inv_scale
    return aux_bits, old, g


@elementwise
def _update(cfg, p, g, m, v, a, bits, coefs, inv_scale):
    """The AdamW update of one leaf: ``bits(stream)`` gives the random bits of its elements;
    ``cfg`` = (rounding, (mu dtype, nu dtype), constants, variant). Returns (p, m, v, aux)."""
    mode, dtypes, constants, variant = cfg

    def state_out(x, stream):
        dtype = dtypes[stream - 1]
        if dtype == jnp.float32:
            return x
        return _narrow_out(_encode(_b32(x), FORMATS["bfloat16"], False, bits(stream)), dtype)

    aux_bits, old, g = _read_leaf(mode, p, g, a, inv_scale)
    new, m_new, v_new = _adamw_math(
        _f32(old), g, _f32(_widen_bits(m)), _f32(_widen_bits(v)), coefs, constants, variant
    )
    m_new, v_new = state_out(m_new, 1), state_out(v_new, 2)
    p_new, a_new = _write_back(mode, p, a, aux_bits, old, new, bits)
    return p_new, m_new, v_new, a_new


def _state8_scale(amax, max_bits: int):
    """``(scale, 1 / scale)`` bits per block (``_state8.state_scale``)."""
    k = (amax >> 23).astype(jnp.int32) - (max_bits >> 23)
    k = k + ((amax & 0x7FFFFF) > (max_bits & 0x7FFFFF)).astype(jnp.int32)
    k = jnp.clip(k, -126, 127)
    return _u(k + 127) << 23, _u(127 - k) << 23


def _explicit_axes(*arrays) -> tuple:
    """The mesh axes that split any of ``arrays`` in its type (a mesh with explicit axes)."""
    axes: list = []
    for x in arrays:
        if x is None:
            continue
        sharding = getattr(jax.typeof(x), "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        if sharding is None or mesh is None or mesh.empty or not mesh.are_all_axes_explicit:
            continue
        for entry in sharding.spec:
            for name in (entry,) if isinstance(entry, str) else entry or ():
                if name not in axes:
                    axes.append(name)
    return tuple(axes)


def _update8(cfg, p, g, m, v, a, bits, coefs, inv_scale):
    """One leaf of an AdamW step with fp8 states (``_state8.update_block8``): ``m``, ``v`` are
    ``(moments, float32 block scales)``, the second moment stored as ``sqrt(v)``; ``cfg`` =
    (rounding, state format name, constants). Returns (p, m, v, aux). Its blocks run over
    the flat leaf, across the pieces of a split one: on a mesh with explicit axes (which
    refuse such reshapes) the update runs with those axes automatic (``auto_axes``: XLA moves
    what a block needs) and each output takes its input's sharding."""
    axes = _explicit_axes(p, g, *m, *v, a)
    if not axes:
        return _update8_blocks(cfg, p, g, m, v, a, bits, coefs, inv_scale)

    def spec(x):
        return None if x is None else jax.typeof(x).sharding.spec

    def body(p, g, m, v, a, noise, coefs, inv_scale):  # every input an argument: automatic
        return _update8_blocks(cfg, p, g, m, v, a, noise.__getitem__, coefs, inv_scale)

    out = (spec(p), (spec(m[0]), spec(m[1])), (spec(v[0]), spec(v[1])), spec(a))
    noise = tuple(bits(stream) for stream in range(3))  # elementwise (XLA drops unused ones)
    with jax.sharding.use_abstract_mesh(jax.typeof(p).sharding.mesh):  # none set: the leaf's
        update = jax.sharding.auto_axes(body, axes=axes, out_sharding=out)
        return update(p, g, m, v, a, noise, coefs, inv_scale)


def _update8_blocks(cfg, p, g, m, v, a, bits, coefs, inv_scale):
    """``_update8`` on arrays whose blocks may be reshaped freely."""
    mode, fmt_name, constants = cfg
    fmt = FORMATS[fmt_name]
    n, block = p.size, _state8.STATE_BLOCK
    nb = -(-n // block)

    def blocks(x):  # flat, zero-padded, [blocks, STATE_BLOCK]
        return jnp.pad(x.reshape(-1), (0, nb * block - n)).reshape(nb, block)

    def per_block(scales):
        return jnp.broadcast_to(scales.reshape(nb, 1), (nb, block))

    def read(state):
        h = lax.bitcast_convert_type(state[0], jnp.uint8).astype(_U32)
        return element_value(blocks(h), per_block(_b32(state[1])), fmt)

    def write(x_bits, stream):
        a = x_bits & 0x7FFFFFFF
        amax = jnp.max(jnp.where(a < 0x7F800000, a, _U32(0)), axis=1)
        scale, multiplier = _state8_scale(amax, max_bits)
        q = block_element(x_bits, per_block(multiplier), fmt, blocks(bits(stream)))
        q = q.reshape(-1)[:n].astype(jnp.uint8).reshape(p.shape)
        return lax.bitcast_convert_type(q, jnp.dtype(fmt.numpy_dtype)), _f32(scale)

    max_bits = int(np.float32(fmt.max_finite).view(np.uint32))
    aux_bits, old, g = _read_leaf(mode, p, g, a, inv_scale)
    s_bits = read(v)
    new, m_new, v_new = _adamw_math(
        blocks(_f32(old)),
        blocks(g),
        _f32(read(m)),
        _f32(mul_bits(s_bits, s_bits)),
        coefs,
        constants,
    )
    m_out, v_out = write(_b32(m_new), 1), write(_b32(sqrt(v_new)), 2)
    new = new.reshape(-1)[:n].reshape(p.shape)
    p_new, a_new = _write_back(mode, p, a, aux_bits, old, new, bits)
    return p_new, m_out, v_out, a_new


def _write_back(mode, p, a, aux_bits, old, new, bits):
    """(new param, new aux) of a leaf from its float32 update ``new`` (``_optim.weight_write``;
    float32 leaves: ``new`` itself)."""
    name = _NARROW.get(jnp.dtype(p.dtype))
    if name is None:
        return new, a
    bits16 = bits(0) if mode == "stochastic" else None
    written, aux_new = _weight_write(mode, FORMATS[name], old, _b32(new), aux_bits, bits16)
    if mode == "master":
        a = new
    elif aux_new is not None:
        a = _narrow_out(aux_new, p.dtype if mode == "kahan" else jnp.int16)
    return _narrow_out(written, p.dtype), a


@elementwise
def _sgd_update(cfg, p, g, b, a, bits, coefs, inv_scale):
    """``_optim.sgd_math`` (dampening 0, no weight decay: optax's ``sgd``) of one leaf, the
    same float32 operations: ``buf = g`` at step 1 else ``fma(1, g, buf * momentum)``;
    ``d = fma(momentum, buf, g)`` (nesterov) or ``buf``; ``p = fma(-lr, d, p)``, then the
    weight write-back. ``cfg`` = (rounding, momentum buffer dtype, momentum, nesterov)."""
    mode, buf_dtype, momentum, nesterov = cfg
    lr, first = coefs
    aux_bits, old, g = _read_leaf(mode, p, g, a, inv_scale)
    buf_new = None
    if b is not None:
        buf = _f32(_widen_bits(b))
        buf_new = jnp.where(first, g, _fma(1.0, g, buf * momentum, exact=(True, True, False)))
        buf_new = _f32(canonical_nan(_b32(buf_new)))  # step 1: the gradient's NaN
        d = _fma(momentum, buf_new, g, exact=(True, False, True)) if nesterov else buf_new
        if buf_dtype != jnp.float32:
            encoded = _encode(_b32(buf_new), FORMATS["bfloat16"], False, bits(1))
            buf_new = _narrow_out(encoded, buf_dtype)
    else:
        d = g
    new = _fma(-lr, d, _f32(old), exact=(True, False, True))
    p_new, a_new = _write_back(mode, p, a, aux_bits, old, new, bits)
    return p_new, buf_new, a_new


def _native_step(update, cfg, columns, layouts, t, k0, k1, extras, host_bits=False):
    """The native fused step: ``update`` leaf by leaf (``_native_leaves``). ``columns``: per
    input (params, grads, states..., aux) the list of leaves; ``extras[k]``: the extra
    arguments of leaf k (coefficients, inv_scale; one object for the leaves inside optax's
    ``mask``, another for those outside). XLA's CPU backend emits one loop per output;
    float32 states end in an op of several arrays, which it writes once (into the state
    buffer) for the parameter's loop to read; on one CPU device, a leaf's 8/16-bit outputs
    (bf16 params and states) are computed in one loop (``_leaves._packed``). Returns per-leaf
    output tuples (params, states..., aux). ``host_bits``: see ``_native_leaves``."""
    p_leaves = columns[0]
    starts = _starts(
        [tuple(p.shape) if lay is None else lay[1] for p, lay in zip(p_leaves, layouts)]
    )
    outs = [tuple(c[k] for i, c in enumerate(columns) if i != 1) for k in range(len(p_leaves))]
    live = [k for k, p in enumerate(p_leaves) if p.size > 0]
    new = _native_leaves(
        update,
        cfg,
        [[leaves[k] for k in live] for leaves in columns],
        [starts[k] for k in live],
        k0,
        k1,
        t,
        [extras[k] for k in live],
        [layouts[k] for k in live],
        host_bits=host_bits,
    )
    for k, o in zip(live, new):
        outs[k] = o
    return outs


class _GT(NamedTuple):  # stand-in for optax.GradientTransformationExtraArgs without optax
    init: Any
    update: Any


try:
    from optax import GradientTransformationExtraArgs as _Base
except ImportError:  # pragma: no cover - optax is optional
    _Base = _GT


class FusedOptimizer(_Base):
    """An ``optax.GradientTransformationExtraArgs`` (``init``, ``update``) with the fused
    ``step(grads, state, params, *, found_inf=None, inv_scale=None) -> (params, state)``
    (module docstring). Made by ``adamw`` and ``sgd``; ``config`` holds the settings."""

    def __new__(cls, init, update, step, config):
        self = super().__new__(cls, init, update)
        self.step = step
        self.config = config
        return self


_FP8_STATES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def _state_dtype(dtype, name: str, fp8: bool = False):
    if isinstance(dtype, (jax.Array, np.ndarray)):  # jnp.dtype() would take the array's dtype
        raise TypeError(
            f"{name}: expected a dtype, got an array (with optax.inject_hyperparams, which calls"
            " a dtype like jnp.bfloat16 as if it were a schedule, keep it in static_args:"
            " srround.adapters.jax.ADAMW_STATIC_ARGS / SGD_STATIC_ARGS)"
        )
    dtype = jnp.dtype(dtype)
    if dtype in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)) or (fp8 and dtype in _FP8_STATES):
        return dtype
    extra = ", float8_e4m3fn or float8_e5m2" if fp8 else ""
    raise TypeError(f"{name}: expected float32, bfloat16{extra}, got {dtype}")


def _state_zeros(params, dtype):
    """A zero state for ``params``: a pytree like ``params`` (keeping sharded leaves'
    shardings), or for fp8 states the pair of pytrees ``(moments, float32 block scales)``
    (``srround.STATE_BLOCK``; the moments sharded as the params, the scales unsharded) - two
    trees of arrays, not a tree of pairs: flax.nnx keeps a state's leaves in variables, and
    turns a tuple held in one into a mapping."""
    if dtype in _FP8_STATES:
        return (
            jax.tree_util.tree_map(lambda p: jnp.zeros_like(p, dtype), params),
            jax.tree_util.tree_map(
                lambda p: jnp.zeros((-(-p.size // _state8.STATE_BLOCK),), jnp.float32), params
            ),
        )
    return jax.tree_util.tree_map(lambda p: jnp.zeros_like(p, dtype), params)


def _aux_for(rounding, p):
    name = _NARROW.get(jnp.dtype(p.dtype))
    if name is None:
        return None
    if rounding == "master":
        return p.astype(jnp.float32)
    if rounding == "kahan":
        return jnp.zeros_like(p)
    if rounding == "remainder":
        if name != "bfloat16":
            raise TypeError("params: rounding='remainder' needs bfloat16 (or float32) params")
        return jnp.zeros_like(p, dtype=jnp.int16)
    return None


def _check_params(leaves) -> None:
    for i, p in enumerate(leaves):
        if not isinstance(p, (jax.Array, np.ndarray)):
            raise TypeError(
                f"params[{i}]: expected an array, got {type(p).__name__} (with equinox pass"
                " eqx.filter(model, eqx.is_inexact_array): its None leaves are left out)"
            )
        if jnp.dtype(p.dtype) not in (jnp.dtype(jnp.float32), *_NARROW):
            extra = ""
            if jnp.dtype(p.dtype) == jnp.float64:
                extra = " (float64 under jax_enable_x64: cast the params to float32)"
            raise TypeError(
                f"params[{i}]: expected float32, bfloat16 or float16, got {p.dtype}{extra}"
            )


def _mask_leaves(mask, params, treedef):
    """Per leaf whether weight decay applies (optax's ``mask``: a pytree of bools like
    params or a prefix of it - one bool for a subtree -, or a function of params returning
    one; ``None``: every leaf)."""
    if mask is None:
        return [True] * treedef.num_leaves
    tree = mask(params) if callable(mask) else mask
    try:
        flags = treedef.flatten_up_to(jax.tree.broadcast(tree, params))
    except (ValueError, TypeError) as exc:
        raise ValueError(
            f"mask: expected a pytree of bools like params (or a prefix of it): {exc}"
        ) from None
    for i, f in enumerate(flags):
        if not isinstance(f, (bool, np.bool_)):
            raise TypeError(f"mask[{i}]: expected a Python bool, got {type(f).__name__}")
    return [bool(f) for f in flags]


# what optax.inject_hyperparams must keep static (its static_args): it makes every number an
# array and calls every callable (dtypes such as jnp.bfloat16, a mask function) as a schedule;
# the fused steps take these as host values - only learning_rate may change between steps
ADAMW_STATIC_ARGS = (
    "b1",
    "b2",
    "eps",
    "eps_root",
    "weight_decay",
    "mask",
    "seed",
    "mu_dtype",
    "state_dtype",
)
SGD_STATIC_ARGS = ("momentum", "seed", "accumulator_dtype")


def _static_real(value, name: str, static_args: str, **bounds) -> float:
    """A hyperparameter the fused step takes as a host float: a real number or a concrete
    0-d array, checked (``_validate.real``). A traced one - what ``optax.inject_hyperparams``
    passes under ``jit`` unless told otherwise - is a ``TypeError`` that says so."""
    dtype = getattr(value, "dtype", None)
    narrow = dtype is not None and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4
    if isinstance(value, jax.core.Tracer) or narrow:
        # optax.inject_hyperparams casts them to the params' dtype: b2 = 0.999 is 1.0 in bf16
        what = "a traced value" if not narrow else f"a {dtype} array (rounded)"
        raise TypeError(
            f"{name}: {what}, but the fused step takes it as a host float; with"
            " optax.inject_hyperparams keep it static: static_args=srround.adapters.jax."
            f"{static_args} (only learning_rate can be injected)"
        )
    return _host_real(value, name, **bounds)


def _host_real(value, name: str, **bounds) -> float:
    """``value`` checked as a real number (``_validate.real``), a concrete 0-d array too."""
    if getattr(value, "shape", None) == () and not isinstance(value, np.generic):
        value = float(value)
    return _validate.real(value, name, **bounds)


def _static_seed(seed, static_args: str):
    """``seed`` with an integer 0-d array (``optax.inject_hyperparams`` makes the int one) as an
    int; a traced integer is a ``TypeError`` (a seed is fixed for the run; keys may be traced)."""
    integer = isinstance(seed, (jax.Array, np.ndarray)) and jnp.issubdtype(seed.dtype, jnp.integer)
    if not integer or np.shape(seed) != ():
        return seed
    if isinstance(seed, jax.core.Tracer):
        raise TypeError(
            "seed: a traced int; with optax.inject_hyperparams keep it static:"
            f" static_args=srround.adapters.jax.{static_args}"
        )
    return int(seed)


_LR_OPTIMIZERS = 16  # optimizers kept per function by ``_lr_as_argument``


def _lr_as_argument(make):
    """``make`` (``adamw``, ``sgd``) taking a learning rate given as a concrete array - what
    ``optax.inject_hyperparams`` passes to an eager ``update`` - as an argument of the compiled
    step, not a constant of it: checked as a number is, then the optimizer of the other
    settings is made once and kept (the ``_LR_OPTIMIZERS`` latest, by their settings), and the
    value passed to its step, so new values reuse one compiled program (before: a new
    optimizer, traced and compiled again, at every call). Bits as with the number."""
    signature = inspect.signature(make)
    kept: dict = {}

    def key_of(value):
        try:
            hash(value)
            return value
        except TypeError:  # an array (a 0-d number: by value), a mask tree (by identity)
            dtype = getattr(value, "dtype", None)
            if dtype is not None and np.ndim(value) == 0 and jnp.issubdtype(dtype, jnp.number):
                return ("value", str(value.dtype), value.item())
            return ("id", id(value))

    @functools.wraps(make)
    def made(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        lr = bound.arguments["learning_rate"]
        if not isinstance(lr, jax.Array) or isinstance(lr, jax.core.Tracer):
            return make(*args, **kwargs)
        make(*args, **kwargs)  # every check, the learning rate's as a number's
        settings = {k: v for k, v in bound.arguments.items() if k != "learning_rate"}
        key = tuple(sorted((k, key_of(v)) for k, v in settings.items()))
        if key not in kept:
            if len(kept) >= _LR_OPTIMIZERS:
                kept.pop(next(iter(kept)))
            # (the settings kept too: an identity key stays that object's)
            kept[key] = (make(_lr_from_the_step, **settings), settings)
        return kept[key][0].with_lr(jnp.asarray(lr, jnp.float32))

    return made


def _lr_from_the_step(count):
    """The learning rate of ``_lr_as_argument``'s optimizers: the step's argument, never this."""
    raise AssertionError("the learning rate is an argument of the step")


def _learning_rate(learning_rate):
    """An optax schedule (callable) as it is; a traced scalar (``optax.inject_hyperparams``
    under ``jit``) as a constant schedule of it; else the learning rate checked: a real number
    (a concrete 0-d array too) >= 0 and finite - before the step, which would fail in the
    host call or compute with it."""
    if callable(learning_rate):
        return learning_rate
    if isinstance(learning_rate, jax.core.Tracer):
        if np.shape(learning_rate) != ():
            raise ValueError(
                f"learning_rate: expected a scalar, got shape {np.shape(learning_rate)}"
            )
        return lambda count: learning_rate
    return _host_real(learning_rate, "learning_rate", low=0.0)


def _fused(
    kind,
    *,
    lr,
    seed,
    rounding,
    impl,
    shard_specs,
    states,
    cfg,
    native,
    host,
    host_groups=None,
    host_bits=False,
    lr_fits=None,
):
    """The optimizer object shared by ``adamw`` and ``sgd``.

    ``impl``: ``"native"``, ``"callback"`` or ``"auto"`` (callback where the program is lowered
    for the CPU, native elsewhere: ``lax.platform_dependent``); ``host_bits``: the native
    step's random lanes from the host on one CPU device (``_native_leaves``); ``states``: (name,
    dtype or None (absent), stream) per state buffer; ``native(t, lr, inv_scale, params,
    treedef) -> (update, cfg, extras)``; ``host``: the NumPy step for the callback path,
    ``host(ps, gs, states, *, aux, lr, step, seed, inv_scale)``; ``host_groups(params,
    treedef) -> [(host, leaf indices), ...]``: leaves that take different host steps (optax's
    ``mask``: with and without weight decay), one host call per group; ``None``: ``host`` for
    every leaf; ``lr_fits(lr) -> bool`` (traced): whether a run-time learning rate (float32,
    finite, >= 0) keeps the step's coefficients within float32 (``None``: any does); one that
    does not skips the step."""
    if rounding not in _ROUNDINGS:
        raise ValueError(f"rounding: expected one of {sorted(_ROUNDINGS)}, got {rounding!r}")
    k0, k1 = _key_words(seed)
    state_type = {"adamw": AdamWState, "sgd": SGDState}[kind]

    def init(params):
        leaves, treedef = jax.tree_util.tree_flatten(params)
        _check_params(leaves)
        check_arrays(("params", leaves))
        buffers = []
        for _, dtype, _ in states:
            if dtype is None:
                buffers.append(jax.tree_util.tree_map(lambda p: None, params))
            else:
                buffers.append(_state_zeros(params, dtype))
        aux = jax.tree_util.tree_unflatten(treedef, [_aux_for(rounding, p) for p in leaves])
        return state_type(jnp.zeros((), jnp.int32), *buffers, aux)

    def lr_at(count, lr_value):
        if lr_value is not None:  # an argument of the compiled step (``_lr_as_argument``)
            return jnp.asarray(lr_value, jnp.float32)
        if callable(lr):
            value = jnp.asarray(lr(count), jnp.float32)
            if value.shape != ():
                raise ValueError(
                    f"learning_rate: the schedule gave an array of shape {value.shape}, expected"
                    " a scalar"
                )
            return value
        return float(lr)

    def compute(grads, state, params, inv_scale, lr_value):
        p_leaves, treedef = jax.tree_util.tree_flatten(params)
        try:
            g_leaves = treedef.flatten_up_to(grads)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"grads: not the structure of params: {exc}") from None
        for k, (p, g) in enumerate(zip(p_leaves, g_leaves)):
            if not hasattr(g, "dtype"):  # None (a frozen or filtered leaf), a number
                raise TypeError(
                    f"grads[{k}]: expected an array like params[{k}], got {type(g).__name__}"
                    " (every parameter needs a gradient: zeros for a frozen one, or leave it"
                    " out of params)"
                )
            if jnp.shape(g) != jnp.shape(p):
                raise ValueError(
                    f"grads[{k}]: shape {jnp.shape(g)} does not match params[{k}]'s shape"
                    f" {jnp.shape(p)}"
                )
            if jnp.dtype(g.dtype) not in _GRAD_DTYPES:
                raise TypeError(
                    f"grads[{k}]: expected float32, bfloat16 or float16, got {jnp.dtype(g.dtype)}"
                )
        s_leaves = [  # fp8 states as (moments, scales) pairs per leaf
            list(zip(*(treedef.flatten_up_to(tree) for tree in state[1 + i])))
            if dtype in _FP8_STATES
            else treedef.flatten_up_to(state[1 + i])
            for i, (_, dtype, _) in enumerate(states)
        ]
        a_leaves = treedef.flatten_up_to(state[-1])
        specs = _leaf_specs(shard_specs, params, treedef)
        layouts, global_shapes = _layouts(p_leaves, specs)
        t = state.count + 1
        lr_t = lr_at(state.count, lr_value)
        if inv_scale is not None:
            inv_scale = jnp.asarray(inv_scale, jnp.float32)

        def on_lax():
            update, ucfg, extras = native(t, lr_t, inv_scale, params, treedef)
            columns = [p_leaves, g_leaves, *s_leaves, a_leaves]
            return _native_step(
                update, ucfg, columns, layouts, t, _u(k0), _u(k1), extras, host_bits
            )

        def on_host():
            blocked = [col for col in s_leaves if col and isinstance(col[0], tuple)]
            s_cols = s_leaves
            if blocked:  # fp8 states: (moments, scales) pairs as four columns, then paired
                if any(lay is not None for lay in layouts):
                    raise ValueError(
                        "shard_specs: impl='callback' with fp8 states runs on whole leaves"
                        " (their blocks); inside shard_map with split leaves use impl='native'"
                    )
                s_cols = [[x[part] for x in col] for part in (0, 1) for col in s_leaves]
            columns = (p_leaves, g_leaves, s_cols, a_leaves)
            every = range(len(p_leaves))
            groups = [(host, every)] if host_groups is None else host_groups(params, treedef)
            outs: list[Any] = [None] * len(p_leaves)
            for host_step, leaves in groups:
                group_outs = _callback_step(
                    host_step,
                    columns,
                    t,
                    lr_t,
                    k0,
                    k1,
                    inv_scale,
                    layouts,
                    global_shapes,
                    bool(blocked),
                    leaves,
                )
                for i in leaves:  # the groups split the leaves: each from its group's call
                    outs[i] = group_outs[i]
            if blocked:
                outs = [(o[0], (o[1], o[3]), (o[2], o[4]), o[5]) for o in outs]
            return outs

        if impl == "auto" and not jax.sharding.get_abstract_mesh().manual_axes:
            outs = lax.platform_dependent(cpu=on_host, default=on_lax)  # the host step on CPUs
        elif impl == "auto":  # inside shard_map: the host step's results typed as the native's
            # (traced here for its types; outside shard_map this costs 0.25 s of a 1.5 s first
            # call on 196 leaves - the native ops reach XLA before they are dropped)
            native_outs = on_lax()
            outs = lax.platform_dependent(
                cpu=lambda: varying_as(on_host(), native_outs), default=lambda: native_outs
            )
        else:
            outs = on_lax() if impl == "native" else on_host()

        def unflat(i, part=None):
            return jax.tree_util.tree_unflatten(
                treedef, [o[i] if part is None else o[i][part] for o in outs]
            )

        new_states = [
            (unflat(1 + i, 0), unflat(1 + i, 1)) if dtype in _FP8_STATES else unflat(1 + i)
            for i, (_, dtype, _) in enumerate(states)
        ]
        new_state = state_type(t, *new_states, unflat(1 + len(states)))
        return unflat(0), new_state

    def step(grads, state, params, found_inf, inv_scale, lr_value):
        skip = None
        if found_inf is not None:
            skip = jnp.asarray(found_inf)
            skip = jnp.reshape(skip.astype(bool) if skip.dtype == jnp.bool_ else skip != 0, ())
        if inv_scale is not None:  # both impls: an unusable scale skips, as found_inf does
            unusable = ~_scale_usable(inv_scale)
            skip = unusable if skip is None else skip | unusable
        if callable(lr) or lr_value is not None:  # known at run time: likewise
            lr_t = lr_at(state.count, lr_value)
            usable = jnp.isfinite(lr_t) & (lr_t >= 0)
            unusable = ~(usable if lr_fits is None else usable & lr_fits(lr_t))
            skip = unusable if skip is None else skip | unusable
        if skip is None:
            return compute(grads, state, params, inv_scale, lr_value)
        # inside shard_map the branches must be typed alike: the host step's results are
        # typed as the inputs vary (a host call's carry no such type)
        return lax.cond(
            skip,
            lambda: (params, state),
            lambda: varying_as(compute(grads, state, params, inv_scale, lr_value), (params, state)),
        )

    @jax.custom_jvp
    def fused_step(grads, state, params, found_inf, inv_scale, lr_value):
        """``step``, refused under differentiation (its bit operations would give 0)."""
        return step(grads, state, params, found_inf, inv_scale, lr_value)

    @fused_step.defjvp
    def fused_step_jvp(primals, tangents):
        raise TypeError(
            f"{kind} (srround): tx.step and tx.update are not differentiable (the fused step"
            f" writes rounded bits); to differentiate through an update, use optax.{kind} and"
            " srround.adapters.jax.apply_updates (straight-through)"
        )

    # an eager call is one compiled program; inlined under an outer jit
    jitted = jax.jit(fused_step)

    @functools.lru_cache(maxsize=16)
    def expected_state(treedef, avals):
        """``init``'s state for params of these shapes and dtypes (ShapeDtypeStructs), and
        the leaves of each of its fields."""
        shapes = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in avals]
        state = jax.eval_shape(init, jax.tree_util.tree_unflatten(treedef, shapes))
        return state, {f: jax.tree_util.tree_leaves(getattr(state, f)) for f in state._fields}

    def check_state(state, params):
        """A clear error for a state that ``init(params)`` did not make: another optimizer's,
        one of other settings (``state_dtype``, ``mu_dtype``, ``rounding``, momentum) or of
        other params, which the step would misread or fail on deep inside."""
        if type(state) is not state_type:
            raise TypeError(
                f"state: expected the {state_type.__name__} of this optimizer's init(params),"
                f" got {type(state).__name__}"
            )
        leaves, treedef = jax.tree_util.tree_flatten(params)
        avals = tuple((tuple(np.shape(p)), jnp.dtype(p.dtype)) for p in leaves)
        expected, want_leaves = expected_state(treedef, avals)
        for field in state_type._fields:
            got = getattr(state, field)
            if jax.tree_util.tree_structure(got) != jax.tree_util.tree_structure(
                getattr(expected, field)
            ):
                raise ValueError(
                    f"state.{field}: not the structure this optimizer's init(params) gives (a"
                    " state of another optimizer, of other settings - state_dtype, mu_dtype,"
                    " rounding, momentum - or of other params)"
                )
            for i, (g, w) in enumerate(zip(jax.tree_util.tree_leaves(got), want_leaves[field])):
                dtype = jnp.result_type(g)  # a Python int count too
                same = dtype == w.dtype or (field == "count" and jnp.issubdtype(dtype, jnp.integer))
                if np.shape(g) != w.shape or not same:
                    path = jax.tree_util.tree_flatten_with_path(got)[0][i][0]
                    raise ValueError(
                        f"state.{field}{jax.tree_util.keystr(path)}: expected {w.dtype}"
                        f"{list(w.shape)} as this optimizer's init(params) makes, got"
                        f" {dtype}{list(np.shape(g))}"
                    )

    def scalar(x, name):
        """``x`` (an array of one element: a scalar, or torch's ``[1]``) as a 0-d array."""
        if x is None or isinstance(x, (bool, int, float, np.generic)):
            return x
        if np.size(x) != 1:
            raise ValueError(f"{name}: expected a scalar, got shape {tuple(np.shape(x))}")
        return jnp.reshape(x, ())

    def checked_step(grads, state, params, *, found_inf=None, inv_scale=None, lr_value=None):
        p_leaves = jax.tree_util.tree_leaves(params)
        _check_params(p_leaves)
        check_arrays(
            ("params", p_leaves),
            ("grads", jax.tree_util.tree_leaves(grads)),
            ("state", jax.tree_util.tree_leaves(state)),
            ("found_inf", found_inf),
            ("inv_scale", inv_scale),
        )
        check_state(state, params)
        found_inf, inv_scale = scalar(found_inf, "found_inf"), scalar(inv_scale, "inv_scale")
        if isinstance(inv_scale, (int, float, np.generic)):  # an array is checked in the step
            inv_scale = _validate.inv_scale(inv_scale)
        return jitted(grads, state, params, found_inf, inv_scale, lr_value)

    def update(updates, state, params=None, *, lr_value=None, **extra_args):
        if params is None:
            raise ValueError(f"{kind} (srround): update needs params (the fused step writes them)")
        new_params, new_state = checked_step(
            updates,
            state,
            params,
            found_inf=extra_args.get("found_inf"),
            inv_scale=extra_args.get("inv_scale"),
            lr_value=lr_value,
        )
        return jax.tree_util.tree_map(_exact_update, new_params, params), new_state

    def with_lr(value):
        """This optimizer with the learning rate ``value`` (a float32 scalar array) passed to
        its compiled step as an argument (``_lr_as_argument``)."""
        return FusedOptimizer(
            init,
            functools.partial(update, lr_value=value),
            functools.partial(checked_step, lr_value=value),
            dict(config, lr=value),
        )

    config = dict(cfg, kind=kind, impl=impl, seed=seed, rounding=rounding)
    step_without_lr = functools.partial(checked_step, lr_value=None)
    tx = FusedOptimizer(init, functools.partial(update, lr_value=None), step_without_lr, config)
    tx.with_lr = with_lr
    return tx


@_lr_as_argument
def adamw(
    learning_rate,
    b1=0.9,
    b2=0.999,
    eps=1e-8,
    eps_root=0.0,
    mu_dtype=None,
    weight_decay=1e-4,
    mask=None,
    *,
    nesterov=False,
    seed=0,
    rounding="stochastic",
    state_dtype=jnp.float32,
    impl=None,
    shard_specs=None,
) -> FusedOptimizer:
    """Fused AdamW with srround's weight write-back: ``optax.adamw``'s signature and
    defaults, an ``optax.GradientTransformationExtraArgs``. With ``eps_root=0`` and
    ``nesterov=False`` its math is torch.optim.AdamW's and bit for bit ``srround.adamw_step``.

    Args:
        learning_rate: a float, or an optax schedule (a function of the step count, called with
            ``state.count`` = steps taken so far, as optax does; its float32 value is used).
        b1: decay of the first moment, as ``optax.adamw``.
        b2: decay of the second moment.
        eps: added outside the square root of the bias-corrected second moment.
        eps_root: added inside that square root (optax's; native only when nonzero).
        weight_decay: decoupled weight decay, multiplied by the learning rate (default 1e-4,
            as optax).
        mu_dtype: dtype of the first moment, float32 or bfloat16 (default: ``state_dtype``;
            fp8 states: ``state_dtype`` only).
        mask: as optax: a pytree of bools like params or a prefix of it (or a function of
            params giving one);
            weight decay applies where True (the host step: one call for the leaves inside,
            one for those outside; with fp8 states native only).
        nesterov: optax's Nesterov momentum. Native only.
        seed: int in [0, 2**64) or a JAX PRNG key, fixed for the run: step ``t`` derives its
            noise from the counter ``t * 2**36 + ...``, so no key is threaded by hand.
        rounding: ``"stochastic"``, ``"nearest"``, ``"kahan"``, ``"master"`` or
            ``"remainder"`` (bf16 parameters only), for bf16/fp16 leaves; float32 leaves are
            always updated exactly.
        state_dtype: ``jnp.float32``, ``jnp.bfloat16`` or fp8 (``jnp.float8_e4m3fn``,
            ``jnp.float8_e5m2``; no nesterov, eps_root, shard_specs): stochastically rounded
            moments. An fp8
            state leaf is the pair ``(moments, float32 block scales)``, the second moment in
            the square-root domain (``docs/contracts.md``, "fp8 states").
        impl: ``None`` (default: the host step when lowered for the CPU and the settings allow,
            else native; see the module docstring), ``"native"`` or ``"callback"``
            (``srround.adamw_step`` on the host).
        shard_specs: when the step runs inside ``shard_map``: the partition specs of the
            params (a spec or a pytree prefix, as ``in_specs``; grads and states split alike),
            so every block uses the noise of its global elements (equal to the unsharded step).
            Both implementations; not with fp8 states. Not needed under ``jit`` with sharded
            arrays.

    Returns:
        ``tx`` with ``tx.init(params) -> AdamWState``, ``tx.update(grads, state, params) ->
        (updates, state)`` (float32 updates that ``optax.apply_updates`` turns into the
        stochastically rounded params) and the fused ``tx.step(grads, state, params) ->
        (params, state)``.
    """
    learning_rate = _learning_rate(learning_rate)
    static = "ADAMW_STATIC_ARGS"
    b1 = _static_real(b1, "b1", static, low=0.0, high=1.0, high_open=True)
    b2 = _static_real(b2, "b2", static, low=0.0, high=1.0, high_open=True)
    eps = _static_real(eps, "eps", static, low=0.0)
    eps_root = _static_real(eps_root, "eps_root", static, low=0.0)
    weight_decay = _static_real(weight_decay, "weight_decay", static, low=0.0)
    if not callable(learning_rate):  # a number; a schedule's values skip the step (lr_fits)
        _validate.adamw_coefficients(
            learning_rate, b1, weight_decay, names=("learning_rate", "b1", "weight_decay")
        )
    seed = _static_seed(seed, static)
    state_dtype = _state_dtype(state_dtype, "state_dtype", fp8=True)
    mu_dtype = state_dtype if mu_dtype is None else _state_dtype(mu_dtype, "mu_dtype")
    fp8 = state_dtype in _FP8_STATES
    variant = (bool(nesterov), float(eps_root))
    # what srround.adamw_step runs (optax's mask: one host call per group of leaves, with and
    # without weight decay; not with fp8 states, whose host step takes no stream positions)
    torch_math = not any(variant) and mu_dtype == state_dtype and not (fp8 and mask is not None)
    impl_ = _impl(impl, "auto" if torch_math and not fp8 else "native")
    if fp8 and (any(variant) or shard_specs is not None or mu_dtype != state_dtype):
        raise ValueError(
            f"state_dtype: {state_dtype} (block-scaled) states take neither nesterov, eps_root,"
            " shard_specs nor another mu_dtype"
        )
    if impl_ == "callback" and not torch_math:
        raise ValueError(
            "impl='callback' runs srround.adamw_step (torch's AdamW): nesterov, eps_root, a"
            " mu_dtype other than state_dtype and a mask with fp8 states need impl='native'"
        )
    constants = tuple(np.float32(c) for c in (b2, eps, 1.0 - b1, 1.0 - b2))
    b1, b2, wd = float(b1), float(b2), float(weight_decay)

    def native(t, lr_t, inv_scale, params, treedef):
        coefs = _coefs(t, lr_t, b1, b2, wd)
        with_decay = (coefs, inv_scale)
        without = (_no_decay(coefs), inv_scale)
        flags = _mask_leaves(mask, params, treedef)
        extras = [with_decay if f else without for f in flags]
        if fp8:
            return _update8, (rounding, state_dtype.name, constants), extras
        return _update, (rounding, (mu_dtype, state_dtype), constants, variant), extras

    def host_with(weight_decay):
        def host(ps, gs, sts, **step):
            scales = dict(exp_avg_scales=sts[2], exp_avg_sq_scales=sts[3]) if fp8 else {}
            _host("adamw_step")(
                ps,
                gs,
                *sts[:2],
                betas=(b1, b2),
                eps=float(eps),
                weight_decay=weight_decay,
                rounding=rounding,
                **scales,
                **step,
            )

        return host

    host, host_undecayed = host_with(wd), host_with(0.0)

    def lr_fits(lr_t):
        """``_validate.adamw_coefficients`` of a run-time learning rate, in float64 as there."""
        with jax.enable_x64(True):
            lr64 = lr_t.astype(jnp.float64)
            step_size, decay = lr64 / (1.0 - b1), 1.0 - lr64 * wd
            limit = _validate.F32_ROUNDS_TO_INF
            return (jnp.abs(step_size) < limit) & (jnp.abs(decay) < limit)

    def host_groups(params, treedef):  # optax's mask: leaves outside it take no weight decay
        flags = _mask_leaves(mask, params, treedef)
        return [
            (host, [i for i, f in enumerate(flags) if f]),
            (host_undecayed, [i for i, f in enumerate(flags) if not f]),
        ]

    cfg = dict(
        lr=learning_rate,
        b1=b1,
        b2=b2,
        eps=float(eps),
        eps_root=float(eps_root),
        wd=wd,
        nesterov=bool(nesterov),
        mu_dtype=mu_dtype,
        state_dtype=state_dtype,
    )
    return _fused(
        "adamw",
        lr=learning_rate,
        seed=seed,
        rounding=rounding,
        impl=impl_,
        shard_specs=shard_specs,
        states=(("exp_avg", mu_dtype, 1), ("exp_avg_sq", state_dtype, 2)),
        cfg=cfg,
        native=native,
        host=host,
        host_groups=None if mask is None else host_groups,
        lr_fits=lr_fits,
        host_bits=impl is None and impl_ == "native",  # the default, for native-only settings
    )


class SGDState(NamedTuple):
    """State of ``sgd`` (a pytree).

    Attributes:
        count: int32 scalar, steps taken.
        momentum_buffer: pytree like params (``accumulator_dtype``; ``None`` leaves without
            momentum), optax's trace.
        aux: as ``AdamWState.aux``.
    """

    count: Any
    momentum_buffer: Any
    aux: Any


@_lr_as_argument
def sgd(
    learning_rate,
    momentum=None,
    nesterov=False,
    accumulator_dtype=None,
    *,
    seed=0,
    rounding="stochastic",
    impl=None,
    shard_specs=None,
) -> FusedOptimizer:
    """Fused SGD with srround's weight write-back: ``optax.sgd``'s signature, an
    ``optax.GradientTransformationExtraArgs``; bit for bit ``srround.sgd_step`` (torch's SGD
    with dampening 0 and no weight decay, which is optax's math with fused multiply-adds).

    Args:
        learning_rate: a float or an optax schedule (of ``state.count``).
        momentum: ``None`` (plain SGD) or the trace decay (optax's ``trace``: ``buf = g +
            momentum * buf``, ``buf = g`` at the first step as both optax and torch).
        nesterov: Nesterov momentum (``d = g + momentum * buf``).
        accumulator_dtype: float32 (default) or bfloat16 (stochastically rounded).
        seed: as ``adamw``.
        rounding: as ``adamw``.
        impl: as ``adamw``.
        shard_specs: as ``adamw``.
    """
    buf_dtype = _state_dtype(
        jnp.float32 if accumulator_dtype is None else accumulator_dtype, "accumulator_dtype"
    )
    learning_rate = _learning_rate(learning_rate)
    if momentum is not None:
        momentum = _static_real(momentum, "momentum", "SGD_STATIC_ARGS", low=0.0)
    seed = _static_seed(seed, "SGD_STATIC_ARGS")
    if nesterov and not momentum:
        raise ValueError("nesterov: needs momentum > 0")
    mom = 0.0 if momentum is None else float(momentum)
    has_buf = momentum is not None and mom != 0.0

    def native(t, lr_t, inv_scale, params, treedef):
        coefs = (jnp.asarray(lr_t, jnp.float32), t == 1)
        extra = (coefs, inv_scale)
        return (
            _sgd_update,
            (rounding, buf_dtype, np.float32(mom), bool(nesterov)),
            [extra] * treedef.num_leaves,
        )

    def host(ps, gs, sts, **step):
        buf = sts[0] if has_buf else None
        _host("sgd_step")(
            ps, gs, buf, momentum=mom, nesterov=bool(nesterov), rounding=rounding, **step
        )

    cfg = dict(lr=learning_rate, momentum=mom, nesterov=bool(nesterov), accumulator_dtype=buf_dtype)
    return _fused(
        "sgd",
        lr=learning_rate,
        seed=seed,
        rounding=rounding,
        impl=_impl(impl, "auto"),
        shard_specs=shard_specs,
        states=(("momentum_buffer", buf_dtype if has_buf else None, 1),),
        cfg=cfg,
        native=native,
        host=host,
    )


def _exact_update(new, p):
    """float32 ``u`` with ``float32(p + u) == new`` where one exists: ``new - p``, or that
    nudged by one ulp when the subtraction rounded (old and new of different signs or far
    apart). For bf16/fp16 leaves ``new - p`` is exact in float32 unless the exponents differ
    by more than ~16, so ``optax.apply_updates`` (``(p + u).astype(p.dtype)``) gives ``new``."""
    n32, p32 = new.astype(jnp.float32), p.astype(jnp.float32)
    u = n32 - p32
    miss = p32 + u
    nudged = jnp.nextafter(u, jnp.where(miss < n32, jnp.float32(jnp.inf), -jnp.inf))
    return jnp.where((miss != n32) & (p32 + nudged == n32), nudged, u)


def _scale_usable(inv_scale):
    """``_elements.scale_usable`` of a float32 scalar, as a traced bool: a positive finite
    pattern (compared as bits, so subnormals count as the kernels count them)."""
    bits = lax.bitcast_convert_type(
        jnp.reshape(jnp.asarray(inv_scale, jnp.float32), ()), jnp.uint32
    )
    return (bits > 0) & (bits < 0x7F800000)


def _callback_step(
    host_step, columns, t, lr, k0, k1, inv_scale, layouts, global_shapes, whole, leaves
):
    """The fused step as one host call (``_callback``) into srround's NumPy step (``host_step``),
    in place in the results' buffers (``aliases``; the gradients are only read). ``columns`` =
    (params, grads, state columns, aux): leaves per column (``None`` leaves: absent). Under
    ``jit`` each shard runs on its own (and inside ``shard_map``, each block: ``layouts``), its
    contiguous runs placed in the random stream at their global indices (``stream_starts``).
    ``whole``: whole leaves only (fp8 states: their blocks span a leaf). ``leaves``: the
    indices of the leaves this call updates, at their places in the whole tree's stream; the
    others come back as they are. On one CPU device small leaves reach the host joined
    (``_leaves.host_units``), each at its own place in the stream (same bits: the step is
    elementwise)."""
    p_leaves, g_leaves, s_leaves, a_leaves = columns
    live = [i for i in leaves if p_leaves[i].size > 0]
    unsharded = all(layouts[i] is None for i in live)
    pack = not whole and unsharded and _leaves._on_one_cpu([p_leaves[i] for i in live])
    units = _leaves.host_units(live, [p_leaves, g_leaves, *s_leaves, a_leaves], pack)
    has_aux = [a_leaves[u[0]] is not None for u in units]
    states = [col for col in s_leaves if any(col[i] is not None for i in live)]
    n, ns, na = len(units), len(states), sum(has_aux)
    static_lr = None if not isinstance(lr, float) else lr
    tree_starts = _starts(global_shapes)
    sizes = [int(np.prod(global_shapes[i], dtype=np.int64)) for i in range(len(global_shapes))]
    joined_runs, within, _ = _leaves.joined_runs(units, sizes, tree_starts)
    starts = [tree_starts[u[0]] if len(u) == 1 else 0 for u in units]
    shapes_live = [
        tuple(global_shapes[u[0]]) if len(u) == 1 else (sum(sizes[i] for i in u),) for u in units
    ]
    # the table of the last call, kept while the buffers stay (with donation XLA hands the
    # step the same buffers every call): about 3 ms less host work a 196-leaf step
    reuse = StepReuse()

    def host(h0, h1, t_host, lr_host, scale_host, *arrays):
        arrays = list(arrays)  # params, states, aux: writable; grads, origins: read-only
        ps, gs = arrays[:n], arrays[n : 2 * n]
        sts = [arrays[(2 + j) * n : (3 + j) * n] for j in range(ns)]
        aux_it = iter(arrays[(2 + ns) * n : (2 + ns) * n + na])
        aux = [next(aux_it) if h else None for h in has_aux]
        origins = arrays[(2 + ns) * n + na :]
        runs = [
            _runs(p.shape, o, g) if r is None else r
            for p, o, g, r in zip(ps, origins, shapes_live, joined_runs)
        ]
        positions = [s + first for s, r in zip(starts, runs) for _, _, first in r]
        placed = {} if whole else {"stream_starts": positions}

        def pieces(leaves):  # each leaf's runs: flat views of the host arrays
            return [
                None if x is None else x.reshape(-1)[lo : lo + size]
                for x, leaf_runs in zip(leaves, runs)
                for lo, size, _ in leaf_runs
            ]

        with reuse.active():
            host_step(
                pieces(ps),
                pieces(gs),
                [pieces(st) for st in sts],
                aux=pieces(aux) if any(has_aux) else None,
                lr=static_lr if static_lr is not None else float(lr_host),
                step=int(t_host),
                seed=_seed_of(h0, h1),
                inv_scale=float(scale_host),
                **placed,
            )
        return tuple(ps + [x for st in sts for x in st] + [a for a in aux if a is not None])

    aux_leaf = [j for j, h in enumerate(has_aux) if h]
    result_leaves = (*range(n), *(list(range(n)) * ns), *aux_leaf)
    leaves_in = (
        _leaves.join_units(p_leaves, units)
        + _leaves.join_units(g_leaves, units)
        + [x for col in states for x in _leaves.join_units(col, units)]
        + [a for a, h in zip(_leaves.join_units(a_leaves, units), has_aux) if h]
    )
    results_in = leaves_in[:n] + leaves_in[2 * n :]  # what the step writes, in result order
    scale = jnp.float32(1.0) if inv_scale is None else jnp.asarray(inv_scale, jnp.float32)
    lr_arg = jnp.asarray(0.0 if static_lr is not None else lr, jnp.float32)
    scalars = (_u(k0), _u(k1), jnp.asarray(t, jnp.int32), lr_arg, scale)

    # what the host function does: the optimizer's step and this tree's static layout
    key = ("optimizer step", host_step, n, ns, tuple(has_aux), static_lr, whole)
    key += (tuple(starts), tuple(tuple(g) for g in shapes_live), tuple(joined_runs))

    def body(*operands_and_origins):
        *operands, origins = operands_and_origins
        local = operands[5:]
        shapes = tuple(  # this shard's
            jax.ShapeDtypeStruct(local[_result_operand(r, n)].shape, x.dtype)
            for r, x in enumerate(results_in)
        )
        origin_args = [
            _origin_arg(None if origins is None else origins.get(j), local[j].ndim)
            for j in range(n)
        ]
        aliases = {5 + _result_operand(r, n): r for r in range(len(shapes))}
        out = _callback(host, shapes, *operands, *origin_args, key=key, aliases=aliases)
        return out[0] if len(shapes) == 1 else tuple(out)

    results = []
    if n:
        blocks = {j: layouts[u[0]][0] for j, u in enumerate(units) if layouts[u[0]] is not None}
        if blocks:  # inside shard_map: each block's origin
            out = body(*scalars, *leaves_in, blocks)
        elif whole or pack:
            out = body(*scalars, *leaves_in, None)
        else:
            leaf_of = (None,) * 5 + (*range(n), *range(n), *result_leaves[n:])
            out = _per_shard(body, leaf_of, *scalars, *leaves_in, result_leaves=result_leaves)
        results = [out] if len(result_leaves) == 1 else list(out)
    unit_of = {k: j for j, u in enumerate(units) for k in u}
    shapes = {k: p_leaves[k].shape for k in within}
    of_leaf = _leaves.split_joined(within, sizes, shapes, (k0, k1, t))
    outs = [
        [p, *(col[k] for col in s_leaves), a] for k, (p, a) in enumerate(zip(p_leaves, a_leaves))
    ]
    aux_results = dict(zip(aux_leaf, results[(1 + ns) * n :]))
    state_cols = [c for c, col in enumerate(s_leaves) if any(col[i] is not None for i in live)]
    for k in live:
        j = unit_of[k]
        outs[k][0] = of_leaf(results[j], k)
        for c_pos, c in enumerate(state_cols):
            outs[k][1 + c] = of_leaf(results[(1 + c_pos) * n + j], k)
        if has_aux[j]:
            outs[k][-1] = of_leaf(aux_results[j], k)
    return [tuple(o) for o in outs]


def _result_operand(r: int, n: int) -> int:
    """The operand (after the scalars) that result ``r`` of ``_callback_step`` overwrites:
    params come first, then the grads (not written), then states and aux."""
    return r if r < n else r + n
