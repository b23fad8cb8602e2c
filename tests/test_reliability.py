"""What real programs do around the calls: threads, fork, DataLoader workers, aliased memory,
hostile arguments, and loss scaling that flags what it produces.

The thread and fork tests run in fresh subprocesses: a first call (adapter import, Numba
compile or cache load, the threading layer's start) happens once per process, and a process
killed by a runtime abort must not take the test run with it.
"""

from __future__ import annotations

import math
import os
import textwrap

import numpy as np
import pytest

import srround

from .conftest import Backend
from .reference import run_python

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(code: str, *, env: dict | None = None, timeout: float = 240):
    """Run ``code`` in a fresh interpreter (CPU only); returns the CompletedProcess."""
    environ = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", JAX_PLATFORMS="cpu", **(env or {}))
    return run_python(
        ["-c", textwrap.dedent(code)], env=environ, cwd=_ROOT, timeout=timeout, check=False
    )


def _ok(result, expected_stdout="ok"):
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.split()[-1:] == [expected_stdout], result.stdout + result.stderr


# -- threads (finding 1) ------------------------------------------------------------------------

_FIRST_CALLS = """
import threading, numpy as np
{setup}
import srround
SIZES = (1000, 1 << 17)  # even threads: one worker thread; odd ones start the parallel layer
barrier = threading.Barrier(8)
results, errors = {{}}, []

def call(i):
    N = SIZES[i % 2]
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
    N = SIZES[i % 2]
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


@pytest.mark.parametrize("case", sorted(_CASES))
def test_first_calls_from_eight_threads(case):
    """Eight threads make the process's first call at once (adapter import, kernel compile or
    cache load, threading-layer start: half of them on parallel sizes), in a fresh process;
    every call succeeds and gives the bits of the same call made alone. torch, whose import
    race showed in about 1 of 3 processes, gets three."""
    setup, make, call, same = _CASES[case]
    if setup:
        pytest.importorskip(setup.split()[1].rstrip(","))
    code = _FIRST_CALLS.format(setup=setup, make=make, call=call, same=same)
    for _ in range(3 if case == "torch" else 1):  # a cold first compile: minutes on a busy CI
        _ok(_python(code, timeout=600))


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


def test_concurrent_audits_on_workqueue_take_turns():
    """The audit's kernels launch behind the same lock: four threads auditing large tensors
    at once on workqueue (the weights' pattern pass and the per-pattern statistics) used to
    abort the process ("Terminating: Nested parallel kernel launch detected")."""
    code = """
    import threading, numpy as np, numba
    from srround import audit
    assert numba.threading_layer() == "workqueue", numba.threading_layer()
    w = (np.random.default_rng(0).standard_normal((1 << 20) + 5) * 0.05).astype(np.float32)
    def run():
        r = audit.audit_tensor(w, lr=1e-4)
        return r.stagnation, r.fp16
    expected = run()
    bad = []
    def work():
        for _ in range(5):
            try:
                if run() != expected:
                    bad.append("differs")
            except BaseException as e:
                bad.append(repr(e))
    threads = [threading.Thread(target=work) for _ in range(4)]
    [t.start() for t in threads]; [t.join() for t in threads]
    assert not bad, bad
    print("ok")
    """
    _ok(_python(code, env={"NUMBA_THREADING_LAYER": "workqueue"}, timeout=600))


def test_process_exits_with_a_jax_host_step_still_running():
    """A script that ends right after a jitted step whose host call (the fused step on the CPU)
    has not run yet: the handler is Python, and a call that starts once the interpreter
    finalizes never gets the GIL - the process hung in XLA's thread-pool shutdown (8 of 8
    runs, before). srround waits at exit for the live arrays' programs
    (``_ffi._finish_programs``). The outputs are kept, as a training loop keeps its params."""
    pytest.importorskip("jax")
    code = """
        import jax, jax.numpy as jnp, numpy as np
        import srround.adapters.jax as sj
        rng = np.random.default_rng(0)
        params = {"w": jnp.asarray(rng.standard_normal((64, 32)), jnp.bfloat16),
                  "b": jnp.asarray(rng.standard_normal(32), jnp.bfloat16)}
        grads = {k: jnp.asarray(rng.standard_normal(v.shape), jnp.float32)
                 for k, v in params.items()}
        tx = sj.adamw(1e-2, weight_decay=0.1, seed=3)
        out = jax.jit(tx.update)(grads, tx.init(params), params)  # not waited for
        print("ok")
    """
    for _ in range(2):
        _ok(_python(code, timeout=60))


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


def test_forked_children_draw_their_own_seeds():
    """``seed=None`` in ``multiprocessing`` fork children (DataLoader workers): each child had
    a copy of the parent's generator, so all drew the parent's next seed - the same noise in
    every worker. A child now draws fresh entropy; after ``srround.manual_seed`` it continues
    the parent's reproducible sequence."""
    code = """
    import multiprocessing as mp, numpy as np, srround
    x = np.full(64, 1.0 + 2.0**-9, np.float32)  # up or down with probability 1/2 each

    def draw(_):
        return srround.stochastic_round(x).view(np.uint16).tobytes()

    def children():
        with mp.get_context("fork").Pool(4) as pool:
            return pool.map(draw, range(4), chunksize=1)

    draw(0)
    assert len(set(children() + [draw(0)])) == 5
    srround.manual_seed(5)
    got = children()
    srround.manual_seed(5)
    assert got == [draw(0)] * 4
    print("ok")
    """
    _ok(_python(code))


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


