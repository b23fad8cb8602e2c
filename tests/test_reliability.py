"""What real programs do around the calls: threads, fork, DataLoader workers, aliased memory,
hostile arguments, and loss scaling that flags what it produces.

The thread and fork tests run in fresh subprocesses: a first call (adapter import, Numba
compile or cache load, the threading layer's start) happens once per process, and a process
killed by a runtime abort must not take the test run with it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(code: str, *, env: dict | None = None, timeout: float = 240):
    """Run ``code`` in a fresh interpreter (CPU only); returns the CompletedProcess."""
    environ = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", JAX_PLATFORMS="cpu", **(env or {}))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environ,
        cwd=_ROOT,
    )


def _ok(result, expected_stdout="ok"):
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.split()[-1:] == [expected_stdout], result.stdout + result.stderr


# -- threads (finding 1) ------------------------------------------------------------------------

_FIRST_CALLS = """
import threading, numpy as np
{setup}
import srround
N = {n}
barrier = threading.Barrier(8)
results, errors = {{}}, []

def call(i):
    {make}
    barrier.wait()
    try:
        results[i] = {call}
    except BaseException as e:
        errors.append(repr(e))

threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert not errors, errors
for i in range(8):  # the same call again, alone: the same bits
    {make}
    again = {call}
    assert {same}, i
print("ok")
"""

_CASES = {
    "numpy": (
        "",
        "x = np.linspace(-1, 1, N, dtype=np.float32) * (i + 1)",
        "srround.stochastic_round(x, seed=i).view(np.uint16)",
        "np.array_equal(results[i], again)",
    ),
    "torch": (
        "import torch",
        "x = torch.linspace(-1, 1, N) * (i + 1)",
        "srround.stochastic_round(x, seed=i).view(torch.int16)",
        "torch.equal(results[i], again)",
    ),
    "jax": (
        "import jax, jax.numpy as jnp",
        "x = jnp.linspace(-1, 1, N, dtype=jnp.float32) * (i + 1)",
        "np.asarray(srround.stochastic_round(x, seed=i)).view(np.uint16)",
        "np.array_equal(results[i], again)",
    ),
    "unscale_and_check": (
        "",
        "g = [np.full(N, 2.0 ** i, np.float32), np.full(N // 3, np.inf if i % 2 else 1.0,"
        " np.float32)]",
        "(srround.unscale_and_check(g, 0.5)[0], g[0][0], g[1][0])",
        "results[i] == (float(i % 2), 2.0 ** (i - 1), np.inf if i % 2 else 0.5)",
    ),
}


@pytest.mark.parametrize("n", [1000, 1 << 17], ids=["serial", "parallel"])
@pytest.mark.parametrize("case", sorted(_CASES))
def test_first_calls_from_eight_threads(case, n):
    """Eight threads make the process's first call at once (adapter import, kernel compile or
    cache load, threading-layer start), three fresh processes each; every call succeeds and
    gives the bits of the same call made alone."""
    setup, make, call, same = _CASES[case]
    if setup:
        pytest.importorskip(setup.split()[1].rstrip(","))
    code = _FIRST_CALLS.format(setup=setup, make=make, call=call, same=same, n=n)
    for _ in range(3):
        _ok(_python(code))


def test_concurrent_parallel_calls_on_workqueue_take_turns():
    """On Numba's workqueue layer (chosen by the user here; srround's fallback without TBB)
    two threads launching parallel kernels at once used to abort the process; srround
    serialises its launches there."""
    code = """
    import threading, numpy as np, numba, srround
    assert numba.threading_layer() == "workqueue", numba.threading_layer()
    x = np.linspace(-1, 1, 1 << 18, dtype=np.float32)
    expected = srround.stochastic_round(x, seed=1).view(np.uint16)
    bad = []
    def work():
        for _ in range(10):
            if not np.array_equal(srround.stochastic_round(x, seed=1).view(np.uint16), expected):
                bad.append(1)
    threads = [threading.Thread(target=work) for _ in range(4)]
    [t.start() for t in threads]; [t.join() for t in threads]
    assert not bad
    print("ok")
    """
    _ok(_python(code, env={"NUMBA_THREADING_LAYER": "workqueue"}))


# -- fork and DataLoader workers (finding 2) ------------------------------------------------------

_FORK = """
import multiprocessing as mp, numpy as np, srround
x = np.linspace(-1, 1, {n}, dtype=np.float32)
parent = srround.stochastic_round(x, seed=3).view(np.uint16)

def child(queue):
    queue.put(srround.stochastic_round(x, seed=3).view(np.uint16).tobytes())

ctx = mp.get_context("fork")
queue = ctx.Queue()
workers = [ctx.Process(target=child, args=(queue,)) for _ in range(2)]
[w.start() for w in workers]
got = [queue.get(timeout=120) for _ in workers]
[w.join(30) for w in workers]
assert [w.exitcode for w in workers] == [0, 0], [w.exitcode for w in workers]
assert all(g == parent.tobytes() for g in got)
print("ok")
"""


@pytest.mark.parametrize("n", [1000, 1 << 17], ids=["serial", "parallel"])
def test_forked_child_gets_the_parents_bits(n):
    """After the parent ran a kernel, ``multiprocessing`` fork children call srround and get
    the parent's bits (GNU OpenMP killed them: "fork() called from a process already using GNU
    OpenMP")."""
    _ok(_python(_FORK.format(n=n)))


