"""CPU and CUDA give the same bits; so do one and two CPU threads. CUDA runs on a real GPU when
there is one, else in Numba's simulator with a tiny launch configuration."""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest

import srround

from .reference import FORMAT_NAMES, bits, run_python, to_cuda


def _inputs(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32)
    x[::17] = np.array([0x7FFFFFFF], np.uint32).view(np.float32)[0]
    x[5::19] = np.float32(1e-41)  # fp32 subnormal
    x[7::23] = np.float32(-np.inf)
    return x


@pytest.mark.cuda
@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("n,offset", [(203, 0), (203, 3), (64, 8), (5, 2**34 + 2)])
def test_cpu_and_cuda_bit_identical(name, n, offset, small_cuda_launch):
    from numba import cuda

    if not cuda.is_available():
        pytest.skip("no CUDA")
    x = _inputs(n)
    cpu = bits(srround.stochastic_round(x, dtype=name, seed=5, offset=offset))
    gpu = srround.stochastic_round(to_cuda(x), dtype=name, seed=5, offset=offset)
    assert np.array_equal(cpu, bits(gpu.copy_to_host()))

    assert np.array_equal(
        bits(srround.round_nearest(x, dtype=name)),
        bits(srround.round_nearest(to_cuda(x), dtype=name).copy_to_host()),
    )
    narrow = srround.round_nearest(x, dtype=name)
    assert np.array_equal(
        bits(srround.to_float32(narrow)),
        bits(srround.to_float32(to_cuda(narrow)).copy_to_host()),
    )
    u = (np.random.default_rng(1).standard_normal(n) * 1e-3).astype(np.float32)
    w_cpu, w_gpu = narrow.copy(), to_cuda(narrow)
    srround.stochastic_add(w_cpu, u, alpha=-0.3, seed=9, offset=offset)
    srround.stochastic_add(w_gpu, to_cuda(u), alpha=-0.3, seed=9, offset=offset)
    assert np.array_equal(bits(w_cpu), bits(w_gpu.copy_to_host()))


@pytest.mark.cuda
def test_cuda_unaligned_slice_uses_general_kernel_same_bits(small_cuda_launch):
    from numba import cuda

    if not cuda.is_available():
        pytest.skip("no CUDA")
    x = _inputs(64)
    dx = cuda.to_device(x)
    got = srround.stochastic_round(dx[1:], seed=3, offset=1)
    assert np.array_equal(bits(got.copy_to_host()), bits(srround.stochastic_round(x, seed=3))[1:])


_HASH_SCRIPT = """
import hashlib, numpy as np, srround
x = np.random.default_rng(0).standard_normal(300_001).astype(np.float32)
h = hashlib.sha256()
for name in ("bfloat16", "float16"):
    h.update(srround.stochastic_round(x, dtype=name, seed=77, offset=3).view(np.uint16).tobytes())
    w = srround.round_nearest(x, dtype=name)
    srround.stochastic_add(w, x * np.float32(1e-3), alpha=0.5, seed=78, offset=1)
    h.update(w.view(np.uint16).tobytes())
print(h.hexdigest())
"""


def test_thread_count_does_not_change_bits():
    digests = []
    for threads in ("1", "2"):
        env = dict(os.environ, NUMBA_NUM_THREADS=threads)
        result = run_python(["-c", _HASH_SCRIPT], env=env, cwd=None)
        digests.append(result.stdout.strip())
    assert digests[0] == digests[1]


def test_small_cpu_calls_run_on_one_thread_with_the_same_bits(monkeypatch):
    """Below ``_config.CPU_SERIAL_BELOW`` elements a CPU kernel runs on the calling thread
    alone (``_cpu.run``); the bits are those of the parallel path and the caller's Numba thread
    count is left as it was."""
    import numba

    from srround import _config, _cpu

    asked = []

    def spy(n):
        asked.append(n)
        numba.set_num_threads(n)

    monkeypatch.setattr(_cpu, "set_num_threads", spy)
    threads = numba.get_num_threads()
    x = _inputs(5000)
    results = []
    for threshold in (0, 1 << 30):  # always parallel, then always serial
        monkeypatch.setattr(_config, "CPU_SERIAL_BELOW", threshold)
        w = srround.round_nearest(x)
        srround.stochastic_add(w, x, alpha=1e-3, seed=6, offset=1)
        grads = [x[:3000] * np.float32(4), (x[3000:] * np.float32(4)).astype(ml_dtypes.bfloat16)]
        found = srround.unscale_and_check(grads, 0.25)
        params, moments = (
            [w[:3000].copy(), w[3000:].copy()],
            [np.zeros(3000, np.float32), np.zeros(2000, np.float32)],
        )
        squares = [m.copy() for m in moments]
        srround.adamw_step(
            params,
            [g.astype(ml_dtypes.bfloat16) for g in grads],
            moments,
            squares,
            lr=1e-2,
            step=1,
            seed=7,
        )
        results.append(
            [
                bits(a)
                for a in (
                    srround.stochastic_round(x, seed=5, offset=2),
                    w,
                    found,
                    *grads,
                    *params,
                    *moments,
                    *squares,
                )
            ]
        )
        assert numba.get_num_threads() == threads
    assert asked and set(asked[::2]) == {1} and set(asked[1::2]) == {threads}
    assert all(np.array_equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("kernel", ["stochastic_round", "stochastic_add"])
def test_a_view_of_runs_gets_the_whole_arrays_bits(device, kernel, monkeypatch, small_cuda_launch):
    """A view whose elements are evenly spaced runs of a larger array's stream (``View.runs``:
    a tensor-parallel ``Shard(1)`` piece, its rows) through ``_api._launch_runs``: each column
    piece of a matrix gets the whole matrix's bits, for batches of 1, 2 and all rows (rows
    padded to the stream's spacing, a batch a launch); CPU, and CUDA (the simulator in CI)."""
    from srround import _api
    from srround._dispatch import View
    from srround._formats import get_format
    from srround._rng import split_seed

    rows, cols, offset, alpha = 5, 7, 11, 1e-3
    x = _inputs(rows * cols).reshape(rows, cols)
    w = (np.linspace(-1, 1, rows * cols, dtype=np.float32) * 3).astype(ml_dtypes.bfloat16)
    w = w.reshape(rows, cols)
    if kernel == "stochastic_round":
        expected = bits(srround.stochastic_round(x.reshape(-1), seed=5, offset=offset))
    else:
        whole = w.reshape(-1).copy()
        srround.stochastic_add(whole, x.reshape(-1), alpha=alpha, seed=5, offset=offset)
        expected = bits(whole)
    expected = expected.reshape(rows, cols)
    stream = None
    if device == "cuda":
        from numba import cuda

        stream = cuda.default_stream()
    on = to_cuda if device == "cuda" else np.ascontiguousarray
    for padded in (cols, 2 * cols, 1 << 22):
        monkeypatch.setattr(_api, "_PADDED_ELEMENTS", padded)
        for lo, hi in ((0, 3), (3, cols)):
            src = on(x[:, lo:hi].reshape(-1).view(np.uint32))
            dst = on(w[:, lo:hi].reshape(-1).view(np.uint16))
            view = View(dst, device, (rows, hi - lo), None, stream, runs=(hi - lo, cols - hi + lo))
            key = split_seed(5)
            fmt = get_format("bfloat16")
            _api._launch_random(kernel, view, src, dst, alpha, key, offset + lo, fmt, False)
            got = dst.copy_to_host() if device == "cuda" else dst
            assert np.array_equal(got.reshape(rows, hi - lo), expected[:, lo:hi]), (padded, lo)