def test_child_forked_during_a_launch_runs_serially():
    """A child forked while another thread is inside an srround CPU launch, or just after one
    ended (``_threads.SETTLE_S``: TBB's workers are still returning to their pool; a CI run
    hung in ``test_fork_while_other_threads_run_kernels`` with the first rule alone), runs its
    launches on the calling thread alone (the worker pool it inherits may be unusable: TBB
    could not shut it down for the fork), with the same bits; a child forked once the pool
    has settled, and the parent, keep the pool."""
    code = """
    import os, threading, time, numpy as np, srround
    from srround import _threads
    x = np.linspace(-1, 1, 1 << 17, dtype=np.float32)
    expected = srround.stochastic_round(x, seed=5).view(np.uint16)

    def forked(check):
        pid = os.fork()
        if pid == 0:
            same = np.array_equal(srround.stochastic_round(x, seed=5).view(np.uint16), expected)
            os._exit(0 if same and check() else 1)
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    inside, release = threading.Event(), threading.Event()

    def hold():
        with _threads.launching:  # as a thread in the middle of a kernel
            inside.set()
            release.wait()

    holder = threading.Thread(target=hold)
    holder.start()
    assert inside.wait(30)
    assert forked(lambda: _threads.serial_only) == 0
    release.set()
    holder.join()
    _threads._last_end = time.monotonic()  # a launch that has just ended
    assert forked(lambda: _threads.serial_only) == 0
    _threads._last_end -= _threads.SETTLE_S  # and once the pool has settled
    assert forked(lambda: not _threads.serial_only) == 0
    assert not _threads.serial_only
    print("ok")
    """
    _ok(_python(code, env={"PYTHONWARNINGS": "ignore::DeprecationWarning"}))


def test_fork_while_other_threads_run_kernels():
    """Threads keep launching parallel kernels while the main thread forks children that
    call srround: no child dies or hangs, every result has the expected bits. (With TBB, about
    one fork in six caught a kernel running and its child hung: 12 forks.)"""
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
    for _ in range(12):
        queue = ctx.Queue()
        p = ctx.Process(target=child, args=(queue,))
        p.start()
        assert queue.get(timeout=30) == expected.tobytes()
        p.join(30)
        assert p.exitcode == 0, p.exitcode
    stop.set()
    [t.join() for t in threads]
    assert not bad
    print("ok")
    """
    _ok(_python(code, env={"PYTHONWARNINGS": "ignore::DeprecationWarning"}))


def test_child_forked_during_a_launch_runs_serial_twins(monkeypatch):
    """Finding (CI, 11-27): a child forked while another thread ran a kernel hung in its first
    launch, though it ran it as a region of one thread: that still enters TBB, whose worker
    pool the fork left unusable. Such a child (``serial_only``) now runs the kernels' serial
    twins, compiled without ``parallel``, which never enter the threading layer: same bits."""
    from srround import _cpu, _threads

    x = np.linspace(-1, 1, 5000, dtype=np.float32)
    expected = srround.stochastic_round(x, seed=5).view(np.uint16)
    monkeypatch.setattr(_threads, "serial_only", True)
    monkeypatch.setattr(_cpu, "_SERIAL_TWINS", {})
    np.testing.assert_array_equal(srround.stochastic_round(x, seed=5).view(np.uint16), expected)
    twins = list(_cpu._SERIAL_TWINS.values())
    assert twins and not any(t.targetoptions.get("parallel") for t in twins)


def test_serial_twins_load_from_the_disk_cache(tmp_path):
    """Finding (11-27): every forked child compiled its serial twins afresh (not cached on
    disk), about 2 s a kernel in each DataLoader worker; 12 forks took 25-45 s. A twin is
    cached apart from its parallel kernel: a second process loads it, and the parallel kernel
    still loads its own entry. The twins are made alike for every kernel; this one uses
    ``to_float32``, which compiles in about a second from the empty cache the test needs
    (``stochastic_round``: 15-20 s on a busy 2-core CI machine)."""
    code = """
    import ml_dtypes, numpy as np, srround
    from srround import _cpu, _threads
    x = np.linspace(-1, 1, 5000, dtype=np.float32).astype(ml_dtypes.bfloat16)
    parallel = srround.to_float32(x)
    _threads.serial_only = True
    serial = srround.to_float32(x)
    assert np.array_equal(serial, parallel) and serial.dtype == np.float32
    (twin,) = _cpu._SERIAL_TWINS.values()
    print(sum(twin.stats.cache_hits.values()), sum(twin.stats.cache_misses.values()))
    """
    env = {"NUMBA_CACHE_DIR": str(tmp_path)}
    first, second = _python(code, env=env), _python(code, env=env)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert first.stdout.split() == ["0", "1"], first.stdout  # compiled, then written
    assert second.stdout.split() == ["1", "0"], second.stdout  # loaded


def test_nested_use_neither_deadlocks_nor_oversubscribes():
    """srround from a thread pool while torch runs intra-op work and a user's own Numba
    ``prange`` function runs in another thread, and from inside a JAX callback under ``jit``:
    everything finishes with the expected bits, and the thread count grows by less than the
    number of callers and not again on a second round (Numba's one shared pool: workers do
    not multiply with the callers). Needs TBB: the user's own ``prange`` function, called
    from several threads, aborts Numba's workqueue layer whatever srround does."""
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    from srround import _threads

    if not _threads.tbb_usable():
        pytest.skip("TBB is not installed: Numba's workqueue layer aborts on concurrent launches")
    code = """
    import os, threading, time
    from concurrent.futures import ThreadPoolExecutor
    import numba, numpy as np, torch, jax, jax.numpy as jnp, srround, srround.adapters.jax

    def os_threads():
        return len(os.listdir("/proc/self/task"))

    def settled_threads():  # exiting threads (pool shutdowns) leave /proc a moment later
        count = os_threads()
        for _ in range(20):
            time.sleep(0.1)
            count, previous = os_threads(), count
            if count == previous:
                break
        return count

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
    baseline = settled_threads()

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
        return settled_threads()

    first = round_of_work()
    second = round_of_work()
    # pools may grow once to their size; eight callers must not each bring their own workers
    assert first - baseline < 8, (baseline, first)
    assert second <= first + 1, (first, second)
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


@pytest.mark.parametrize("chosen", ["tbb", "safe", "threadsafe"])
def test_a_chosen_tbb_layer_finds_the_pip_tbb(chosen):
    """A user's choice that needs TBB: Numba alone does not find pip's libtbb (outside the
    loader's path), so `import srround` failed ("No threading layer could be loaded ... pip
    install tbb", for tbb and safe) or ran on GNU OpenMP (threadsafe: no fork after it)."""
    from srround import _threads

    if not _threads.tbb_usable():
        pytest.skip("no usable TBB runtime installed")
    code = "import numba, srround; print(numba.threading_layer())"
    result = _python(code, env={"NUMBA_THREADING_LAYER": chosen})
    assert result.returncode == 0 and result.stdout.split()[-1] == "tbb", result.stderr


# -- loss scaling flags what it produces (finding 4) ---------------------------------------------


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf, -math.inf, 1e-50, "0.5", True])
def test_unusable_host_inv_scale_is_an_error_before_any_write(bad):
    g = np.ones(8, np.float32)
    with pytest.raises((TypeError, ValueError), match="inv_scale"):
        srround.unscale_and_check(g, bad)
    np.testing.assert_array_equal(g, np.ones(8, np.float32))