def test_dataloader_workers_call_srround():
    """A torch DataLoader with two forked workers whose collate function rounds the batch:
    the bits the parent computes for the same batches."""
    pytest.importorskip("torch")
    code = """
    import numpy as np, torch, srround
    from torch.utils.data import DataLoader

    def collate(items):
        batch = torch.stack(items)
        return srround.stochastic_round(batch, seed=int(batch[0, 0])).view(torch.int16)

    data = [torch.full((1 << 15,), float(i)) + torch.linspace(0, 1, 1 << 15) for i in range(8)]
    expected = [collate(data[i : i + 2]) for i in range(0, 8, 2)]  # the parent uses srround
    loader = DataLoader(data, batch_size=2, num_workers=2, collate_fn=collate,
                        multiprocessing_context="fork")
    got = list(loader)
    assert len(got) == 4 and all(torch.equal(a, b) for a, b in zip(got, expected))
    print("ok")
    """
    _ok(_python(code))


def test_fork_while_other_threads_run_kernels():
    """Threads keep launching parallel kernels while the main thread forks children that
    call srround: no child dies or hangs, every result has the expected bits."""
    code = """
    import multiprocessing as mp, threading, numpy as np, srround
    x = np.linspace(-1, 1, 1 << 17, dtype=np.float32)
    expected = srround.stochastic_round(x, seed=5).view(np.uint16)
    stop, bad = threading.Event(), []

    def busy():
        while not stop.is_set():
            if not np.array_equal(srround.stochastic_round(x, seed=5).view(np.uint16), expected):
                bad.append(1)

    def child(queue):
        queue.put(srround.stochastic_round(x, seed=5).view(np.uint16).tobytes())

    threads = [threading.Thread(target=busy) for _ in range(3)]
    [t.start() for t in threads]
    ctx = mp.get_context("fork")
    for _ in range(4):
        queue = ctx.Queue()
        p = ctx.Process(target=child, args=(queue,))
        p.start()
        assert queue.get(timeout=120) == expected.tobytes()
        p.join(30)
        assert p.exitcode == 0, p.exitcode
    stop.set()
    [t.join() for t in threads]
    assert not bad
    print("ok")
    """
    _ok(_python(code, env={"PYTHONWARNINGS": "ignore::DeprecationWarning"}))


def test_nested_use_neither_deadlocks_nor_oversubscribes():
    """srround from a thread pool while torch runs intra-op work and a user's own Numba
    ``prange`` function runs in another thread, and from inside a JAX callback under ``jit``:
    everything finishes, and the process holds no more threads than the pools it started
    (Numba's one shared pool: threads do not multiply with the callers)."""
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    code = """
    import os, threading
    from concurrent.futures import ThreadPoolExecutor
    import numba, numpy as np, torch, jax, jax.numpy as jnp, srround, srround.adapters.jax

    def os_threads():
        return len(os.listdir("/proc/self/task"))

    @numba.njit(parallel=True)
    def user_kernel(a):
        s = 0.0
        for i in numba.prange(a.size):
            s += a[i] * 0.5
        return s

    x = np.linspace(-1, 1, 1 << 17, dtype=np.float32)
    expected = srround.stochastic_round(x, seed=2).view(np.uint16)
    user_kernel(x)
    torch.ones(1 << 16) @ torch.ones(1 << 16)
    f = jax.jit(lambda v: srround.adapters.jax.stochastic_round(v, seed=2, impl="callback"))
    np.asarray(f(jnp.asarray(x)))
    baseline = os_threads()

    def task(i):
        if i % 2 == 0:
            return user_kernel(x) is not None
        t = torch.from_numpy(x.copy())
        return torch.equal(srround.stochastic_round(t, seed=2).view(torch.int16),
                           torch.from_numpy(expected.view(np.int16)))

    def jax_calls(results):  # one thread: concurrent JAX callbacks can deadlock XLA's CPU pool
        for _ in range(6):
            results.append(np.array_equal(np.asarray(f(jnp.asarray(x))).view(np.uint16), expected))

    def round_of_work():
        jax_results = []
        jax_thread = threading.Thread(target=jax_calls, args=(jax_results,))
        jax_thread.start()
        with ThreadPoolExecutor(8) as pool:
            assert all(pool.map(task, range(32)))
        jax_thread.join()
        assert jax_results == [True] * 6
        return os_threads()

    first = round_of_work()
    second = round_of_work()
    # worker pools may grow once to their size, not with the number of calling threads
    assert first - baseline <= numba.get_num_threads() + torch.get_num_threads(), (baseline, first)
    assert second <= first, (first, second)
    print("ok")
    """
    _ok(_python(code, timeout=300))


def test_threading_layer_is_chosen_for_threads_and_fork():
    """Unless the user chose one, srround runs on a layer that is safe for both."""
    result = _python("import numba, srround; print(numba.threading_layer())")
    assert result.returncode == 0, result.stderr
    layer = result.stdout.split()[-1]
    assert layer in ("tbb", "workqueue")
    from srround import _threads

    if _threads.tbb_usable():
        assert layer == "tbb"
    chosen = _python(
        "import numba, srround; print(numba.threading_layer())",
        env={"NUMBA_THREADING_LAYER": "workqueue"},
    )
    assert chosen.stdout.split()[-1] == "workqueue", chosen.stderr
