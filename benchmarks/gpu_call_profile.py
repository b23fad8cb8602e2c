"""Where the host time of a small CUDA call goes (the H100 runs measured 0.23-0.75 ms per call
whatever its size, and 1.3 ms for ``unscale_and_check`` of 200 small tensors). Run by
``gpu_session.sh``::

    python benchmarks/gpu_call_profile.py [--calls 2000] [--json PATH]

Times, per call on 1024 elements: an empty Numba CUDA kernel with as many arguments as
srround's (the launch floor), ``srround.stochastic_round`` on raw Numba device arrays and on
torch CUDA tensors, and torch's own cast; ``srround.unscale_and_check`` of 200 tensors and
torch's own unscale; then prints the functions that take the most host time in the srround
calls (``cProfile``, sorted by own time)."""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

from _harness import add_json_argument, utc_now, write_json


def _per_call(fn, calls: int, sync) -> float:
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - t0) / calls


def _profile(fn, calls: int, top: int) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--top", type=int, default=25, help="profile rows per call kind")
    add_json_argument(p)
    args = p.parse_args(argv)
    started = utc_now()
    import ml_dtypes
    import numpy as np
    import torch

    import srround
    from srround._numba_cuda_compat import import_numba_cuda

    # numba-cuda 0.30.4 under NumPy 2.5 fails its first compile unless srround's shim runs first
    cuda = import_numba_cuda()

    n = 1024
    x = cuda.to_device(np.linspace(-1, 1, n, dtype=np.float32))
    out = cuda.device_array(n, ml_dtypes.bfloat16)

    @cuda.jit
    def empty(a, b, c, d, e, f, g, h, i, j):
        pass

    def launch():
        empty[1, 256](x, out, np.float32(0), 1, 2, 3, 7, 8, False, 0)

    def raw():
        srround.stochastic_round(x, seed=1, out=out)

    rows = {
        "numba empty kernel, 10 args": _per_call(launch, args.calls, cuda.synchronize),
        "srround.stochastic_round, numba arrays": _per_call(raw, args.calls, cuda.synchronize),
    }
    profiled = [("numba arrays", raw)]
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    if gpu:  # (not in Numba's simulator)
        xt = torch.linspace(-1, 1, n, device="cuda")
        ot = torch.empty(n, dtype=torch.bfloat16, device="cuda")

        def on_torch():
            srround.stochastic_round(xt, seed=1, out=ot)

        def torch_cast():
            ot.copy_(xt)

        grads = [torch.randn(n, device="cuda") for _ in range(200)]
        inv_scale = torch.ones(1, device="cuda")
        found = torch.zeros(1, device="cuda")

        def unscale():
            srround.unscale_and_check(grads, inv_scale, found_inf=found)

        def torch_unscale():
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale)

        sync = torch.cuda.synchronize
        rows["srround.stochastic_round, torch tensors"] = _per_call(on_torch, args.calls, sync)
        rows["torch out.copy_(x) (bf16 cast)"] = _per_call(torch_cast, args.calls, sync)
        rows["srround.unscale_and_check, 200 tensors"] = _per_call(unscale, args.calls, sync)
        rows["torch _amp_foreach_..._unscale_, 200 tensors"] = _per_call(
            torch_unscale, args.calls, sync
        )
        profiled += [("torch tensors", on_torch), ("unscale_and_check, 200 tensors", unscale)]
    print(f"host time per call, {n} elements, {args.calls} calls ({gpu or 'no torch GPU'})")
    for label, seconds in rows.items():
        print(f"  {label:44s} {seconds * 1e6:9.1f} us")
    profiles = {}
    for label, fn in profiled:
        profiles[label] = _profile(fn, args.calls // 4, args.top)
        print(f"\n== cProfile of srround on {label} (own time) ==")
        print(profiles[label])
    write_json(
        args.json,
        "gpu_call_profile",
        results=[{"row": label, "us": s * 1e6} for label, s in rows.items()],
        columns=[["row", "call", ""], ["us", "us per call", ".1f"]],
        baseline="an empty Numba kernel launch; torch's own cast",
        meta={"elements": n, "calls": args.calls},
        gpu=gpu,
        started=started,
        profiles=profiles,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