@pytest.mark.parametrize("bad", [0.0, -2.0, math.nan, math.inf])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_unusable_device_inv_scale_sets_found_inf(writable_backend, dtype, bad):
    """An inv_scale held in an array cannot be checked on the host without a sync: the
    kernel flags it (it used to zero or poison every gradient and leave the flag at 0)."""
    from srround._formats import FORMATS

    put, get = writable_backend.put, writable_backend.get
    numpy_dtype = np.float32 if dtype == "float32" else FORMATS[dtype].numpy_dtype
    host = np.linspace(-2, 2, 40, dtype=np.float32).astype(numpy_dtype)
    grads = [put(host.copy()), put(host[:7].copy())]
    found = srround.unscale_and_check(grads, put(np.float32([bad])))
    assert get(found).tolist() == [1.0]


@pytest.mark.parametrize("scale", [math.nan, math.inf])
def test_nan_or_inf_device_scale_per_tensor_flags_that_tensor(writable_backend, scale):
    put, get = writable_backend.put, writable_backend.get
    grads = [put(np.ones(5, np.float32)), put(np.ones(3, np.float32))]
    found = srround.unscale_and_check(grads, put(np.float32([0.5, scale])), per_tensor=True)
    assert get(found).tolist() == [0.0, 1.0]
    assert get(grads[0]).tolist() == [0.5] * 5


def test_found_inf_is_about_the_unscaled_gradient(writable_backend):
    """fp16 gradients times an inv_scale > 1 that overflow become inf: flagged, since the
    optimizer would read inf (the flag was computed from the inputs)."""
    put, get = writable_backend.put, writable_backend.get
    g = put(np.float16([60000.0, 1.0]))
    assert get(srround.unscale_and_check(g, 2.0)).tolist() == [1.0]
    assert np.isinf(get(g)[0])
    fine = put(np.float16([30000.0, 1.0]))
    assert get(srround.unscale_and_check(fine, 2.0)).tolist() == [0.0]
    assert get(fine).tolist() == [60000.0, 2.0]


def test_adamw_step_host_inv_scale_is_checked():
    p, g = np.ones(4, np.float32), np.ones(4, np.float32)
    m, v = np.zeros(4, np.float32), np.zeros(4, np.float32)
    for bad in (0.0, math.nan, -1.0, math.inf):
        with pytest.raises(ValueError, match="inv_scale"):
            srround.adamw_step(p, g, m, v, lr=1e-3, step=1, inv_scale=bad)
    assert p.tolist() == [1.0] * 4 and m.tolist() == [0.0] * 4


