"""The callback backend: ``jax.pure_callback`` into srround's NumPy path (the Numba kernels).

The operands are copied to the host, computed there and copied back, so this path is only
sensible on CPU. Callbacks are ``vmap_method="sequential"``: a vmapped call equals the
per-example calls. The host work runs on a thread of this module (``_HOST``): XLA's CPU runtime
runs computations, and the host callbacks inside them, with flush-to-zero/denormals-are-zero
set, which would make the Numba fma treat subnormal operands as zero. A new thread inherits its
creator's floating-point environment, so ``_HOST`` is started at import, outside any XLA
computation, and Numba's worker pool, if first started from it, inherits the default one too.
"""

from __future__ import annotations

import concurrent.futures

import jax
import jax.numpy as jnp
import numpy as np

import srround._api as _srround_api
from srround._formats import Format

from ._lax import _u, result_dtype

_HOST = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="srround-jax-host")
_HOST.submit(int).result()  # start the thread now, outside any XLA computation


def _seed_of(k0, k1) -> int:
    """The int seed of Threefry key words ``(k0, k1)`` (host scalars)."""
    return int(k0) | (int(k1) << 32)


def _callback(fn, result_shape, *args):
    """``jax.pure_callback(fn, result_shape, *args)`` with ``fn`` run on ``_HOST``."""

    def on_host(*arrays):
        return _HOST.submit(fn, *arrays).result()

    return jax.pure_callback(on_host, result_shape, *args, vmap_method="sequential")


def _host(name: str):
    """srround's own API function ``name`` (the NumPy path, run on host arrays)."""
    return getattr(_srround_api, name)


def stochastic_round(x, fmt: Format, k0, k1, offset: int, overflow: str):
    """``srround.stochastic_round`` of float32 ``x`` on the host."""

    def host(xh, h0, h1):
        y = _host("stochastic_round")(
            np.asarray(xh, order="C"),
            dtype=fmt.name,
            seed=_seed_of(h0, h1),
            offset=offset,
            overflow=overflow,
        )
        return np.asarray(y).view(result_dtype(fmt)).reshape(xh.shape)

    shape = jax.ShapeDtypeStruct(x.shape, result_dtype(fmt))
    return _callback(host, shape, x, _u(k0), _u(k1))


def round_nearest(x, fmt: Format, overflow: str):
    """``srround.round_nearest`` of float32 ``x`` on the host."""

    def host(xh):
        return (
            np.asarray(
                _host("round_nearest")(np.asarray(xh, order="C"), dtype=fmt.name, overflow=overflow)
            )
            .view(result_dtype(fmt))
            .reshape(xh.shape)
        )

    return _callback(host, jax.ShapeDtypeStruct(x.shape, result_dtype(fmt)), x)


def to_float32(y, fmt: Format):
    """``srround.to_float32`` of narrow ``y`` (format ``fmt``) on the host."""

    def host(yh):
        widened = _host("to_float32")(np.asarray(yh, order="C"), dtype=fmt.name)
        return np.asarray(widened).reshape(yh.shape)

    return _callback(host, jax.ShapeDtypeStruct(y.shape, jnp.float32), y)


def stochastic_add(w, u, alpha, fmt: Format, k0, k1, offset: int, overflow: str):
    """``srround.stochastic_add`` on a host copy of ``w``; returns the new ``w``."""

    def host(wh, uh, ah, h0, h1):
        target = np.array(wh)  # a writable copy: the callback's input is read-only
        _host("stochastic_add")(
            target,
            np.asarray(uh, order="C"),
            alpha=np.float32(ah),
            seed=_seed_of(h0, h1),
            offset=offset,
            dtype=fmt.name,
            overflow=overflow,
        )
        return target

    shape = jax.ShapeDtypeStruct(w.shape, w.dtype)
    return _callback(host, shape, w, u, jnp.asarray(alpha, jnp.float32), _u(k0), _u(k1))