@pytest.mark.parametrize("bad", [0.0, -0.5, math.nan, math.inf])
def test_unusable_array_inv_scale_skips_the_fused_step(optim_backend, bad):
    """An ``inv_scale`` array passed to the fused step is checked where it is read (the CPU
    step before its launch, the CUDA prepare kernel, JAX's step on both impls): it sets
    ``found_inf`` and changes nothing, step counts included; a later good step still runs.
    It used to reach the weights (NaN, or zeroed / reversed gradients). The configuration of
    test_optim_contract's reference test: no new compiled step."""
    from .reference import normal_params
    from .test_optim_contract import SHAPES, _grads, _mixed, _same, front_end

    put, get = optim_backend.put, optim_backend.get
    dtypes = _mixed("stochastic")
    opt = front_end(optim_backend, "adamw", normal_params(SHAPES, dtypes), rounding="stochastic")
    opt.step(_grads(1, dtypes))
    before = opt.result()
    if optim_backend.framework == "jax":  # immutable: the flag is an input, the skip the output
        opt.step(_grads(2, dtypes), inv_scale=bad)
    else:
        scale, flag = put(np.float32([bad])), put(np.float32([0.0]))
        if optim_backend.framework == "torch":
            for p, g in zip(opt.params, _grads(2, dtypes)):
                p.grad = put(g)
            opt.opt.step(inv_scale=scale, found_inf=flag)
        else:
            grads = [put(g) for g in _grads(2, dtypes)]
            kw = dict(step=opt.steps, rounding="stochastic", seed=opt.seed, **opt.hyper)
            srround.adamw_step(
                opt.params, grads, *opt.states.values(), inv_scale=scale, found_inf=flag, **kw
            )
        assert get(flag).tolist() == [1.0]
        _same(opt.result(), before, "flagged step changed something")
        opt.step(_grads(2, dtypes), inv_scale=put(np.float32([bad])))  # no found_inf given
    _same(opt.result(), before, "an unusable inv_scale changed something")
    opt.step(_grads(2, dtypes))
    assert opt.result()["count"] == [2] * len(dtypes)


def test_torch_maximize_takes_a_tensor_inv_scale():
    """torch's ``maximize`` negates ``inv_scale`` for the kernel: a positive tensor scale still
    steps (the same bits as a float one), a negative one is flagged."""
    torch = pytest.importorskip("torch")
    from srround.adapters.torch import AdamW

    from .reference import normal_params
    from .test_optim_contract import SHAPES, _grads, _mixed, _same

    dtypes = _mixed("stochastic")
    runs = []
    for scale in (0.5, torch.tensor([0.5])):
        params = [
            torch.nn.Parameter(Backend.TORCH_CPU.put(p)) for p in normal_params(SHAPES, dtypes)
        ]
        opt = AdamW(params, lr=1e-2, maximize=True, seed=1)
        for p, g in zip(params, _grads(1, dtypes)):
            p.grad = Backend.TORCH_CPU.put(g)
        opt.step(inv_scale=scale)
        runs.append({"params": [Backend.TORCH_CPU.get(p) for p in params]})
    _same(runs[1], runs[0], "tensor inv_scale under maximize")
    flag = torch.zeros(1)
    opt.step(inv_scale=torch.tensor([-0.5]), found_inf=flag)
    assert flag.tolist() == [1.0]
    _same({"params": [Backend.TORCH_CPU.get(p) for p in params]}, runs[0], "negative scale")


# -- hostile scalar arguments (finding 5) ---------------------------------------------------------


def _adamw_buffers():
    p = np.ones(6, np.float32)
    return [p], [np.full(6, 0.5, np.float32)], [np.zeros(6, np.float32)], [np.zeros(6, np.float32)]


_ADAMW_BAD = [
    ({"lr": math.nan}, ValueError, "lr: expected a finite number"),
    ({"lr": math.inf}, ValueError, "lr: expected a finite number"),
    ({"lr": -1.0}, ValueError, r"lr: expected a value in \[0.0, inf\]"),
    ({"lr": "1e-3"}, TypeError, "lr: expected a real number, got '1e-3'"),
    ({"lr": np.float32([1e-3, 2e-3])}, TypeError, r"lr: expected a real number, got an array of"),
    ({"lr": 1e39}, ValueError, "lr: .* overflows float32"),
    ({"weight_decay": math.nan}, ValueError, "weight_decay: expected a finite"),
    ({"weight_decay": -0.1}, ValueError, "weight_decay: expected a value"),
    ({"eps": -1e-8}, ValueError, "eps: expected a value"),
    ({"betas": (1.0, 1.0)}, ValueError, r"betas\[0\]: expected a value in \[0.0, 1.0\)"),
    ({"betas": (0.9, 1.0)}, ValueError, r"betas\[1\]: expected a value in \[0.0, 1.0\)"),
    ({"betas": (0.9, math.nan)}, ValueError, r"betas\[1\]: expected a finite"),
    ({"betas": 0.9}, TypeError, "betas: expected a pair"),
    ({"betas": (0.9, 0.99, 0.5)}, TypeError, "betas: expected a pair"),
    ({"step": 2.5}, TypeError, "step: expected an int, got 2.5"),
    ({"step": 0}, ValueError, "step: expected an int in"),
    ({"step": True}, TypeError, "step: expected an int"),
    ({"rounding": ["stochastic"]}, ValueError, "rounding: expected one of"),
]


@pytest.mark.parametrize("bad, error, message", _ADAMW_BAD, ids=lambda v: repr(v)[:40])
def test_adamw_step_rejects_bad_hyperparameters_before_writing(bad, error, message):
    p, g, m, v = _adamw_buffers()
    kwargs = {"lr": 1e-3, "step": 1, **bad}
    with pytest.raises(error, match=message):
        srround.adamw_step(p, g, m, v, **kwargs)
    assert p[0].tolist() == [1.0] * 6 and m[0].tolist() == [0.0] * 6 and v[0].tolist() == [0.0] * 6


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("bad", [-2, -1, 2**26 - 1, 2**31 - 1])
def test_a_host_step_array_that_cannot_take_a_step_is_an_error(kind, bad):
    """Finding (11-28): an int32 ``step`` array (steps taken, incremented before use) whose
    next value was not in [1, 2**26) ran: AdamW wrote NaN weights from -1 (bias correction
    1 - beta1**0 = 0), and past 2**26 - 1 the noise offsets left the stream (2**31 - 1
    wrapped to a negative count). Now a ValueError naming the element, before anything is
    written; the largest that can step, 2**26 - 2, steps."""
    (p0, g0, m0, v0), (p, g, m, v) = (_adamw_buffers(), _adamw_buffers())
    p, g, m, v = p0 + p, g0 + g, m0 + m, v0 + v  # two tensors: the bad count is the second's
    states = (m, v) if kind == "adamw" else (m,)
    step_fn = getattr(srround, f"{kind}_step")
    steps = np.int32([3, bad])
    with pytest.raises(ValueError, match=rf"^step\[1\]: {bad} steps taken"):
        step_fn(p, g, *states, lr=1e-3, step=steps, seed=0)
    assert steps.tolist() == [3, bad] and p[1].tolist() == [1.0] * 6
    assert all(not s[1].any() for s in states)
    steps[1] = 2**26 - 2
    step_fn(p, g, *states, lr=1e-3, step=steps, seed=0)
    assert steps.tolist() == [4, 2**26 - 1] and np.isfinite(p[1]).all()


_SGD_BAD = [
    ({"lr": math.nan}, ValueError, "lr: expected a finite"),
    ({"lr": -0.1}, ValueError, "lr: expected a value"),
    ({"momentum": -0.5}, ValueError, "momentum: expected a value"),
    ({"momentum": math.inf}, ValueError, "momentum: expected a finite"),
    ({"dampening": math.nan}, ValueError, "dampening: expected a finite"),
    ({"weight_decay": -1.0}, ValueError, "weight_decay: expected a value"),
    ({"nesterov": "yes"}, TypeError, "nesterov: expected a bool"),
    ({"nesterov": True}, ValueError, "nesterov: needs momentum > 0"),
]


@pytest.mark.parametrize("bad, error, message", _SGD_BAD, ids=lambda v: repr(v)[:40])
def test_sgd_step_rejects_bad_hyperparameters_before_writing(bad, error, message):
    p, g = [np.ones(6, np.float32)], [np.ones(6, np.float32)]
    with pytest.raises(error, match=message):
        srround.sgd_step(p, g, [np.zeros(6, np.float32)], **{"lr": 0.1, "step": 1, **bad})
    assert p[0].tolist() == [1.0] * 6


_ALPHA_BAD = [
    (np.float32([2, 3]), TypeError, "alpha: expected a real number, got an array"),
    ([], TypeError, r"alpha: expected a real number, got \[\]"),
    (math.nan, ValueError, "alpha: expected a finite"),
    (-math.inf, ValueError, "alpha: expected a finite"),
    (1e40, ValueError, "alpha: .* overflows float32"),
    ("2", TypeError, "alpha: expected a real number"),
    (1 + 2j, TypeError, "alpha: expected a real number"),
]


@pytest.mark.parametrize("bad, error, message", _ALPHA_BAD, ids=lambda v: repr(v)[:30])
def test_stochastic_add_rejects_bad_alpha(bad, error, message):
    w = np.ones(4, np.float16)
    with pytest.raises(error, match=message):
        srround.stochastic_add(w, np.ones(4, np.float32), alpha=bad, seed=0)
    assert w.tolist() == [1.0] * 4


_UPDATE_BAD = [
    ({"backoff_factor": math.nan}, ValueError, "backoff_factor: expected a finite"),
    ({"backoff_factor": 0.0}, ValueError, r"backoff_factor: expected a value in \(0.0, 1.0\]"),
    ({"backoff_factor": 1.5}, ValueError, "backoff_factor: expected a value"),
    ({"growth_factor": 0.0}, ValueError, r"growth_factor: expected a value in \[1.0, inf\]"),
    ({"growth_factor": math.inf}, ValueError, "growth_factor: expected a finite"),
    ({"growth_interval": 2.5}, TypeError, "growth_interval: expected an int, got 2.5"),
    ({"growth_interval": 0}, ValueError, "growth_interval: expected an int in"),
    ({"growth_interval": 2**31}, ValueError, "growth_interval: expected an int in"),
    ({"hysteresis": 1.0}, TypeError, "hysteresis: expected an int"),
    ({"min_scale": -1.0}, ValueError, "min_scale: expected a value"),
    ({"max_scale": 0.0}, ValueError, "max_scale: expected a value"),
    ({"max_scale": math.nan}, ValueError, "max_scale: expected a number, got nan"),
    ({"min_scale": 4.0, "max_scale": 2.0}, ValueError, "min_scale: 4.0 is above max_scale"),
]


@pytest.mark.parametrize("bad, error, message", _UPDATE_BAD, ids=lambda v: repr(v)[:40])
def test_update_scale_rejects_bad_factors_before_writing(bad, error, message):
    scale, tracker = np.float32([8.0]), np.zeros(1, np.int32)
    with pytest.raises(error, match=message):
        srround.update_scale(scale, tracker, np.float32([1.0]), **bad)
    assert scale.tolist() == [8.0] and tracker.tolist() == [0]


def test_static_scale_and_unbounded_max_are_accepted():
    scale, tracker = np.float32([8.0]), np.zeros(1, np.int32)
    srround.update_scale(
        scale,
        tracker,
        np.float32([0.0]),
        growth_factor=1,
        backoff_factor=1,
        growth_interval=1,
        max_scale=math.inf,
    )
    assert scale.tolist() == [8.0]


def test_messages():
    """Finding 9's messages: no "expected 1 or 1 values", manual_seed(None) does not offer None,
    grads errors do not list int16."""
    with pytest.raises(ValueError) as info:
        srround.unscale_and_check(np.ones(2, np.float32), np.float32([1.0, 1.0]))
    assert str(info.value) == "inv_scale: expected 1 value, got 2"
    with pytest.raises(TypeError) as info:
        srround.manual_seed(None)
    assert "or None" not in str(info.value) and "got None" in str(info.value)
    with pytest.raises(TypeError) as info:
        srround.adamw_step(
            np.ones(2, np.float32),
            np.ones(2, np.float64),
            np.zeros(2, np.float32),
            np.zeros(2, np.float32),
            lr=0.1,
            step=1,
        )
    assert "int16" not in str(info.value) and str(info.value).startswith("grads[0]:")


# -- aliased memory (finding 3) ----------------------------------------------------------------


def test_out_overlapping_x_is_an_error():
    """An ``out`` that shares bytes with ``x`` gave wrong bits silently (the kernel reads x
    after writing out); any overlap is an error naming both, and nothing is written."""
    buf = np.linspace(-1, 1, 1 << 12, dtype=np.float32)
    keep = buf.copy()
    out = buf.view(np.float16)[: buf.size]  # the first half of x's bytes
    with pytest.raises(ValueError, match="out: shares memory with x"):
        srround.stochastic_round(buf, dtype="float16", seed=0, out=out)
    with pytest.raises(ValueError, match="out: shares memory with x"):
        srround.round_nearest(buf, dtype="float16", out=out)
    np.testing.assert_array_equal(buf, keep)
    wide = np.zeros(1 << 12, np.float32)
    narrow = wide.view(np.float16)[: 1 << 12]
    with pytest.raises(ValueError, match="out: shares memory with y"):
        srround.to_float32(narrow, out=wide)


def test_stochastic_add_u_overlapping_w_is_an_error():
    u = np.ones(64, np.float32)
    w = u.view(np.float16)[32:96]
    with pytest.raises(ValueError, match="u: shares memory with w"):
        srround.stochastic_add(w, u, seed=0)
    assert u.tolist() == [1.0] * 64


def test_same_gradient_twice_is_an_error():
    """The same tensor twice (or overlapping views) was unscaled twice."""
    g = np.full(16, 4.0, np.float32)
    with pytest.raises(ValueError, match=r"grads\[1\]: shares memory with grads\[0\]"):
        srround.unscale_and_check([g, g], 0.5)
    with pytest.raises(ValueError, match=r"grads\[2\]: shares memory with grads\[0\]"):
        srround.unscale_and_check([g[:8], np.ones(3, np.float32), g[4:]], 0.5)
    assert g.tolist() == [4.0] * 16
    found = np.zeros(1, np.float32)
    with pytest.raises(ValueError, match=r"found_inf: shares memory with grads\[0\]"):
        srround.unscale_and_check([g], 0.5, found_inf=g[3:4])
    # adjacent views do not overlap
    srround.unscale_and_check([g[:8], g[8:]], 0.5, found_inf=found)
    assert g.tolist() == [2.0] * 16 and found.tolist() == [0.0]


def test_torch_views_of_one_storage():
    torch = pytest.importorskip("torch")
    flat = torch.ones(32)
    with pytest.raises(ValueError, match=r"grads\[1\]: shares memory with grads\[0\]"):
        srround.unscale_and_check([flat[:20], flat[10:]], 0.5)
    assert flat.tolist() == [1.0] * 32
    srround.unscale_and_check([flat[:16], flat[16:]], 0.5)
    assert flat.tolist() == [0.5] * 32


def test_adamw_step_overlapping_buffers_are_an_error():
    flat = np.zeros(40, np.float32)
    p, g = [np.ones(8, np.float32), np.ones(8, np.float32)], [np.ones(8, np.float32)] * 2
    cases = [
        (
            [p[0], p[0]],
            g,
            [flat[:8], flat[8:16]],
            [flat[16:24], flat[24:32]],
            "params[1]",
            "params[0]",
        ),
        (p, g, [flat[:8], flat[4:12]], [flat[16:24], flat[24:32]], "exp_avgs[1]", "exp_avgs[0]"),
        (p, g, [flat[:8], flat[8:16]], [flat[8:16], flat[24:32]], "exp_avg_sqs[0]", "exp_avgs[1]"),
        (
            p,
            [flat[:8], g[1]],
            [flat[:8], flat[8:16]],
            [flat[16:24], flat[24:32]],
            "exp_avgs[0]",
            "grads[0]",
        ),
    ]
    for params, grads, m, v, second, first in cases:
        with pytest.raises(
            ValueError,
            match=rf"{second}: shares memory with {first}".replace("[", r"\[").replace("]", r"\]"),
        ):
            srround.adamw_step(params, grads, m, v, lr=0.1, step=1)
    assert flat.tolist() == [0.0] * 40 and p[0].tolist() == [1.0] * 8
    # one gradient buffer read for two parameters is fine (reads only)
    shared = np.ones(8, np.float32)
    srround.adamw_step(
        p, [shared, shared], [flat[:8], flat[8:16]], [flat[16:24], flat[24:32]], lr=0.1, step=1
    )
    assert shared.tolist() == [1.0] * 8 and p[0][0] < 1.0


def test_no_overlap_sweep_matches_brute_force():
    """The check finds an offending pair exactly when a brute-force pairwise check does: for
    a few buffers (its pairwise loop) and for more (the sorted sweep)."""
    from hypothesis import given
    from hypothesis import strategies as st

    from srround import _validate

    span = st.tuples(st.integers(0, 60), st.integers(0, 12), st.booleans())

    @given(st.lists(span, min_size=0, max_size=20))
    def check(spans):
        items = [(f"a[{i}]", s, n, w) for i, (s, n, w) in enumerate(spans)]
        clash = any(
            a[2] and b[2] and (a[3] or b[3]) and a[1] < b[1] + b[2] and b[1] < a[1] + a[2]
            for i, a in enumerate(items)
            for b in items[i + 1 :]
        )
        if clash:
            with pytest.raises(ValueError, match="shares memory"):
                _validate.no_overlap(items)
        else:
            _validate.no_overlap(items)

    check()


# -- jax.grad through a rounding (finding 9) -----------------------------------------------------


@pytest.mark.parametrize("impl", ["native", "callback"])
def test_jax_grad_is_straight_through(impl):
    """``jax.grad`` through a stochastic round returned zeros silently; the derivative is now
    1 (the derivative of ``E[SR(x)] = x``), also under ``jit``, and for ``stochastic_add``
    ``dw + alpha du + u dalpha``."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from srround.adapters import jax as sj

    x = jnp.linspace(-2, 2, 16, dtype=jnp.float32)

    def loss(x):
        y = sj.stochastic_round(x, seed=1, impl=impl).astype(jnp.float32)
        return (y * jnp.arange(16, dtype=jnp.float32)).sum()

    expected = np.arange(16, dtype=np.float32)
    np.testing.assert_array_equal(np.asarray(jax.grad(loss)(x)), expected)
    np.testing.assert_array_equal(np.asarray(jax.jit(jax.grad(loss))(x)), expected)
    nearest = jax.grad(lambda x: sj.round_nearest(x, impl=impl).astype(jnp.float32).sum())(x)
    np.testing.assert_array_equal(np.asarray(nearest), np.ones(16, np.float32))
    w = x.astype(jnp.bfloat16)

    def add(w, u, alpha):
        return sj.stochastic_add(w, u, alpha=alpha, seed=2, impl=impl).astype(jnp.float32).sum()

    dw, du, dalpha = jax.grad(add, argnums=(0, 1, 2))(w, x, jnp.float32(0.5))
    assert np.asarray(dw.astype(jnp.float32)).tolist() == [1.0] * 16
    assert np.asarray(du).tolist() == [0.5] * 16
    assert float(dalpha) == pytest.approx(float(x.sum()), abs=1e-5)
    # the values are those of the call without a gradient
    plain = sj.stochastic_round(x, seed=1, impl=impl)
    _, vjp = jax.vjp(lambda x: sj.stochastic_round(x, seed=1, impl=impl), x)
    assert np.array_equal(
        np.asarray(jax.jit(lambda x: sj.stochastic_round(x, seed=1))(x)), np.asarray(plain)
    )


# -- property: any arguments either raise before writing or give finite results -----------------


def test_adamw_step_arguments_property():
    """Over arbitrary hyperparameters (numbers of every size and sign, NaN, inf, strings,
    arrays, bools) and finite arrays: a call either raises TypeError/ValueError naming an
    argument with every buffer untouched, or succeeds with finite weights and states."""
    from hypothesis import example, given, settings
    from hypothesis import strategies as st

    anything = st.one_of(
        st.floats(allow_nan=True, allow_infinity=True),
        st.integers(-(2**70), 2**70),
        st.booleans(),
        st.text(max_size=3),
        st.just(np.float32([0.1, 0.2])),
        st.none(),
    )
    plausible = st.floats(-0.5, 1.5, allow_nan=False)
    value = st.one_of(plausible, anything)
    arrays = st.lists(st.floats(-1e3, 1e3, width=32), min_size=1, max_size=9)

    @settings(max_examples=150, deadline=None)
    @given(value, value, value, value, value, arrays)
    @example(0.0, 0.0, 0.0, 2.1163244541552786e-91, 0.0, [0.0])  # eps 0 in float32 (found 11-28)
    @example(3.402823466e38, 0.5, 0.5, 0.5, 0.0, [0.0])  # step size lr / (1 - beta1) overflows
    def check(lr, beta1, beta2, eps, weight_decay, values):
        p = np.asarray(values, np.float32)
        g = (p * 0.5).astype(np.float32)
        m, v = np.zeros_like(p), np.zeros_like(p)
        before = [a.copy() for a in (p, g, m, v)]
        try:
            srround.adamw_step(
                p,
                g,
                m,
                v,
                lr=lr,
                betas=(beta1, beta2),
                eps=eps,
                weight_decay=weight_decay,
                step=1,
                seed=0,
            )
        except (TypeError, ValueError) as e:
            assert str(e).split(":")[0] in ("lr", "betas[0]", "betas[1]", "eps", "weight_decay")
            for a, b in zip((p, g, m, v), before):
                np.testing.assert_array_equal(a, b)
            return
        if np.float32(eps) == 0:  # torch's rule allows eps=0: 0/0 where a gradient is 0
            return  # (1e-91 too: the step computes in float32, as torch's fused step does)
        assert np.isfinite(p).all() and np.isfinite(m).all() and np.isfinite(v).all()

    check()


def test_adamw_coefficients_that_overflow_float32_are_an_error():
    """Finding (11-28): with ``lr / (1 - betas[0])`` (the first step's step size) or
    ``1 - lr * weight_decay`` beyond float32, the step wrote NaN where a first moment or a
    weight was 0 (``inf * 0``), in the functional step and the torch optimizer alike (torch's
    for-each AdamW raises there). Now a ValueError naming the learning rate, before anything
    is written."""
    torch = pytest.importorskip("torch")
    import srround.adapters.torch as sat

    for kw in (
        {"lr": 3.402823466e38, "betas": (0.5, 0.5)},
        {"lr": 1e30, "betas": (0.0, 0.5), "weight_decay": 1e10},
    ):
        p = np.zeros(3, np.float32)
        g, m, v = p.copy(), p.copy(), p.copy()
        with pytest.raises(ValueError, match=r"^lr: .* overflows float32"):
            srround.adamw_step(p, g, m, v, step=1, seed=0, **kw)
        assert not (p.any() or m.any() or v.any())
        with pytest.raises(ValueError, match=r"^lr: .* overflows float32"):
            sat.AdamW([torch.nn.Parameter(torch.zeros(3))], seed=0, **kw)
        param = torch.nn.Parameter(torch.zeros(3))
        param.grad = torch.zeros(3)
        opt = sat.AdamW([param], seed=0)
        opt.param_groups[0].update(kw)  # edited after construction: checked at the step
        with pytest.raises(ValueError, match=r"^lr \(param group 0\): .* overflows float32"):
            opt.step()
        assert not param.detach().isnan().any()
    p = np.zeros(3, np.float32)  # the largest that fits: no error, no NaN
    g, m, v = p.copy(), p.copy(), p.copy()
    srround.adamw_step(p, g, m, v, lr=1.7e38, betas=(0.5, 0.5), step=1, seed=0)
    assert np.isfinite(p).all()


def test_jax_adamw_coefficients_that_overflow_float32_are_an_error():
    """The same rule for JAX's fused ``adamw``, checked when it is made with a number
    learning rate (a schedule's values are known at run time: such a value skips the step,
    ``test_jax_optim.py``)."""
    pytest.importorskip("jax")
    from srround.adapters import jax as sj

    with pytest.raises(ValueError, match=r"^learning_rate: learning_rate / \(1 - b1\)"):
        sj.adamw(3.402823466e38, b1=0.5, seed=0)
    sj.adamw(lambda count: 3.402823466e38, b1=0.5, seed=0)


def test_unscale_and_check_property():
    """Over arbitrary float32 gradients (NaN and inf included) and scales: ``found_inf`` is
    set exactly when an unscaled gradient is non-finite or the scale is not positive and
    finite, and the gradients equal NumPy's float32 product."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    floats = st.floats(width=32, allow_nan=True, allow_infinity=True)

    @settings(max_examples=150, deadline=None)
    @given(st.lists(floats, min_size=1, max_size=12), floats)
    def check(values, scale):
        g = np.asarray(values, np.float32)
        with np.errstate(all="ignore"):
            expected = g * np.float32(scale)
        found = srround.unscale_and_check(g, np.float32([scale]))
        usable = np.isfinite(scale) and scale > 0
        flagged = not usable or not np.isfinite(expected).all()
        assert found.tolist() == [float(flagged)]
        if not flagged:
            np.testing.assert_array_equal(g, expected)

    check()
